"""Tier 1 of the linear family: the registered custom ops torch.ops.attention_ext.{linear_fwd,
linear_bwd, linear_step}, with fake kernels and autograd.

    linear_fwd(q, k, v, decay?, initial_state?, key_mask?, cu_seqlens?, max_seqlen, feature_map,
               causal, normalize, eps, scale) -> (out, den, final_state)
    linear_bwd(dout, dfinal_state?, q, k, v, out, den, decay?, initial_state?, key_mask?,
               cu_seqlens?, max_seqlen, feature_map, causal, normalize, eps, scale)
        -> (dq, dk, dv, ddecay, dinitial_state)
    linear_step(q, k, v, state!, normalizer!?, decay?, feature_map, eps, scale) -> out
        the recurrent form over T positions (reference.linear_step), state (B, H, M, Dv) and
        normalizer (B, H, M) advanced in place; no autograd (the functional layer runs the
        differentiable PyTorch form when autograd records)

The math is reference.linear_attention's (reference.linear_step's for the step). The schemas are defined in C++ (csrc/torch/); this
module adds `register_fake` (after `check_inputs`, the C++ input rules restated) and
`register_autograd`, when the extension defines the ops. Without them, `HAS_OP` is False and the
functional layer runs the reference.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._ext import HAS_EXT, registered
from .._dtypes import DTYPES, acc_dtype, dtype_name, shape_of

# the op's schema is defined (fakes and autograd can attach), and which devices have a kernel;
# read once at import so the lookups stay traceable by torch.compile
HAS_OP = HAS_EXT and hasattr(torch.ops.attention_ext, "linear_fwd") and hasattr(torch.ops.attention_ext, "linear_bwd")
_KERNELS = {dev: HAS_OP and registered("attention_ext::linear_fwd", key) for dev, key in (("cpu", "CPU"),
                                                                                          ("cuda", "CUDA"))}
HAS_STEP_OP = HAS_EXT and hasattr(torch.ops.attention_ext, "linear_step")
_STEP_KERNELS = {dev: HAS_STEP_OP and registered("attention_ext::linear_step", key) for dev, key in (("cpu", "CPU"),
                                                                                                   ("cuda", "CUDA"))}
FEATURE_MAP_CODES = (0, 1, 2)  # identity, elu + 1, relu (reference.phi)
MAX_WIDTH = 1024  # the kernels' limit on the feature width M and the value width Dv


def has_kernel(device: torch.device, dtype: Optional[torch.dtype] = None) -> bool:
    """True when a compiled linear kernel serves tensors on `device` (and of `dtype`, when given)."""
    if not _KERNELS.get(device.type, False):
        return False
    return dtype is None or (dtype in DTYPES and (dtype != torch.float64 or device.type == "cpu"))


def has_step_kernel(device: torch.device, dtype: Optional[torch.dtype] = None) -> bool:
    """True when a compiled linear_step kernel serves tensors on `device` (and of `dtype`)."""
    if not _STEP_KERNELS.get(device.type, False):
        return False
    return dtype is None or (dtype in DTYPES and (dtype != torch.float64 or device.type == "cpu"))


def state_width(dv: int, normalize: bool) -> int:
    """Dv' = Dv + 1 with normalize (the state's last column is the normalizer z), else Dv."""
    return dv + 1 if normalize else dv


# ---------------------------------------------------------------------------------- input checks
_P = "attention_ext.linear: "


def _check_side(t: Optional[Tensor], name: str, shape: tuple, dtype: torch.dtype, q: Tensor) -> None:
    if t is None:
        return
    torch._check_type(t.dtype == dtype, lambda: f"{_P}{name} must be {dtype_name(dtype)}, got {dtype_name(t.dtype)}")
    torch._check_value(tuple(t.shape) == tuple(shape),
                       lambda: f"{_P}{name} must have shape {list(shape)}, got {shape_of(t)}")
    torch._check(t.device == q.device, lambda: f"{_P}{name} must be on {q.device}, got {t.device}")
    torch._check_value(t.is_contiguous(), lambda: f"{_P}{name} must be contiguous")


def _check_qkv_common(q: Tensor, k: Tensor, v: Tensor, what: str, seq: str) -> None:
    """The rules q, k, v share in every linear op, as C++ check_qkv_common states them: 4-D, one dtype
    of the four, one device (`what` prefixes the messages, `seq` names the sequence dim)."""
    torch._check_value(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                       lambda: f"{what}q, k, v must be 4-D (B, H, {seq}, D), got q {shape_of(q)}, k {shape_of(k)}, "
                               f"v {shape_of(v)}")
    torch._check_type(q.dtype == k.dtype == v.dtype,
                      lambda: f"{what}q, k, v must share a dtype, got {dtype_name(q.dtype)}, {dtype_name(k.dtype)}, "
                              f"{dtype_name(v.dtype)}")
    torch._check_type(q.dtype in DTYPES,
                      lambda: f"{what}q, k, v must be float32, float16, bfloat16 or float64, got {dtype_name(q.dtype)}")
    torch._check(q.device == k.device == v.device,
                 lambda: f"{what}q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_inputs(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor] = None,
                 initial_state: Optional[Tensor] = None, key_mask: Optional[Tensor] = None,
                 cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0, feature_map: int = 1,
                 causal: bool = False, normalize: bool = True, eps: float = 1e-6, scale: float = 1.0) -> None:
    """linear_fwd's input rules as the C++ check_linear_inputs (csrc/torch/linear_binding.cpp) states
    them, in its order, with the same error types (ValueError, TypeError, RuntimeError) and
    messages. Run by the fake kernels (torch.compile, meta tensors) and before the reference
    fallback. The values inside cu_seqlens are the functional layer's to check (a fake has none)."""
    _check_qkv_common(q, k, v, _P, "S")
    b, h, s, m = q.shape
    hk = k.shape[1]
    torch._check_value(k.shape[0] == b and v.shape[0] == b,
                       lambda: f"{_P}batch mismatch: q {shape_of(q)}, k {shape_of(k)}, v {shape_of(v)}")
    torch._check_value(k.shape[2] == s and v.shape[2] == s,
                       lambda: f"{_P}q, k, v must have one sequence length, got {s}, {k.shape[2]}, {v.shape[2]}")
    torch._check_value(k.shape[3] == m, lambda: f"{_P}feature width mismatch: q has {m}, k has {k.shape[3]}")
    torch._check_value(v.shape[1] == hk, lambda: f"{_P}k and v must have the same heads, got {hk} and {v.shape[1]}")
    torch._check_value(1 <= m <= MAX_WIDTH and 1 <= v.shape[3] <= MAX_WIDTH,
                       lambda: f"{_P}feature and value widths must be in [1, {MAX_WIDTH}], got {m} and {v.shape[3]}")
    torch._check_value(hk >= 1 and h % hk == 0,
                       lambda: f"{_P}query heads ({h}) must be a multiple of kv heads ({hk})")
    for t in (q, k, v):
        torch._check_value(t.stride(3) == 1 or t.shape[3] == 1,
                           lambda: f"{_P}the last dim of q, k, v must be contiguous (stride 1), got strides "
                                   f"{list(t.stride())}")
    torch._check_value(feature_map in FEATURE_MAP_CODES,
                       lambda: f"{_P}feature_map must be 0 (identity), 1 (elu + 1) or 2 (relu), got {feature_map}")
    torch._check_value(math.isfinite(eps) and eps >= 0.0, lambda: f"{_P}eps must be finite and >= 0, got {eps:g}")
    torch._check_value(math.isfinite(scale), lambda: f"{_P}scale must be finite, got {scale:g}")
    torch._check_value(causal or decay is None, lambda: f"{_P}decay needs causal=True (a gate orders the positions)")
    acc = acc_dtype(q.dtype)
    nb = b
    if cu_seqlens is not None:
        cu = cu_seqlens
        torch._check_value(b == 1, lambda: f"{_P}varlen inputs are one (1, H, total, D) pack, got batch {b}")
        torch._check_type(cu.dtype == torch.int32, lambda: f"{_P}cu_seqlens must be int32, got {dtype_name(cu.dtype)}")
        torch._check_value(cu.dim() == 1 and cu.numel() >= 2 and cu.is_contiguous(),
                           lambda: f"{_P}cu_seqlens must be a contiguous (B + 1) tensor, got {shape_of(cu)}")
        torch._check(cu.device == q.device, lambda: f"{_P}cu_seqlens must be on {q.device}")
        torch._check_value(max_seqlen >= 0, lambda: f"{_P}max_seqlen must be >= 0")
        nb = cu.numel() - 1
    _check_side(decay, "decay", (b, h, s), acc, q)
    _check_side(initial_state, "initial_state", (nb, h, m, state_width(v.shape[3], normalize)), acc, q)
    _check_side(key_mask, "key_mask", (b, s), torch.bool, q)


