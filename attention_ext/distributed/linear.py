"""Context-parallel linear attention: each rank holds a contiguous shard of the sequence and
computes its queries' output of attention_ext.linear.linear_attention over the whole sequence.

Linear attention's past is a fixed-size state, so no keys travel, only states:

    S_r = sum_{t in shard r} exp(G_end - G_t) phi(k_t) v'_t^T      (B, H, M, Dv')  the shard's state
    L_r = sum_{t in shard r} decay_t                                 (B, H)          its total log-decay
    E_r = exp(L_r) E_{r-1} + S_r,  E_{-1} = S_0 (initial_state or 0) the state after shard r

With GLA's gates per feature (decay (B, H, n, M)) the same holds row by row: G, L_r (B, H, M)
and exp(L_r) scale the state's rows (Diag(exp(L_r)) E_{r-1}).

with v' = [v, 1] under normalize (the state's last column is the normalizer z), G the running
sum of the log-gates inside the shard and G_end its last value (no decay: every weight 1, L = 0).
A padded key (key_mask False, each rank passing its (B, n) shard of the mask) has
phi(k_t) = 0: it adds nothing to S_r or z; its gate still decays the state, as in the kernel.

Forward, per rank r:
0. only for a stabilized log-domain feature map (FAVOR+ with stabilize=True) under normalize:
   linear_attention offsets every key's exponents by one constant per (batch, kv head), the
   maximum over the WHOLE sequence's real keys (and the initial state's log_scale), detached;
   each rank takes the maximum over its own real keys (-inf for none) and ONE all-reduce(MAX) of
   that detached (B, H_k) tensor gives the global one, bit-identical on every rank and to the
   single process (a maximum is exact). The states S_j, the initial state and the returned
   state's log_scale are then all in that one offset, as in the single-process op. Detached, so
   this collective has no backward;
1. S_r and L_r from this shard alone (one PyTorch matmul, O(n M Dv')), packed as one
   (B, H, M Dv' + 1) tensor;
2. ONE all-gather of the packed (S, L) pairs (sharding._AllGather: its backward is one
   reduce-scatter that sums every rank's gradient of them back to the owner), O(P M Dv') bytes
   per rank, independent of the sequence length;
3. causal: state_in = E_{r-1}, the exclusive prefix over the ranks before r (a loop over at most
   P - 1 gathered states); non-causal: state_in = S_0 + sum_{j != r} S_j (every rank sees every
   key; the sum is over the gathered states, so it is exact, no subtract-own);
4. the local fused kernel: linear_attention(q_r, k_r, v_r, initial_state=state_in), which adds
   the shard's own keys (causal: in order, with decay; the local mask) and normalizes with the
   combined z.
return_state gives the global final state E_{P-1} (non-causal: S_0 + sum_j S_j), the same on
every rank (with the stabilizer: its log_scale, the global offset).

Backward is autograd's: the kernel's backward gives dq, dk, dv, ddecay and d(state_in); the
prefix combination is PyTorch; the gather's reduce-scatter carries d(S_j, L_j) back to rank j,
whose step-1 matmul turns it into its part of dk, dv and ddecay. One collective per direction,
plus step 0's all-reduce forward for a stabilized FAVOR+.

Shards may have different lengths per rank (rank order is sequence order), so no padding rule
applies. Only the contiguous sharding exists: zigzag / stripe would interleave rank order with
sequence order, which a causal prefix of states cannot express.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..linear import feature_maps, reference
from ..linear.functional import (LinearAttentionState, linear_attention, normalize_offset, stabilized,
                                 stabilized_features)
from ..linear.ops import acc_dtype
from .._args import TENSOR_LAYOUT, key_padding_mask_renamed, layout_mismatch, not_a_tensor, renamed
from .agree import agree, field, map_field, needed, shard_field, state_field
from .sharding import _AllGather, _check_layout, check_cu_seqlens, shards_bhsd

__all__ = ["context_parallel_linear_attention"]


def _features(feature_map, q: Tensor, k: Tensor, normalize: bool, key_mask: Optional[Tensor],
              prev: Optional[Tensor], group) -> Tuple[Tensor, Tensor, str, Tensor, Optional[Tensor]]:
    """(q for the kernel, k for the kernel, the kernel's feature map name, phi(k) in the compute
    dtype (B, H_k, n, M) for the shard state, the keys' log-scale (B, H) or None). Fused maps
    (elu, relu, identity) stay in the kernel; any other map runs here once and the kernel gets its
    features with "identity". A stabilized log-domain map (FAVOR+) under normalize offsets the
    keys by the global stabilizer (_global_key_scale: one all-reduce), as linear_attention does."""
    fm = feature_maps.resolve(feature_map, q.shape[-1])
    acc = acc_dtype(q.dtype)
    code = getattr(fm, "fused_code", None)
    if code is not None:
        return q, k, reference.FUSED_FEATURE_MAPS[code], reference.phi(k.to(acc), code), None, None
    if isinstance(fm, feature_maps.FeatureMap):
        fm.prepare()  # once per call, as linear_attention does (random maps must be seeded alike on every rank)
    h = q.shape[1]
    log_scale = eps_log = None
    if stabilized(fm, normalize):  # the key offset the same on every rank: one all-reduce(MAX)
        fq, fk, log_scale, eps_log = stabilized_features(
            fm, q, k, lambda e_k: _global_key_scale(e_k, key_mask, prev, h, group))
    else:
        fq = feature_maps.apply(fm, q, is_query=True, normalized=normalize)
        fk = feature_maps.apply(fm, k, is_query=False, normalized=normalize)
    for name, f, x in (("q", fq, q), ("k", fk, k)):
        if not (isinstance(f, Tensor) and f.dim() == 4 and f.shape[:3] == x.shape[:3]):
            raise ValueError(f"feature_map must map {name} (B, H, S, D) to (B, H, S, M), got "
                             f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
    return fq, fk, "identity", fk.to(acc), log_scale, eps_log


def _global_key_scale(e_k: Tensor, key_mask: Optional[Tensor], prev: Optional[Tensor], h: int, group) -> Tensor:
    """linear.functional._key_scale over the WHOLE sequence: the maximum of the real keys'
    exponents e_k (B, H_k, n, M) over every rank's shard and the incoming state's log_scale prev
    ((B, H) or None), per (batch, kv head), (B, H_k); 0 where there is none (no real key, no
    prev). Detached, as in the single-process op (the offset cancels in out_i = O'_i / den_i, eps
    term included: linear.functional.normalize_offset), so one all-reduce(MAX) of a detached tensor is exact:
    max is exact in floating point, whatever the order of the ranks."""
    b, hk = e_k.shape[:2]
    e = e_k.detach()
    if key_mask is not None:
        e = e.masked_fill(~key_mask.view(b, 1, -1, 1), float("-inf"))
    # -inf, not 0, for a shard without real keys: it must not raise a maximum that is negative elsewhere
    c = e.flatten(2).amax(-1) if e.shape[2] else e.new_full((b, hk), float("-inf"))  # (B, H_k)
    c = c.contiguous()
    dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)  # the extra collective, forward only
    if prev is not None:
        c = torch.maximum(c, prev.detach().to(c.dtype).view(b, hk, h // hk).amax(-1))
    return torch.where(torch.isfinite(c), c, torch.zeros_like(c))


def _shard_state(fk: Tensor, v: Tensor, h: int, decay: Optional[Tensor], normalize: bool,
                 key_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """This shard's (S_r (B, H, M, Dv'), L_r (B, H, 1), or (B, H, M) per feature) in fk's dtype
    (the compute dtype); fk (B, H_k, n, M), v (B, H_k, n, Dv), decay (B, H, n) log-gates, (B, H,
    n, M) per feature, or None, key_mask (B, n) bool (True = a real key) or None. A padded key adds
    nothing to S_r (nor to z, its last column); its gate still decays the state, as in the
    kernel."""
    b, hk, n, _ = fk.shape
    if key_mask is not None:
        # where, not a product: a padded key's feature may be inf under a stabilizer its exponent
        # did not enter (0 * inf = nan); its gradient is 0 either way
        fk = torch.where(key_mask.view(b, 1, n, 1), fk, torch.zeros_like(fk))
    vv = v.to(fk.dtype)
    if normalize:
        vv = torch.cat([vv, torch.ones_like(vv[..., :1])], -1)  # (B, H_k, n, Dv')
    if decay is None:  # one state per kv head, shared by its query heads
        s = (fk.transpose(-1, -2) @ vv).repeat_interleave(h // hk, dim=1)  # (B, H, M, Dv')
        return s, fk.new_zeros(b, h, 1)
    # key t's weight exp(G_end - G_t) is the exp of the gates after t summed to the shard's end,
    # formed as suffix sums and never as a difference of running sums: after a gate of -inf (a hard
    # reset) or -1e9 the difference is nan or all rounding, the sum is exact (0 weight, or the
    # later keys' own)
    per_feature = decay.dim() == 4
    g = decay if per_feature else decay.unsqueeze(-1)  # (B, H, n, M or 1)
    suffix = g.flip(2).cumsum(2).flip(2)  # the gates from t to the end
    after = torch.cat([suffix[:, :, 1:], torch.zeros_like(suffix[:, :, :1])], 2)  # from t + 1
    fkw = fk.repeat_interleave(h // hk, dim=1) * after.exp()  # (B, H, n, M)
    s = fkw.transpose(-1, -2) @ vv.repeat_interleave(h // hk, dim=1)  # (B, H, M, Dv')
    return s, suffix[:, :, 0] if n else fk.new_zeros(b, h, g.shape[-1])


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
    shard_layout: str = "contiguous",
    feature_map: feature_maps.FeatureMapSpec = "elu",
    causal: bool = True,
    decay: Optional[Tensor] = None,
    key_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    normalize: bool = True,
    eps: float = 1e-6,
    layout: str = "bhsd",
    initial_state: Union[LinearAttentionState, Tensor, None] = None,
    return_state: bool = False,
    cu_seqlens: Union[Tensor, Sequence[int], None] = None,
    check_ranks: bool = True,
    key_padding_mask: None = None,
    qkv_layout: None = None,
) -> Union[Tensor, Tuple[Tensor, LinearAttentionState]]:
    """linear_attention over a sequence sharded contiguously across the ranks of `group`.

    Args:
        q: this rank's query shard, (B, H, n, D) for layout="bhsd" or (B, n, H, D) for
            "bshd"; rank r holds the r-th contiguous piece (shard_sequence(shard_layout=
            "contiguous"), or any split in rank order: n may differ per rank).
        k, v: this rank's key / value shards, (B, H_k, n, D) and (B, H_k, n, Dv) (same layout),
            H % H_k == 0 (GQA / MQA).
        group: the process group (default: the world).
        shard_layout: the sequence sharding; must be "contiguous" (ValueError otherwise).
        layout: the tensors' layout, "bhsd" or "bshd" (as in linear_attention). A sharding
            given here raises a ValueError that names shard_layout; the old name qkv_layout
            raises a TypeError that names layout.
        feature_map, scale, normalize, eps: as linear_attention (fused "elu" / "relu" /
            "identity", or any map). A stabilized FAVOR+ under normalize takes its key offset
            from the whole sequence: one extra all-reduce(MAX) forward (module docstring, step
            0). A random map must hold the same projection on every rank.
        causal: as linear_attention (default True here: the recurrent form across ranks).
        decay: this rank's shard of the (B, H, S) per-token log-gates, (B, H, n) whatever the
            layout, or of GLA's per-feature gates, (B, H, n, M); causal only (as
            linear_attention). Differentiable.
        key_mask: this rank's shard of linear_attention's (B, S) key_mask, (B, n) bool (True =
            a real key) whatever the layout; a padded key contributes to no
            query, on any rank, nor to the normalizer (nor to a stabilizer's maximum).
        initial_state: the state the WHOLE sequence starts from (a LinearAttentionState, its
            log_scale (B, H) if any, or the op's (B, H, M, Dv') tensor), the same on every rank;
            it enters before rank 0's first token.
        return_state: also return the global final state (after the last rank's last token;
            non-causal: initial state plus every key), the same on every rank. Its gradient, like
            the keys', sums over ranks: a loss on it on every rank counts it once per rank.
        cu_seqlens: packed documents (causal, B = 1): the GLOBAL document offsets of the pack,
            the same on every rank, with shards of equal length (shard_sequence's contiguous
            layout; checked after the all-gather). The state resets at every document start (a
            log-gate of -inf there, exact: the states weight keys by sums of the gates after
            them), so no document sees another's keys or normalizer, on this rank or an earlier
            one; positions from cu_seqlens[-1] on are padding (keys that enter nothing, queries
            that read nothing). initial_state enters the first document; return_state gives the
            state after the last position.
        check_ranks: as context_parallel_attention's: every rank checks its arguments and the
            group agrees on them (shapes but for the shards' lengths, dtypes, options, the feature
            map's type, cu_seqlens) in one small all-gather before any collective, so a bad or
            mismatched argument raises the same error on every rank; False skips it.

    Returns this rank's output shard in q's layout and dtype (and the state). Communication: one
    all-gather of the (state, log-decay) pairs forward and one reduce-scatter backward, run by
    every rank's backward (rank 0 included, see _Tie), so every rank of the group must call
    backward, with inputs that require grad on all ranks or on none. A stabilized FAVOR+ under
    normalize adds one all-reduce(MAX) of a detached (B, H_k) tensor forward (the keys' global
    offset), before the all-gather; it has no backward.
    """
    fn = "context_parallel_linear_attention()"
    check_ranks = needed(group, check_ranks)
    sd = 1 if layout == "bshd" else 2  # the shards' length may differ per rank: their sequence dim is left out
    fields = dict.fromkeys(("q", "k", "v", "decay", "key_mask", "initial_state", "feature_map", "grad mode",
                            "shard_layout", "causal", "scale", "normalize", "eps", "layout", "cu_seqlens"))
    err = None
    try:  # this rank's checks, then the group's agreement (agree.py), before any collective
        if check_ranks:
            fields.update(q=shard_field(q, sd), k=shard_field(k, sd), v=shard_field(v, sd),
                          decay=shard_field(decay, 2), key_mask=shard_field(key_mask, 1),
                          initial_state=state_field(initial_state), feature_map=map_field(feature_map),
                          shard_layout=shard_layout, causal=field(causal), scale=field(scale),
                          normalize=field(normalize), eps=field(eps), layout=layout, cu_seqlens=field(cu_seqlens))
            fields["grad mode"] = torch.is_grad_enabled()
        if key_padding_mask is not None:
            raise key_padding_mask_renamed("context_parallel_linear_attention()")
        if qkv_layout is not None:
            raise renamed("context_parallel_linear_attention()", "qkv_layout", "layout", TENSOR_LAYOUT)
        _check_layout(shard_layout)
        if shard_layout != "contiguous":
            raise ValueError(f"context_parallel_linear_attention needs shard_layout='contiguous' (the states combine in "
                             f"rank order, which must be sequence order), got {shard_layout!r}")
        q0, k0, v0 = q, k, v
        q, k, v = shards_bhsd(q, k, v, layout=layout)  # (B, H, n, D) views
        b, h, n, _ = q.shape
        hk = k.shape[1]
        if k.shape[:3] != (b, hk, n) or v.shape[:3] != (b, hk, n) or k.shape[-1] != q.shape[-1] or h % hk:
            e = ValueError(f"q, k, v shards must be (B, H, n, D), (B, H_k, n, D), (B, H_k, n, Dv) with H % H_k == 0, "
                           f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
            raise layout_mismatch(q0, k0, v0, layout, e, arg="layout", same_len=True) or e
        acc = acc_dtype(q.dtype)
        if decay is not None:
            if not causal:
                raise ValueError("decay needs causal=True (a gate orders the positions)")
            if not isinstance(decay, Tensor) or decay.dim() not in (3, 4) or tuple(decay.shape[:3]) != (b, h, n):
                raise ValueError(f"decay must be this rank's (B, H, n) = {(b, h, n)} log-gates, or (B, H, n, M) with "
                                 f"a gate per feature, got "
                                 f"{tuple(decay.shape) if isinstance(decay, Tensor) else type(decay).__name__}")
            decay = decay.to(acc)
        if cu_seqlens is not None:  # packed documents: a reset (log-gate -inf) at each start, padding masked
            if not causal:
                raise ValueError("cu_seqlens needs causal=True (the documents reset a causal state)")
            if b != 1:
                raise ValueError(f"cu_seqlens packs documents into ONE sequence: the shards' batch must be 1, got {b}")
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            # the end is checked against S after the all-gather, once every rank knows the shards are
            # of one length (a per-rank S could fail on some ranks only, and the others would hang)
            cu = check_cu_seqlens(cu_seqlens, sys.maxsize)
            off = rank * n
            pos = torch.arange(off, off + n, device=q.device)
            # every start, the padding's (cu[-1]) too: padded queries see no document; a shard's first
            # position included (position 0 is the sequence's start: the initial state enters there)
            starts = torch.tensor([t for t in cu[1:] if max(off, 1) <= t < off + n], dtype=torch.long, device=q.device)
            reset = torch.isin(pos, starts).view(1, 1, n, *((1,) if decay is not None and decay.dim() == 4 else ()))
            decay = (decay if decay is not None else q.new_zeros((b, h, n), dtype=acc)).masked_fill(reset, float("-inf"))
            real = (pos < cu[-1]).view(1, n)
            key_mask = real if key_mask is None else key_mask & real
        if key_mask is not None:
            if not isinstance(key_mask, Tensor):
                raise not_a_tensor("key_mask", key_mask)
            if tuple(key_mask.shape) != (b, n):
                raise ValueError(f"key_mask must be this rank's (B, n) = {(b, n)} shard of the mask (True = a real key), "
                                 f"got {tuple(key_mask.shape)}")
            if key_mask.dtype != torch.bool:
                raise ValueError(f"key_mask must be bool (True = a real key), got {key_mask.dtype}")
            if key_mask.device != q.device:
                raise ValueError(f"key_mask must be on {q.device}, got {key_mask.device}")
            key_mask = key_mask.contiguous()
        s0, prev = None, None  # (B, H, M, Dv') the initial state, (B, H) its log_scale
        if initial_state is not None:
            if isinstance(initial_state, LinearAttentionState):
                prev = initial_state.log_scale
                if prev is not None and (not isinstance(prev, Tensor) or tuple(prev.shape) != (b, h)):
                    raise ValueError(f"initial_state.log_scale must be (B, H) = {(b, h)}, got "
                                     f"{tuple(prev.shape) if isinstance(prev, Tensor) else type(prev).__name__}")
                s0 = initial_state.augmented(normalize)
            elif isinstance(initial_state, Tensor):
                s0 = initial_state
            else:
                raise TypeError(f"initial_state must be a LinearAttentionState or a Tensor, got "
                                f"{type(initial_state).__name__}")
            s0 = s0.to(acc)
    except Exception as e:  # noqa: BLE001  (any failure here must reach every rank, not leave them waiting)
        err = e
    agree(fn, group, fields, err, check=check_ranks)

    # a stabilized FAVOR+ under normalize: one all-reduce(MAX) here, before the all-gather (every
    # rank takes the same branch: the feature map and normalize are the same on every rank)
    qf, kf, fm_name, phik, log_scale, eps_log = _features(feature_map, q, k, normalize, key_mask, prev,
                                                          group)
    if decay is not None and decay.dim() == 4:  # the same on every rank: all raise, before the all-gather
        if eps_log is not None:
            raise ValueError("a decay per feature (B, H, n, M) takes the fused feature maps or an unstabilized one: "
                             "pass stabilize=False to the feature map")
        if decay.shape[-1] != phik.shape[-1]:
            raise ValueError(f"decay must be this rank's (B, H, n, M) = {(b, h, n, phik.shape[-1])} gates per feature "
                             f"(M the feature map's width), got {tuple(decay.shape)}")
    s_r, l_r = _shard_state(phik, v, h, decay, normalize, key_mask)  # (B, H, M, Dv'), (B, H, 1 or M)
    m, dvp = s_r.shape[-2:]
    if s0 is not None and tuple(s0.shape) != (b, h, m, dvp):
        raise ValueError(f"initial_state must be (B, H, M, Dv') = {(b, h, m, dvp)}, got {tuple(s0.shape)}")
    if s0 is not None and (prev is not None or log_scale is not None):
        # the initial state re-expressed in the keys' offset, as linear.functional._as_state_tensor
        # does (differentiable in prev; the offset itself is detached)
        old = prev.to(acc) if prev is not None else 0.0
        new = log_scale.to(acc) if log_scale is not None else 0.0
        s0 = s0 * torch.exp(old - new)[..., None, None]

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # the all-gather: (1, B, H, M Dv' + L) -> (P, B, H, M Dv' + L), rank j's pair in row j, L = 1
    # or M (per feature) log-decays (with documents one more column, the shard's length, so that
    # every rank sees unequal shards)
    parts = [s_r.reshape(b, h, m * dvp), l_r]
    if cu_seqlens is not None:
        parts.append(s_r.new_full((b, h, 1), float(n)))
    gathered = _AllGather.apply(torch.cat(parts, -1).unsqueeze(0), group)
    if cu_seqlens is not None:
        lens = gathered[:, 0, 0, -1].tolist()
        if any(x != n for x in lens):
            raise ValueError(f"cu_seqlens needs shards of one length (the documents' offsets are global), got "
                             f"{[int(x) for x in lens]} tokens per rank: shard with shard_sequence(..., "
                             f"shard_layout='contiguous')")
        gathered = gathered[..., :-1]
        check_cu_seqlens(cu_seqlens, n * world)  # the documents' end within S, on every rank alike
    states = gathered[..., :m * dvp].reshape(world, b, h, m, dvp)  # S_j
    logd = gathered[..., m * dvp:]  # (P, B, H, 1 or M) L_j

    if causal:
        e = s0  # E_{j-1}: the state entering shard j
        state_in = None
        for j in range(world if return_state else rank + 1):  # E_{P-1} only when it is returned
            if j == rank:
                state_in = e
            if e is None:
                e = states[j]
            else:
                e = (e * logd[j].exp().unsqueeze(-1) if decay is not None else e) + states[j]
        final = e if return_state else None
    else:  # every query reads every key: the others' states, summed exactly (no subtraction of our own)
        others = [states[j] for j in range(world) if j != rank]
        state_in = sum(others[1:], others[0]) if others else None
        if s0 is not None:
            state_in = s0 if state_in is None else state_in + s0
    if eps_log is None:
        res = linear_attention(qf, kf, v, feature_map=fm_name, causal=causal, normalize=normalize, eps=eps,
                               scale=scale, decay=decay, key_mask=key_mask, initial_state=state_in,
                               return_state=False)
    else:  # stabilized: unnormalized on v' = [v, 1] with the augmented state, then linear_attention's division
        va = torch.cat([v.to(kf.dtype), torch.ones_like(v[..., :1], dtype=kf.dtype)], -1)
        res = linear_attention(qf, kf, va, feature_map=fm_name, causal=causal, normalize=False, scale=scale,
                               decay=decay, key_mask=key_mask, initial_state=state_in,
                               return_state=False)
        res = normalize_offset(res, float(eps), eps_log, q.dtype)
    if gathered.requires_grad:
        res = _Tie.apply(res, gathered)
    if layout == "bshd":
        res = res.transpose(1, 2)
    if not return_state:
        return res
    if not causal:
        final = states.sum(0) if s0 is None else states.sum(0) + s0
    return res, LinearAttentionState.from_augmented(final, normalize, log_scale)
