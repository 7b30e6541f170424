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

The plan and a step's forward and backward: steps.py (shared with mode="allgather"'s overlapped
form). Entry points: attend runs this mode on an AttentionOptions (options.py: the options and their
checks, shared by every mode); ring_attention is context_parallel_attention(mode="ring") with
the `stats` dict public.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..softmax import ops as _ops
from .options import AttentionOptions, takes_options
from .steps import backward_step, config, finish_forward, forward_step, sinks_grad

__all__ = ["ring_attention", "attend"]


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


def _drained(reqs, step, *args) -> None:
    """step(*args), the compute beside the transfers `reqs` in flight; when it raises (a kernel's
    own check: the ranks agreed on the arguments, so every rank raises at the same step), the
    transfers are waited for first: the peers posted their halves, and requests left unwaited
    would leave the group stuck for its next collective."""
    try:
        step(*args)
    except BaseException:
        for r in reqs or ():
            r.wait()
        raise


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
            _drained(reqs, forward_step, q, cur, calls, out, lse, cfg)
            tm.compute_s += tm.now() - t0
            if reqs is not None:
                _wait(tm, reqs)
                cur = nxt_buf
        out = finish_forward(out, lse, sinks, q.dtype)
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
            in_flight = [*(reqs or ()), *(dkv_reqs if dkv_in is not None else ())]
            _drained(in_flight, backward_step, q, cur, cfg["plan"]((rank - t) % world), dout, out, lse, dlse, dq, dkv,
                     cfg)
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
        dsinks = sinks_grad(sinks, dout, out, lse, dlse) if sinks is not None and ctx.needs_input_grad[3] else None
        if cfg["stats"] is not None:
            cfg["stats"].update(bwd_p2p_ops=tm.ops, bwd_kv_sends=tm.kv_sends, bwd_wait_s=tm.wait_s,
                                bwd_compute_s=tm.compute_s)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), dsinks, None


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
    cfg = config(q, opts, group=group, shard_layout=shard_layout, stats=stats)
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
    check_ranks: bool = True,
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
    opts = AttentionOptions.agreed("ring_attention()", options, ("group", "shard_layout", "stats", "check_ranks"), q, k,
                                   v, group=group, shard_layout=shard_layout, check_ranks=check_ranks,
                                   parallel=dict(mode="ring", shard_layout=shard_layout, overlap=True))
    return opts.result(*attend(q, k, v, opts, group=group, shard_layout=shard_layout, stats=stats))