def check_bwd_inputs(dout: Tensor, dfinal_state: Optional[Tensor], q: Tensor, v: Tensor, out: Tensor, den: Tensor,
                     cu_seqlens: Optional[Tensor], normalize: bool) -> None:
    """linear_bwd's own rules on top of check_inputs (the C++ check_linear_bwd_inputs)."""
    want = [q.shape[0], q.shape[1], q.shape[2], v.shape[3]]
    torch._check_value(shape_of(dout) == want and shape_of(out) == want,
                       lambda: f"attention_ext.linear_bwd: dout and out must be (B, H, S, Dv) = {want}")
    torch._check_type(dout.dtype == q.dtype and out.dtype == q.dtype,
                      lambda: f"attention_ext.linear_bwd: dout and out must have q's dtype {dtype_name(q.dtype)}")
    torch._check_value(dout.stride(3) == 1 and out.stride(3) == 1,
                       lambda: "attention_ext.linear_bwd: dout and out need a contiguous last dim")
    torch._check(dout.device == q.device and out.device == q.device,
                 lambda: f"attention_ext.linear_bwd: dout and out must be on {q.device}")
    acc = acc_dtype(q.dtype)
    _check_side(den, "den", tuple(q.shape[:3]), acc, q)
    _check_side(dfinal_state, "dfinal_state", _final_state_shape(q, v, cu_seqlens, normalize), acc, q)


