"""Drop-in for torch.nn.functional.scaled_dot_product_attention on the fused softmax kernel."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..softmax import ops
from ..softmax.functional import attention

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention (same arguments, same
    conventions and error types: bool mask True = attend, is_causal aligned top-left).
    (N, ..., L, E) inputs; 4-D inputs with equal q/k/v head dims run the fused kernel, other
    shapes run torch's own."""
    if not all(isinstance(t, Tensor) for t in (query, key, value)):
        raise TypeError("scaled_dot_product_attention: query, key and value must be Tensors")
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise RuntimeError(
            f"Expected query, key, and value to have the same dtype, but got query.dtype: {query.dtype} "
            f"key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if not query.is_floating_point():  # torch's own would fail deep inside a matmul, naming no argument
        raise RuntimeError(f"scaled_dot_product_attention: query, key and value must be floating point, got "
                           f"{query.dtype}")
    if query.device != key.device or query.device != value.device:
        raise RuntimeError(
            f"Expected query, key, and value to have the same device type, but got query.device: {query.device} "
            f"key.device: {key.device} and value.device: {value.device} instead.")
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise RuntimeError("scaled_dot_product_attention: query, key and value must have at least 2 dims")
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    if query.size(-1) != key.size(-1):
        raise RuntimeError(f"scaled_dot_product_attention: query and key head dims differ ({query.size(-1)} vs "
                           f"{key.size(-1)})")
    if query.dim() == 4 and key.dim() == 4 and value.dim() == 4:
        hq, hk = query.size(1), key.size(1)
        if hq != hk and not enable_gqa:
            raise RuntimeError(f"scaled_dot_product_attention: number of heads in query ({hq}) and key ({hk}) differ; "
                               "pass enable_gqa=True for grouped-query attention")
        if hq % hk != 0:
            raise RuntimeError(f"scaled_dot_product_attention: number of heads in key/value ({hk}) must divide the "
                               f"number of heads in query ({hq})")
    fused = (query.dim() == 4 and key.dim() == 4 and value.dim() == 4 and value.size(-1) == query.size(-1)
             and query.size(-1) <= 256 and ops.has_kernel(query.device, query.dtype))
    if not fused:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    return attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, causal=is_causal, scale=scale)
