"""Tier 2 of the linear family: the functional API.

- linear_attention():       the parallel form (causal or not), every option of the op, any feature map
- linear_attention_step():  the recurrent form: advance a LinearAttentionState by a few tokens
- LinearAttentionState:     S (B, H, M, Dv) and z (B, H, M), float32 (float64 for float64 inputs)

Input rules the op states itself (shapes, dtypes, GQA, option ranges) are checked by the op's one
C++ check: on a compiled kernel, in its Meta kernel under torch.compile and on meta tensors, and
(ops.check_inputs) before the reference fallback. This layer checks what the op cannot see: layouts, the feature map, states and the
values inside cu_seqlens.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .._args import as_offsets, key_padding_mask_renamed, layout_mismatch, not_a_tensor
from . import delta, feature_maps, ops, reference
from .feature_maps import FeatureMapSpec

__all__ = ["linear_attention", "linear_attention_step", "LinearAttentionState"]

_warned_fallback = set()


def _check(cond: bool, msg, exc=ValueError):
    if not cond:
        raise exc(msg() if callable(msg) else msg)


@dataclass
class LinearAttentionState:
    """The recurrent state of causal linear attention after some positions:

        S = sum_j w_j phi(k_j) v_j^T    (B, H, M, Dv)
        z = sum_j w_j phi(k_j)          (B, H, M), the normalizer; None without normalize

    w_j the decay weights exp(G_last - G_j) (1 without decay), float32 (float64 for float64
    inputs), one state per query head. The op carries both as one augmented (B, H, M, Dv + 1)
    tensor (z its last column): `augmented()` and `from_augmented()` convert.

    log_scale (B, H): S and z are stored divided by exp(log_scale), set by log-domain feature
    maps (FAVOR+) that keep their key features bounded; None = 0."""

    S: Tensor
    z: Optional[Tensor] = None
    log_scale: Optional[Tensor] = None

    def __post_init__(self):
        # checked where the state is made: the kernels read S and z with the shapes stated here
        _check(isinstance(self.S, Tensor) and self.S.dim() == 4,
               lambda: f"LinearAttentionState: S must be a 4-D (B, H, M, Dv) Tensor, got "
                       f"{tuple(self.S.shape) if isinstance(self.S, Tensor) else type(self.S).__name__}")
        _check(self.S.is_floating_point(), lambda: f"LinearAttentionState: S must be floating point, got {self.S.dtype}",
               TypeError)
        for name, t, shape in (("z", self.z, self.S.shape[:3]), ("log_scale", self.log_scale, self.S.shape[:2])):
            if t is None:
                continue
            _check(isinstance(t, Tensor) and tuple(t.shape) == tuple(shape),
                   lambda: f"LinearAttentionState: {name} must be {tuple(shape)} (from S {tuple(self.S.shape)}), got "
                           f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
            _check(t.is_floating_point(), lambda: f"LinearAttentionState: {name} must be floating point, got {t.dtype}",
                   TypeError)
            _check(t.device == self.S.device,
                   lambda: f"LinearAttentionState: {name} must be on S's device {self.S.device}, got {t.device}")

    @classmethod
    def zeros(cls, batch: int, heads: int, m: int, dv: int, *, normalize: bool = True, device=None,
              dtype: torch.dtype = torch.float32) -> "LinearAttentionState":
        s = torch.zeros(batch, heads, m, dv, device=device, dtype=dtype)
        return cls(s, torch.zeros(batch, heads, m, device=device, dtype=dtype) if normalize else None)

    @classmethod
    def from_augmented(cls, t: Tensor, normalize: bool, log_scale: Optional[Tensor] = None) -> "LinearAttentionState":
        """(B, H, M, Dv') -> state; Dv' = Dv + 1 (z the last column) with normalize."""
        if normalize:
            return cls(t[..., :-1].contiguous(), t[..., -1].contiguous(), log_scale)
        return cls(t.contiguous(), None, log_scale)

    def augmented(self, normalize: bool = True) -> Tensor:
        """The op's (B, H, M, Dv') form: [S, z] with normalize, else S."""
        if not normalize:
            return self.S
        _check(self.z is not None, "initial_state has no normalizer z (it was made with normalize=False); "
                                   "normalize=True needs one")
        return torch.cat([self.S, self.z.unsqueeze(-1)], -1)

    @property
    def normalize(self) -> bool:
        return self.z is not None

    def _map(self, fn) -> "LinearAttentionState":
        return LinearAttentionState(*(None if t is None else fn(t) for t in (self.S, self.z, self.log_scale)))

    def detach(self) -> "LinearAttentionState":
        return self._map(Tensor.detach)

    def clone(self) -> "LinearAttentionState":
        return self._map(Tensor.clone)

    def to(self, *args, **kwargs) -> "LinearAttentionState":
        return self._map(lambda t: t.to(*args, **kwargs))


def _key_scale(fm, e_k: Tensor, key_mask: Optional[Tensor], prev: Optional[Tensor], h: int) -> Tensor:
    """The log-domain keys' common exponent offset, (B, H_k): the maximum over this call's (real)
    keys and the incoming state's log_scale prev ((nb, H) or None), so that every feature
    exp(e - offset) <= 1 and the state only ever scales down."""
    b, hk = e_k.shape[:2]
    if key_mask is not None:
        e_k = e_k.masked_fill(~key_mask.view(b, 1, -1, 1), float("-inf"))
    c = e_k.detach().flatten(2).amax(-1) if e_k.shape[2] else e_k.new_full((b, hk), float("-inf"))  # (B, H_k)
    if prev is not None:
        p = prev.detach().to(c.dtype).view(prev.shape[0], hk, h // hk).amax(-1)  # (nb, H_k)
        c = torch.maximum(c, p if p.shape[0] == b else p.amax(0, keepdim=True))
    return torch.where(torch.isfinite(c), c, torch.zeros_like(c))


def stabilized(fm, normalize: bool) -> bool:
    """Whether `fm` runs stabilized: a log-domain map (FAVOR+) with stabilize=True, under
    normalization (the only place its offsets cancel)."""
    return bool(getattr(fm, "log_domain", False) and getattr(fm, "stabilize", False) and normalize)


def stabilized_features(fm, q: Tensor, k: Tensor, key_offset) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """A stabilized map's features in the compute dtype (not q's: see normalize_offset), for
    linear_attention and context parallelism alike: each query row divided by exp of its largest
    exponent a_i (its largest feature is then 1 / sqrt(m)), every key by exp(c), c =
    key_offset(e_k) (B, H_k) from the keys' exponents e_k (B, H_k, S, M) (_key_scale, or CP's
    global one). Returns (fq (B, H, S, M), fk (B, H_k, S, M), log_scale = c per query head (B, H),
    eps_log = -(a_i + c) (B, H, S)); the offsets are detached."""
    h = q.shape[1]
    e_q = fm.exponents(q)  # (B, H, S, M) float32 (float64 for float64 q)
    a = e_q.detach().amax(-1) if e_q.shape[-1] else e_q.new_zeros(e_q.shape[:-1])  # (B, H, S)
    e_k = fm.exponents(k)  # (B, H_k, S, M)
    c = key_offset(e_k)  # (B, H_k)
    log_scale = c.repeat_interleave(h // k.shape[1], dim=1)  # (B, H)
    fq = fm.features(e_q - a.unsqueeze(-1), e_q.dtype)
    fk = fm.features(e_k - c[:, :, None, None], e_k.dtype)
    return fq, fk, log_scale, -(a + log_scale.to(a.dtype).unsqueeze(-1))


def normalize_offset(o_aug: Tensor, eps: float, eps_log: Tensor, dtype: torch.dtype) -> Tensor:
    """out = O' / (den' + eps exp(eps_log)) in `dtype`, from o_aug = [O' | den']
    (B, H, S, Dv + 1), the unnormalized op on v' = [v, 1] over a stabilized map's features.

    Stabilizing divides phi(q_i) by exp(a_i) (its row offset) and phi(k_j) by exp(c) (the keys'
    offset), so O'_i and den'_i are O_i and den_i divided by exp(a_i + c): the definition
    O_i / (den_i + eps) is O'_i / (den'_i + eps exp(-(a_i + c))), eps_log = -(a_i + c). Adding
    eps to den'_i instead (the fused kernel's scalar eps) made it exp(a_i + c) times larger:
    FAVOR+ at D = 128, causal, fp32 was 2% off its definition, and a result depended on where a
    sequence was split into calls (the keys' running maximum c). The result is now the
    definition, whatever the split. So where the features underflow (inputs of norm ~100:
    exponents of -1000), eps dominates and the output goes to 0, as the unstabilized formula's
    does; the stabilizers keep it finite (eps_log is capped at 80, exp(80) * eps finite in
    float32). The features, v' and o_aug are in the compute dtype (float32), where the
    unnormalized sums cannot overflow as fp16's would. A row with no keys (den' = 0) gives 0,
    as eps > 0 does."""
    num, den = o_aug[..., :-1], o_aug[..., -1:]
    den = den + eps * torch.exp(eps_log.to(den.dtype).clamp(max=80.0)).unsqueeze(-1)
    out = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))
    return out.to(dtype)


def _featurize(fm, q: Tensor, k: Tensor, normalize: bool, key_mask: Optional[Tensor],
               state: Optional[LinearAttentionState]
               ) -> Tuple[Tensor, Tensor, int, Optional[Tensor], Optional[Tensor]]:
    """(q, k, feature_map code, key log-scale, eps_log) for the op: fused maps pass q and k
    through with their code; any other map runs here, and the kernel applies its identity (code
    0) to the features. A stabilized log-domain map (FAVOR+) under normalization gets its keys'
    common offset, (B, H) per query head (see _key_scale), its features in the compute dtype and
    eps_log (B, H, S) for normalize_offset; else those two are None."""
    code = getattr(fm, "fused_code", None)
    if code is not None:
        return q, k, code, None, None
    h = q.shape[1]
    log_scale = eps_log = None
    if stabilized(fm, normalize):
        prev = state.log_scale if state is not None else None
        fq, fk, log_scale, eps_log = stabilized_features(fm, q, k, lambda e_k: _key_scale(fm, e_k, key_mask, prev, h))
    else:
        fq = feature_maps.apply(fm, q, is_query=True, normalized=normalize)
        fk = feature_maps.apply(fm, k, is_query=False, normalized=normalize)
    for name, f, x in (("q", fq, q), ("k", fk, k)):
        _check(isinstance(f, Tensor) and f.dim() == 4 and f.shape[:3] == x.shape[:3],
               lambda: f"feature_map must map {name} (B, H, S, D) to (B, H, S, M), got "
                       f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
    _check(fq.shape[-1] == fk.shape[-1],
           lambda: f"feature_map gave q and k different widths: {fq.shape[-1]} and {fk.shape[-1]}")
    if eps_log is None:
        fq, fk = (f.to(q.dtype) if f.dtype != q.dtype else f for f in (fq, fk))
    fq, fk = (f if f.stride(-1) == 1 else f.contiguous() for f in (fq, fk))
    return fq, fk, 0, log_scale, eps_log


def _fused(q: Tensor, k: Tensor, v: Tensor, opts: dict) -> Tuple[Tensor, Tensor, Tensor]:
    """The op on (B, H, S, D) views where a compiled kernel serves q's device and dtype; else
    reference.py under the op's own input rules (ops.check_inputs), with a warning."""
    if ops.has_kernel(q.device, q.dtype):
        return ops.fwd(q, k, v, **opts)
    ops.check_inputs(q, k, v, **opts)
    key = (q.device.type, q.dtype)
    if key not in _warned_fallback:
        _warned_fallback.add(key)
        warnings.warn(f"attention_ext: no compiled linear attention kernel for {q.dtype} on {q.device}; running the "
                      f"PyTorch reference", RuntimeWarning)
    acc = ops.acc_dtype(q.dtype)
    kw = {n: opts[n] for n in ("decay", "initial_state", "key_mask", "cu_seqlens", "feature_map", "causal",
                               "normalize", "eps", "scale")}
    out, den, final = reference.linear_attention(q.to(acc), k.to(acc), v.to(acc), **kw)
    return out.to(q.dtype), den, final


