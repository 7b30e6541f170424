"""Context-parallel attention, mode="ulysses" (DeepSpeed-Ulysses): an all-to-all turns sequence
shards into head shards, each rank runs the fused kernel on the WHOLE sequence for its heads, and
an all-to-all turns the output back into sequence shards.

Shapes (P ranks, this rank j, h = H / P query heads per rank, n = S / P tokens per rank):

    q (B, H, n, D) in the sharding's token order
      -> all-to-all -> (B, h, S, D): heads [j h, (j + 1) h), every token; rows arrive grouped by
         source rank (rank r's tokens in r's sharding order) and one index_select puts them in
         GLOBAL token order, so the local attention is plain: causal, window, ALiBi and the
         seq_len padding need no mask (padding: queries and keys are cut to [0, seq_len), the cut
         queries' outputs are 0).
    out (B, h, S, D) (and LSE (B, h, S)) -> back to the source order -> all-to-all -> (B, H, n, D).

Communication, counted by the tests: forward 2 all-to-alls (q, k and v packed in ONE, then out
with the LSE packed in ONE); backward 2 (their inverses: the gradient of an all-to-all is the
all-to-all of the gradient, which for equal chunks is the same exchange). Tensors of different
dtypes (a bf16 out, an fp32 LSE) share a call as raw bytes.

Heads: H % P == 0 is required (ValueError otherwise). KV heads (GQA, g = H / H_k query heads
per KV head) follow one rule: with gl = gcd(h, g), the local query heads fall in blocks of gl
consecutive heads that share a KV head, and rank j receives one KV head per block, c = h / gl:
- H_k % P == 0: gl = g, c = H_k / P, the KV heads are split, each sent once;
- P % H_k == 0 (fewer KV heads than ranks): gl = h, c = 1, the rank's one KV head (replicated
  over the P / H_k ranks that share it);
- otherwise (a rank's heads straddle groups, e.g. H=6, H_k=2, P=3): gl = gcd(h, g) < h, the
  KV heads are replicated per block.
The local attention then sees h query heads over c KV heads, GQA ratio gl. Replication is an
index_select, so the backward sums the copies' dK / dV (and the all-to-all returns them to the
token owners).

Packed documents (cu_seqlens; B = 1): the whole sequence is local, so the local attention is one
varlen call over the documents (documents.py's plan against every key; with dropout, one call
per document at its coordinates, the global heads included).

Dropout: the local call draws at the global heads (b * H + j h + local head) and positions
(already global once the rows are in token order): the single process's mask for the shared seed.

Per-head parameters: sinks (H,) and alibi_slopes (H,) / (B, H) are sliced to the local heads.
Rank j's dsinks is the complete gradient of its own heads' sinks and 0 elsewhere, so the sum over
the group (all_reduce) is the exact full gradient: the same rule as mode="allgather".
alibi_slopes get no gradient (as attention_ext.attention).

Entry points: attend runs this mode on an AttentionOptions (options.py: the options and their
checks, shared by every mode); ulysses_attention is context_parallel_attention(mode="ulysses").
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..softmax import ops as _ops
from ..softmax.functional import attention as _attention
from . import documents
from .options import AttentionOptions, takes_options
from .sharding import dropout_coords, dropout_seed, global_positions

__all__ = ["ulysses_attention", "attend", "kv_heads_for_rank"]


def _all_to_all(out: Tensor, x: Tensor, group) -> None:
    # looked up per call so that a test can wrap dist.all_to_all_single to count collectives
    dist.all_to_all_single(out, x, group=group)


def _exchange(xs: List[Tensor], group) -> List[Tensor]:
    """One all-to-all for several tensors of shapes (P, ...): chunk [r] goes to rank r, and
    result [r] is what rank r sent us. Each tensor is viewed as bytes and the per-rank chunks are
    concatenated, so dtypes may differ."""
    world = dist.get_world_size(group)
    flat = [x.contiguous().view(world, -1).view(torch.uint8) for x in xs]  # (P, bytes_i)
    send = flat[0] if len(flat) == 1 else torch.cat(flat, 1)  # (P, sum bytes)
    recv = torch.empty_like(send)
    _all_to_all(recv, send, group)
    outs, o = [], 0
    for x, f in zip(xs, flat):
        nb = f.shape[1]
        # a fresh (P, nb) buffer, not contiguous(): with one rank the slice already counts as
        # contiguous, and at a byte offset (or row stride) that is no multiple of x's item size
        # it cannot be viewed as x's dtype
        seg = recv if len(flat) == 1 else recv[:, o:o + nb].clone(memory_format=torch.contiguous_format)
        outs.append(seg.view(x.dtype).view(x.shape))
        o += nb
    return outs


class _AllToAll(torch.autograd.Function):
    """_exchange under autograd. Chunks are equal on every rank, so the exchange is its own
    inverse: the backward is the same all-to-all of the gradients (one call)."""

    @staticmethod
    def forward(ctx, group, *xs: Tensor):
        ctx.group = group
        return tuple(_exchange(list(xs), group))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        return (None,) + tuple(_exchange(list(grads), ctx.group))


def kv_heads_for_rank(h_q: int, h_k: int, rank: int, world_size: int) -> Tuple[List[int], int]:
    """The global KV heads rank `rank` receives (in local order) and the local GQA ratio gl
    (local query head i uses local KV head i // gl); the rule is in the module docstring."""
    h = h_q // world_size
    g = h_q // h_k
    gl = math.gcd(h, g)
    return [(rank * h + m * gl) // g for m in range(h // gl)], gl


def attend(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, group: Optional[dist.ProcessGroup],
           shard_layout: str) -> Tuple[Tensor, Optional[Tensor]]:
    """mode="ulysses" on this rank's shards (any layout): (out (B, H, n, D), lse (B, H, n), or
    None without return_lse: the LSE then makes no trip). The entry points (ulysses_attention,
    attention.context_parallel_attention) turn them into their result."""
    q, k, v = opts.shards(q, k, v)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    b, hq, n, d = q.shape
    hk = k.shape[1]
    if hq % world != 0:
        raise ValueError(f"mode='ulysses' shards the heads: the number of query heads H={hq} must be a multiple "
                         f"of the group size P={world} (use mode='allgather' otherwise)")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"the query heads H={hq} must be a multiple of the KV heads H_k={hk}")
    _, _, s, seq_len = opts.sequence(q, group, shard_layout)
    docs = opts.documents(q, s, shard_layout)
    block = opts.blocks(q, s)
    if b == 0:  # an empty batch (on every rank: B is the group's): nothing to exchange
        out = q * 0 + (k.sum() + v.sum()) * 0  # (0, H, n, D), in the graph of q, k, v
        return out, q.new_zeros(q.shape[:3], dtype=_ops.acc_dtype(q.dtype))
    wl, wr = opts.window
    h = hq // world
    heads = slice(rank * h, (rank + 1) * h)
    alibi_slopes = None if opts.alibi_slopes is None else opts.alibi_slopes[..., heads]
    sinks = None if opts.sinks is None else opts.sinks[heads]

    # received row r * n + i holds global token src[r * n + i]; full[t] = received[inv[t]]
    src = torch.cat([global_positions(s, rank=r, world_size=world, shard_layout=shard_layout, cu_seqlens=docs)
                     for r in range(world)])
    src = src.to(q.device)
    inv = torch.argsort(src)

    # send buffers, (P, B, heads for rank r, n, D): rank r's query heads, and the KV heads they need
    q_send = q.reshape(b, world, h, n, d).movedim(1, 0)
    kv_idx = [i for r in range(world) for i in kv_heads_for_rank(hq, hk, r, world)[0]]  # (P * c,)
    c = len(kv_idx) // world
    if kv_idx == list(range(hk)):  # split: a view, no copy
        k_send, v_send = (t.reshape(b, world, c, n, d).movedim(1, 0) for t in (k, v))
    else:  # replicated KV heads (index_select: the backward sums the copies)
        idx = torch.tensor(kv_idx, device=k.device)
        k_send, v_send = (t.index_select(1, idx).view(b, world, c, n, d).movedim(1, 0) for t in (k, v))
    q_r, k_r, v_r = _AllToAll.apply(group, q_send, k_send, v_send)  # (P, B, h or c, n, D) by source rank
    # (P, B, x, n, D) -> (B, x, S, D) in global token order
    qf, kf, vf = (t.movedim(0, 2).reshape(b, t.shape[2], s, d).index_select(2, inv) for t in (q_r, k_r, v_r))
    if seq_len < s:  # padding: keys (and queries) >= seq_len cut off
        qf, kf, vf = (t[:, :, :seq_len] for t in (qf, kf, vf))

    # local heads, the whole sequence: one kernel call, position rules on global indices;
    # dropout at the global heads (rows and keys are already global: the identity)
    drop = {}
    seed = dropout_seed(opts.dropout_p, opts.seed, group, q.device)
    if block is not None:  # the rank's heads' part of the layout
        block = (block[0] if block[0].shape[0] == 1 else block[0][rank * h:(rank + 1) * h], block[1])
    if docs is not None or block is not None:
        every = torch.arange(seq_len)
        calls = documents.plan(every, every, docs or (0, seq_len), wl, wr, alibi_slopes, _ops.acc_dtype(q.dtype),
                               q.device, dropout=None if seed is None else (b, h, hq, rank * h), block=block)
        out, lse = documents.attend(qf, kf, vf, calls, scale=opts.scale, softcap=opts.softcap, sinks=sinks,
                                    alibi=alibi_slopes, dropout_p=opts.dropout_p, seed=seed)
    else:
        if seed is not None:
            sl = qf.shape[2]
            drop = dict(dropout_p=opts.dropout_p, seed=seed,
                        dropout_coords=dropout_coords(b, h, torch.arange(sl), torch.arange(sl), h_total=hq,
                                                      h0=rank * h, device=q.device))
        out, lse = _attention(qf, kf, vf, scale=opts.scale, causal=opts.causal, window=(wl, wr),
                              alibi_slopes=alibi_slopes, softcap=opts.softcap, sinks=sinks, return_lse=True, **drop)
    if seq_len < s:
        out = torch.nn.functional.pad(out, (0, 0, 0, s - seq_len))
        lse = torch.nn.functional.pad(lse, (0, s - seq_len))

    # back to source order, (P, B, h, n, ...) by destination rank
    out_send = out.index_select(2, src).view(b, h, world, n, d).movedim(2, 0)
    back = [out_send]
    if opts.return_lse:
        back.append(lse.index_select(2, src).view(b, h, world, n).movedim(2, 0))
    got = _AllToAll.apply(group, *back)  # [r]: rank r's heads for this rank's tokens
    out_l = got[0].movedim(0, 1).reshape(b, hq, n, d)
    return out_l, (got[1].movedim(0, 1).reshape(b, hq, n) if opts.return_lse else None)


@takes_options
def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    shard_layout: str = "zigzag",
    check_ranks: bool = True,
    **options: Any,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """context_parallel_attention(mode="ulysses"): the same arguments, options and results (see
    attention.context_parallel_attention); the design is this module's docstring."""
    opts = AttentionOptions.agreed("ulysses_attention()", options, ("group", "shard_layout", "check_ranks"), q, k, v,
                                   group=group, shard_layout=shard_layout, check_ranks=check_ranks,
                                   parallel=dict(mode="ulysses", shard_layout=shard_layout, overlap=True))
    return opts.result(*attend(q, k, v, opts, group=group, shard_layout=shard_layout))