_PS = "attention_ext.linear_step: "


def check_step_inputs(q: Tensor, k: Tensor, v: Tensor, state: Tensor, normalizer: Optional[Tensor] = None,
                      decay: Optional[Tensor] = None, feature_map: int = 1, eps: float = 1e-6,
                      scale: float = 1.0) -> None:
    """linear_step's input rules as the C++ check_linear_step_inputs (csrc/torch/linear_binding.cpp)
    states them, in its order, with the same error types and messages (run by the fake)."""
    _check_qkv_common(q, k, v, _PS, "T")
    b, h, t, m = q.shape
    hk, dv = k.shape[1], v.shape[3]
    torch._check_value(k.shape[0] == b and v.shape[0] == b and k.shape[2] == t and v.shape[2] == t
                       and k.shape[3] == m and v.shape[1] == hk,
                       lambda: f"{_PS}q {shape_of(q)}, k {shape_of(k)}, v {shape_of(v)} do not match (B, H, T, M), "
                               f"(B, H_k, T, M), (B, H_k, T, Dv)")
    torch._check_value(1 <= m <= MAX_WIDTH and 1 <= dv <= MAX_WIDTH,
                       lambda: f"{_PS}feature and value widths must be in [1, {MAX_WIDTH}], got {m} and {dv}")
    torch._check_value(hk >= 1 and h % hk == 0, lambda: f"{_PS}query heads ({h}) must be a multiple of kv heads ({hk})")
    for x in (q, k, v):
        torch._check_value(x.stride(3) == 1 or x.shape[3] == 1,
                           lambda: f"{_PS}the last dim of q, k, v must be contiguous (stride 1), got strides "
                                   f"{list(x.stride())}")
    torch._check_value(feature_map in FEATURE_MAP_CODES,
                       lambda: f"{_PS}feature_map must be 0 (identity), 1 (elu + 1) or 2 (relu), got {feature_map}")
    torch._check_value(math.isfinite(eps) and eps >= 0.0, lambda: f"{_PS}eps must be finite and >= 0, got {eps:g}")
    torch._check_value(math.isfinite(scale), lambda: f"{_PS}scale must be finite, got {scale:g}")
    acc = acc_dtype(q.dtype)
    for name, x, shape in (("state", state, (b, h, m, dv)), ("normalizer", normalizer, (b, h, m)),
                           ("decay", decay, (b, h, t))):
        if x is None:
            continue
        torch._check_type(x.dtype == acc, lambda: f"{_PS}{name} must be {dtype_name(acc)}, got {dtype_name(x.dtype)}")
        torch._check_value(tuple(x.shape) == shape, lambda: f"{_PS}{name} must have shape {list(shape)}, got {shape_of(x)}")
        torch._check(x.device == q.device, lambda: f"{_PS}{name} must be on {q.device}, got {x.device}")
        if name == "decay":
            torch._check_value(x.is_contiguous(), lambda: f"{_PS}decay must be contiguous")
        else:
            torch._check_value(x.stride(-1) == 1 or x.shape[-1] == 1,
                               lambda: f"{_PS}the last dim of {name} must be contiguous")


