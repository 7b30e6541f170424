"""The steps of the context-parallel modes that compute one key shard at a time (ring.py, and
allgather.py's overlapped path): the plan of (this rank's queries, one owner's K / V shard) as
kernel calls, and a step's forward (partial outputs merged in float32 by their LSE) and backward
(the exact gradient pieces, given the GLOBAL out and LSE).

The plan, per owner, from global positions (no device sync; made once per call and kept for the
backward):
- no documents (_plan): the rectangle of allowed pairs: nothing allowed (the causal future,
  outside the window, all padding): no call; every pair allowed: a call with no rule; the same
  ascending positions as causal triangle: causal=True (top-left); otherwise an explicit mask over
  the bounding rectangle: bool, or with ALiBi a float bias -slope * |i - j| with -inf where masked
  ((1 or B, H, rows, cols)). _plan_plain finds the first two shapes in O(n) (no window, no ALiBi).
- packed documents: documents.plan (runs inside one document paired by document; varlen calls).
Padding (positions >= seq_len, a suffix of every shard) is in no call, queries and keys alike.
Dropout: every call carries its elements' global coordinates (sharding.dropout_coords, or the
document's own), so the mask is the single process's and the backward redraws it.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import documents
from ..softmax import ops as _ops
from ..softmax.functional import _default_scale, _rng_state
from .documents import Call
from .options import AttentionOptions
from .sharding import dropout_coords, dropout_seed, global_positions

__all__ = ["config", "forward_step", "backward_step", "finish_forward", "sinks_grad"]


# ----------------------------------------------------------------------------------- the plan
def _Step(i0: int, i1: int, j0: int, j1: int, causal: bool = False, mask: Optional[Tensor] = None) -> Call:
    """One kernel call of the plan: queries [i0, i1) x keys [j0, j1) of the visiting shard,
    causal (top-left, no mask) or an explicit mask (None = every pair allowed)."""
    return Call(slice(i0, i1), slice(j0, j1), window=(-1, 0) if causal else (-1, -1), mask=mask)


_DENSE = object()  # _plan_plain's answer when the (n, n) pair matrix is needed after all


def _plan_plain(pq: Tensor, pk: Tensor, seq_len: int, causal: bool):
    """_plan without a window or ALiBi, in O(n) instead of the (n, n) pair matrix (which costs
    ~0.1 s a step at n = 4096): the allowed pairs are key j < seq_len (and pk[j] <= pq[i] when
    causal), so the bounding box and its two cheap shapes follow from minima and maxima. A box
    that is neither all-allowed nor a causal diagonal returns _DENSE (the caller builds the mask)."""
    valid = pk < seq_len
    nq = int((pq < seq_len).sum())  # the real query rows: a prefix (padding is a shard's suffix)
    if not bool(valid.any()) or nq == 0:
        return None
    if not causal:
        cols = valid.nonzero().flatten()
        j0, j1 = int(cols[0]), int(cols[-1]) + 1
        return _Step(0, nq, j0, j1) if bool(valid[j0:j1].all()) else _DENSE
    kmin = int(pk[valid].min())
    rows = ((pq >= kmin) & (pq < seq_len)).nonzero().flatten()
    if rows.numel() == 0:
        return None
    cols = (valid & (pk <= int(pq.max()))).nonzero().flatten()
    i0, i1, j0, j1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    kb, qb = pk[j0:j1], pq[i0:i1]
    if not bool(valid[j0:j1].all()):
        return _DENSE
    if int(kb.max()) <= int(qb.min()):  # every key of the box is at or before every query
        return _Step(i0, i1, j0, j1)
    if i1 - i0 == j1 - j0 and torch.equal(qb, kb) and bool((qb[1:] > qb[:-1]).all()):
        return _Step(i0, i1, j0, j1, causal=True)  # the same ascending positions: top-left causal
    return _DENSE


def _plan(pq: Tensor, pk: Tensor, seq_len: int, wl: int, wr: int, alibi_slopes: Optional[Tensor],
          acc: torch.dtype, device) -> Optional[Call]:
    """The call for queries at global positions pq (n,) against keys at pk (n,) (CPU int64), or
    None when no pair is allowed. See the module docstring for the cases."""
    if alibi_slopes is None and wl < 0 and wr in (-1, 0):
        fast = _plan_plain(pq, pk, seq_len, causal=wr == 0)
        if fast is not _DENSE:
            return fast
    rel = pk.view(1, -1) - pq.view(-1, 1)  # (n, n): key - query
    ok = (pq < seq_len).view(-1, 1) & (pk < seq_len).view(1, -1)  # no padded query or key is read
    if wr >= 0:
        ok = ok & (rel <= wr)
    if wl >= 0:
        ok = ok & (rel >= -wl)
    rows, cols = ok.any(1).nonzero().flatten(), ok.any(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    i0, i1, j0, j1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    sub = ok[i0:i1, j0:j1]
    if alibi_slopes is None:
        if bool(sub.all()):
            return _Step(i0, i1, j0, j1)
        if i1 - i0 == j1 - j0 and torch.equal(pq[i0:i1], pk[j0:j1]) and \
                torch.equal(sub, torch.ones_like(sub).tril()):
            return _Step(i0, i1, j0, j1, causal=True)
        return _Step(i0, i1, j0, j1, mask=sub.contiguous().to(device).view(1, 1, i1 - i0, j1 - j0))
    sl = alibi_slopes.detach().to(acc)
    sl = sl.view(1, -1, 1, 1) if sl.dim() == 1 else sl.view(sl.shape[0], sl.shape[1], 1, 1)
    bias = -sl * rel[i0:i1, j0:j1].abs().to(device=sl.device, dtype=acc)  # (1 or B, H, rows, cols)
    return _Step(i0, i1, j0, j1, mask=bias.masked_fill(~sub.to(sl.device), float("-inf")).contiguous())


def _options(step: Call, cfg: dict, sq: int, sk: int) -> dict:
    """The op's options for one call (no sinks: they join once, in the final merge; ALiBi slopes
    only where the call runs them in the kernel, else they are in its mask)."""
    dev = cfg["device"]
    varlen = step.cu_q is not None
    return dict(bias=step.mask, alibi_slopes=cfg["alibi"] if step.alibi else None, sinks=None, seqlens_k=None,
                cu_seqlens_q=step.cu_q.to(dev) if varlen else None, cu_seqlens_k=step.cu_k.to(dev) if varlen else None,
                max_seqlen_q=step.max_q if varlen else sq, max_seqlen_k=step.max_k if varlen else sk,
                scale=cfg["scale"], softcap=cfg["softcap"], window_left=step.window[0], window_right=step.window[1],
                bottom_right=step.bottom_right, dropout_p=cfg["dropout_p"], seed=0, offset=0,
                rng_state=cfg["rng_state"], dropout_coords=step.coords, block_layout=step.block_layout,
                block_size=step.block_size)


def _rows(x: Tensor, idx) -> Tensor:
    """x[:, :, idx] along the sequence dim: a view for a slice, a gather for indices."""
    return x[:, :, idx] if isinstance(idx, slice) else x.index_select(2, idx.to(x.device))


def _add_rows(x: Tensor, idx, y: Tensor) -> None:
    """x[:, :, idx] += y, in place (indices may repeat: each adds)."""
    if isinstance(idx, slice):
        x[:, :, idx] += y
    else:
        x.index_add_(2, idx.to(x.device), y.to(x.dtype))


def _merge(out: Tensor, lse: Tensor, o_t: Optional[Tensor], l_t: Tensor) -> None:
    """In place, float32: (out, lse) <- the softmax over both key sets. o_t None: a value-0 term
    (the sinks). -inf on both sides (nothing seen yet, nothing here) leaves (0, -inf)."""
    new = torch.logaddexp(lse, l_t)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # new = -inf: both weights 0
    w_old = torch.exp(lse - safe).unsqueeze(-1)
    out.mul_(w_old)
    if o_t is not None:
        out.add_(torch.exp(l_t - safe).unsqueeze(-1) * o_t.to(out.dtype))
    lse.copy_(new)


# ----------------------------------------------------------------------------------- a call's setup
def config(q: Tensor, opts: AttentionOptions, *, group: Optional[dist.ProcessGroup], shard_layout: str,
           stats: Optional[dict] = None) -> dict:
    """The per-call configuration every step reads: the group, the options as the op takes them,
    and plan(owner), the calls of this rank's queries against owner's shard (memoized). q:
    (B, H, n, D) after opts.shards()."""
    rank, world, s, seq_len = opts.sequence(q, group, shard_layout)
    docs = opts.documents(q, s, shard_layout)
    block = opts.blocks(q, s)
    wl, wr = opts.window
    acc = _ops.acc_dtype(q.dtype)
    pos = [global_positions(s, rank=r, world_size=world, shard_layout=shard_layout, cu_seqlens=docs)
           for r in range(world)]
    alibi_slopes = opts.alibi_slopes
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().to(device=q.device, dtype=acc)
    plans: Dict[int, List[Call]] = {}
    seed = dropout_seed(opts.dropout_p, opts.seed, group, q.device)
    rng_state = None if seed is None else _rng_state(seed, None)  # (seed, 0): attention()'s for that seed
    h = q.shape[1]

    def plan(owner: int) -> List[Call]:  # made once per owner, reused by the backward
        if owner in plans:
            return plans[owner]
        if docs is not None or block is not None:  # one document: the whole real sequence
            plans[owner] = documents.plan(pos[rank], pos[owner], docs or (0, seq_len), wl, wr, alibi_slopes, acc,
                                          q.device, block=block,
                                          dropout=None if rng_state is None else (q.shape[0], h, h, 0))
            return plans[owner]
        step = _plan(pos[rank], pos[owner], seq_len, wl, wr, alibi_slopes, acc, q.device)
        if step is not None and rng_state is not None:  # the step's queries and keys where they are global
            step.coords = dropout_coords(q.shape[0], h, pos[rank][step.rows], pos[owner][step.cols], h_total=h,
                                         device=q.device)
        plans[owner] = [] if step is None else [step]
        return plans[owner]

    scale = opts.scale
    return dict(group=group, world=world, rank=rank, plan=plan, stats=stats, softcap=float(opts.softcap),
                scale=float(scale) if scale is not None else _default_scale(q.shape[3]),
                dropout_p=float(opts.dropout_p), rng_state=rng_state, device=q.device,
                alibi=None if alibi_slopes is None else
                (alibi_slopes.reshape(-1) if alibi_slopes.shape[0] == 1 else alibi_slopes).contiguous())


# ----------------------------------------------------------------------------------- a step
def forward_step(q: Tensor, kv: Tensor, calls: List[Call], out: Tensor, lse: Tensor, cfg: dict) -> None:
    """The calls of one key shard kv (2, B, H_k, n, D), merged in place into the running float32
    out (B, H, n, D) and lse (B, H, n)."""
    for step in calls:
        qs, ks, vs = _rows(q, step.rows), _rows(kv[0], step.cols), _rows(kv[1], step.cols)
        o_t, l_t = _ops.fwd(qs, ks, vs, **_options(step, cfg, qs.shape[2], ks.shape[2]))
        if isinstance(step.rows, slice):
            _merge(out[:, :, step.rows], lse[:, :, step.rows], o_t, l_t)
        else:  # a varlen call's rows (each once): gather, merge, put back
            idx = step.rows.to(q.device)
            o_r, l_r = out.index_select(2, idx), lse.index_select(2, idx)
            _merge(o_r, l_r, o_t, l_t)
            out.index_copy_(2, idx, o_r)
            lse.index_copy_(2, idx, l_r)


def finish_forward(out: Tensor, lse: Tensor, sinks: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """After every shard: the sinks join the softmax once (an extra "key" with logit sink_h and
    value 0), and the output takes q's dtype."""
    if sinks is not None:
        b, h, n = lse.shape
        _merge(out, lse, None, sinks.detach().to(out.dtype).view(1, h, 1).expand(b, h, n))
    return out.to(dtype)