def _per_feature_gates(qf: Tensor, kf: Tensor, v: Tensor, code: int, opts: dict,
                       out_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """linear_attention with GLA's gates, one per feature: decay (B, H, S, M), S_t =
    Diag(exp(decay_t)) S_{t-1} + phi(k_t) v'_t^T. The recurrence is the delta-rule kernels' with
    the plain write u_t = v'_t (linear/delta.py: `plain`), run per query head on the features in
    the compute dtype, so the gates stay exact down to -inf (a hard reset). The op's rules check
    everything else (with one feature's gates standing in for the decay). Returns (out in
    out_dtype, the final state (nb, H, M, Dv'))."""
    decay = opts["decay"]
    b, h, s, _ = qf.shape
    hk, acc = kf.shape[1], decay.dtype
    # Identity features without the normalizer on the CPU kernel, one k / v head per query head:
    # q, k and v go in as they are (the kernel widens them to float32 as .to(acc) would, and rounds
    # out and each gradient once, as the conversions' autograd does), so a 16-bit call skips three
    # conversions and reads half the bytes. With GQA, k and v repeat over the group, and their
    # gradients must sum over it before they round; a scale of 0 runs at 1 and multiplies out by
    # 0, which a 16-bit out rounded to inf would turn to NaN.
    s0 = opts["initial_state"]
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qf, kf, v, decay, s0))
    if (code == 0 and not opts["normalize"] and opts["scale"] != 0.0 and h == kf.shape[1]
            and qf.dtype == kf.dtype == v.dtype == out_dtype and qf.device.type == "cpu"
            and delta.has_kernel(qf.device, qf.dtype, grad=grad)):
        acc = qf.dtype
    # contiguous before the map, not after: q and k are (B, H, S, D) views of bshd inputs, and
    # the map's backward (elu_backward) lays its output out as the gradient (contiguous, from the
    # op) in eager but as its input under torch.compile's fake tensors, which broke a compiled
    # backward's view of it; the op reads contiguous rows either way, so no copy is added
    phi_q, phi_k = (reference.phi(t.to(acc).contiguous(), code) for t in (qf, kf))
    m = phi_q.shape[-1]
    _check(tuple(decay.shape) == (b, h, s, m),
           lambda: f"decay must be (B, H, S) or, a gate per feature, (B, H, S, M) = {(b, h, s, m)}, got "
                   f"{tuple(decay.shape)}")
    ops.check_inputs(qf, kf, v, **dict(opts, decay=decay[..., 0].contiguous()))  # every other rule, the op's
    vv = v.to(acc)
    if opts["key_mask"] is not None:  # a padded key writes nothing (where, not a product: 0 x NaN / inf)
        real = opts["key_mask"].view(b, 1, s, 1)
        phi_k, vv = torch.where(real, phi_k, torch.zeros_like(phi_k)), torch.where(real, vv, torch.zeros_like(vv))
    if h != hk:  # the state is per query head (its gates): k and v repeated over the group
        phi_k, vv = (t.repeat_interleave(h // hk, dim=1) for t in (phi_k, vv))
    dv, s0, scale = vv.shape[-1], opts["initial_state"], opts["scale"]
    # The state's columns evolve independently, so the normalizer column z runs as a call of its
    # own: v keeps every width the op takes (a column more could pass the kernels' limit), at no
    # extra kernel work (tasks are blocks of columns). A scale of 0 gives 0: run at 1, times 0.
    a = dict(q=phi_q.contiguous(), k=phi_k.contiguous(), v=vv.contiguous(), beta=phi_q.new_ones(b, h, s),
             gate=decay, initial_state=s0[..., :dv].contiguous() if s0 is not None else None,
             cu_seqlens=opts["cu_seqlens"], scale=scale if scale != 0.0 else 1.0, qk_l2norm=False, plain=True)
    o, final = delta.run(a)
    if opts["normalize"]:
        z0 = s0[..., dv:].contiguous() if s0 is not None else None
        den, final_z = delta.run(dict(a, v=phi_q.new_ones(b, h, s, 1), initial_state=z0))
        if scale == 0.0:
            o, den = o * 0.0, den * 0.0
        o = o / (den + opts["eps"])
        final = torch.cat([final, final_z], -1)
    elif scale == 0.0:
        o = o * 0.0
    return o.to(out_dtype), final


def _as_state_tensor(state, normalize: bool, acc: torch.dtype, device,
                     log_scale: Optional[Tensor]) -> Optional[Tensor]:
    """The op's (nb, H, M, Dv') initial state, rescaled from the state's log_scale to `log_scale`
    (the keys' offset of this call; None = 0)."""
    if state is None:
        return None
    t = state.augmented(normalize) if isinstance(state, LinearAttentionState) else state
    _check(isinstance(t, Tensor), lambda: f"initial_state must be a LinearAttentionState or a Tensor, got "
                                          f"{type(state).__name__}", TypeError)
    _check(t.device == device, lambda: f"initial_state must be on {device}, got {t.device}")
    t = t.to(acc)
    prev = state.log_scale if isinstance(state, LinearAttentionState) else None
    if prev is not None or log_scale is not None:
        prev = prev.to(acc) if prev is not None else 0.0
        new = log_scale.to(acc) if log_scale is not None else 0.0
        t = t * torch.exp(prev - new)[..., None, None]
    return t.contiguous()


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: FeatureMapSpec = "elu",
    causal: bool = False,
    normalize: bool = True,
    eps: float = 1e-6,
    scale: Optional[float] = None,
    decay: Optional[Tensor] = None,
    key_mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
    layout: str = "bhsd",
    initial_state: Union[LinearAttentionState, Tensor, None] = None,
    return_state: bool = False,
    key_padding_mask: None = None,
) -> Union[Tensor, Tuple[Tensor, LinearAttentionState]]:
    """Linear attention: out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps) (reference.linear_attention
    states the math).

    Args:
        q: (B, H, S, D), or (B, S, H, D) with layout="bshd".
        k: (B, H_k, S, D); v: (B, H_k, S, Dv) (same layout); H % H_k == 0 gives MQA / GQA with no
            copy; Dv may differ from D.
        feature_map: a registered name ("elu", "relu", "identity" run fused in the kernel;
            "favor", "rfa"), a FeatureMap, or any nn.Module / callable (..., D) -> (..., M),
            applied to q and k before the kernel.
        causal: position i reads keys j <= i (the recurrent form); else every key.
        normalize: divide by the normalizer phi(q_i)^T z_i + eps; False returns phi(q_i)^T S_i.
        scale: multiplies phi(q); None = 1.
        decay: (B, H, S) log-gates (causal only): S_t = exp(decay_t) S_{t-1} + phi(k_t) v_t^T;
            or (B, H, S, M), a gate per feature (GLA): S_t = Diag(exp(decay_t)) S_{t-1} + ...
            (the delta-rule kernels' plain write; fused or unstabilized feature maps). Always
            (B, H, S[, M]), whatever the layout.
        key_mask: (B, S) bool, True = a real key (as attention()'s); a padded key writes nothing.
            Its gate (decay) still applies as given: set decay to 0 there for padding that leaves
            the state as it is (the nn layers do).
        cu_seqlens: (nb + 1) offsets of a varlen pack: q, k, v are (total, H, D) or a B = 1
            tensor in `layout`; each sequence starts from its own initial state and never sees its
            neighbour's. max_seqlen: the longest sequence (computed when None).
        initial_state: a LinearAttentionState (or the op's (B, H, M, Dv') tensor) the sequence
            continues from; (nb, ...) with cu_seqlens.
        return_state: also return the LinearAttentionState after the last position (with
            causal=False: initial_state plus every key).
        key_padding_mask: not read: a TypeError says to pass key_mask=~key_padding_mask (the
            name is torch's, with the opposite polarity).

    Returns out with q's layout and dtype (and the state).
    """
    if key_padding_mask is not None:
        raise key_padding_mask_renamed("linear_attention()")
    packed = cu_seqlens is not None and isinstance(q, Tensor) and q.dim() == 3
    if packed:  # (total, H, D) -> (1, total, H, D)
        for name, t in (("k", k), ("v", v)):
            _check(not isinstance(t, Tensor) or t.dim() == 3,
                   lambda: f"with cu_seqlens, q, k and v are one kind of pack: q is (total, H, D), so {name} must be "
                           f"(total, H_k, D) too (or all (1, total, H, D)), got {name} of shape {tuple(t.shape)}")
        q, k, v = (t.unsqueeze(0) if isinstance(t, Tensor) else t for t in (q, k, v))
        layout = "bshd"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t)
        _check(t.dim() == 4, lambda: f"{name} must be 4-D ({'B, H, S, D' if layout == 'bhsd' else 'B, S, H, D'}), "
               f"got shape {tuple(t.shape)}")
    _check(layout in ("bhsd", "bshd"), lambda: f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    q0, k0, v0 = q, k, v
    if layout == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D) views, no copy
    _check(q.device == k.device == v.device,
           lambda: f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    acc = ops.acc_dtype(q.dtype)
    if key_mask is not None:
        if not isinstance(key_mask, Tensor):
            raise not_a_tensor("key_mask", key_mask)
        _check(tuple(key_mask.shape) == (q.shape[0], q.shape[2]),
               lambda: f"key_mask must be (B, S) = {(q.shape[0], q.shape[2])} (True = a real key), got "
                       f"{tuple(key_mask.shape)}")
        _check(key_mask.dtype == torch.bool,
               lambda: f"key_mask must be bool (True = a real key), got {key_mask.dtype}", TypeError)
        key_mask = key_mask.contiguous()
    fm = feature_maps.resolve(feature_map, q.shape[-1])
    if isinstance(fm, feature_maps.FeatureMap):
        fm.prepare()
    state_in = initial_state if isinstance(initial_state, LinearAttentionState) else None
    qf, kf, code, log_scale, eps_log = _featurize(fm, q, k, normalize, key_mask, state_in)
    out_dtype = q.dtype
    if eps_log is not None:  # stabilized: the unnormalized op on v' = [v, 1] in the compute dtype
        v = torch.cat([v.to(qf.dtype), torch.ones_like(v[..., :1], dtype=qf.dtype)], -1)
        acc = ops.acc_dtype(qf.dtype)
    if qf.stride(-1) != 1 or kf.stride(-1) != 1 or v.stride(-1) != 1:
        qf, kf, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (qf, kf, v))
    if decay is not None:
        if not isinstance(decay, Tensor):
            raise not_a_tensor("decay", decay)
        _check(decay.dim() in (3, 4), lambda: f"decay must be (B, H, S) log-gates, or (B, H, S, M) with a gate per "
                                              f"feature, got {decay.dim()}-D {tuple(decay.shape)}")
        # the conversion below would take a bool mask as log-gates of 1 (a growing state)
        _check(decay.is_floating_point(), lambda: f"decay must be floating-point log-gates, got {decay.dtype}", TypeError)
        decay = decay.to(acc).contiguous()
    if cu_seqlens is not None:
        cu = as_offsets(cu_seqlens, "cu_seqlens", q.device)
        _check(cu.dim() == 1 and cu.numel() >= 2, lambda: f"cu_seqlens must be (nb + 1,), got {tuple(cu.shape)}")
        lens = cu[1:] - cu[:-1]
        if q.device.type == "cpu" or not torch.compiler.is_compiling():
            _check(int(cu[0]) == 0, "cu_seqlens must start at 0")
            _check(bool((lens >= 0).all()), "cu_seqlens must be non-decreasing")
            _check(int(cu[-1]) <= q.shape[2], "cu_seqlens end past the packed tensors")
            if max_seqlen is not None:
                _check(int(lens.max()) <= max_seqlen, "a sequence is longer than max_seqlen")
        if max_seqlen is None:
            max_seqlen = int(lens.max())
        cu_seqlens = cu
    opts = dict(decay=decay, initial_state=_as_state_tensor(initial_state, normalize, acc, q.device, log_scale),
                key_mask=key_mask, cu_seqlens=cu_seqlens,
                max_seqlen=int(max_seqlen) if max_seqlen is not None else q.shape[2], feature_map=code,
                causal=bool(causal), normalize=bool(normalize) and eps_log is None, eps=float(eps),
                scale=1.0 if scale is None else float(scale))
    try:
        if decay is not None and decay.dim() == 4:
            _check(eps_log is None, "a decay per feature (B, H, S, M) takes the fused feature maps or an unstabilized "
                                    "one: pass stabilize=False to the feature map")
            out, final = _per_feature_gates(qf, kf, v, code, opts, out_dtype)
        else:
            out, _, final = _fused(qf, kf, v, opts)
    except ValueError as e:  # the op's shape errors: name `layout` where the shapes prove a mix-up
        mix = None if packed else layout_mismatch(q0, k0, v0, layout, e, same_len=True)
        if mix is not None:
            raise mix from e
        raise
    if eps_log is not None:
        out = normalize_offset(out, float(eps), eps_log, out_dtype)
    if layout == "bshd":
        out = out.transpose(1, 2)
    if packed:
        out = out.squeeze(0)  # (total, H, Dv)
    if not return_state:
        return out
    if log_scale is not None:  # (B, H) -> (nb, H): a varlen pack shares one offset
        log_scale = log_scale.expand(final.shape[0], -1).contiguous()
    return out, LinearAttentionState.from_augmented(final, normalize, log_scale)


