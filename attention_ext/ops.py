"""Tier 1: the registered custom ops, torch.ops.attention_ext.*, with fake kernels and autograd.

The schema is defined once in C++ (csrc/api/attention.cpp). This module adds what the
dispatcher needs from Python: `register_fake` (shapes for torch.compile / meta tensors) and
`register_autograd` (the backward op), so autograd, torch.compile and opcheck all work.

When the compiled extension is missing, `HAS_EXT` is False and the functional layer runs
reference.py instead, with a warning.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

try:
    from . import _C  # noqa: F401  (registers torch.ops.attention_ext)

    HAS_EXT = True
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    _C = None
    HAS_EXT = False
    _IMPORT_ERROR = e
    warnings.warn(
        f"attention_ext: compiled kernels not available ({e}); falling back to the pure-PyTorch reference",
        RuntimeWarning,
        stacklevel=2,
    )


# device type -> a compiled kernel is registered; read once at import so the lookup stays
# traceable by torch.compile
_KERNELS = {
    dev: HAS_EXT and torch._C._dispatch_has_kernel_for_dispatch_key("attention_ext::fwd", key)
    for dev, key in (("cpu", "CPU"), ("cuda", "CUDA"))
}


def has_kernel(device: torch.device) -> bool:
    """True when a compiled kernel serves tensors on `device`."""
    return _KERNELS.get(device.type, False)


# Positional options after the tensors, as in the C++ schema (ATTN_OPTIONS_SCHEMA).
OPTION_NAMES = (
    "bias", "alibi_slopes", "sinks", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
    "max_seqlen_k", "scale", "softcap", "window_left", "window_right", "bottom_right", "dropout_p",
    "seed", "offset",
)


def _empty_like_layout(t: Tensor) -> Tensor:
    # mirrors attn::api::empty_like_layout: keep (B, S, H, D) storage when heads are inner
    if t.stride(1) < t.stride(2):
        b, h, s, d = t.shape
        return t.new_empty((b, s, h, d)).transpose(1, 2)
    return t.new_empty(t.shape)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the float side tensors (lse, additive bias, ALiBi slopes, sinks and their
    gradients) for inputs of `dtype`: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


if HAS_EXT:

    @torch.library.register_fake("attention_ext::fwd")
    def _fwd_fake(q, k, v, *opts):
        b, h, sq, _ = q.shape
        return _empty_like_layout(q), q.new_empty((b, h, sq), dtype=acc_dtype(q.dtype))

    @torch.library.register_fake("attention_ext::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, *rest, dlse=None):
        o = dict(zip(OPTION_NAMES, rest[: len(OPTION_NAMES)]))
        bias_grad = rest[len(OPTION_NAMES)]
        bias, cu_q = o["bias"], o["cu_seqlens_q"]
        nb = cu_q.shape[0] - 1 if cu_q is not None else q.shape[0]
        sq = o["max_seqlen_q"] if cu_q is not None else q.shape[2]
        sk = o["max_seqlen_k"] if cu_q is not None else k.shape[2]
        acc = dict(dtype=acc_dtype(q.dtype))
        if bias_grad and bias is not None and bias.dtype.is_floating_point:
            dbias = q.new_empty((nb, q.shape[1], 1 if bias.shape[2] == 1 else sq, sk), **acc)
        else:
            dbias = q.new_empty((0,), **acc)
        dsinks = q.new_empty((nb, q.shape[1]), **acc) if o["sinks"] is not None else q.new_empty((0,), **acc)
        return _empty_like_layout(q), _empty_like_layout(k), _empty_like_layout(v), dbias, dsinks

    @torch.library.register_fake("attention_ext::dropout_mask")
    def _dropout_mask_fake(b, h, sq, sk, p, seed, offset, device=None):
        return torch.empty((b, h, sq, sk), dtype=torch.bool, device=device or "cpu")

    def _setup_context(ctx, inputs, output):
        q, k, v, *opts = inputs
        out, lse = output
        o = dict(zip(OPTION_NAMES, opts))
        ctx.opts = o
        ctx.save_for_backward(q, k, v, out, lse, o["bias"], o["alibi_slopes"], o["sinks"], o["seqlens_k"],
                              o["cu_seqlens_q"], o["cu_seqlens_k"])
        ctx.deterministic = getattr(_deterministic, "value", False)

    def _backward(ctx, dout, dlse):
        q, k, v, out, lse, bias, alibi, sinks, seqlens_k, cu_q, cu_k = ctx.saved_tensors
        o = ctx.opts
        if dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum().backward()
            dout = dout.contiguous()
        bias_grad = bias is not None and bias.dtype.is_floating_point and ctx.needs_input_grad[3]
        if dlse is not None:
            # rows that saw nothing have lse = -inf and no gradient to pass on
            dlse = dlse.to(lse.dtype).masked_fill(torch.isinf(lse), 0.0).contiguous()
        dq, dk, dv, dbias, dsinks = torch.ops.attention_ext.bwd(
            dout, q, k, v, out, lse, bias, alibi, sinks, seqlens_k, cu_q, cu_k, o["max_seqlen_q"],
            o["max_seqlen_k"], o["scale"], o["softcap"], o["window_left"], o["window_right"],
            o["bottom_right"], o["dropout_p"], o["seed"], o["offset"], bias_grad, ctx.deterministic, dlse,
        )
        grad_bias = dbias.sum_to_size(bias.shape) if bias_grad else None
        grad_sinks = dsinks.sum(0) if (sinks is not None and ctx.needs_input_grad[5]) else None
        # None for the remaining options, num_splits and deterministic
        return (dq, dk, dv, grad_bias, None, grad_sinks) + (None,) * (len(OPTION_NAMES) - 3 + 2)

    torch.library.register_autograd("attention_ext::fwd", _backward, setup_context=_setup_context)


class _Flag:
    value = False


_deterministic = _Flag()


def fwd(q: Tensor, k: Tensor, v: Tensor, **options):
    """torch.ops.attention_ext.fwd with keyword options (see OPTION_NAMES). Returns (out, lse)."""
    return torch.ops.attention_ext.fwd(q, k, v, *[options[n] for n in OPTION_NAMES])


def dropout_mask(b: int, h: int, sq: int, sk: int, p: float, seed: int, offset: int = 0, device=None) -> Tensor:
    """The (B, H, Sq, Sk) bool keep-mask the kernels draw for (seed, offset): Philox4x32-10,
    identical on the CPU and the GPU."""
    return torch.ops.attention_ext.dropout_mask(b, h, sq, sk, p, seed, offset, device)