def backward_step(q: Tensor, kv: Tensor, calls: List[Call], dout: Tensor, out: Tensor, lse: Tensor,
                  dlse: Optional[Tensor], dq: Tensor, dkv: Tensor, cfg: dict) -> None:
    """The gradient pieces of one key shard's calls, given the GLOBAL out and lse: added in place
    to dq (B, H, n, D) and dkv (2, B, H_k, n, D), float32."""
    for step in calls:
        sl = step.rows
        qs, ks, vs = _rows(q, sl), _rows(kv[0], step.cols), _rows(kv[1], step.cols)
        a = dict(_options(step, cfg, qs.shape[2], ks.shape[2]),
                 dout=_rows(dout, sl), q=qs, k=ks, v=vs, out=_rows(out, sl), lse=_rows(lse, sl).contiguous(),
                 topk_thr=None, topk_jcut=None,
                 bias_grad=False, deterministic=False,
                 dlse=None if dlse is None else _rows(dlse, sl).contiguous())
        dq_t, dk_t, dv_t, _, _ = torch.ops.attention_ext.softmax_bwd(*[a[nm] for nm in _ops.BWD_ARGS])
        _add_rows(dq, sl, dq_t)
        _add_rows(dkv[0], step.cols, dk_t)
        _add_rows(dkv[1], step.cols, dv_t)


def sinks_grad(sinks: Tensor, dout: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor]) -> Tensor:
    """This rank's queries' part of dsinks: dsinks_h = sum_{b, i} p_sink * (dlse - dO_i . O_i),
    p_sink = exp(sink_h - lse_i)."""
    acc = lse.dtype
    dd = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, n): dO_i . O_i
    g = -dd if dlse is None else dlse - dd
    p_sink = torch.exp(sinks.detach().to(acc).view(1, -1, 1) - lse)
    return (p_sink * g).sum((0, 2)).to(sinks.dtype)