# ---------------------------------------------------------------------------------- schema
def _arg_names(op: str) -> Tuple[str, ...]:
    return tuple(a.name for a in getattr(torch.ops.attention_ext, op).default._schema.arguments)


# The ops' argument names, read from their registered schemas (empty without the ops: nothing
# calls them then).
STEP_ARGS = _arg_names("linear_step") if HAS_STEP_OP else ()
FWD_ARGS = _arg_names("linear_fwd") if HAS_OP else ()
BWD_ARGS = _arg_names("linear_bwd") if HAS_OP else ()
OPTION_NAMES = FWD_ARGS[3:]  # decay ... scale, in schema order
_GRAD_INPUTS = ("q", "k", "v", "decay", "initial_state")  # the inputs the backward differentiates


def _empty_like_layout(t: Tensor, last: Optional[int] = None) -> Tensor:
    """A new (B, H, S, last) tensor with t's storage order: (B, S, H, D) storage when heads are
    inner, as the C++ allocation rule does."""
    b, h, s, d = t.shape
    d = d if last is None else last
    if t.stride(1) < t.stride(2):
        return t.new_empty((b, s, h, d)).transpose(1, 2)
    return t.new_empty((b, h, s, d))


def _final_state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], normalize: bool) -> tuple:
    nb = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    return (nb, q.shape[1], q.shape[3], state_width(v.shape[3], normalize))


def fwd(q: Tensor, k: Tensor, v: Tensor, **options) -> Tuple[Tensor, Tensor, Tensor]:
    """torch.ops.attention_ext.linear_fwd with keyword options (every name of OPTION_NAMES).
    Returns (out, den, final_state)."""
    a = dict(options, q=q, k=k, v=v)
    return torch.ops.attention_ext.linear_fwd(*[a[n] for n in FWD_ARGS])


def step(q: Tensor, k: Tensor, v: Tensor, state: Tensor, normalizer: Optional[Tensor] = None,
         decay: Optional[Tensor] = None, *, feature_map: int = 1, eps: float = 1e-6, scale: float = 1.0) -> Tensor:
    """torch.ops.attention_ext.linear_step: out (B, H, T, Dv); state and normalizer advanced in
    place."""
    a = dict(q=q, k=k, v=v, state=state, normalizer=normalizer, decay=decay, feature_map=feature_map, eps=eps,
             scale=scale)
    return torch.ops.attention_ext.linear_step(*[a[n] for n in STEP_ARGS])


