"""Pure-PyTorch definitions of the sparse family: the test oracles of block_sparse_attention and
topk_attention. Dense and slow on purpose; tests run them in float64.

Notation as in softmax/reference.py: q (B, H, S_q, D), k, v (B, H_k, S_k, D), H % H_k == 0
(query head h reads kv head h // (H / H_k)). Masks are True = attend; key_mask (B, S_k)
True = a real key. Causal is aligned top-left (query i sees keys j <= i) unless bottom_right
(j <= i + S_k - S_q).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..softmax import reference as softmax_ref


def _allowed(q: Tensor, k: Tensor, *, causal: bool, bottom_right: bool, key_mask: Optional[Tensor],
             attn_mask: Optional[Tensor]) -> Tensor:
    """(B, H or 1, S_q, S_k) bool: the element-wise masks alone."""
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    ok = softmax_ref.mask_structure(sq, sk, window=(-1, 0) if causal else (-1, -1), bottom_right=bottom_right,
                                    batch=b, device=q.device)  # (B, 1, S_q, S_k)
    if key_mask is not None:
        ok = ok & key_mask.to(torch.bool).view(b, 1, 1, sk)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise TypeError("the sparse references take a bool attn_mask (True = attend)")
        ok = ok & attn_mask
    return ok


def block_sparse_attention_ref(q: Tensor, k: Tensor, v: Tensor, block_layout: Tensor, block_size: int, *,
                               causal: bool = False, bottom_right: bool = False, scale: Optional[float] = None,
                               key_mask: Optional[Tensor] = None,
                               attn_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Softmax attention restricted to the computed blocks. Returns (out, lse).

    block_layout (H or 1, ceil(S_q / bs), ceil(S_k / bs)) bool; query i may see key j iff
    block_layout[h, i // bs, j // bs] and the element masks (causal, key_mask, attn_mask
    broadcastable to (B, H, S_q, S_k)) allow it:

        s   = scale * q @ k^T,  -inf where not allowed          (B, H, S_q, S_k)
        lse = logsumexp_j s                                     (B, H, S_q)
        out = softmax(s) @ v                                    (B, H, S_q, D)

    A row with nothing allowed gives out = 0 and lse = -inf.
    """
    sq, sk = q.shape[2], k.shape[2]
    blocks = block_layout.to(device=q.device, dtype=torch.bool)
    elem = blocks.repeat_interleave(block_size, dim=1).repeat_interleave(block_size, dim=2)[:, :sq, :sk]
    ok = _allowed(q, k, causal=causal, bottom_right=bottom_right, key_mask=key_mask,
                  attn_mask=attn_mask) & elem.unsqueeze(0)
    ok = ok.expand(q.shape[0], q.shape[1], sq, sk)
    return softmax_ref.attention(q, k, v, scale=scale, bias=ok)


def topk_select(scores: Tensor, allowed: Tensor, k_top: int) -> Tensor:
    """(..., S_k) bool: the k_top allowed keys of each row with the highest scores; among equal
    scores the lower key index wins (an ascending stable sort of -score keeps index order).
    Fewer than k_top allowed keys: all of them."""
    neg = (-scores).masked_fill(~allowed, float("inf"))
    order = torch.sort(neg, dim=-1, stable=True).indices[..., :k_top]
    return torch.zeros_like(allowed).scatter_(-1, order, True) & allowed


def topk_attention_ref(q: Tensor, k: Tensor, v: Tensor, k_top: int, *, causal: bool = False,
                       bottom_right: bool = False, scale: Optional[float] = None,
                       key_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Hard attention: each query keeps its k_top highest-scoring allowed keys and softmax runs
    over them. Returns (out, lse).

        s    = scale * q @ k^T                                  (B, H, S_q, S_k)
        keep = the first k_top allowed keys in the order (-s_j, j)   (ties: lower j first)
        out  = softmax(s over keep) @ v,  lse = logsumexp(s over keep)

    k_top >= S_k is dense attention; k_top = 1 returns v at the argmax key. A row with nothing
    allowed (or k_top = 0) gives out = 0 and lse = -inf.
    """
    b, h, sq, d = q.shape
    sk = k.shape[2]
    if scale is None:
        scale = d ** -0.5
    kk = k.repeat_interleave(h // k.shape[1], dim=1)  # (B, H, S_k, D)
    s = (q @ kk.transpose(-1, -2)) * scale  # (B, H, S_q, S_k)
    ok = _allowed(q, k, causal=causal, bottom_right=bottom_right, key_mask=key_mask,
                  attn_mask=None).expand(b, h, sq, sk)
    keep = topk_select(s, ok, k_top)
    return softmax_ref.attention(q, k, v, scale=scale, bias=keep)
