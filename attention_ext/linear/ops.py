"""Tier 1 of the linear family: the registered custom ops torch.ops.attention_ext.{linear_fwd,
linear_bwd, linear_step} and their autograd.

    linear_fwd(q, k, v, decay?, initial_state?, key_mask?, cu_seqlens?, max_seqlen, feature_map,
               causal, normalize, eps, scale, keep_residual=False) -> (out, den, final_state, out_residual)
    linear_bwd(dout, dfinal_state?, q, k, v, out, den, decay?, initial_state?, key_mask?,
               cu_seqlens?, max_seqlen, feature_map, causal, normalize, eps, scale, out_residual?)
        -> (dq, dk, dv, ddecay, dinitial_state)
        out_residual: out's rounding residual (a normalized fp16 / bf16 call that keeps it, else
        empty), which the backward adds back to out where it forms d den = -(dout . out) / den:
        with out alone, a row that sees one key (or keys with near-equal values) loses the
        normalizer's small eps / den gradient to out's 16-bit rounding (csrc/common/linear_params.h)
    linear_step(q, k, v, state!, normalizer!?, decay?, feature_map, eps, scale) -> out
        the recurrent form over T positions (reference.linear_step), state (B, H, M, Dv) and
        normalizer (B, H, M) advanced in place, decay (B, H, T) or (B, H, T, M) (per feature); no autograd (the functional layer runs the
        differentiable PyTorch form when autograd records)

The math is reference.linear_attention's (reference.linear_step's for the step). The schemas,
the input checks and the Meta kernels (shapes for torch.compile and meta tensors, after the same
checks) are C++ (csrc/torch/linear_binding.*, linear_meta.cpp); this module adds
`register_autograd`, when the extension defines the ops. Without them, `HAS_OP` is False and the
functional layer runs the reference.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._ext import HAS_EXT, call_autograd, call_below_autograd, eager_autograd, refuse_double_backward, registered
from .._dtypes import DTYPES, acc_dtype  # noqa: F401  (acc_dtype: distributed.linear reads it here)

# the op's schema is defined (fakes and autograd can attach), and which devices have a kernel;
# read once at import so the lookups stay traceable by torch.compile
HAS_OP = HAS_EXT and hasattr(torch.ops.attention_ext, "linear_fwd") and hasattr(torch.ops.attention_ext, "linear_bwd")
_KERNELS = {dev: HAS_OP and registered("attention_ext::linear_fwd", key) for dev, key in (("cpu", "CPU"),
                                                                                          ("cuda", "CUDA"))}
HAS_STEP_OP = HAS_EXT and hasattr(torch.ops.attention_ext, "linear_step")
_STEP_KERNELS = {dev: HAS_STEP_OP and registered("attention_ext::linear_step", key) for dev, key in (("cpu", "CPU"),
                                                                                                   ("cuda", "CUDA"))}


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


# ---------------------------------------------------------------------------------- kernel selection
_cuda_kernels = dict(chunk_parallel=True, segment_chunks=0, chunk_states=False, delta_chunked=False)


def set_cuda_kernels(chunk_parallel: bool = True, segment_chunks: int = 0, chunk_states: bool = False,
                     delta_chunked: Optional[bool] = False) -> dict:
    """Process-wide: the schedule of the CUDA tensor-core forward and backward (fp16 / bf16,
    feature width <= 128).

        chunk_parallel  True (the default): the chunk-parallel kernels (segments of chunks in
                        parallel, a scan of the segment states, then the outputs or gradients in
                        parallel; docs/gpu.md). False: one CTA walks each sequence (the
                        sequential kernels, slower on every shape timed: benchmarks/results/).
        segment_chunks  chunks of 64 rows per segment; 0 picks enough segments to fill the device.
        chunk_states    True: the chunk-parallel forward and backward store the state entering
                        (and the gradient leaving) every chunk of 64 rows, then compute every
                        chunk's outputs or gradients at once (flash-linear-attention's schedule;
                        docs/gpu.md), where M, Dv and every stride are multiples of 8; other
                        calls keep the segment kernels. Off by default until a GPU run has
                        tested and timed them.
        delta_chunked   the delta rule on CUDA: False (the default) = the recurrent forward
                        kernel, and PyTorch's chunked WY form for calls that need gradients;
                        True = the chunk-parallel tensor-core kernels for every bf16 / fp16 call
                        they take (K <= 128, K and V multiples of 8): the forward for every gate
                        (per-key ones, and GLA's plain write with them), forward and backward;
                        None = those kernels from 256 rows on. Off by default until a GPU run
                        has tested and timed them (docs/gpu.md).

    Returns the previous selection, so that `set_cuda_kernels(**old)` restores it. The float32
    kernels are unchanged by it."""
    new = dict(chunk_parallel=bool(chunk_parallel), segment_chunks=int(segment_chunks),
               chunk_states=bool(chunk_states), delta_chunked=None if delta_chunked is None else bool(delta_chunked))
    if HAS_EXT:  # the ops state the rules; without the extension nothing runs on CUDA
        torch.ops.attention_ext.linear_set_cuda_kernels(new["chunk_parallel"], new["segment_chunks"],
                                                        new["chunk_states"])
        torch.ops.attention_ext.delta_set_cuda_kernels(-1 if delta_chunked is None else int(bool(delta_chunked)))
    old = dict(_cuda_kernels)
    _cuda_kernels.update(new)
    return old


def cuda_kernels() -> dict:
    """The current selection of set_cuda_kernels (its four keywords)."""
    return dict(_cuda_kernels)


# ---------------------------------------------------------------------------------- input checks
def check_inputs(q: Tensor, k: Tensor, v: Tensor, **options) -> None:
    """linear_fwd's input rules, for a call that reaches no kernel (the reference fallback): the
    op's own C++ check (check_linear_inputs), run by the check-only op linear_check on any device.
    Options as fwd takes them (OPTION_NAMES). Without the extension there is no check to run (the
    reference raises its own errors)."""
    if HAS_OP:
        torch.ops.attention_ext.linear_check(q, k, v, *[options[n] for n in OPTION_NAMES])


# ---------------------------------------------------------------------------------- schema
def _arg_names(op: str) -> Tuple[str, ...]:
    return tuple(a.name for a in getattr(torch.ops.attention_ext, op).default._schema.arguments)


# The ops' argument names, read from their registered schemas (empty without the ops: nothing
# calls them then).
STEP_ARGS = _arg_names("linear_step") if HAS_STEP_OP else ()
FWD_ARGS = _arg_names("linear_fwd") if HAS_OP else ()
BWD_ARGS = _arg_names("linear_bwd") if HAS_OP else ()
OPTION_NAMES = tuple(n for n in FWD_ARGS[3:] if n != "keep_residual")  # decay ... scale, in schema order
_GRAD_INPUTS = ("q", "k", "v", "decay", "initial_state")  # the inputs the backward differentiates


# The CUDA tensor-core kernels (fp16 / bf16 calls of feature width M <= this) keep no residual,
# and the CUDA op refuses keep_residual there (csrc/common/linear_params.h
# kLinearTensorCoreMaxFeatures, csrc/torch/linear_binding.h check_cuda_residual). The device's part
# of the rule is decided here: the op's Meta kernel sees meta tensors, not the device.
_CUDA_TENSOR_CORE_MAX_FEATURES = 128


def _keep_residual(q: Tensor, k: Tensor, options: dict) -> bool:
    """Whether the op keeps out's rounding residual for its backward: autograd records the call and
    a gradient reads d den (q, k, decay or the initial state needs one; dv never reads it), and on
    CUDA the SIMT kernels take it. The op itself keeps one only for normalized 16-bit calls."""
    if not torch.is_grad_enabled() or not any(isinstance(t, Tensor) and t.requires_grad for t in
                                              (q, k, options.get("decay"), options.get("initial_state"))):
        return False
    return q.device.type != "cuda" or q.shape[-1] > _CUDA_TENSOR_CORE_MAX_FEATURES


def fwd(q: Tensor, k: Tensor, v: Tensor, **options) -> Tuple[Tensor, Tensor, Tensor]:
    """torch.ops.attention_ext.linear_fwd with keyword options (every name of OPTION_NAMES).
    Returns (out, den, final_state). Where autograd will record the call and its backward reads
    d den (_keep_residual), a normalized 16-bit call also keeps out's rounding residual for the
    backward (the autograd context holds it)."""
    a = dict(options, q=q, k=k, v=v, keep_residual=_keep_residual(q, k, options))
    args = [a[n] for n in FWD_ARGS]
    grad = torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in args)
    return call_autograd(torch.ops.attention_ext.linear_fwd.default, args, _EagerFwd, grad)[:3]


def step(q: Tensor, k: Tensor, v: Tensor, state: Tensor, normalizer: Optional[Tensor] = None,
         decay: Optional[Tensor] = None, *, feature_map: int = 1, eps: float = 1e-6, scale: float = 1.0) -> Tensor:
    """torch.ops.attention_ext.linear_step: out (B, H, T, Dv); state and normalizer advanced in
    place."""
    a = dict(q=q, k=k, v=v, state=state, normalizer=normalizer, decay=decay, feature_map=feature_map, eps=eps,
             scale=scale)
    return torch.ops.attention_ext.linear_step(*[a[n] for n in STEP_ARGS])


# ---------------------------------------------------------------------------------- fakes, autograd
if HAS_OP:

    def _setup_context(ctx, inputs, output):
        a = dict(zip(FWD_ARGS, inputs))
        out, den, _, res = output
        ctx.mark_non_differentiable(den, res)  # saved for the backward; linear_bwd takes no dden
        ctx.set_materialize_grads(False)  # an unused final_state gives dfinal_state None, not zeros
        need = {n: ctx.needs_input_grad[FWD_ARGS.index(n)] for n in _GRAD_INPUTS}
        ctx.need = need
        if not any(need.values()):
            return
        ctx.scalars = {n: a[n] for n in ("max_seqlen", "feature_map", "causal", "normalize", "eps", "scale")}
        ctx.save_for_backward(a["q"], a["k"], a["v"], out, den, a["decay"], a["initial_state"], a["key_mask"],
                              a["cu_seqlens"], res if res.numel() else None)

    def _backward(ctx, dout, dden, dfinal_state, dres):
        if not any(ctx.need.values()):
            return (None,) * len(FWD_ARGS)
        q, k, v, out, den, decay, initial_state, key_mask, cu_seqlens, res = ctx.saved_tensors
        if dout is None:  # only final_state reached the loss
            dout = torch.zeros_like(out)
        elif dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum().backward()
            dout = dout.contiguous()
        if dfinal_state is not None:
            dfinal_state = dfinal_state.contiguous()
        a = dict(ctx.scalars, dout=dout, dfinal_state=dfinal_state, q=q, k=k, v=v, out=out, den=den, decay=decay,
                 initial_state=initial_state, key_mask=key_mask, cu_seqlens=cu_seqlens, out_residual=res)
        args = [a[n] for n in BWD_ARGS]
        # create_graph=True records the call (linear_bwd's autograd refuses a second backward)
        op = torch.ops.attention_ext.linear_bwd.default
        dq, dk, dv, ddecay, dinit = op(*args) if torch.is_grad_enabled() else call_below_autograd(op, args)
        grads = dict(q=dq, k=dk, v=dv, decay=ddecay if decay is not None else None,
                     initial_state=dinit if initial_state is not None else None)
        return tuple(grads[n] if n in grads and ctx.need[n] else None for n in FWD_ARGS)

    torch.library.register_autograd("attention_ext::linear_fwd", _backward, setup_context=_setup_context)
    _EagerFwd = eager_autograd("LinearFwd", _setup_context, _backward)  # eager calls (_ext.call_autograd)
    refuse_double_backward("attention_ext::linear_bwd", "linear attention", "reference.linear_attention")
