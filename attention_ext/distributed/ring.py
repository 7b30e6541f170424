"""Ring context-parallel attention (context_parallel_attention(mode="ring")): the K/V shards
circulate around the ranks of the group and never exist whole on one rank.

Forward, P ranks, rank r: step t = 0 .. P-1 holds the K/V shard of owner (r - t) mod P (only the
H_k KV heads with GQA, K and V stacked into one (2, B, H_k, n, D) buffer). Before computing on the
visiting shard, step t posts (torch.distributed.batch_isend_irecv) its send to rank r + 1 and the
receive of the next shard from rank r - 1, so the transfer overlaps the compute: P - 1 transfers.
Each step runs the fused kernel (ops.fwd) for (partial out, lse) of the local queries against the
visiting keys and merges in float32:

    lse = logaddexp(lse, lse_t);  out = exp(lse_old - lse) * out + exp(lse_t - lse) * o_t

Running out (B, H, n, D) and lse (B, H, n) stay float32 until the end; out is cast to q's dtype
once. Sinks are not given to the per-step kernel calls: they join the softmax once, in the final
merge (lse = logaddexp(lse, sink_h), out *= exp(lse_old - lse)).

Positions. Every rule (causal, window, ALiBi, the padding rule keys >= seq_len) is on GLOBAL
token indices: the local queries' global_positions against the visiting shard's owner's. Per
(local queries, visiting shard) a plan is made on the host from those positions (no device sync):
- nothing allowed (the causal future, outside the window, all padding): the step is SKIPPED (the
  ring still forwards the shard);
- padding (positions >= seq_len, a suffix of every shard) is outside every step, queries and keys
  alike: no padded position is read, whatever it holds; a padded row's out is 0 and its lse -inf
  (the sink's logit with sinks);
- the allowed pairs fill a rectangle [i0, i1) x [j0, j1) of (queries, keys): one call on those
  slices, no mask (zigzag's causal off-diagonal shards: half the queries, or half the keys);
- queries and keys are the same positions (the own shard) and the pattern is the causal
  triangle: causal=True (top-left) on it, no mask;
- otherwise (the window's edges, stripe, ALiBi, partial padding): an explicit mask over the
  bounding rectangle: bool (True = attend), or with ALiBi a float bias -slope * |i - j| with
  -inf where masked ((1 or B, H, rows, cols) per call).
allgather.py's bottom-right trick needs keys [k0, a + c) in one call, which a single visiting
shard does not give; the rectangle plan finds the same savings per shard (zigzag + causal: no
mask at all). The plans are made once per call and kept for the backward: with masks, at most
(1 or B, H, n, n) per shard, the (n, S) of mode="allgather"'s explicit-mask path in all.

Packed documents (cu_seqlens; B = 1): a step's calls are the plan of documents.py for the local
queries against the visiting shard (runs inside one document, paired by document: no query meets
a key of another document); a visiting shard that shares no document with the local queries
(after the window) has no call: the step is skipped. Causal, window and ALiBi run in the kernel
where a pair of runs ends (or starts) at the same position, else in a mask.

Dropout: every step's kernel call draws its elements' Philox decisions at their GLOBAL (batch,
head, query position, key position) (the op's dropout_coords, made with the step's plan), from
one seed the group shares (sharding.dropout_seed): the mask is the single process's for that
seed, the merge stays exact (dropout scales the normalized probabilities, which the LSE weights
combine linearly), and the backward redraws the same decisions per step.

Backward (a torch.autograd.Function): K/V rotate again, with float32 dK / dV accumulators that
travel one step behind them: at step t the rank computes the visiting shard's pieces with the
kernel's backward (the bwd op) given the GLOBAL out and lse of its queries, so each piece is the
exact part of the gradient (P = exp(s - lse) restricted to the shard, D = rowsum(dO * O)
global), adds them to the accumulator that arrived from rank r - 1 and sends it on to rank r + 1.
After P steps (P - 1 K/V transfers, P accumulator transfers) every accumulator is back at its
owner. dq accumulates locally in float32.
Gradients: q, k, v, and sinks (this rank's queries' part, as mode="allgather": sum it over the
group): dsinks_h = sum_{b, i} p_sink * (dlse - dO_i . O_i), p_sink = exp(sink_h - lse_i).
A gradient through the returned LSE (dlse) is passed to every step's backward. alibi_slopes get
no gradient (a clear error if they require one).

Entry points: attend runs this mode on an AttentionOptions (options.py: the options and their
checks, shared by every mode); ring_attention is context_parallel_attention(mode="ring") with
the `stats` dict public.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..softmax import ops as _ops
from ..softmax.functional import _default_scale, _rng_state
from .documents import Call
from . import documents
from .options import AttentionOptions, takes_options
from .sharding import dropout_coords, dropout_seed, global_positions

__all__ = ["ring_attention", "attend"]


# ----------------------------------------------------------------------------------- the per-step plan
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
                rng_state=cfg["rng_state"], dropout_coords=step.coords)


def _rows(x: Tensor, idx) -> Tensor:
    """x[:, :, idx] along the sequence dim: a view for a slice, a gather for indices."""
    return x[:, :, idx] if isinstance(idx, slice) else x.index_select(2, idx.to(x.device))


def _add_rows(x: Tensor, idx, y: Tensor) -> None:
    """x[:, :, idx] += y, in place (indices may repeat: each adds)."""
    if isinstance(idx, slice):
        x[:, :, idx] += y
    else:
        x.index_add_(2, idx.to(x.device), y.to(x.dtype))


# ----------------------------------------------------------------------------------- communication
class _Timer:
    """Seconds in wait() and in compute, and the P2P ops posted, for `stats` (None: records
    nothing). On CUDA each reading synchronizes the device, so that the times are the device's."""

    def __init__(self, on: bool, device: torch.device):
        self.on, self.cuda = on, device.type == "cuda"
        self.wait_s = self.compute_s = 0.0
        self.ops = self.kv_sends = self.steps = self.calls = 0

    def now(self) -> float:
        if self.on and self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _post(tm: _Timer, send: Tensor, recv: Tensor, nxt: int, prv: int, group, kv: bool):
    """Send `send` to group rank nxt and receive `recv` from prv: one batch_isend_irecv."""
    g = lambda r: r if group is None else dist.get_global_rank(group, r)  # noqa: E731  P2POp takes global ranks
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, g(nxt), group),
                                   dist.P2POp(dist.irecv, recv, g(prv), group)])
    tm.ops += 2
    tm.kv_sends += int(kv)
    return reqs


