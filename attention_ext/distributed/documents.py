"""Packed documents under context parallelism (context_parallel_attention(..., cu_seqlens=cu)): the
plan of kernel calls for a set of local queries against a set of keys, both given by their global
positions, such that no query attends a key of another document.

Every position rule (causal, window, ALiBi) is relative: key - query. Inside one document that
difference is the same on global positions as on positions that restart at the document's start,
so the rules keep their per-document meaning once the calls never cross a document. Dropout is
the exception: flash_attn_varlen_func draws document d's element (h, i, j) at (d H + h, i - s_d,
j - s_d) (s_d the document's start), so a call with dropout covers one document and passes those
coordinates (the op's dropout_coords).

The plan (plan()): the queries and the keys are cut into RUNS, maximal stretches of consecutive
positions inside one document (positions at or past the real length are in no run: padding is
never read). A query run [a, a1) and a key run [b0, b1) of the same document are first clipped to
the pairs the window allows (rel = key - query in [-left, right]); then the pair is
- "bottom-right": the clipped keys end where the queries end (b1 == a1): the kernel's
  bottom-right diagonal (Sk - Sq = a - b0) puts local query i and key j at their global
  distance, so causal / window / ALiBi run in the kernel, with no mask (the causal case of
  mode="allgather": every query run against its document's keys up to its end);
- "top-left": the clipped keys start where the queries start (b0 == a), diagonal 0, likewise;
- "full": neither, but every pair allowed and no ALiBi (or no rule at all): no position rule;
- "mask": otherwise, a bool mask (with ALiBi a float bias) over the clipped rectangle.
Calls of one kind with no mask and no dropout go together in ONE varlen call (cu_seqlens over
the pieces), as long as no query row repeats in it (the results merge per row). A shard cut
into many short runs (shard_layout="stripe") is planned per document instead: each document's
queries against its keys with a mask (no dropout: one call with a same-document mask).

Two executors run a plan: attend() (autograd, the local queries against keys that hold every
document whole: modes "allgather" and "ulysses") and ring.py's steps (the raw ops, per visiting
shard).
"""
from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..softmax.functional import attention as _attention, attention_varlen as _attention_varlen

__all__ = ["Call", "plan", "attend"]

_INF = float("inf")


class Call:
    """One kernel call of a plan. rows / cols: the local query rows and the key indices it reads,
    a slice or an int64 index tensor; window / bottom_right / alibi: the kernel's position rule
    (alibi False: none); mask: None, bool (1, 1, r, c) or a float bias (1, H, r, c) (ALiBi in it);
    cu_q / cu_k (int32) with max_q / max_k: a varlen call over pieces; coords: with dropout, the
    op's dropout_coords; block_layout / block_size: the call's part of a block-sparse layout."""
    __slots__ = ("rows", "cols", "window", "bottom_right", "alibi", "mask", "cu_q", "cu_k", "max_q", "max_k",
                 "coords", "block_layout", "block_size")

    def __init__(self, rows, cols, window=(-1, -1), bottom_right=False, alibi=False, mask=None):
        self.rows, self.cols, self.window, self.bottom_right = rows, cols, window, bottom_right
        self.alibi, self.mask = alibi, mask
        self.cu_q = self.cu_k = None
        self.max_q = self.max_k = 0
        self.coords = None
        self.block_layout, self.block_size = None, 0  # a block-sparse call: its part of the layout

    def n_rows(self) -> int:
        r = self.rows
        return r.stop - r.start if isinstance(r, slice) else r.numel()


def _runs(pos: List[int], cu: Sequence[int], real: int) -> List[Tuple[int, int, int, int]]:
    """Maximal runs (i0, i1, doc, first position) of consecutive positions in one document, over
    the positions below `real`."""
    out = []
    i0, d, end = None, 0, 0
    for i in range(len(pos) + 1):
        t = pos[i] if i < len(pos) else None
        if i0 is not None and (t is None or t != pos[i - 1] + 1 or t >= end):
            out.append((i0, i, d, pos[i0]))
            i0 = None
        if i0 is None and t is not None and 0 <= t < real:
            i0, d = i, bisect.bisect_right(cu, t) - 1  # the document holding t (empty ones skipped)
            end = cu[d + 1]
    return out


