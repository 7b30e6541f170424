"""A Python stand-in for the C++ linear_fwd / linear_bwd ops, defined from reference.py, so that
the op tests, the fakes and the autograd wiring of attention_ext.linear.ops can run before (or
without) the compiled kernel: `ATTENTION_EXT_LINEAR_STANDIN=1 pytest tests/linear`.

`define_ops()` must run before attention_ext is imported (ops.py reads the registry at import); it
does nothing when the extension defines the ops itself.
"""
from __future__ import annotations

import glob
import os

import torch

SCHEMAS = (
    "linear_fwd(Tensor q, Tensor k, Tensor v, Tensor? decay, Tensor? initial_state, Tensor? key_mask, "
    "Tensor? cu_seqlens, int max_seqlen, int feature_map, bool causal, bool normalize, float eps, float scale, "
    "bool keep_residual=False) -> (Tensor, Tensor, Tensor, Tensor)",
    "linear_bwd(Tensor dout, Tensor? dfinal_state, Tensor q, Tensor k, Tensor v, Tensor out, Tensor den, "
    "Tensor? decay, Tensor? initial_state, Tensor? key_mask, Tensor? cu_seqlens, int max_seqlen, int feature_map, "
    "bool causal, bool normalize, float eps, float scale, Tensor? out_residual=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_LIB = None


def _like_layout(x, t):
    """x (B, H, S, D) contiguous, stored like t ((B, S, H, D) when t's heads are inner)."""
    if t.stride(1) < t.stride(2):
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x.contiguous()


def _fwd(q, k, v, decay, initial_state, key_mask, cu_seqlens, max_seqlen, feature_map, causal, normalize, eps, scale,
         keep_residual=False):
    from attention_ext.linear import ops, reference
    ops.check_inputs(q, k, v, decay=decay, initial_state=initial_state, key_mask=key_mask, cu_seqlens=cu_seqlens,
                     max_seqlen=max_seqlen, feature_map=feature_map, causal=causal, normalize=normalize, eps=eps,
                     scale=scale)  # the C++ kernel's own check
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, den, final = reference.linear_attention(
        q.to(acc), k.to(acc), v.to(acc), feature_map=feature_map, causal=causal, normalize=normalize, eps=eps,
        scale=scale, decay=decay, initial_state=initial_state, key_mask=key_mask, cu_seqlens=cu_seqlens)
    o = _like_layout(out.to(q.dtype), q)
    # the kernels' rule (csrc/torch/linear_binding.h keep_residual_for): normalized 16-bit calls
    keep = keep_residual and normalize and q.dtype in (torch.float16, torch.bfloat16)
    scale = 2048.0 if q.dtype == torch.float16 else 256.0  # linear_params.h kResidualScale*
    res = _like_layout(((out - o.to(acc)) * scale).to(q.dtype), q) if keep else q.new_empty((0,))
    return o, den.contiguous(), final.contiguous(), res


def _bwd(dout, dfinal_state, q, k, v, out, den, decay, initial_state, key_mask, cu_seqlens, max_seqlen, feature_map,
         causal, normalize, eps, scale, out_residual=None):
    from attention_ext.linear import reference
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        leaves = [t.detach().to(acc).requires_grad_() for t in (q, k, v)]
        side = [t.detach().clone().requires_grad_() if t is not None else None for t in (decay, initial_state)]
        o, _, final = reference.linear_attention(
            *leaves, feature_map=feature_map, causal=causal, normalize=normalize, eps=eps, scale=scale, decay=side[0],
            initial_state=side[1], key_mask=key_mask, cu_seqlens=cu_seqlens)
        loss = (o * dout.to(acc)).sum()
        if dfinal_state is not None:
            loss = loss + (final * dfinal_state).sum()
        wrt = leaves + [t for t in side if t is not None]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
    dq, dk, dv = (_like_layout(g.to(t.dtype), t) for g, t in zip(grads[:3], (q, k, v)))
    rest = iter(grads[3:])
    empty = q.new_empty((0,), dtype=acc)
    ddecay = next(rest).contiguous() if decay is not None else empty
    dinit = next(rest).contiguous() if initial_state is not None else empty
    return dq, dk, dv, ddecay, dinit


def define_ops() -> bool:
    """Load the compiled extension (if built), then define the stand-ins where it lacks the ops.
    True when the stand-ins were defined."""
    global _LIB
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for so in glob.glob(os.path.join(root, "attention_ext", "_C*.so")):
        torch.ops.load_library(so)
    if hasattr(torch.ops.attention_ext, "linear_fwd"):
        return False
    _LIB = torch.library.Library("attention_ext", "FRAGMENT")
    for schema in SCHEMAS:
        _LIB.define(schema)
    _LIB.impl("linear_fwd", _fwd, "CPU")
    _LIB.impl("linear_bwd", _bwd, "CPU")
    return True
