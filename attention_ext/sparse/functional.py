"""Tier 2 of the sparse family: block_sparse_attention and topk_attention.

This first version runs both through the fused softmax op with a dense element mask; the
kernels' block iterator (csrc/common/block_sparse.h) replaces the mask with the same signatures.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..softmax.functional import attention

__all__ = ["block_sparse_attention", "topk_attention", "layout_to_mask"]


def layout_to_mask(layout: Tensor, block_size: int, sq: int, sk: int) -> Tensor:
    """(H or 1, ceil(Sq/bs), ceil(Sk/bs)) bool layout -> (H or 1, Sq, Sk) bool element mask."""
    m = layout.repeat_interleave(block_size, dim=1).repeat_interleave(block_size, dim=2)
    return m[:, :sq, :sk]


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, layout: Tensor, *, block_size: int = 64,
                           causal: bool = False, scale: Optional[float] = None,
                           key_padding_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                           layout_qkv: str = "bhsd", return_lse: bool = False,
                           **options) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over the (query block, key block) pairs `layout` names. Placeholder: dense
    element mask through the fused op."""
    sq = q.shape[2] if layout_qkv == "bhsd" else q.shape[1]
    sk = k.shape[2] if layout_qkv == "bhsd" else k.shape[1]
    mask = layout_to_mask(layout.to(device=q.device, dtype=torch.bool), block_size, sq, sk).unsqueeze(0)
    return attention(q, k, v, layout=layout_qkv, scale=scale, causal=causal, attn_mask=mask,
                     key_padding_mask=key_padding_mask, dropout_p=dropout_p, return_lse=return_lse, **options)


def topk_attention(q: Tensor, k: Tensor, v: Tensor, k_top: int, *, causal: bool = False,
                   scale: Optional[float] = None, key_padding_mask: Optional[Tensor] = None,
                   layout_qkv: str = "bhsd", return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Hard attention: each query keeps its k_top highest-scoring keys (ties: the lower key index
    wins) and softmax runs over them. Placeholder: dense scores."""
    if layout_qkv == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    sc = scale if scale is not None else d ** -0.5
    kk = k.repeat_interleave(h // k.shape[1], dim=1)
    s = (q.float() @ kk.float().transpose(-1, -2)) * sc
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed.expand(b, h, sq, sk)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    # ties: a stable descending sort keeps the lower index first
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k_top]
    keep = torch.zeros_like(allowed).scatter_(-1, order, True) & allowed
    out = attention(q, k, v, scale=sc, attn_mask=keep, return_lse=return_lse)
    if layout_qkv == "bshd":
        out = (out[0].transpose(1, 2), out[1]) if return_lse else out.transpose(1, 2)
    return out