def _rel_mask(qp: Tensor, kp: Tensor, lo: float, hi: float, alibi: Optional[Tensor], acc: torch.dtype,
              device) -> Tensor:
    """The mask of queries at qp against keys at kp (CPU int64, one document or a same-document
    test applied by the caller): bool (1, 1, r, c), or with ALiBi a float (1, H, r, c) bias with
    -inf where masked."""
    rel = kp.view(1, -1) - qp.view(-1, 1)
    ok = (rel >= lo) & (rel <= hi)
    if alibi is None:
        return ok.to(device).view(1, 1, *ok.shape)
    sl = alibi.detach().to(device=device, dtype=acc)
    sl = sl.view(sl.shape[0] if sl.dim() == 2 else 1, -1, 1, 1)  # (1 or B, H, 1, 1)
    bias = -sl * rel.abs().to(device=device, dtype=acc)
    return bias.masked_fill(~ok.to(device), float("-inf")).contiguous()


def plan(pq: Tensor, pk: Tensor, cu: Sequence[int], wl: int, wr: int, alibi: Optional[Tensor], acc: torch.dtype,
         device, dropout: Optional[Tuple[int, int, int]] = None,
         block: Optional[Tuple[Tensor, int]] = None) -> List[Call]:
    """The calls of queries at global positions pq against keys at pk (CPU int64 tensors, each
    ascending within its runs), documents cu (host ints; positions from cu[-1] on are padding),
    window (wl, wr) on global positions (-1 unbounded), ALiBi slopes (H,) or (B, H), or None.
    dropout: (B, H_call, H_total, h0) when the calls draw dropout (the call's heads are global
    heads [h0, h0 + H_call) of H_total): one document per call, with its coordinates. block: a
    block-sparse layout of the whole sequence, (bool (H or 1, ceil(S / bs), ceil(S / bs)) on the
    CPU, bs): each call takes its part of the grid when its queries and keys start on block
    boundaries (the kernel skips the off blocks), else the layout as an element mask; calls with no
    on block are dropped, and none is grouped into a varlen call. [] when nothing is allowed."""
    lo = -wl if wl >= 0 else -_INF
    hi = wr if wr >= 0 else _INF
    real = cu[-1]
    lq, lk = pq.tolist(), pk.tolist()
    qr, kr = _runs(lq, cu, real), _runs(lk, cu, real)
    if len(qr) > max(16, len(lq) // 16) or len(kr) > max(16, len(lk) // 16):
        return _with_blocks(_plan_per_document(pq, pk, cu, lo, hi, alibi, acc, device, dropout), pq, pk, block, device)
    by_doc: Dict[int, List[Tuple[int, int, int, int]]] = defaultdict(list)
    for run in kr:
        by_doc[run[2]].append(run)
    pieces = []  # (kind, i0, i1, j0, j1, doc)
    for i0, i1, d, a in qr:
        for j0, j1, _, b0 in by_doc.get(d, ()):
            a1, b1 = a + (i1 - i0), b0 + (j1 - j0)
            # queries that see some key, keys that some query sees: x + lo <= b1 - 1, x + hi >= b0
            qa, qa1 = max(a, b0 - hi), min(a1, b1 - 1 - lo + 1)
            kb, kb1 = max(b0, a + lo), min(b1, a1 - 1 + hi + 1)
            if qa >= qa1 or kb >= kb1:
                continue
            qa, qa1, kb, kb1 = int(qa), int(qa1), int(kb), int(kb1)
            every = (kb1 - 1) - qa <= hi and kb - (qa1 - 1) >= lo
            if alibi is None and (every and (wl, wr) == (-1, -1) or every and kb1 != qa1 and kb != qa):
                kind = "full"  # no rule at all, or none needed and no aligned call to join
            elif kb1 == qa1:
                kind = "br"
            elif kb == qa:
                kind = "tl"
            else:
                kind = "mask"
            pieces.append((kind, i0 + qa - a, i0 + qa1 - a, j0 + kb - b0, j0 + kb1 - b0, d))
    calls, groups = [], defaultdict(list)
    for kind, i0, i1, j0, j1, d in pieces:
        rows, cols = slice(i0, i1), slice(j0, j1)
        if kind == "mask":
            call = Call(rows, cols, mask=_rel_mask(pq[rows], pk[cols], lo, hi, alibi, acc, device))
        elif dropout is not None or block is not None:
            call = _kernel_call(kind, rows, cols, wl, wr, alibi)
        else:
            groups[kind].append((i0, i1, j0, j1))
            continue
        if dropout is not None:
            call.coords = _coords(dropout, pq[rows] - cu[d], pk[cols] - cu[d], d, device)
        calls.append(call)
    for kind, ps in groups.items():
        calls.extend(_varlen_calls(kind, ps, wl, wr, alibi))
    return _with_blocks(calls, pq, pk, block, device)


def _with_blocks(calls: List[Call], pq: Tensor, pk: Tensor, block: Optional[Tuple[Tensor, int]], device
                 ) -> List[Call]:
    """The calls under a block-sparse layout (plan's `block`): each with its part of the grid, or
    the layout as an element mask; the calls that meet no on block dropped."""
    if block is None:
        return calls
    layout, bs = block
    out = []
    for c in calls:
        qp, kp = pq[c.rows], pk[c.cols]
        aligned = isinstance(c.rows, slice) and isinstance(c.cols, slice) and int(qp[0]) % bs == 0 and \
            int(kp[0]) % bs == 0
        if aligned:  # contiguous runs from block boundaries: the grid's rectangle
            qb, kb = int(qp[0]) // bs, int(kp[0]) // bs
            sub = layout[:, qb:qb + -(-qp.numel() // bs), kb:kb + -(-kp.numel() // bs)]
            if not bool(sub.any()):
                continue
            if not bool(sub.all()):
                c.block_layout, c.block_size = sub.contiguous().to(device), bs
            out.append(c)
            continue
        em = layout[:, qp // bs][:, :, kp // bs]  # (H or 1, rows, cols): the element mask
        if not bool(em.any()):
            continue
        em = em.to(device).unsqueeze(0)
        if c.mask is None:
            c.mask = em
        elif c.mask.dtype == torch.bool:
            c.mask = c.mask & em
        else:  # an ALiBi bias
            c.mask = c.mask.masked_fill(~em, float("-inf"))
        out.append(c)
    return out


def _kernel_call(kind: str, rows, cols, wl: int, wr: int, alibi: Optional[Tensor]) -> Call:
    if kind == "full":
        return Call(rows, cols)
    return Call(rows, cols, window=(wl, wr), bottom_right=kind == "br", alibi=alibi is not None)


def _varlen_calls(kind: str, pieces: List[Tuple[int, int, int, int]], wl: int, wr: int,
                  alibi: Optional[Tensor]) -> List[Call]:
    """Pieces of one kind as varlen calls, no query row twice in a call (a row's pieces merge
    across calls); one piece stays a plain call on slices."""
    layers: List[List[Tuple[int, int, int, int]]] = []
    for p in pieces:  # the first call none of whose pieces shares a row with this one
        k = next((i for i, ps in enumerate(layers) if all(p[1] <= o[0] or o[1] <= p[0] for o in ps)), len(layers))
        if k == len(layers):
            layers.append([])
        layers[k].append(p)
    calls = []
    for ps in layers:
        if len(ps) == 1:
            i0, i1, j0, j1 = ps[0]
            calls.append(_kernel_call(kind, slice(i0, i1), slice(j0, j1), wl, wr, alibi))
            continue
        rows = torch.cat([torch.arange(i0, i1) for i0, i1, _, _ in ps])
        cols = torch.cat([torch.arange(j0, j1) for _, _, j0, j1 in ps])
        call = _kernel_call(kind, rows, cols, wl, wr, alibi)
        lq, lk = [i1 - i0 for i0, i1, _, _ in ps], [j1 - j0 for _, _, j0, j1 in ps]
        call.cu_q = torch.tensor([0] + list(itertools.accumulate(lq)), dtype=torch.int32)
        call.cu_k = torch.tensor([0] + list(itertools.accumulate(lk)), dtype=torch.int32)
        call.max_q, call.max_k = max(lq), max(lk)
        calls.append(call)
    return calls


def _plan_per_document(pq: Tensor, pk: Tensor, cu: Sequence[int], lo: float, hi: float, alibi: Optional[Tensor],
                       acc: torch.dtype, device, dropout) -> List[Call]:
    """Runs too short to plan one by one (stripe): a mask per document, or, without dropout, one
    call whose mask also requires the same document."""
    bounds = torch.tensor(cu[1:], dtype=torch.int64)
    real = cu[-1]
    dq = torch.searchsorted(bounds, pq, right=True)
    dk = torch.searchsorted(bounds, pk, right=True)
    calls = []
    if dropout is None:
        rows, cols = (pq < real).nonzero().flatten(), (pk < real).nonzero().flatten()
        if rows.numel() == 0 or cols.numel() == 0:
            return []
        mask = _rel_mask(pq[rows], pk[cols], lo, hi, alibi, acc, device)
        same = (dq[rows].view(-1, 1) == dk[cols].view(1, -1)).to(device)
        mask = mask & same if alibi is None else mask.masked_fill(~same, float("-inf"))
        return [Call(rows, cols, mask=mask)]
    for d in sorted(set(dq[pq < real].tolist()) & set(dk[pk < real].tolist())):
        rows, cols = ((dq == d) & (pq < real)).nonzero().flatten(), ((dk == d) & (pk < real)).nonzero().flatten()
        call = Call(rows, cols, mask=_rel_mask(pq[rows], pk[cols], lo, hi, alibi, acc, device))
        call.coords = _coords(dropout, pq[rows] - cu[d], pk[cols] - cu[d], d, device)
        calls.append(call)
    return calls


def _coords(dropout: Tuple[int, int, int, int], rows: Tensor, cols: Tensor, doc: int, device) -> Tensor:
    """dropout_coords of a call inside document `doc`: heads at (b + d) H_total + h0 + h (B = 1
    with documents; d = 0 without), rows and keys at their positions inside the document
    (flash_attn_varlen_func's draw; the global positions when the one document is the sequence)."""
    b, h, h_total, h0 = dropout
    bh = ((torch.arange(b) + doc) * h_total + h0).view(-1, 1) + torch.arange(h).view(1, -1)
    return torch.cat([bh.flatten(), rows.long(), cols.long()]).to(device=device, dtype=torch.int32)


def _take(x: Tensor, idx: Union[slice, Tensor]) -> Tensor:
    """x[:, :, idx] along the sequence: a view for a slice, index_select for indices."""
    return x[:, :, idx] if isinstance(idx, slice) else x.index_select(2, idx.to(x.device))


def attend(q: Tensor, k: Tensor, v: Tensor, calls: List[Call], *, scale: Optional[float], softcap: float,
           sinks: Optional[Tensor], alibi: Optional[Tensor], dropout_p: float = 0.0,
           seed: Union[int, Tensor, None] = None) -> Tuple[Tensor, Tensor]:
    """Run a plan whose calls cover each query row at most once (keys that hold every document
    whole), under autograd: q (B, H, n, D), k / v (B, H_k, Sk, D) -> out (B, H, n, D), lse
    (B, H, n) float32 (B = 1 with varlen calls); rows in no call (padding, or a row a block
    layout leaves with no key) get out 0 and lse -inf (with sinks: the sink's logit)."""
    h, n = q.shape[1], q.shape[2]
    if alibi is not None and alibi.dim() == 2 and alibi.shape[0] == 1:
        alibi = alibi.reshape(-1)  # (1, H): one sequence, as varlen takes it
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses, rows = [], [], []
    common = dict(scale=scale, softcap=softcap, sinks=sinks, return_lse=True)
    for c in calls:
        qs, ks, vs = _take(q, c.rows), _take(k, c.cols), _take(v, c.cols)
        slopes = alibi if c.alibi else None
        if c.cu_q is not None:
            o, l = _attention_varlen(qs[0].transpose(0, 1), ks[0].transpose(0, 1), vs[0].transpose(0, 1), c.cu_q,
                                     c.cu_k, c.max_q, c.max_k, window=c.window, bottom_right=c.bottom_right,
                                     alibi_slopes=slopes, **common)
            o, l = o.transpose(0, 1).unsqueeze(0), l.unsqueeze(0)
        else:
            drop = dict(dropout_p=dropout_p, seed=seed, dropout_coords=c.coords) if c.coords is not None else {}
            if c.block_layout is not None:
                drop.update(block_layout=c.block_layout, block_size=c.block_size)
            o, l = _attention(qs, ks, vs, window=c.window, bottom_right=c.bottom_right, alibi_slopes=slopes,
                              attn_mask=c.mask, **common, **drop)
        outs.append(o)
        lses.append(l)
        rows.append(torch.arange(c.rows.start, c.rows.stop) if isinstance(c.rows, slice) else c.rows)
    # the lse of a row that sees nothing: -inf, or the sink's logit (with its gradient)
    empty = q.new_full(q.shape[:3], float("-inf"), dtype=acc) if sinks is None else \
        sinks.to(acc).view(1, -1, 1).expand(q.shape[:3])
    if not calls:  # no real row: out and lse in the graph of q, k, v (the backward's collectives still run)
        zero = q.sum() * 0 + (k.sum() + v.sum()) * 0
        out = q * 0 + zero
        if sinks is not None:
            out = out + sinks.sum().to(out.dtype) * 0
        return out, empty + zero.to(acc)
    idx = torch.cat(rows)
    if idx.numel() == n and torch.equal(idx, torch.arange(n)):  # the calls cover the rows in order
        return torch.cat(outs, 2), torch.cat(lses, 2).to(acc)
    idx = idx.to(q.device)
    out = q.new_zeros(q.shape).index_copy(2, idx, torch.cat(outs, 2).to(q.dtype))
    lse = empty.index_copy(2, idx, torch.cat(lses, 2).to(acc))
    return out, lse
