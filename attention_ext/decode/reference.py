"""Pure-PyTorch reference of the decode op: gather each sequence's keys out of the (paged) cache,
then the softmax family's reference. Both the fallback on devices without a compiled kernel and
the tests' oracle (in float64)."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..softmax import reference as softmax_reference


def gather_cache(cache: Tensor, block_table: Optional[Tensor] = None, cache_batch_idx: Optional[Tensor] = None,
                 cache_leftpad: Optional[Tensor] = None, batch: Optional[int] = None) -> Tensor:
    """(B, capacity, H_k, D): the cache rows of every batch entry, shifted left by its pad, so
    that key j is cache row leftpad + j. cache is (B_cache, S_cache, H_k, D), or paged
    (num_pages, page_size, H_k, D) with block_table (B, max_pages). Rows past the end of a
    sequence hold whatever the cache holds there (the caller masks them by length)."""
    if block_table is not None:
        pages = block_table.long().clamp(0, cache.shape[0] - 1)  # unused entries may be anything
        b, n = pages.shape
        rows = cache[pages].reshape(b, n * cache.shape[1], *cache.shape[2:])
    elif cache_batch_idx is not None:
        rows = cache[cache_batch_idx.long()]
    else:
        rows = cache if batch is None else cache[:batch]
    if cache_leftpad is not None:
        cap = rows.shape[1]
        idx = (torch.arange(cap, device=rows.device)[None, :] + cache_leftpad.long()[:, None]).clamp(max=cap - 1)
        rows = torch.gather(rows, 1, idx[:, :, None, None].expand(-1, -1, *rows.shape[2:]))
    return rows


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cache_seqlens: Optional[Tensor] = None,
                     block_table: Optional[Tensor] = None, cache_batch_idx: Optional[Tensor] = None,
                     cache_leftpad: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                     window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                     alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                     k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """q (B, Sq, H, D) against the cache (flash-attn layout). Sequence b's keys are cache rows
    [leftpad[b], cache_seqlens[b]); the diagonal is bottom-right (the last query row sees the
    last key). Causal is window_size = (left, 0). An int8 / float8_e4m3fn cache is read as
    cache.float() * descale (per row (.., .., H_k), or per batch entry and kv head (B, H_k)).
    Returns out (B, Sq, H, D) in q's dtype and lse (B, H, Sq) (the math runs in q's dtype: call it
    with float64 tensors for the oracle)."""
    b = q.shape[0]
    if k_descale is not None:  # per row: the cache's own rows (per batch entry: after the gather)
        k_cache = k_cache.to(q.dtype) * (k_descale.to(q.dtype)[..., None] if k_descale.dim() == 3 else 1)
    if v_descale is not None:
        v_cache = v_cache.to(q.dtype) * (v_descale.to(q.dtype)[..., None] if v_descale.dim() == 3 else 1)
    k = gather_cache(k_cache, block_table, cache_batch_idx, cache_leftpad, b)
    v = gather_cache(v_cache, block_table, cache_batch_idx, cache_leftpad, b)
    if k_descale is not None and k_descale.dim() == 2:  # per batch entry: the rows it gathered
        k = k.to(q.dtype) * k_descale.to(q.dtype)[:, None, :, None]
    if v_descale is not None and v_descale.dim() == 2:
        v = v.to(q.dtype) * v_descale.to(q.dtype)[:, None, :, None]
    cap = k.shape[1]
    lens = cache_seqlens if cache_seqlens is not None else torch.full((b,), cap, dtype=torch.int32, device=q.device)
    if cache_leftpad is not None:
        lens = lens - cache_leftpad
    out, lse = softmax_reference.attention(
        q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), scale=softmax_scale,
        softcap=softcap, window=tuple(window_size), bottom_right=True, alibi_slopes=alibi_slopes, sinks=sinks,
        seqlens_k=lens.to(torch.int32))
    return out.transpose(1, 2), lse
