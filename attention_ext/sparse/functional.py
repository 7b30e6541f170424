"""Tier 2 of the sparse family: block_sparse_attention and topk_attention.

Both are the fused softmax op with one more option (csrc/common/block_sparse.h): a block layout,
whose tile index the kernels walk so that cost follows the on blocks, or top-k's per-row
thresholds from a streaming threshold pass. Every other option of attention() composes with them.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from .._args import TENSOR_LAYOUT, key_padding_mask_renamed, misplaced, renamed
from ..softmax.functional import attention
from .layouts import SparseMask

__all__ = ["block_sparse_attention", "topk_attention", "layout_to_mask"]


def layout_to_mask(block_layout: Tensor, block_size: int, sq: int, sk: int) -> Tensor:
    """(H or 1, ceil(Sq/bs), ceil(Sk/bs)) bool block layout -> (H or 1, Sq, Sk) bool element mask."""
    m = block_layout.repeat_interleave(block_size, dim=1).repeat_interleave(block_size, dim=2)
    return m[:, :sq, :sk]


def _sparse_layout_args(fn: str, layout: Any, options: dict) -> None:
    """The sparse functionals' refusals of the old `layout_qkv` and of a block layout given as
    `layout`. Runs only where a call is wrong (the caller tests `options` / the type first)."""
    if "layout_qkv" in options:
        raise renamed(fn, "layout_qkv", "layout", TENSOR_LAYOUT)
    if not isinstance(layout, str):
        raise misplaced(fn, "layout", layout, TENSOR_LAYOUT,
                        "the block layout (a bool tensor or a SparseMask) goes in block_layout, the 4th positional "
                        "argument")


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, block_layout: Union[Tensor, SparseMask, None] = None, *,
                           block_size: int = 64, causal: bool = False, scale: Optional[float] = None,
                           key_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                           layout: str = "bhsd", return_lse: bool = False,
                           key_padding_mask: None = None, **options: Any) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Softmax attention over the (query block, key block) pairs a block layout names.

    Args:
        q: (B, H, Sq, D) (or (B, Sq, H, D) with layout="bshd"); k, v: (B, H_k, Sk, D),
            H % H_k == 0 (MQA / GQA without a copy).
        block_layout: bool (H or 1, ceil(Sq / block_size), ceil(Sk / block_size)), True = the
            block is computed (the builders of attention_ext.sparse make them), or a SparseMask
            from attention_ext.sparse.from_mask, whose element mask then applies inside its
            partially allowed blocks. Required (its default only lets a call that passes a block
            layout as `layout=` get an error that says where it goes).
        block_size: the layout's block, a positive multiple of 16 (ignored for a SparseMask,
            which carries its own).
        causal, key_mask, dropout_p, scale: as attention() (key_mask (B, Sk) True = a real
            key); they apply element-wise inside the computed blocks, so lengths need not divide
            the block.
        layout: the tensors' layout, "bhsd" or "bshd", as in attention(). A tensor or a
            SparseMask here raises a TypeError that says the block layout goes in block_layout;
            the old name layout_qkv raises a TypeError that names layout.
        key_padding_mask: not read: a TypeError says to pass key_mask=~key_padding_mask (the
            name is torch's, with the opposite polarity).
        **options: any other option of attention_ext.attention (alibi_slopes, softcap, sinks,
            window, attn_mask, generator, seed, ...).

    Returns out (and the LSE). A query whose row has no computed key gives 0 (LSE -inf).
    Cost follows the number of computed blocks, on the CPU kernels and the CUDA ones alike.
    """
    if key_padding_mask is not None:
        raise key_padding_mask_renamed("block_sparse_attention()")
    if "layout_qkv" in options or not isinstance(layout, str):
        _sparse_layout_args("block_sparse_attention()", layout, options)
    if block_layout is None:
        raise TypeError("block_sparse_attention() missing its block layout: pass block_layout (a bool tensor or a "
                        "SparseMask) as the 4th positional argument")
    if isinstance(block_layout, str):
        raise misplaced("block_sparse_attention()", "block_layout", block_layout,
                        "the block layout (a bool tensor or a SparseMask)",
                        "the tensors' layout ('bhsd' / 'bshd') goes in layout")
    if isinstance(block_layout, SparseMask):
        block_size, mask, block_layout = block_layout.block_size, block_layout.mask, block_layout.block_layout
        if mask is not None:
            # its element mask is (H or 1, S_q, S_k) of the length it was built for
            if isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() == 4 and k.dim() == 4:
                sq, sk = (q.shape[2], k.shape[2]) if layout == "bhsd" else (q.shape[1], k.shape[1])
                if tuple(mask.shape[-2:]) != (sq, sk):
                    raise ValueError(f"block_layout: the SparseMask was built for (S_q, S_k) = "
                                     f"{tuple(mask.shape[-2:])}, the inputs have {(sq, sk)}: build it with "
                                     f"from_mask(..., seq_len={sq}{'' if sq == sk else f', seq_len_k={sk}'})")
            user = options.pop("attn_mask", None)
            mask = mask.unsqueeze(0) if mask.dim() == 3 else mask
            mask = mask.to(q.device)
            if user is not None:
                mask = mask & user if user.dtype == torch.bool else user.masked_fill(~mask, float("-inf"))
            options["attn_mask"] = mask
    if not isinstance(block_layout, Tensor):
        raise TypeError(f"block_layout must be a bool tensor or a SparseMask, got {type(block_layout).__name__}")
    return attention(q, k, v, layout=layout, scale=scale, causal=causal, key_mask=key_mask, dropout_p=dropout_p,
                     return_lse=return_lse, block_layout=block_layout, block_size=block_size, **options)


def topk_attention(q: Tensor, k: Tensor, v: Tensor, k_top: int, *, causal: bool = False,
                   scale: Optional[float] = None, key_mask: Optional[Tensor] = None,
                   layout: str = "bhsd", return_lse: bool = False, key_padding_mask: None = None,
                   **options: Any) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Hard attention: each query keeps only its k_top highest-scoring keys among those the
    other rules allow (causal, padding, window, masks), and softmax runs over them. Ties in the
    score go to the lower key index, so the selection is deterministic; k_top=1 is argmax
    attention and k_top >= Sk is dense attention.

    Runs in two passes, neither of which builds an (Sq, Sk) tensor: a streaming per-row top-k
    gives each row a threshold (the k-th logit and the last key kept at it), then the fused
    kernel runs with the threshold as one more mask. The gradient flows through the kept
    scores (the selection itself is piecewise constant).

    Args are attention()'s (key_mask (B, Sk) True = a real key; layout the tensors' layout, "bhsd"
    or "bshd" (the old name layout_qkv raises a TypeError that names layout); **options:
    alibi_slopes, softcap, window, attn_mask, dropout_p, ...; the logits ranked are the final
    ones, after scale, softcap, ALiBi and an additive mask).
    key_padding_mask is not read: a TypeError says to pass key_mask=~key_padding_mask.
    """
    if key_padding_mask is not None:
        raise key_padding_mask_renamed("topk_attention()")
    if not isinstance(k_top, int) or isinstance(k_top, bool) or k_top < 1:
        raise ValueError(f"k_top must be an int >= 1, got {k_top!r}")
    if "layout_qkv" in options or not isinstance(layout, str):
        _sparse_layout_args("topk_attention()", layout, options)
    return attention(q, k, v, layout=layout, scale=scale, causal=causal, key_mask=key_mask, return_lse=return_lse,
                     topk=k_top, **options)
