"""Drop-ins for flash-attn 2.x's functions on the fused softmax kernel: (B, S, H, D) layout,
causal aligned bottom-right, flash-attn's argument order. `num_splits` (keyword only) follows
flash-attn's convention: N splits of the keys on CUDA, 1 = none, 0 (the default, as
attention()'s) = a heuristic that splits only grids too small to fill the GPU."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .._args import LayoutMismatch, not_a_tensor
from ..decode.kvcache import flash_attn_with_kvcache
from ..softmax import reference
from ..softmax.functional import attention, attention_varlen, attention_weights, window_size_pair

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]

# out, or (out, lse, probs) with return_attn_probs=True, as flash-attn returns
_OutOrProbs = Union[Tensor, Tuple[Tensor, Tensor, Tensor]]
_FN = "attention_ext.flash_attn"  # the prefix of this module's argument errors


def _no_probs_with_quant(return_attn_probs: bool, qk_quant) -> None:
    if return_attn_probs and qk_quant is not None:
        raise ValueError(f"{_FN}: return_attn_probs=True does not combine with qk_quant={qk_quant!r} (the "
                         "probabilities are recomputed from unquantized scores); call it without qk_quant for them")


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, num_splits: int = 0,
                    qk_quant: Optional[str] = None) -> _OutOrProbs:
    """Drop-in for flash_attn.flash_attn_func: q (B, Sq, H, D), k / v (B, Sk, H_k, D); causal is
    aligned bottom-right. return_attn_probs=True returns (out, lse (B, H, Sq), probs
    (B, H, Sq, Sk)) with the real probabilities recomputed from the LSE. qk_quant="int8":
    attention()'s int8 Q.K^T (inference; not with return_attn_probs)."""
    window = window_size_pair(window_size, _FN)
    _no_probs_with_quant(return_attn_probs, qk_quant)
    try:
        out, lse = attention(q, k, v, layout="bshd", scale=softmax_scale, causal=causal, bottom_right=True,
                             window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                             return_lse=True, deterministic=deterministic, num_splits=num_splits, qk_quant=qk_quant)
    except LayoutMismatch as e:  # attention()'s hint names its `layout`, which this drop-in does not take
        raise ValueError(f"flash_attn_func: {e.shapes} fit (B, H, S, D), but flash_attn_func takes flash-attn's "
                         f"(B, S, H, D): pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), or call "
                         f"attention_ext.attention(q, k, v, layout='bhsd') ({e.cause})") from e
    if return_attn_probs:
        probs = attention_weights(q, k, lse, layout="bshd", scale=softmax_scale, causal=causal, bottom_right=True,
                                  window=window, softcap=softcap, alibi_slopes=alibi_slopes)
        return out, lse, probs
    return out


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                              return_attn_probs: bool = False, *, num_splits: int = 0) -> _OutOrProbs:
    """qkv (B, S, 3, H, D): q, k, v are strided views of the pack, never copied."""
    if not isinstance(qkv, Tensor):
        raise not_a_tensor("qkv", qkv, _FN)
    if not (qkv.dim() == 5 and qkv.shape[2] == 3):
        raise ValueError(f"qkv must be (B, S, 3, H, D), got {tuple(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs, num_splits=num_splits)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                             return_attn_probs: bool = False, *, num_splits: int = 0) -> _OutOrProbs:
    """kv (B, Sk, 2, H_k, D)."""
    if not isinstance(kv, Tensor):
        raise not_a_tensor("kv", kv, _FN)
    if not (kv.dim() == 5 and kv.shape[2] == 2):
        raise ValueError(f"kv must be (B, S, 2, H_k, D), got {tuple(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, num_splits=num_splits)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None, *,
                           num_splits: int = 1, qk_quant: Optional[str] = None) -> _OutOrProbs:
    """Drop-in for flash_attn.flash_attn_varlen_func: q (total_q, H, D), k / v (total_k, H_k, D),
    sequence b in rows [cu_seqlens[b], cu_seqlens[b+1]). Returns out (total_q, H, D) (and lse
    (H, total_q) and the (B, H, max_seqlen_q, max_seqlen_k) probabilities with
    return_attn_probs).

    block_table (B, max_pages) int32: paged K/V, k / v (num_pages, page_size, H_k, D); sequence
    b's cu_seqlens_k[b+1] - cu_seqlens_k[b] keys are rows 0.. of its pages block_table[b, :].
    The pages are gathered into a packed (total_k, H_k, D) copy with torch indexing (one extra
    read + write of every used key and value, O(total_k * H_k * D) memory; differentiable to
    k / v), then the unpaged varlen kernel runs on it. qk_quant="int8": attention()'s int8 Q.K^T
    (inference; not with return_attn_probs), each sequence with its own K mean and blocks."""
    window = window_size_pair(window_size, _FN)
    _no_probs_with_quant(return_attn_probs, qk_quant)
    if block_table is not None:
        k, v = _gather_paged_varlen(k, v, block_table, cu_seqlens_k)
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                scale=softmax_scale, causal=causal, bottom_right=True, window=window,
                                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=True,
                                deterministic=deterministic, num_splits=num_splits, qk_quant=qk_quant)
    if return_attn_probs:
        return out, lse, _varlen_probs(q, k, lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                       softmax_scale, softcap, causal, window, alibi_slopes)
    return out


