"""Context-parallel attention, mode="allgather": K and V, stacked, travel in ONE all-gather (only
the H_k KV heads with GQA); its backward is one reduce-scatter that sums dK / dV back to the
owning ranks. The local queries then run the fused kernel (attention_ext.attention) against the
gathered keys, with every position rule (causal, window, ALiBi) on GLOBAL token indices, by one
of three paths:

Two forms. By default (overlap=True, eager) the collectives overlap the compute
(attend_overlapped, _Overlapped below): the gather (one all-to-all) is posted asynchronously and
the local queries run against the rank's own shard while the others arrive, then against each
other shard, merged in float32 by the LSE (the per-shard plans and steps of steps.py, as
mode="ring"); the backward computes the other shards' dK / dV pieces first and sends them to
their owners (one all-to-all, summed on arrival) while it computes its own shard's. With
overlap=False, or under torch.compile (which traces no async collective), the form below: one
all-gather, then one kernel call per run of the shard against the gathered keys, through
autograd (fewer, larger calls; nothing overlapped).

Padding (seq_len < S): the keys past seq_len (the gathered sequence's tail) are cut off and only
the shard's real rows (a prefix: real_rows) are computed, so no padded position is ever read,
whatever it holds (NaN included); the padded rows' out and lse are 0. A rank with no real row
still makes its calls, on 0 rows, so its backward joins the group's reduce-scatter.

1. no position rule (non-causal, no window, no ALiBi, no padding): one call, all keys, no mask.
2. causal, and the shard is at most 2 contiguous runs of positions (contiguous: 1, zigzag: 2):
   one call per run [a, a + c) against keys [k0, a + c) with bottom_right=True, k0 = max(0, a -
   window_left) (0 for an unbounded window). bottom-right puts the diagonal at Sk - Sq = a - k0,
   i.e. local query i, local key j' compare as global a + i against k0 + j': the causal window
   and ALiBi's |i + diag - j| are exactly the global ones, with no mask and no wasted keys.
3. otherwise (stripe with positions, non-causal window or ALiBi, padding of a non-causal
   sequence): an explicit mask over (local queries, all keys) built from global positions: bool
   for causal / window / padding, a float additive bias (-slope * |i - j|, -inf where masked)
   with ALiBi. It costs an (n, S) mask (times H with ALiBi) per call.
Dropout (every path): each call's dropout_coords name its queries' and keys' global positions,
so the mask is the single process's for the shared seed (sharding.dropout_seed).

Packed documents (cu_seqlens; B = 1): the gathered keys are cut at the documents' end and the
local queries run the plan of documents.py against them: per run of the shard inside one
document, its document's keys (causal: up to the run's end, bottom-right, as path 2), every
unmasked call of a kind in one varlen call; no query meets a key of another document.

The options (causal, window_size, ...) and their checks: options.py; the front door that picks
this mode: attention.py.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..softmax import ops as _ops
from ..softmax.functional import attention as _attention
from . import documents, steps
from .options import AttentionOptions
from .sharding import all_gather_sequence, dropout_coords, dropout_seed, global_positions, real_rows

__all__ = ["attend", "attend_overlapped"]


def _runs(s: int, rank: int, world: int, shard_layout: str) -> Optional[List[Tuple[int, int, int]]]:
    """The shard's maximal runs of consecutive global positions, [(local start, global start,
    length)], from the shard_layout's arithmetic (plain ints: no tensor, so torch.compile traces no
    data-dependent branch); None for a stripe shard of more than 2 runs (path 3 serves it)."""
    n = s // world
    if shard_layout == "contiguous":
        runs = [(0, rank * n, n)]
    elif shard_layout == "zigzag":
        c = n // 2
        runs = [(0, rank * c, c), (c, (2 * world - 1 - rank) * c, c)]
    elif world == 1:
        runs = [(0, 0, n)]
    elif n <= 2:
        runs = [(i, rank + i * world, 1) for i in range(n)]
    else:
        return None
    merged = [runs[0]]
    for i0, a, c in runs[1:]:  # zigzag on one rank: chunks 0 and 1 are one run
        j0, b, d = merged[-1]
        merged[-1:] = [(j0, b, d + c)] if b + d == a else [(j0, b, d), (i0, a, c)]
    return merged


def _position_mask(pq: Tensor, s: int, wl: int, wr: int, alibi_slopes: Optional[Tensor],
                   dtype: torch.dtype) -> Tensor:
    """Path 3's attn_mask for queries at global positions pq (n,) against keys [0, s) (s: the real
    length; padded keys are cut off before): bool (n, s) (True = attend), or with ALiBi a float
    (1 or B, H, n, s) bias with -inf where masked."""
    pk = torch.arange(s, device=pq.device)
    rel = pk.view(1, -1) - pq.view(-1, 1)  # (n, s): key - query
    ok = torch.ones(pq.numel(), s, dtype=torch.bool, device=pq.device)
    if wr >= 0:
        ok = ok & (rel <= wr)
    if wl >= 0:
        ok = ok & (rel >= -wl)
    if alibi_slopes is None:
        return ok
    sl = alibi_slopes.to(dtype)
    sl = sl.view(1, -1, 1, 1) if sl.dim() == 1 else sl.view(sl.shape[0], sl.shape[1], 1, 1)
    bias = -sl * rel.abs().to(dtype)  # (1 or B, H, n, s)
    return bias.masked_fill(~ok, float("-inf"))


def attend(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, group: Optional[dist.ProcessGroup],
           shard_layout: str, overlap: bool = True) -> Tuple[Tensor, Tensor]:
    """mode="allgather" on this rank's shards (any layout): (out (B, H, n, D), lse (B, H, n)).
    The entry point (attention.context_parallel_attention) turns them into its result.
    overlap (eager only: torch.compile traces the paths below; and not with ALiBi slopes that
    require grad, which the form below takes, giving them none as attention() does):
    attend_overlapped."""
    slopes_grad = opts.alibi_slopes is not None and opts.alibi_slopes.requires_grad
    if overlap and not torch.compiler.is_compiling() and not slopes_grad:
        return attend_overlapped(q, k, v, opts, group=group, shard_layout=shard_layout)
    q, k, v = opts.shards(q, k, v)
    rank, world, s, seq_len = opts.sequence(q, group, shard_layout)
    docs = opts.documents(q, s, shard_layout)
    block = opts.blocks(q, s)
    if docs is not None or block is not None:  # a block layout: the plan's calls over one document
        return _attend_documents(q, k, v, opts, docs or (0, seq_len), group=group, shard_layout=shard_layout,
                                 rank=rank, world=world, s=s, block=block)
    n = q.shape[2]
    wl, wr = opts.window
    causal, alibi_slopes, dropout_p = opts.causal, opts.alibi_slopes, opts.dropout_p

    # one collective: K and V stacked, (2, B, H_k, n, D) -> (2, B, H_k, S, D) in global order
    kv = all_gather_sequence(torch.stack([k, v]), dim=3, group=group, shard_layout=shard_layout)
    kf, vf = kv[0], kv[1]
    pos = global_positions(s, rank=rank, world_size=world, shard_layout=shard_layout)
    common = dict(scale=opts.scale, softcap=opts.softcap, sinks=opts.sinks, return_lse=True)
    seed = dropout_seed(dropout_p, opts.seed, group, q.device)
    b, h = q.shape[:2]

    def drop(rows: Tensor, cols: Tensor) -> dict:  # dropout at global (query, key) positions; keys are in global order
        if seed is None:
            return {}
        return dict(dropout_p=dropout_p, seed=seed,
                    dropout_coords=dropout_coords(b, h, rows, cols, h_total=h, device=q.device))

    runs = _runs(s, rank, world, shard_layout)
    positional = causal or wl >= 0 or wr >= 0 or alibi_slopes is not None or seq_len < s
    nr = real_rows(seq_len, s, rank=rank, world_size=world, shard_layout=shard_layout) if seq_len < s else n
    if seq_len < s:  # padding: no padded key or query row is read (the module docstring)
        kf, vf = kf[:, :, :seq_len], vf[:, :, :seq_len]
    if not positional:  # path 1
        out, lse = _attention(q, kf, vf, **common, **drop(pos, torch.arange(s)))
    elif causal and runs is not None and len(runs) <= 2:  # path 2: the bottom-right diagonal trick per run
        outs, lses = [], []
        for i0, a, c in runs:
            c = max(0, min(c, seq_len - a))  # the run's real rows (padding: a suffix of the shard)
            if c == 0 and outs:
                continue
            k0 = max(0, a - wl) if wl >= 0 else 0
            k1 = a + c if c else 0  # a wholly padded shard: 0 rows against 0 keys
            k0 = min(k0, k1)
            o, l = _attention(q[:, :, i0:i0 + c], kf[:, :, k0:k1], vf[:, :, k0:k1], causal=True,
                              bottom_right=True, window=(wl, 0), alibi_slopes=alibi_slopes, **common,
                              **drop(torch.arange(a, a + c), torch.arange(k0, k1)))
            outs.append(o)
            lses.append(l)
        out, lse = (torch.cat(outs, 2), torch.cat(lses, 2)) if len(outs) > 1 else (outs[0], lses[0])
    else:  # path 3: explicit mask from global positions
        acc = _ops.acc_dtype(q.dtype)
        mask = _position_mask(pos[:nr].to(q.device), seq_len, wl, wr, alibi_slopes, acc)
        out, lse = _attention(q[:, :, :nr], kf, vf, attn_mask=mask, **common,
                              **drop(pos[:nr], torch.arange(seq_len)))
    if nr < n:  # the padded rows: 0
        out = torch.nn.functional.pad(out, (0, 0, 0, n - nr))
        lse = torch.nn.functional.pad(lse, (0, n - nr))
    return out, lse


def _attend_documents(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, docs: Tuple[int, ...], *,
                      group: Optional[dist.ProcessGroup], shard_layout: str, rank: int, world: int, s: int,
                      block: Optional[Tuple[Tensor, int]] = None) -> Tuple[Tensor, Tensor]:
    """attend() for packed documents or a block layout (the module docstring): one all-gather,
    then the plan."""
    cu = opts.documents(q, s, shard_layout)  # the sharding's documents (docs may be the one real sequence)
    kv = all_gather_sequence(torch.stack([k, v]), dim=3, group=group, shard_layout=shard_layout, cu_seqlens=cu)
    real = docs[-1]
    kf, vf = kv[0][:, :, :real], kv[1][:, :, :real]
    pos = global_positions(s, rank=rank, world_size=world, shard_layout=shard_layout, cu_seqlens=cu)
    seed = dropout_seed(opts.dropout_p, opts.seed, group, q.device)
    h = q.shape[1]
    wl, wr = opts.window
    calls = documents.plan(pos, torch.arange(real), docs, wl, wr, opts.alibi_slopes, _ops.acc_dtype(q.dtype),
                           q.device, dropout=None if seed is None else (q.shape[0], h, h, 0), block=block)
    return documents.attend(q, kf, vf, calls, scale=opts.scale, softcap=opts.softcap, sinks=opts.sinks,
                            alibi=opts.alibi_slopes, dropout_p=opts.dropout_p, seed=seed)


# ----------------------------------------------------------------------------------- overlapped
def _all_to_all(out: Tensor, x: Tensor, group):
    """An asynchronous all_to_all_single (looked up per call so that a test can count it)."""
    return dist.all_to_all_single(out, x, group=group, async_op=True)


class _Overlapped(torch.autograd.Function):
    """mode="allgather" with its collectives overlapped (attend_overlapped): (q (B, H, n, D),
    k, v (B, H_k, n, D), sinks) -> (out (B, H, n, D) in q's dtype, lse (B, H, n) float32).

    Forward: the gather of the stacked K / V (an all-to-all of P copies) is posted
    asynchronously and the local queries run against the rank's OWN shard while the others'
    arrive; then against each other shard; the partial results merge in float32 by their LSE
    (steps.py, as mode="ring"). Backward: the gradient pieces of the other shards first (dq
    locally, their dK / dV into one float32 buffer per owner), those buffers sent to their owners
    by one asynchronous all-to-all, and the own shard's pieces computed while it runs; the
    arrivals are summed. One collective forward, one backward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], cfg: dict):
        group, world, rank = cfg["group"], cfg["world"], cfg["rank"]
        acc = _ops.acc_dtype(q.dtype)
        b, h, n, d = q.shape
        kv = torch.stack([k, v]).contiguous()  # (2, B, H_k, n, D)
        # the all-gather as an all-to-all of P copies (the same bytes on the wire: on gloo it runs
        # 3x faster than gloo's all-gather, 10 against 30 ms for 16.8 MB on 2 ranks)
        flat = kv.new_empty((world * 2,) + tuple(kv.shape[1:]))  # rank r's K, V at rows 2r, 2r + 1
        send = kv.unsqueeze(0).expand((world,) + tuple(kv.shape)).reshape((world * 2,) + tuple(kv.shape[1:]))
        work = _all_to_all(flat, send, group) if world > 1 else None
        gathered = flat.view((world,) + tuple(kv.shape))
        out = q.new_zeros((b, h, n, d), dtype=acc)
        lse = q.new_full((b, h, n), float("-inf"), dtype=acc)
        steps.forward_step(q, kv, cfg["plan"](rank), out, lse, cfg)  # while the others' shards arrive
        if work is not None:
            work.wait()
        for r in range(world):
            if r != rank:
                steps.forward_step(q, gathered[r], cfg["plan"](r), out, lse, cfg)
        out = steps.finish_forward(out, lse, sinks, q.dtype)
        ctx.cfg = cfg
        ctx.save_for_backward(q, gathered if world > 1 else kv.unsqueeze(0), sinks, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Optional[Tensor]):
        q, gathered, sinks, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        group, world, rank = cfg["group"], cfg["world"], cfg["rank"]
        acc = _ops.acc_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        if dlse is not None:  # rows that saw nothing (lse -inf) pass nothing on
            dlse = dlse.to(acc).masked_fill(torch.isinf(lse), 0.0)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv_shape = tuple(gathered.shape[1:])
        if world > 1:
            pieces = torch.zeros((world,) + kv_shape, dtype=acc, device=q.device)  # dK / dV per owner
            for r in range(world):
                if r != rank:
                    steps.backward_step(q, gathered[r], cfg["plan"](r), dout, out, lse, dlse, dq, pieces[r], cfg)
            # pieces[r] to rank r, one all-to-all (the reduce-scatter's bytes; on gloo 4x faster than its
            # reduce-scatter), summed on arrival
            recv = torch.empty_like(pieces)
            work = _all_to_all(recv.flatten(0, 1), pieces.flatten(0, 1), group)
        own = torch.zeros(kv_shape, dtype=acc, device=q.device)
        steps.backward_step(q, gathered[rank if world > 1 else 0], cfg["plan"](rank), dout, out, lse, dlse, dq, own,
                            cfg)  # while the reduce-scatter runs
        if world > 1:
            work.wait()
            own += recv.sum(0)
        dsinks = steps.sinks_grad(sinks, dout, out, lse, dlse) if sinks is not None and ctx.needs_input_grad[3] \
            else None
        return dq.to(q.dtype), own[0].to(q.dtype), own[1].to(q.dtype), dsinks, None


def attend_overlapped(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *,
                      group: Optional[dist.ProcessGroup], shard_layout: str) -> Tuple[Tensor, Tensor]:
    """mode="allgather" with the all-gather (forward) and the reduce-scatter (backward) overlapped
    with the own shard's compute (_Overlapped): every option, shard layout and packed documents
    (the plans of steps.py)."""
    q, k, v = opts.shards(q, k, v)
    alibi_slopes = opts.alibi_slopes
    if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("the overlapped all-gather gives alibi_slopes no gradient: pass them detached")
    cfg = steps.config(q, opts, group=group, shard_layout=shard_layout)
    return _Overlapped.apply(q, k, v, opts.sinks, cfg)