def _wait(tm: _Timer, reqs) -> None:
    t0 = tm.now()
    for r in reqs:
        r.wait()
    tm.wait_s += tm.now() - t0


# ----------------------------------------------------------------------------------- autograd
class _Ring(torch.autograd.Function):
    """(q (B, H, n, D), k, v (B, H_k, n, D), sinks (H,) or None) -> (out (B, H, n, D) in q's dtype,
    lse (B, H, n) float32). cfg: the group and the options (see ring_attention)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], cfg: dict):
        group, world, rank = cfg["group"], cfg["world"], cfg["rank"]
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        tm = _Timer(cfg["stats"] is not None, q.device)
        acc = _ops.acc_dtype(q.dtype)
        b, h, n, d = q.shape
        out = q.new_zeros((b, h, n, d), dtype=acc)                  # running output, float32
        lse = q.new_full((b, h, n), float("-inf"), dtype=acc)       # running log-sum-exp, float32
        cur = torch.stack([k, v])                                   # (2, B, H_k, n, D), travels
        for t in range(world):
            reqs = None
            if t < world - 1:  # the next shard is in flight while this one is computed
                nxt_buf = torch.empty_like(cur)
                reqs = _post(tm, cur, nxt_buf, nxt, prv, group, kv=True)
            t0 = tm.now()
            calls = cfg["plan"]((rank - t) % world)
            tm.steps += bool(calls)
            tm.calls += len(calls)
            for step in calls:
                qs, ks, vs = _rows(q, step.rows), _rows(cur[0], step.cols), _rows(cur[1], step.cols)
                o_t, l_t = _ops.fwd(qs, ks, vs, **_options(step, cfg, qs.shape[2], ks.shape[2]))
                if isinstance(step.rows, slice):
                    _merge(out[:, :, step.rows], lse[:, :, step.rows], o_t, l_t)
                else:  # a varlen call's rows (each once): gather, merge, put back
                    idx = step.rows.to(q.device)
                    o_r, l_r = out.index_select(2, idx), lse.index_select(2, idx)
                    _merge(o_r, l_r, o_t, l_t)
                    out.index_copy_(2, idx, o_r)
                    lse.index_copy_(2, idx, l_r)
            tm.compute_s += tm.now() - t0
            if reqs is not None:
                _wait(tm, reqs)
                cur = nxt_buf
        if sinks is not None:  # the sinks join the softmax once: an extra "key" with logit sink_h, value 0
            _merge(out, lse, None, sinks.detach().to(acc).view(1, h, 1).expand(b, h, n))
        out = out.to(q.dtype)
        if cfg["stats"] is not None:
            cfg["stats"].update(fwd_p2p_ops=tm.ops, fwd_kv_sends=tm.kv_sends, fwd_wait_s=tm.wait_s,
                                fwd_compute_s=tm.compute_s, fwd_steps=tm.steps, fwd_calls=tm.calls)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Optional[Tensor]):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        group, world, rank = cfg["group"], cfg["world"], cfg["rank"]
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        tm = _Timer(cfg["stats"] is not None, q.device)
        acc = _ops.acc_dtype(q.dtype)
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.contiguous()
        if dlse is not None:  # rows that saw nothing (lse -inf) pass nothing on
            dlse = dlse.to(acc).masked_fill(torch.isinf(lse), 0.0)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        cur = torch.stack([k, v])                                   # (2, B, H_k, n, D)
        dkv_in = None                                               # the accumulator arriving from rank - 1
        for t in range(world):
            reqs = None
            if t < world - 1:
                nxt_buf = torch.empty_like(cur)
                reqs = _post(tm, cur, nxt_buf, nxt, prv, group, kv=True)
            t0 = tm.now()
            dkv = torch.zeros(cur.shape, dtype=acc, device=q.device)  # this step's pieces, float32
            for step in cfg["plan"]((rank - t) % world):
                sl = step.rows
                qs, ks, vs = _rows(q, sl), _rows(cur[0], step.cols), _rows(cur[1], step.cols)
                a = dict(_options(step, cfg, qs.shape[2], ks.shape[2]),
                         dout=_rows(dout, sl), q=qs, k=ks, v=vs, out=_rows(out, sl), lse=_rows(lse, sl).contiguous(),
                         block_layout=None, block_size=0, topk_thr=None, topk_jcut=None,
                         bias_grad=False, deterministic=False,
                         dlse=None if dlse is None else _rows(dlse, sl).contiguous())
                dq_t, dk_t, dv_t, _, _ = torch.ops.attention_ext.softmax_bwd(*[a[nm] for nm in _ops.BWD_ARGS])
                _add_rows(dq, sl, dq_t)
                _add_rows(dkv[0], step.cols, dk_t)
                _add_rows(dkv[1], step.cols, dv_t)
            tm.compute_s += tm.now() - t0
            if dkv_in is not None:  # the accumulator of this shard, from rank - 1's step t - 1
                _wait(tm, dkv_reqs)
                dkv += dkv_in
            if world == 1:  # its own next visitor: no transfer (gloo has no send to self)
                dkv_in, dkv_reqs = dkv, []
            else:
                dkv_in = torch.empty_like(dkv)
                dkv_reqs = _post(tm, dkv, dkv_in, nxt, prv, group, kv=False)  # on to the shard's next visitor
            if reqs is not None:
                _wait(tm, reqs)
                cur = nxt_buf
        _wait(tm, dkv_reqs)  # after P steps: this rank's own shard's dK / dV, summed over every rank
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dd = (dout.to(acc) * out.to(acc)).sum(-1)               # (B, H, n): dO_i . O_i
            g = -dd if dlse is None else dlse - dd
            p_sink = torch.exp(sinks.detach().to(acc).view(1, -1, 1) - lse)
            dsinks = (p_sink * g).sum((0, 2)).to(sinks.dtype)
        if cfg["stats"] is not None:
            cfg["stats"].update(bwd_p2p_ops=tm.ops, bwd_kv_sends=tm.kv_sends, bwd_wait_s=tm.wait_s,
                                bwd_compute_s=tm.compute_s)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), dsinks, None


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


# ----------------------------------------------------------------------------------- entry points
def attend(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, group: Optional[dist.ProcessGroup],
           shard_layout: str, stats: Optional[Dict[str, Union[int, float]]] = None) -> Tuple[Tensor, Tensor]:
    """mode="ring" on this rank's shards (any layout): (out (B, H, n, D), lse (B, H, n)). The
    entry points (ring_attention, attention.context_parallel_attention) turn them into their result."""
    q, k, v = opts.shards(q, k, v)
    if not _ops.has_kernel(q.device, q.dtype):
        raise NotImplementedError(f"mode='ring' needs a compiled kernel for {q.dtype} on {q.device}")
    alibi_slopes = opts.alibi_slopes
    if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("mode='ring' gives alibi_slopes no gradient: pass them detached "
                                  "(or use mode='allgather')")
    rank, world, s, seq_len = opts.sequence(q, group, shard_layout)
    docs = opts.documents(q, s, shard_layout)
    wl, wr = opts.window
    acc = _ops.acc_dtype(q.dtype)
    pos = [global_positions(s, rank=r, world_size=world, shard_layout=shard_layout, cu_seqlens=docs)
           for r in range(world)]
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().to(device=q.device, dtype=acc)
    plans: Dict[int, List[Call]] = {}
    seed = dropout_seed(opts.dropout_p, opts.seed, group, q.device)
    rng_state = None if seed is None else _rng_state(seed, None)  # (seed, 0): attention()'s for that seed
    h = q.shape[1]

    def plan(owner: int) -> List[Call]:  # made once per owner, reused by the backward
        if owner in plans:
            return plans[owner]
        if docs is not None:
            plans[owner] = documents.plan(pos[rank], pos[owner], docs, wl, wr, alibi_slopes, acc, q.device,
                                          dropout=None if rng_state is None else (h, h, 0))
            return plans[owner]
        step = _plan(pos[rank], pos[owner], seq_len, wl, wr, alibi_slopes, acc, q.device)
        if step is not None and rng_state is not None:  # the step's queries and keys where they are global
            step.coords = dropout_coords(q.shape[0], h, pos[rank][step.rows], pos[owner][step.cols], h_total=h,
                                         device=q.device)
        plans[owner] = [] if step is None else [step]
        return plans[owner]

    scale = opts.scale
    cfg = dict(group=group, world=world, rank=rank, plan=plan, stats=stats, softcap=float(opts.softcap),
               scale=float(scale) if scale is not None else _default_scale(q.shape[3]),
               dropout_p=float(opts.dropout_p), rng_state=rng_state, device=q.device,
               alibi=None if alibi_slopes is None else alibi_slopes.reshape(-1).contiguous())
    return _Ring.apply(q, k, v, opts.sinks, cfg)


@takes_options
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    shard_layout: str = "zigzag",
    stats: Optional[Dict[str, Union[int, float]]] = None,
    **options: Any,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """context_parallel_attention(mode="ring"): the same arguments, options and result (see
    there).

    stats: a dict that, when given, receives per call fwd_p2p_ops (P2P ops posted: a send and a
    receive per transfer), fwd_kv_sends (K/V shards sent: P - 1), fwd_wait_s (seconds in wait()
    on transfers), fwd_compute_s (seconds in kernels and merges), fwd_steps (the steps that
    computed: the others had nothing allowed, e.g. no shared document) and fwd_calls (their
    kernel calls), and the same bwd_* P2P / time keys when the backward runs (its P2P ops also
    carry the dK / dV accumulators: P of them).
    """
    opts = AttentionOptions.of("ring_attention()", options, ("group", "shard_layout", "stats"))
    return opts.result(*attend(q, k, v, opts, group=group, shard_layout=shard_layout, stats=stats))
