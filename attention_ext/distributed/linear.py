"""Context-parallel linear attention: each rank holds a contiguous shard of the sequence and
computes its queries' output of attention_ext.linear.linear_attention over the whole sequence.

Linear attention's past is a fixed-size state, so no keys travel, only states:

    S_r = sum_{t in shard r} exp(G_end - G_t) phi(k_t) v'_t^T      (B, H, M, Dv')  the shard's state
    L_r = sum_{t in shard r} decay_t                                 (B, H)          its total log-decay
    E_r = exp(L_r) E_{r-1} + S_r,  E_{-1} = S_0 (initial_state or 0) the state after shard r

with v' = [v, 1] under normalize (the state's last column is the normalizer z), G the running
sum of the log-gates inside the shard and G_end its last value (no decay: every weight 1, L = 0).

Forward, per rank r:
1. S_r and L_r from this shard alone (one PyTorch matmul, O(n M Dv')), packed as one
   (B, H, M Dv' + 1) tensor;
2. ONE all-gather of the packed (S, L) pairs (sharding._AllGather: its backward is one
   reduce-scatter that sums every rank's gradient of them back to the owner), O(P M Dv') bytes
   per rank, independent of the sequence length;
3. causal: state_in = E_{r-1}, the exclusive prefix over the ranks before r (a loop over at most
   P - 1 gathered states); non-causal: state_in = S_0 + sum_{j != r} S_j (every rank sees every
   key; the sum is over the gathered states, so it is exact, no subtract-own);
4. the local fused kernel: linear_attention(q_r, k_r, v_r, initial_state=state_in), which adds
   the shard's own keys (causal: in order, with decay) and normalizes with the combined z.
return_state gives the global final state E_{P-1} (non-causal: S_0 + sum_j S_j), the same on
every rank.

Backward is autograd's: the kernel's backward gives dq, dk, dv, ddecay and d(state_in); the
prefix combination is PyTorch; the gather's reduce-scatter carries d(S_j, L_j) back to rank j,
whose step-1 matmul turns it into its part of dk, dv and ddecay. One collective per direction.

Shards may have different lengths per rank (rank order is sequence order), so no padding rule
applies. Only the contiguous layout exists: zigzag / stripe would interleave rank order with
sequence order, which a causal prefix of states cannot express.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..linear import feature_maps, reference
from ..linear.functional import LinearAttentionState, linear_attention
from ..linear.ops import acc_dtype
from .sharding import LAYOUTS, _AllGather, shards_bhsd

__all__ = ["context_parallel_linear_attention"]


def _features(feature_map, q: Tensor, k: Tensor, normalize: bool) -> Tuple[Tensor, Tensor, str, Tensor]:
    """(q for the kernel, k for the kernel, the kernel's feature map name, phi(k) in the compute
    dtype (B, H_k, n, M) for the shard state). Fused maps (elu, relu, identity) stay in the kernel;
    any other map runs here once and the kernel gets its features with "identity"."""
    fm = feature_maps.resolve(feature_map, q.shape[-1])
    acc = acc_dtype(q.dtype)
    code = getattr(fm, "fused_code", None)
    if code is not None:
        return q, k, reference.FUSED_FEATURE_MAPS[code], reference.phi(k.to(acc), code)
    if getattr(fm, "log_domain", False) and getattr(fm, "stabilize", False) and normalize:
        # the single-process op offsets the keys by their maximum over the WHOLE sequence (a
        # state log_scale); matching it would need that maximum from every rank first
        raise NotImplementedError("context_parallel_linear_attention: a stabilized log-domain feature map (FAVOR+ "
                                  "with stabilize=True) under normalize=True is not built; use stabilize=False, "
                                  "normalize=False or another feature map")
    if isinstance(fm, feature_maps.FeatureMap):
        fm.prepare()  # once per call, as linear_attention does (random maps must be seeded alike on every rank)
    fq = feature_maps.apply(fm, q, is_query=True, normalized=normalize)
    fk = feature_maps.apply(fm, k, is_query=False, normalized=normalize)
    for name, f, x in (("q", fq, q), ("k", fk, k)):
        if not (isinstance(f, Tensor) and f.dim() == 4 and f.shape[:3] == x.shape[:3]):
            raise ValueError(f"feature_map must map {name} (B, H, S, D) to (B, H, S, M), got "
                             f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
    return fq, fk, "identity", fk.to(acc)


def _shard_state(fk: Tensor, v: Tensor, h: int, decay: Optional[Tensor], normalize: bool) -> Tuple[Tensor, Tensor]:
    """This shard's (S_r (B, H, M, Dv'), L_r (B, H)) in fk's dtype (the compute dtype); fk
    (B, H_k, n, M), v (B, H_k, n, Dv), decay (B, H, n) log-gates or None."""
    b, hk, n, _ = fk.shape
    vv = v.to(fk.dtype)
    if normalize:
        vv = torch.cat([vv, torch.ones_like(vv[..., :1])], -1)  # (B, H_k, n, Dv')
    if decay is None:  # one state per kv head, shared by its query heads
        s = (fk.transpose(-1, -2) @ vv).repeat_interleave(h // hk, dim=1)  # (B, H, M, Dv')
        return s, fk.new_zeros(b, h)
    g = decay.cumsum(-1)  # (B, H, n) G_t
    w = (g[..., -1:] - g).exp()  # (B, H, n) exp(G_end - G_t)
    fkw = fk.repeat_interleave(h // hk, dim=1) * w.unsqueeze(-1)  # (B, H, n, M)
    s = fkw.transpose(-1, -2) @ vv.repeat_interleave(h // hk, dim=1)  # (B, H, M, Dv')
    return s, g[..., -1] if n else fk.new_zeros(b, h)


class _Tie(torch.autograd.Function):
    """out unchanged, with the gathered pairs as a second input whose gradient is zero: every
    rank's output then depends on the all-gather, so every rank's backward runs its
    reduce-scatter, also a rank that reads none of the gathered states (rank 0 when causal).
    Without it rank 0 would skip the collective the others wait in."""

    @staticmethod
    def forward(ctx, out: Tensor, gathered: Tensor) -> Tensor:
        ctx.shape, ctx.dtype = gathered.shape, gathered.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, torch.zeros(ctx.shape, dtype=ctx.dtype, device=g.device)


def context_parallel_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "contiguous",
    feature_map: feature_maps.FeatureMapSpec = "elu",
    causal: bool = True,
    decay: Optional[Tensor] = None,
    scale: Optional[float] = None,
    normalize: bool = True,
    eps: float = 1e-6,
    qkv_layout: str = "bhsd",
    initial_state: Union[LinearAttentionState, Tensor, None] = None,
    return_state: bool = False,
) -> Union[Tensor, Tuple[Tensor, LinearAttentionState]]:
    """linear_attention over a sequence sharded contiguously across the ranks of `group`.

    Args:
        q: this rank's query shard, (B, H, n, D) for qkv_layout="bhsd" or (B, n, H, D) for
            "bshd"; rank r holds the r-th contiguous piece (shard_sequence(layout="contiguous"),
            or any split in rank order: n may differ per rank).
        k, v: this rank's key / value shards, (B, H_k, n, D) and (B, H_k, n, Dv) (same layout),
            H % H_k == 0 (GQA / MQA).
        group: the process group (default: the world).
        layout: must be "contiguous" (ValueError otherwise).
        feature_map, scale, normalize, eps: as linear_attention (fused "elu" / "relu" /
            "identity", or any map; a stabilized FAVOR+ under normalize raises
            NotImplementedError). A random map must hold the same projection on every rank.
        causal: as linear_attention (default True here: the recurrent form across ranks).
        decay: this rank's shard of the (B, H, S) per-token log-gates, (B, H, n) whatever the
            layout; causal only (as linear_attention). Differentiable.
        initial_state: the state the WHOLE sequence starts from (a LinearAttentionState without
            log_scale, or the op's (B, H, M, Dv') tensor), the same on every rank; it enters
            before rank 0's first token.
        return_state: also return the global final state (after the last rank's last token;
            non-causal: initial state plus every key), the same on every rank. Its gradient, like
            the keys', sums over ranks: a loss on it on every rank counts it once per rank.

    Returns this rank's output shard in q's layout and dtype (and the state). Communication: one
    all-gather of the (state, log-decay) pairs forward and one reduce-scatter backward, run by
    every rank's backward (rank 0 included, see _Tie), so every rank of the group must call
    backward, with inputs that require grad on all ranks or on none.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout != "contiguous":
        raise ValueError(f"context_parallel_linear_attention needs layout='contiguous' (the states combine in rank "
                         f"order, which must be sequence order), got {layout!r}")
    q, k, v = shards_bhsd(q, k, v, qkv_layout=qkv_layout)  # (B, H, n, D) views
    b, h, n, _ = q.shape
    hk = k.shape[1]
    if k.shape[:3] != (b, hk, n) or v.shape[:3] != (b, hk, n) or k.shape[-1] != q.shape[-1] or h % hk:
        raise ValueError(f"q, k, v shards must be (B, H, n, D), (B, H_k, n, D), (B, H_k, n, Dv) with H % H_k == 0, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    acc = acc_dtype(q.dtype)
    if decay is not None:
        if not causal:
            raise ValueError("decay needs causal=True (a gate orders the positions)")
        if not isinstance(decay, Tensor) or tuple(decay.shape) != (b, h, n):
            raise ValueError(f"decay must be this rank's (B, H, n) = {(b, h, n)} log-gates, got "
                             f"{tuple(decay.shape) if isinstance(decay, Tensor) else type(decay).__name__}")
        decay = decay.to(acc)
    s0 = None
    if initial_state is not None:
        if isinstance(initial_state, LinearAttentionState):
            if initial_state.log_scale is not None:
                raise NotImplementedError("context_parallel_linear_attention: an initial_state with a log_scale "
                                          "(a stabilized FAVOR+ state) is not supported")
            s0 = initial_state.augmented(normalize)
        elif isinstance(initial_state, Tensor):
            s0 = initial_state
        else:
            raise TypeError(f"initial_state must be a LinearAttentionState or a Tensor, got "
                            f"{type(initial_state).__name__}")
        s0 = s0.to(acc)

    qf, kf, fm_name, phik = _features(feature_map, q, k, normalize)
    s_r, l_r = _shard_state(phik, v, h, decay, normalize)  # (B, H, M, Dv'), (B, H)
    m, dvp = s_r.shape[-2:]
    if s0 is not None and tuple(s0.shape) != (b, h, m, dvp):
        raise ValueError(f"initial_state must be (B, H, M, Dv') = {(b, h, m, dvp)}, got {tuple(s0.shape)}")

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # one collective: (1, B, H, M Dv' + 1) -> (P, B, H, M Dv' + 1), rank j's pair in row j
    packed = torch.cat([s_r.reshape(b, h, m * dvp), l_r.unsqueeze(-1)], -1)
    gathered = _AllGather.apply(packed.unsqueeze(0), group)
    states = gathered[..., :-1].reshape(world, b, h, m, dvp)  # S_j
    logd = gathered[..., -1]  # (P, B, H) L_j

    if causal:
        e = s0  # E_{j-1}: the state entering shard j
        state_in = None
        for j in range(world if return_state else rank + 1):  # E_{P-1} only when it is returned
            if j == rank:
                state_in = e
            if e is None:
                e = states[j]
            else:
                e = (e * logd[j].exp()[..., None, None] if decay is not None else e) + states[j]
        final = e if return_state else None
    else:  # every query reads every key: the others' states, summed exactly (no subtraction of our own)
        others = [states[j] for j in range(world) if j != rank]
        state_in = sum(others[1:], others[0]) if others else None
        if s0 is not None:
            state_in = s0 if state_in is None else state_in + s0
    res = linear_attention(qf, kf, v, feature_map=fm_name, causal=causal, normalize=normalize, eps=eps, scale=scale,
                           decay=decay, initial_state=state_in, return_state=False)
    if gathered.requires_grad:
        res = _Tie.apply(res, gathered)
    if qkv_layout == "bshd":
        res = res.transpose(1, 2)
    if not return_state:
        return res
    if not causal:
        final = states.sum(0) if s0 is None else states.sum(0) + s0
    return res, LinearAttentionState.from_augmented(final, normalize)
