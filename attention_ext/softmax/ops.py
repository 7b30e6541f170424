"""Tier 1 of the softmax family: the registered custom ops torch.ops.attention_ext.{fwd, bwd,
dropout_mask, set_cuda_kernels}, with fake kernels and autograd.

The schemas, the input checks and the Meta kernels (shapes for torch.compile and meta tensors,
after the same checks) are C++ (csrc/torch/softmax_binding.*, softmax_meta.cpp). This module adds
`register_autograd` (the backward op), so autograd, torch.compile and opcheck all work. The
option names come from the registered schemas (`OPTION_NAMES`).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.types import Device

from .. import _ext
from .._dtypes import DTYPES, acc_dtype  # noqa: F401  (acc_dtype: the families' callers read it here)
from .._ext import HAS_EXT, call_autograd, call_below_autograd, eager_autograd, refuse_double_backward, registered

# device type -> a compiled kernel is registered; read once at import so the lookup stays
# traceable by torch.compile
_KERNELS = {dev: registered("attention_ext::softmax_fwd", key) for dev, key in (("cpu", "CPU"), ("cuda", "CUDA"))}


def has_kernel(device: torch.device, dtype: Optional[torch.dtype] = None) -> bool:
    """True when a compiled kernel serves tensors on `device` (and of `dtype`, when given)."""
    if not _KERNELS.get(device.type, False):
        return False
    return dtype is None or (dtype in DTYPES and (dtype != torch.float64 or device.type == "cpu"))


# ---------------------------------------------------------------------------------- schema
def _arg_names(op: str) -> Tuple[str, ...]:
    return tuple(a.name for a in getattr(torch.ops.attention_ext, op).default._schema.arguments)


def _common_prefix(a, b) -> Tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return tuple(a[:n])


# The ops' argument names, read from their registered schemas (empty without the extension:
# nothing calls the ops then).
FWD_ARGS = _arg_names("softmax_fwd") if HAS_EXT else ()  # q, k, v, the options, num_splits, deterministic
BWD_ARGS = _arg_names("softmax_bwd") if HAS_EXT else ()  # dout, q, k, v, out, lse, the options, bias_grad, ...
# The options softmax_fwd and softmax_bwd share, in schema order (bias ... topk_jcut).
OPTION_NAMES = _common_prefix(FWD_ARGS[3:], BWD_ARGS[6:])
_FWD_OP = torch.ops.attention_ext.softmax_fwd.default if HAS_EXT else None
_ROUTED_OP = torch.ops.attention_ext.softmax_fwd_routed.default if HAS_EXT else None
_BWD_OP = torch.ops.attention_ext.softmax_bwd.default if HAS_EXT else None
_ROUTE_OP = torch.ops.attention_ext.softmax_fwd_route.default if HAS_EXT else None
# the tensor options (bias, alibi_slopes, ...), from the schema's types
_OPTION_TENSORS = tuple(a.name for a in (_FWD_OP._schema.arguments if HAS_EXT else ())
                        if a.name in OPTION_NAMES and "Tensor" in str(a.type))
# every option at its neutral value: no tensor option, no window, softcap, dropout or varlen
_NEUTRAL_OPTIONS = dict({n: None for n in _OPTION_TENSORS}, max_seqlen_q=0, max_seqlen_k=0, scale=1.0, softcap=0.0,
                        window_left=-1, window_right=-1, bottom_right=False, dropout_p=0.0, seed=0, offset=0,
                        block_size=0)
# options a caller may leave out of ops.fwd: the dropout mask at its own coordinates, dense, no top-k
_OPTION_DEFAULTS = dict(rng_state=None, dropout_coords=None, block_layout=None, block_size=0, topk_thr=None,
                        topk_jcut=None)


# ---------------------------------------------------------------------------------- fakes, autograd
if HAS_EXT:

    @torch.library.register_fake("attention_ext::dropout_mask")
    def _dropout_mask_fake(b, h, sq, sk, p, seed, offset, device=None):
        return torch.empty((b, h, sq, sk), dtype=torch.bool, device=device or "cpu")

    _GRAD_INPUTS = ("q", "k", "v", "bias", "sinks")  # the inputs the backward differentiates

    def _setup_context(ctx, inputs, output):
        a = dict(zip(FWD_ARGS, inputs))
        need = {n: ctx.needs_input_grad[FWD_ARGS.index(n)] for n in _GRAD_INPUTS}
        bias = a["bias"]
        ctx.bias_grad = need["bias"] and bias is not None and bias.dtype.is_floating_point
        ctx.sinks_grad = need["sinks"] and a["sinks"] is not None
        ctx.any_grad = any(need.values())
        if not ctx.any_grad:  # e.g. only alibi_slopes requires grad: nothing to save or compute
            return
        ctx.scalars = {n: a[n] for n in OPTION_NAMES if n not in _OPTION_TENSORS}
        ctx.deterministic = a.get("deterministic", False)
        out, lse = output
        # the backward recomputes the scores from q, k and every option tensor; sinks only enter
        # the (saved) LSE and their own gradient, so they are kept only for that gradient
        sinks = a["sinks"] if ctx.sinks_grad else None
        # rng_state: the backward redraws the forward's dropout mask from the same (seed, offset)
        ctx.save_for_backward(a["q"], a["k"], a["v"], out, lse, bias, a["alibi_slopes"], sinks, a["seqlens_k"],
                              a["cu_seqlens_q"], a["cu_seqlens_k"], a.get("rng_state"), a.get("dropout_coords"),
                              a.get("block_layout"), a.get("topk_thr"), a.get("topk_jcut"))

    def _backward(ctx, dout, dlse):
        if not ctx.any_grad:
            return (None,) * len(FWD_ARGS)
        (q, k, v, out, lse, bias, alibi, sinks, seqlens_k, cu_q, cu_k, rng_state, dropout_coords, block_layout,
         topk_thr, topk_jcut) = ctx.saved_tensors
        if dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum().backward()
            dout = dout.contiguous()
        if dlse is not None:
            # rows that saw nothing have lse = -inf and no gradient to pass on
            dlse = dlse.to(lse.dtype).masked_fill(torch.isinf(lse), 0.0).contiguous()
        a = dict(ctx.scalars, dout=dout, q=q, k=k, v=v, out=out, lse=lse, bias=bias, alibi_slopes=alibi, sinks=sinks,
                 seqlens_k=seqlens_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, rng_state=rng_state,
                 dropout_coords=dropout_coords, block_layout=block_layout, topk_thr=topk_thr, topk_jcut=topk_jcut,
                 bias_grad=ctx.bias_grad, deterministic=ctx.deterministic, dlse=dlse)
        args = [a[n] for n in BWD_ARGS]
        # create_graph=True records the call (softmax_bwd's autograd, below, refuses a second
        # backward); else straight to the kernel, as autograd's layer would go
        dq, dk, dv, dbias, dsinks = (_BWD_OP(*args) if torch.is_grad_enabled() else
                                     call_below_autograd(_BWD_OP, args))
        grads = dict(q=dq, k=dk, v=dv, bias=dbias.sum_to_size(bias.shape) if ctx.bias_grad else None,
                     sinks=dsinks.sum(0) if ctx.sinks_grad else None)
        return tuple(grads.get(n) for n in FWD_ARGS)

    torch.library.register_autograd("attention_ext::softmax_fwd", _backward, setup_context=_setup_context)

    # eager differentiable calls: the same setup and backward without torch's layer (_ext.eager_autograd)
    _EagerFwd = eager_autograd("SoftmaxFwd", _setup_context, _backward)

    # a second backward through the gradients raises (as torch's fused SDPA does)
    refuse_double_backward("attention_ext::softmax_bwd", "softmax attention", "reference.attention")

    def _quant_backward(ctx, dout, dlse):
        raise RuntimeError("attention_ext: the quantized Q.K^T forward (qk_quant) has no backward: it is for "
                           "inference; train with qk_quant=None")

    # a gradient through softmax_fwd_quant is an error at backward time, not a silent None
    torch.library.register_autograd("attention_ext::softmax_fwd_quant", _quant_backward,
                                    setup_context=lambda ctx, inputs, output: None)


_MISSING = object()
_FWD_INDEX = {n: i for i, n in enumerate(FWD_ARGS)}
# fwd's argument list with the defaults filled in: a call copies it and sets what it was given
_FWD_TEMPLATE = [_OPTION_DEFAULTS.get(n, _MISSING) for n in FWD_ARGS]
# the tensor arguments: a call needs autograd's layer only when one of them requires grad
_FWD_TENSOR_SLOTS = tuple(_FWD_INDEX[n] for n in ("q", "k", "v", *_OPTION_TENSORS) if n in _FWD_INDEX)


def check_inputs(q: Tensor, k: Tensor, v: Tensor, **options) -> None:
    """softmax_fwd's input rules, for a call that reaches no kernel (the reference fallback,
    attention_weights): the op's own C++ check, run by softmax_fwd_route, a composite op that
    checks and routes on any device without a kernel. Options as fwd takes them (the ones left out
    at their neutral values). Without the extension there is no check to run (the reference
    raises its own errors)."""
    if not HAS_EXT or torch.compiler.is_compiling():
        return  # the route op returns a str, which a graph cannot hold: eager calls check
    a = {**_NEUTRAL_OPTIONS, **options}
    _ROUTE_OP(q, k, v, *[a[n] for n in OPTION_NAMES])


def call_fwd(args: list, op=None) -> Tuple[Tensor, Tensor]:
    """torch.ops.attention_ext.softmax_fwd (or `op`, of the same schema) on its full argument list
    (FWD_ARGS order), below the Autograd key (call_below_autograd) when grad mode is off or no
    tensor argument requires grad; else, in eager mode, through _EagerFwd."""
    op = op or _FWD_OP
    grad = torch.is_grad_enabled() and any(args[i] is not None and args[i].requires_grad for i in _FWD_TENSOR_SLOTS)
    # the routed op picks the fused kernel whenever an input needs a gradient (route_fwd), which
    # _EagerFwd's forward, run with grad mode off, could not tell it: softmax_fwd itself
    return call_autograd(_FWD_OP if grad and op is _ROUTED_OP else op, args, _EagerFwd, grad)


def fwd(q: Tensor, k: Tensor, v: Tensor, *, num_splits: int = 1, deterministic: bool = False, routed: bool = False,
        **options):
    """torch.ops.attention_ext.softmax_fwd with keyword options (every name of OPTION_NAMES; those of
    _OPTION_DEFAULTS may be left out). Returns (out, lse). num_splits: key splits of the CUDA forward (1 = none, 0 =
    the heuristic); deterministic: the backward adds no atomics (CUDA). routed: the functional API's
    op, softmax_fwd_routed, which runs the decode kernel for the few-row CPU calls fwd_route
    names (softmax_fwd always runs the fused kernels)."""
    a = _FWD_TEMPLATE.copy()
    a[0], a[1], a[2] = q, k, v
    a[_FWD_INDEX["num_splits"]], a[_FWD_INDEX["deterministic"]] = num_splits, deterministic
    for n, x in options.items():
        i = _FWD_INDEX.get(n)
        if i is None or i < 3:
            raise TypeError(f"attention_ext.softmax.ops.fwd: unknown option {n!r} (options: {', '.join(OPTION_NAMES)})")
        a[i] = x
    try:
        return call_fwd(a, _ROUTED_OP if routed else None)
    except (TypeError, RuntimeError, AttributeError):
        missing = [n for n, x in zip(FWD_ARGS, a) if x is _MISSING]  # looked for only when the call failed
        if missing:
            raise TypeError(f"attention_ext.softmax.ops.fwd: missing option(s) {', '.join(missing)}") from None
        raise


_QUANT_OP = torch.ops.attention_ext.softmax_fwd_quant.default if HAS_EXT else None
_QUANT_KERNELS = {dev: registered("attention_ext::softmax_fwd_quant", key) for dev, key in (("cpu", "CPU"),
                                                                                            ("cuda", "CUDA"))}


def has_quant_kernel(device: torch.device, qk_quant: str = "int8") -> bool:
    """True when a compiled kernel runs softmax_fwd_quant (the quantized Q.K^T forward) on
    `device`: "int8" on the CPU and CUDA; "fp8" on sm_90 GPUs only (a CPU or another GPU would run
    the float64 reference: a capability query, the op's NotImplementedError stays the rule). A
    kernel may still refuse a call's shape or dtype (attention() then runs the reference)."""
    if not _QUANT_KERNELS.get(device.type, False):
        return False
    if qk_quant == "fp8":
        return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return True


def _quant_args(q: Tensor, k: Tensor, v: Tensor, qk_quant: str, options: dict) -> list:
    a = {**_NEUTRAL_OPTIONS, **options}
    return [q, k, v, *[a[n] for n in OPTION_NAMES], qk_quant]


def fwd_quant(q: Tensor, k: Tensor, v: Tensor, *, qk_quant: str = "int8", **options) -> Tuple[Tensor, Tensor]:
    """torch.ops.attention_ext.softmax_fwd_quant (the forward with an int8 Q.K^T) with fwd's keyword
    options. Returns (out, lse). Inference only: its backward raises."""
    return call_below_autograd(_QUANT_OP, _quant_args(q, k, v, qk_quant, options))


def check_quant_inputs(q: Tensor, k: Tensor, v: Tensor, *, qk_quant: str = "int8", **options) -> None:
    """softmax_fwd_quant's input rules (C++) for a call no kernel takes: the op's Meta kernel on
    meta copies of the arguments (same shapes, strides and dtypes)."""
    if not HAS_EXT:
        return

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if isinstance(t, Tensor) else t
    _QUANT_OP(*[meta(x) for x in _quant_args(q, k, v, qk_quant, options)])


# torch.ops.attention_ext.softmax_fwd_plain (csrc/torch/softmax_plain.cpp): fwd with no tensor option but
# the bias, a composite op of 11 arguments; _C.softmax_fwd_plain calls it without torch.ops' argument
# conversion.
_PLAIN_OP = torch.ops.attention_ext.softmax_fwd_plain.default if HAS_EXT else None
_PLAIN_ENTRY = _ext._C.softmax_fwd_plain if HAS_EXT else None


def fwd_plain(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, window_left: int = -1,
              window_right: int = -1, bottom_right: bool = False, layout: str = "bhsd", num_splits: int = 0,
              deterministic: bool = False, bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """fwd for a call with no tensor option but a 4-D mask (bias: fwd's; no lengths, ALiBi,
    sinks, dropout, block layout or top-k): the op softmax_fwd_plain, which takes the layout and the
    default scale itself and goes below the Autograd key in C++ when nothing needs a gradient.
    Small calls are where the argument handling in front of a kernel shows. Returns (out, lse),
    out in q's layout."""
    if (type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor
            or (bias is not None and type(bias) is not Tensor) or _plain_traced()):
        return _PLAIN_OP(q, k, v, scale, window_left, window_right, bottom_right, layout, num_splits, deterministic,
                         bias)
    return _PLAIN_ENTRY(q, k, v, scale, window_left, window_right, bottom_right, layout, num_splits, deterministic,
                        bias)


def _plain_traced() -> bool:
    """Whether a call must take torch.ops' full path: torch.compile tracing it, functorch
    transforms, or a torch function mode (which torch.ops hands the call to)."""
    return (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._is_torch_function_mode_enabled())


def fwd_route(q: Tensor, k: Tensor, v: Tensor, **options) -> str:
    """Which kernel the functional API's forward (softmax_fwd_routed, fwd(routed=True)) runs for
    these inputs and options (fwd's keywords), and why: "decode: ..." (a CPU call of few query
    rows with nothing to differentiate runs on the decode kernel) or "fused: ..." (the reason it
    does not). The rule lives in C++ (route_fwd, csrc/torch/softmax_route.cpp); the inputs are
    checked first, as the call would check them. Options left out take the op's neutral values (no tensor option, scale
    1 / sqrt(D), no window, softcap or dropout)."""
    a = dict(_NEUTRAL_OPTIONS, scale=1.0 / math.sqrt(max(q.shape[-1], 1)))
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"attention_ext.softmax.ops.fwd_route: unknown option(s) {sorted(unknown)} "
                        f"(options: {', '.join(OPTION_NAMES)})")
    a.update(options)
    return torch.ops.attention_ext.softmax_fwd_route(q, k, v, *[a[n] for n in OPTION_NAMES])


def topk_threshold(q: Tensor, k: Tensor, k_top: int, **options) -> Tuple[Tensor, Tensor]:
    """torch.ops.attention_ext.topk_threshold with fwd's keyword options: top-k's (B, H, Sq)
    thresholds and cut keys (csrc/common/block_sparse.h), which fwd / bwd take as topk_thr /
    topk_jcut. Not differentiable (the selection is piecewise constant): call it on detached
    tensors."""
    a = {**_OPTION_DEFAULTS, **options}
    return torch.ops.attention_ext.topk_threshold(q, k, *[a[n] for n in OPTION_NAMES], int(k_top))


def dropout_mask(b: int, h: int, sq: int, sk: int, p: float, seed: int, offset: int = 0,
                 device: Device = None) -> Tensor:
    """The (B, H, Sq, Sk) bool keep-mask the kernels draw for (seed, offset): Philox4x32-10,
    identical on the CPU and the GPU. A call that drew its own (seed, offset) as a rng_state
    tensor rebuilds its mask with dropout_mask(..., *rng_state.tolist())."""
    return torch.ops.attention_ext.dropout_mask(b, h, sq, sk, p, seed, offset, device)


# ---------------------------------------------------------------------------------- kernel selection
_DEFAULT_KERNELS: Dict[str, int] = dict(hopper_fwd=1, hopper_bwd=1, tune_fwd=0, tune_bwd=0, force_simt=False)
_kernels = dict(_DEFAULT_KERNELS)


def set_cuda_kernels(hopper_fwd: int = 1, hopper_bwd: int = 1, tune_fwd: int = 0, tune_bwd: int = 0,
                     force_simt: bool = False) -> Dict[str, int]:
    """Process-wide: which CUDA kernels the dispatcher may pick. The defaults are the product's
    kernels; every call sets all five fields.

        hopper_fwd  1 the sm_90a wgmma forward where it applies (the default: it beat the mma.sync
                    forward at every shape measured, benchmarks/results/2026-11-24-h100.md), 0 the
                    mma.sync forward there, 2 the wgmma forward also for softcap, ALiBi, bool
                    masks, additive biases, dropout, block-sparse layouts and qk_quant="int8"
                    (s8 wgmma; checked in the CPU emulator only, no GPU run yet, so not the
                    default). qk_quant="fp8" runs on the wgmma forward at 1 and 2 (its only
                    kernel); at 0 it runs the reference with a warning
        hopper_bwd  1 the sm_90a wgmma backward where it applies (the default, likewise), 0 off,
                    2 also for softcap, ALiBi, bool masks, biases with dbias, dropout and
                    block-sparse layouts (likewise not yet run on a GPU)
        tune_fwd,   the -DATTN_TUNING candidate of the mma.sync forward / backward (0 = the
        tune_bwd    default kernel; a build without -DATTN_TUNING has only 0)
        force_simt  route every call to the SIMT kernels (the sm < 80 path)

    Returns the previous selection, so that `set_cuda_kernels(**old)` restores it."""
    new = dict(hopper_fwd=int(hopper_fwd), hopper_bwd=int(hopper_bwd), tune_fwd=int(tune_fwd),
               tune_bwd=int(tune_bwd), force_simt=bool(force_simt))
    if HAS_EXT:  # the op states the rules on the values; without the extension nothing runs on CUDA
        torch.ops.attention_ext.set_cuda_kernels(*new.values())
    old = dict(_kernels)
    _kernels.update(new)
    return old


def cuda_kernels() -> Dict[str, int]:
    """The current selection of set_cuda_kernels (its five keywords)."""
    return dict(_kernels)
