"""Linformer attention (Wang et al. 2020): linformer_attention.

The op (attention_ext::linformer_attention, csrc/torch/softmax_linformer.cpp) projects k and v
along the sequence with one batched matmul each and runs the softmax attention of q over the r
projected keys on the fused kernel; it states and checks every input rule. This module moves
between layouts.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from .._args import not_a_tensor
from .._ext import HAS_EXT
from . import ops, reference

__all__ = ["linformer_attention"]

_warned = set()


def linformer_attention(q: Tensor, k: Tensor, v: Tensor, proj_k: Tensor, proj_v: Optional[Tensor] = None, *,
                        scale: Optional[float] = None, layout: str = "bhsd") -> Tensor:
    """Softmax attention over keys and values projected along the sequence.

    k' = proj_k @ k and v' = proj_v @ v, then attention(q, k', v'): each query attends r
    projected keys, so time and memory grow as S * r, not S^2. Non-causal (a projection mixes
    every position), as in the paper.

    Args:
        q: (B, H, Sq, D) (or (B, Sq, H, D) with layout="bshd"); k, v: (B, H_k, S, D), H % H_k == 0.
        proj_k: (r, S) shared by every head, or (H_k, r, S) per head (the paper's E), k's dtype.
            A model trained for a maximum length passes proj_k[..., :S].
        proj_v: the same for v (the paper's F); defaults to proj_k (the paper's shared projection).
        scale: defaults to 1 / sqrt(D).
        layout: "bhsd" or "bshd".

    Differentiable in q, k, v and both projections. Returns (B, H, Sq, D) in q's layout (v has k's
    shape, the fused kernel's rule).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("proj_k", proj_k), ("proj_v", proj_v)):
        if not isinstance(t, Tensor) and (t is not None or name != "proj_v"):
            raise not_a_tensor(name, t, "linformer_attention")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"linformer_attention: layout must be 'bhsd' or 'bshd', got {layout!r}")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) if isinstance(t, Tensor) and t.dim() == 4 else t for t in (q, k, v))
    if HAS_EXT and isinstance(q, Tensor) and ops.has_kernel(q.device, q.dtype):
        out = torch.ops.attention_ext.linformer_attention(q, k, v, proj_k, proj_v, scale)
    else:
        if HAS_EXT:  # the op's input rules, on meta tensors (no kernel runs)
            meta = lambda t: t.to("meta") if isinstance(t, Tensor) else t  # noqa: E731
            torch.ops.attention_ext.linformer_attention(meta(q), meta(k), meta(v), meta(proj_k), meta(proj_v), scale)
        key = (q.device.type, q.dtype)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"attention_ext: no compiled kernel for {q.dtype} on {q.device}; linformer_attention runs "
                          "the PyTorch reference", RuntimeWarning)
        acc = ops.acc_dtype(q.dtype)
        out = reference.linformer_attention(q.to(acc), k.to(acc), v.to(acc), proj_k.to(acc),
                                            None if proj_v is None else proj_v.to(acc), scale=scale).to(q.dtype)
    return out.transpose(1, 2) if layout == "bshd" else out