# ---------------------------------------------------------------------------------- fakes, autograd
if HAS_STEP_OP:

    @torch.library.register_fake("attention_ext::linear_step")
    def _step_fake(*args):
        a = dict(zip(STEP_ARGS, args))
        check_step_inputs(**a)
        q, v = a["q"], a["v"]
        return q.new_empty((*q.shape[:3], v.shape[3]))

if HAS_OP:

    @torch.library.register_fake("attention_ext::linear_fwd")
    def _fwd_fake(*args):
        a = dict(zip(FWD_ARGS, args))
        q, v = a["q"], a["v"]
        check_inputs(**a)
        b, h, s, _ = q.shape
        acc = dict(dtype=acc_dtype(q.dtype))
        return (_empty_like_layout(q, v.shape[3]), q.new_empty((b, h, s), **acc),
                q.new_empty(_final_state_shape(q, v, a["cu_seqlens"], a["normalize"]), **acc))

    @torch.library.register_fake("attention_ext::linear_bwd")
    def _bwd_fake(*args):
        a = dict(zip(BWD_ARGS, args))
        q, k, v = a["q"], a["k"], a["v"]
        check_inputs(q, k, v, **{n: a[n] for n in OPTION_NAMES})
        check_bwd_inputs(a["dout"], a["dfinal_state"], q, v, a["out"], a["den"], a["cu_seqlens"], a["normalize"])
        b, h, s, _ = q.shape
        acc = dict(dtype=acc_dtype(q.dtype))
        ddecay = q.new_empty((b, h, s), **acc) if a["decay"] is not None else q.new_empty((0,), **acc)
        dinit = (q.new_empty(_final_state_shape(q, v, a["cu_seqlens"], a["normalize"]), **acc)
                 if a["initial_state"] is not None else q.new_empty((0,), **acc))
        return _empty_like_layout(q), _empty_like_layout(k), _empty_like_layout(v), ddecay, dinit

    def _setup_context(ctx, inputs, output):
        a = dict(zip(FWD_ARGS, inputs))
        out, den, _ = output
        ctx.mark_non_differentiable(den)  # den is saved for the backward; linear_bwd takes no dden
        ctx.set_materialize_grads(False)  # an unused final_state gives dfinal_state None, not zeros
        need = {n: ctx.needs_input_grad[FWD_ARGS.index(n)] for n in _GRAD_INPUTS}
        ctx.need = need
        if not any(need.values()):
            return
        ctx.scalars = {n: a[n] for n in ("max_seqlen", "feature_map", "causal", "normalize", "eps", "scale")}
        ctx.save_for_backward(a["q"], a["k"], a["v"], out, den, a["decay"], a["initial_state"], a["key_mask"],
                              a["cu_seqlens"])

    def _backward(ctx, dout, dden, dfinal_state):
        if not any(ctx.need.values()):
            return (None,) * len(FWD_ARGS)
        q, k, v, out, den, decay, initial_state, key_mask, cu_seqlens = ctx.saved_tensors
        if dout is None:  # only final_state reached the loss
            dout = torch.zeros_like(out)
        elif dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum().backward()
            dout = dout.contiguous()
        if dfinal_state is not None:
            dfinal_state = dfinal_state.contiguous()
        a = dict(ctx.scalars, dout=dout, dfinal_state=dfinal_state, q=q, k=k, v=v, out=out, den=den, decay=decay,
                 initial_state=initial_state, key_mask=key_mask, cu_seqlens=cu_seqlens)
        dq, dk, dv, ddecay, dinit = torch.ops.attention_ext.linear_bwd(*[a[n] for n in BWD_ARGS])
        grads = dict(q=dq, k=dk, v=dv, decay=ddecay if decay is not None else None,
                     initial_state=dinit if initial_state is not None else None)
        return tuple(grads[n] if n in grads and ctx.need[n] else None for n in FWD_ARGS)

    torch.library.register_autograd("attention_ext::linear_fwd", _backward, setup_context=_setup_context)
