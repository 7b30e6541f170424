"""Pure-PyTorch definitions of the sparse family: the test oracles of block_sparse_attention and
topk_attention. Dense and slow on purpose; tests run them in float64.

Notation as in softmax/reference.py: q (B, H, S_q, D), k, v (B, H_k, S_k, D), H % H_k == 0
(query head h reads kv head h // (H / H_k)). Masks are True = attend; key_mask (B, S_k)
True = a real key. Causal is aligned top-left (query i sees keys j <= i) unless bottom_right
(j <= i + S_k - S_q).
"""
from __future__ import annotations

import math
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


def lsh_buckets_ref(qk: Tensor, rotations: Tensor, n_buckets: int) -> Tensor:
    """Reformer's angular LSH: (B, H, n_hashes, S) int64, bucket(x) = argmax([x R_r ; -x R_r])
    (the first maximum on ties) with R_r = rotations[r] (D, n_buckets / 2); n_buckets = 1: all 0."""
    b, h, s, _ = qk.shape
    if n_buckets == 1:
        return torch.zeros(b, h, rotations.shape[0], s, dtype=torch.long, device=qk.device)
    x = torch.einsum("bhsd,rdn->bhrsn", qk.double(), rotations.double())
    return torch.cat([x, -x], -1).argmax(-1)


def lsh_allowed_ref(buckets: Tensor, chunk_size: int, *, causal: bool = False) -> Tuple[Tensor, Tensor]:
    """The pairs LSH attention computes: (allowed (B, H, n_hashes, S, S) bool, alone (B, H, n_hashes, S)
    bool) from the buckets (B, H, n_hashes, S). Per round, each position's rank in the order
    sorted by (bucket, position) and its chunk rank // chunk_size; query i attends key j when they
    share a bucket, chunk(j) is chunk(i) or chunk(i) - 1, j <= i when causal, and j != i, unless
    i has no such key (alone): then i attends only itself."""
    s = buckets.shape[-1]
    pos = torch.arange(s, device=buckets.device)
    eye = pos[:, None] == pos[None, :]
    order = torch.sort(buckets * s + pos, dim=-1).indices                    # sorted row -> position
    rank = torch.empty_like(order).scatter_(-1, order, pos.expand_as(order))  # position -> sorted row
    chunk = rank // chunk_size
    dc = chunk[..., :, None] - chunk[..., None, :]
    allowed = (buckets[..., :, None] == buckets[..., None, :]) & ((dc == 0) | (dc == 1)) & ~eye
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    alone = ~allowed.any(-1)
    return allowed | (alone[..., None] & eye), alone


def lsh_attention_ref(qk: Tensor, v: Tensor, rotations: Tensor, n_buckets: int, chunk_size: int, *,
                      causal: bool = False, buckets: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Reformer's shared-QK LSH attention (Kitaev et al. 2020), dense: (out (B, H, S, D), lse (B, H, S)).

    qk, v (B, H, S, D). Queries are qk_i, keys k_j = qk_j / max(|qk_j|, 1e-12),
    scale 1 / sqrt(D). Per hash round r: each position's bucket (lsh_buckets_ref, or `buckets`
    (B, H, n_hashes, S) given) and the pairs of lsh_allowed_ref; a query alone attends only
    itself, at logit -1e5. The rounds combine by their LSEs: out = sum_r softmax_r(lse_r) out_r.
    Computed in qk's dtype (the tests' oracle passes float64); the hash in float64.
    """
    b, h, s, d = qk.shape
    if buckets is None:
        buckets = lsh_buckets_ref(qk, rotations, n_buckets)
    k = qk / qk.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    scores = torch.einsum("bhid,bhjd->bhij", qk, k) / math.sqrt(d)
    allowed, alone = lsh_allowed_ref(buckets, chunk_size, causal=causal)
    outs, lses = [], []
    for r in range(buckets.shape[2]):
        sc = scores.masked_fill(~allowed[:, :, r], float("-inf"))
        # a lone query's logit is -1e5 (beyond float16's range: set in the LSE, which is at least
        # float32; a lone logit's softmax is 1 whatever its value)
        lse = torch.where(alone[:, :, r], -1e5, sc.to(torch.promote_types(sc.dtype, torch.float32)).logsumexp(-1))
        outs.append(torch.softmax(sc, -1) @ v)
        lses.append(lse)
    lse = torch.stack(lses, 2)                                           # (B, H, R, S)
    total = lse.logsumexp(2)
    w = lse.softmax(2)[..., None]  # max subtracted: exact for a query alone in every round (lse -1e5 in each)
    return (w * torch.stack(outs, 2)).sum(2).to(v.dtype), total