def linear_attention_step(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    state: Optional[LinearAttentionState],
    *,
    feature_map: FeatureMapSpec = "elu",
    decay_t: Optional[Tensor] = None,
    normalize: bool = True,
    eps: float = 1e-6,
    scale: Optional[float] = None,
    layout: str = "bhsd",
    inplace: bool = False,
) -> Tuple[Tensor, LinearAttentionState]:
    """The recurrent form of causal linear attention: advance `state` by T (a few) positions,
    O(M Dv) per position and head, in the state's dtype (float32; float64 for float64):

        S_t = exp(decay_t) S_{t-1} + phi(k_t) v_t^T,  z_t = exp(decay_t) z_{t-1} + phi(k_t)
        out_t = scale phi(q_t)^T S_t / (scale phi(q_t)^T z_t + eps)   (normalize)

    q_t (B, H, T, D), k_t (B, H_k, T, D), v_t (B, H_k, T, Dv) (or (B, T, H, D) with
    layout="bshd"), decay_t (B, H, T), or (B, H, T, M) with GLA's gate per feature (S_t =
    Diag(exp(decay_t)) S_{t-1} + ..., z likewise, as linear_attention's decay; the fused or
    unstabilized feature maps). state None starts from zeros. Random feature maps are not
    redrawn here. Prefill with linear_attention(causal=True, return_state=True), then steps,
    equals the parallel form. inplace=True advances `state` itself (its tensors in place when
    autograd is not recording: decode loops); otherwise a new state is returned and `state` kept.
    normalize=False returns a state without z, as linear_attention does.

    Where autograd does not record and a compiled kernel serves the device and dtype (CPU; CUDA
    for float32 / bfloat16 / float16), this runs torch.ops.attention_ext.linear_step: one pass over
    the state, updated in place (after a copy when inplace=False). Otherwise (autograd recording:
    the step is differentiable in every input; a state dtype other than the op's) it runs
    reference.linear_step, the PyTorch form.
    Returns (out_t with q_t's layout and dtype, state).
    """
    for name, t in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t)
        _check(t.dim() == 4, lambda: f"{name} must be a 4-D Tensor (B, H, T, .) with T >= 1 new tokens, got shape "
               f"{tuple(t.shape)}" + (" (one token taken by an index drops its axis: slice it, x[:, :, -1:])"
                                      if t.dim() == 3 else ""))
    _check(layout in ("bhsd", "bshd"), lambda: f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    q0, k0, v0 = q_t, k_t, v_t
    if layout == "bshd":
        q_t, k_t, v_t = q_t.transpose(1, 2), k_t.transpose(1, 2), v_t.transpose(1, 2)
    # the op states these, but the reference path (autograd) would run an integer step or
    # fail inside a matmul
    _check(q_t.is_floating_point() and k_t.dtype == q_t.dtype and v_t.dtype == q_t.dtype,
           lambda: f"linear_attention_step: q_t, k_t, v_t must share a floating dtype, got {q_t.dtype}, {k_t.dtype}, "
                   f"{v_t.dtype}", TypeError)
    _check(q_t.device == k_t.device == v_t.device,
           lambda: f"linear_attention_step: q_t, k_t, v_t must be on one device, got {q_t.device}, {k_t.device}, "
                   f"{v_t.device}")
    b, h, t, d = q_t.shape
    hk, dv = k_t.shape[1], v_t.shape[-1]
    if not (hk >= 1 and h % hk == 0 and v_t.shape[1] == hk and k_t.shape[-1] == d and k_t.shape[:3] == (b, hk, t)
            and v_t.shape[:3] == (b, hk, t)):
        e = ValueError(f"linear_attention_step: q_t {tuple(q_t.shape)}, k_t {tuple(k_t.shape)}, v_t {tuple(v_t.shape)} "
                       f"do not match (B, H, T, D), (B, H_k, T, D), (B, H_k, T, Dv)")
        raise layout_mismatch(q0, k0, v0, layout, e, same_len=True, names=("q_t", "k_t", "v_t")) or e
    _check(state is None or isinstance(state, LinearAttentionState), "state must be a LinearAttentionState", TypeError)
    fm = feature_maps.resolve(feature_map, d)
    fq, fk, code, log_scale, eps_log = _featurize(fm, q_t, k_t, normalize, None, state)
    m = fq.shape[-1]
    acc = ops.acc_dtype(q_t.dtype)
    if state is None:
        state = LinearAttentionState.zeros(b, h, m, dv, normalize=normalize, device=q_t.device, dtype=acc)
    _check(tuple(state.S.shape) == (b, h, m, dv),
           lambda: f"state.S must be (B, H, M, Dv) = {(b, h, m, dv)}, got {tuple(state.S.shape)}")
    _check(not normalize or state.z is not None, "normalize=True needs a state with a normalizer z")
    if decay_t is not None:
        if not isinstance(decay_t, Tensor):
            raise not_a_tensor("decay_t", decay_t)
        _check(decay_t.is_floating_point(), lambda: f"decay_t must be floating-point log-gates, got {decay_t.dtype}",
               TypeError)
        _check(tuple(decay_t.shape) in ((b, h, t), (b, h, t, m)),
               lambda: f"decay_t must be (B, H, T) = {(b, h, t)} log-gates, or (B, H, T, M) = {(b, h, t, m)} with a "
                       f"gate per feature, got {tuple(decay_t.shape)}")
        _check(decay_t.dim() == 3 or (eps_log is None and state.log_scale is None),
               "a decay_t per feature (B, H, T, M) takes the fused feature maps or an unstabilized one: pass "
               "stabilize=False to the feature map")
    sdt = state.S.dtype
    decay = decay_t.to(sdt) if decay_t is not None else None
    if (log_scale is not None or state.log_scale is not None) and t > 0:
        # re-express the state in this step's key offset: one more log-gate on the first position
        prev = state.log_scale if state.log_scale is not None else 0.0
        shift = (prev - (log_scale if log_scale is not None else 0.0)).to(sdt)  # (B, H)
        decay = decay.clone() if decay is not None else torch.zeros(b, h, t, dtype=sdt, device=q_t.device)
        decay[:, :, 0] += shift
    elif t == 0:
        log_scale = state.log_scale
    s_, z = state.S, state.z if normalize else None
    s_given, z_given = s_, z  # inplace: the tensors that must come out advanced
    track = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (fq, fk, v_t, s_, z, decay))
    if not track and not inplace:
        s_, z = s_.clone(), None if z is None else z.clone()
    opts = dict(feature_map=code, eps=float(eps), scale=1.0 if scale is None else float(scale))
    z_stab = None
    if eps_log is not None:
        # stabilized (FAVOR+): the op advances S unnormalized on the compute-dtype features; z and
        # the normalization follow here, with the eps term of normalize_offset
        v_t, z_stab, z = v_t.to(fq.dtype), z, None
    if not track and sdt == acc and ops.has_step_kernel(q_t.device, fq.dtype):
        fq, fk, vv = (x if x.stride(-1) == 1 else x.contiguous() for x in (fq, fk, v_t))
        s_, z = (x if x is None or x.stride(-1) == 1 else x.contiguous() for x in (s_, z))
        out = ops.step(fq, fk, vv, s_, z, None if decay is None else decay.contiguous(), **opts)
        for written in (s_, z):  # written from C++: autograd's version counters must see it (delta.py)
            if written is not None:
                torch.autograd.graph.increment_version(written)
    else:
        if not track:  # the in-place update views S as (B H, M, Dv)
            s_, z = (x if x is None or x.is_contiguous() else x.contiguous() for x in (s_, z))
        out, s_, z = reference.linear_step(fq, fk, v_t, s_, z, decay, inplace=not track, **opts)
    if eps_log is not None:
        zz, fkr, dens = z_stab.to(fq.dtype), fk.repeat_interleave(h // hk, dim=1), []  # fkr (B, H, T, M)
        for i in range(t):  # z_t = exp(decay_t) z_{t-1} + phi(k_t), den'_t = scale phi(q_t) . z_t
            if decay is not None:
                zz = zz * decay[:, :, i].exp().unsqueeze(-1)
            zz = zz + fkr[:, :, i]
            dens.append((fq[:, :, i] * zz).sum(-1) * opts["scale"])
        den = torch.stack(dens, 2) if dens else out.new_zeros(b, h, 0)  # (B, H, T)
        out = normalize_offset(torch.cat([out, den.unsqueeze(-1).to(out.dtype)], -1), float(eps), eps_log, q_t.dtype)
        if track:
            z = zz.to(sdt)
        else:  # the state's own tensor (or its copy, inplace=False), as the op updates S
            z = z_stab.copy_(zz)
    if layout == "bshd":
        out = out.transpose(1, 2)
    if inplace:
        if not track:  # a state the kernel took as a contiguous copy: the result goes back into it
            if s_ is not s_given:
                s_ = s_given.copy_(s_)
            if z is not None and z_given is not None and z is not z_given:
                z = z_given.copy_(z)
        state.S, state.z, state.log_scale = s_, z, log_scale
        return out, state
    return out, LinearAttentionState(s_, z, log_scale)