def _varlen_probs(q, k, lse, cq, ck, max_q, max_k, scale, softcap, causal, window, alibi_slopes):
    """(B, H, max_seqlen_q, max_seqlen_k) probabilities of every sequence (in the LSE's dtype),
    recomputed from the (H, total_q) LSE, zero outside each sequence."""
    nb, h = cq.numel() - 1, q.shape[1]
    acc = lse.dtype
    probs = q.new_zeros((nb, h, max_q, max_k), dtype=acc)
    window = (window[0], 0) if causal else window
    for b in range(nb):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        slopes = None if alibi_slopes is None else (alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes)
        probs[b, :, : q1 - q0, : k1 - k0] = reference.attention_probs(
            q[q0:q1].transpose(0, 1).unsqueeze(0).to(acc), k[k0:k1].transpose(0, 1).unsqueeze(0).to(acc),
            lse[:, q0:q1].unsqueeze(0), scale=scale, softcap=softcap, window=window, bottom_right=True,
            alibi_slopes=None if slopes is None else slopes.to(acc))[0]
    return probs


def _gather_paged_varlen(k: Tensor, v: Tensor, block_table: Tensor, cu_seqlens_k: Tensor):
    """Packed (total_k, H_k, D) keys and values of paged k / v (num_pages, page_size, H_k, D):
    row cu_seqlens_k[b] + r is row r % page_size of page block_table[b, r // page_size]."""
    if not isinstance(block_table, Tensor) or block_table.dtype != torch.int32:
        raise TypeError("flash_attn_varlen_func: block_table must be an int32 tensor")
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"flash_attn_varlen_func: paged k / v must be (num_pages, page_size, H_k, D), got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    nb = cu_seqlens_k.numel() - 1
    if block_table.dim() != 2 or block_table.shape[0] != nb:
        raise ValueError(f"flash_attn_varlen_func: block_table must be (B={nb}, max_pages), got "
                         f"{tuple(block_table.shape)}")
    if block_table.device != k.device or cu_seqlens_k.device != k.device:
        raise ValueError("flash_attn_varlen_func: block_table, cu_seqlens_k and k must share a device")
    n_pages, page = k.shape[0], k.shape[1]
    cu = cu_seqlens_k.long()
    lens = cu[1:] - cu[:-1]  # (B,)
    if nb and (int(lens.min()) < 0 or int(lens.max()) > block_table.shape[1] * page):
        raise ValueError(f"flash_attn_varlen_func: a sequence is longer than its block_table row "
                         f"({block_table.shape[1]} pages of {page})")
    total = int(cu[-1]) if nb else 0
    seq = torch.repeat_interleave(torch.arange(nb, device=k.device), lens, output_size=total)  # (total_k,)
    r = torch.arange(total, device=k.device) - cu[:-1][seq]  # row inside its sequence
    pages = block_table.long()[seq, r // page]
    if total and (int(pages.min()) < 0 or int(pages.max()) >= n_pages):
        raise ValueError(f"flash_attn_varlen_func: block_table holds a page outside [0, {n_pages})")
    slot = r % page
    return k[pages, slot], v[pages, slot]


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *, num_splits: int = 0) -> _OutOrProbs:
    """Drop-in for flash_attn.flash_attn_varlen_qkvpacked_func: qkv (total, 3, H, D); q, k, v
    are strided views of the pack, never copied."""
    if not isinstance(qkv, Tensor):
        raise not_a_tensor("qkv", qkv, _FN)
    if not (qkv.dim() == 4 and qkv.shape[1] == 3):
        raise ValueError(f"qkv must be (total, 3, H, D), got {tuple(qkv.shape)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, num_splits=num_splits)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, *, num_splits: int = 0) -> _OutOrProbs:
    """Drop-in for flash_attn.flash_attn_varlen_kvpacked_func: q (total_q, H, D), kv
    (total_k, 2, H_k, D); k and v are strided views of the pack, never copied."""
    if not isinstance(kv, Tensor):
        raise not_a_tensor("kv", kv, _FN)
    if not (kv.dim() == 4 and kv.shape[1] == 2):
        raise ValueError(f"kv must be (total_k, 2, H_k, D), got {tuple(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, num_splits=num_splits)
