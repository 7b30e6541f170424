"""Linformer layers: `LinformerAttention`, the module of attention_type="linformer" (Wang et al.
2020).

The same q / k / v / out projections, RoPE and call signature as `Attention`, plus learned
projections E, F along the sequence: keys and values are compressed from S positions to r
(config.linformer_k) before the fused softmax attention, so a layer costs S * r, not S^2. Each
projected key mixes every position, so the layer is non-causal and keeps no generation cache: it
serves encoders (and cross-attention over a memory), never a causal decoder or language model.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .._args import key_padding_mask_renamed, real_tokens
from ..softmax import linformer_attention
from .layers import ATTENTION_MODULES, AttentionConfig, init_projections

SHARING = ("headwise", "kv", "none")

_NON_CAUSAL = ("its projections mix every position of the sequence into each key, so no causal mask "
               "exists over them; use attention_type='lsh' (causal LSH attention) or 'softmax' for a causal "
               "decoder or language model")


class LinformerAttention(nn.Module):
    """Multi-head Linformer attention from an AttentionConfig (attention_type="linformer"):
    softmax(q (E k)^T / sqrt(D)) (F v) per head, E and F learned (r, max_len) projections.

    config.linformer_k is r, config.linformer_max_len the longest sequence the projections span: a
    sequence of S <= max_len positions uses their first S columns, E[..., :S] (as the paper's
    fixed-length model sees shorter inputs padded). config.linformer_share follows the paper's
    sharing options: "headwise" (one E and one F shared by the heads), "kv" (one E = F for keys
    and values, shared by the heads), "none" (E and F per key head, (H_k, r, max_len)); sharing
    across layers is not offered. E and F are initialized Xavier-uniform per (r, max_len) matrix,
    as the authors' implementation (fairseq) initializes its compression layers.

    Non-causal only: a causal config raises ValueError, as do a generation cache and
    allocate_cache (there is no incremental form). key_mask (B, S_k) True = a real key, on a
    prefix of each row (right padding; left padding and holes are refused) / seqlens_k: padded
    keys and values are zeroed before the projection, so they add nothing to
    E k or F v and a padded sequence computes exactly what it computes alone (E[..., :L] over its
    L real positions). attn_mask, window, ALiBi, sinks and softcap have no meaning over projected
    keys and are refused; dropout on probabilities is not applied. Cross-attention (cross=True)
    projects the memory, of at most max_len positions.
    """

    def __init__(self, config: AttentionConfig, cross: bool = False):
        super().__init__()
        c = config
        if c.causal and not cross:
            raise ValueError(f"attention_type='linformer' has no causal form (causal=True): {_NON_CAUSAL}")
        unsupported = [n for n, bad in (("window", tuple(c.window) != (-1, -1)), ("ALiBi", c.positional == "alibi"),
                                         ("sinks", c.sinks), ("softcap", c.softcap > 0)) if bad]
        if unsupported:
            raise ValueError(f"attention_type='linformer' has no {', '.join(unsupported)}")
        if c.linformer_share not in SHARING:
            raise ValueError(f"linformer_share must be one of {SHARING}, got {c.linformer_share!r}")
        if c.linformer_k < 1 or c.linformer_max_len < 1:
            raise ValueError(f"linformer_k and linformer_max_len must be >= 1, got {c.linformer_k} and "
                             f"{c.linformer_max_len}")
        self.config = config
        self.cross = cross
        self.max_len = c.linformer_max_len
        init_projections(self, c, cross)
        shape = (c.linformer_k, c.linformer_max_len)
        if c.linformer_share == "none":
            shape = (c.n_kv_heads, *shape)
        self.proj_k = nn.Parameter(torch.empty(shape))  # E
        self.proj_v = nn.Parameter(torch.empty(shape)) if c.linformer_share != "kv" else None  # F (None: F = E)
        self.reset_projections()

    def reset_projections(self) -> None:
        """Xavier-uniform E and F, each (r, max_len) matrix (per head with linformer_share="none")."""
        with torch.no_grad():
            for p in (self.proj_k, self.proj_v):
                if p is not None:
                    for m in p.view(-1, *p.shape[-2:]):
                        nn.init.xavier_uniform_(m)

    @classmethod
    def allocate_cache(cls, config: AttentionConfig, batch: int, max_len: int, *, device=None, dtype=None,
                       static: bool = False) -> None:
        raise ValueError(f"attention_type='linformer' keeps no generation cache: {_NON_CAUSAL}")

    def forward(self, x: Tensor, context: Optional[Tensor] = None, *, key_mask: Optional[Tensor] = None,
                seqlens_k: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None, cache: None = None,
                key_padding_mask: None = None) -> Tensor:
        """x (B, S, d_model) (and the memory `context` (B, S_k, kv_dim) with cross=True) ->
        (B, S, d_model)."""
        if key_padding_mask is not None:
            raise key_padding_mask_renamed("LinformerAttention.forward()")
        if cache is not None:
            raise ValueError(f"attention_type='linformer' keeps no generation cache (cache=...): {_NON_CAUSAL}")
        if attn_mask is not None:
            raise ValueError("attention_type='linformer' takes no attn_mask: its keys are projections of every "
                             "position, which a mask over positions cannot address (key_mask / seqlens_k mark "
                             "padding)")
        if self.cross and context is None:
            raise ValueError("LinformerAttention(cross=True).forward(): context (B, S_k, kv_dim), the memory, is "
                             "required")
        if not self.cross and context is not None:
            raise ValueError("LinformerAttention.forward(): a self-attention layer takes no context (build it with "
                             "cross=True for cross-attention)")
        b, s, _ = x.shape
        src = context if self.cross else x
        sk = src.shape[1]
        if sk > self.max_len:
            raise ValueError(f"attention_type='linformer': {sk} keys exceed linformer_max_len={self.max_len}, the "
                             f"width of the learned projections; build the layer with a larger linformer_max_len")
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim)  # (B, S, H, D)
        k = self.k_proj(src).view(b, sk, self.n_kv_heads, self.head_dim)  # (B, S_k, H_k, D)
        v = self.v_proj(src).view(b, sk, self.n_kv_heads, self.head_dim)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        key_mask = real_tokens(key_mask, seqlens_k, b, sk, x.device, "LinformerAttention.forward()")  # (B, S_k)
        if key_mask is not None:
            # right padding only: a sequence's real keys are columns [0, len) of E and F, as alone
            prefix = torch.arange(sk, device=key_mask.device) < key_mask.sum(-1, keepdim=True)
            if not torch.equal(key_mask.bool(), prefix):
                raise ValueError("attention_type='linformer' takes right padding only: key_mask must be True on a "
                                 "prefix of each row (its keys are projected by position: left padding or holes "
                                 "would move the real keys onto other columns of E and F)")
        if key_mask is not None:  # zero padding after the biased projections: it adds nothing to E k, F v
            keep = key_mask.view(b, sk, 1, 1).bool()
            k, v = k.masked_fill(~keep, 0.0), v.masked_fill(~keep, 0.0)  # (0 x NaN would be NaN)
        proj_k = self.proj_k[..., :sk].to(k.dtype)
        proj_v = self.proj_v[..., :sk].to(v.dtype) if self.proj_v is not None else None
        out = linformer_attention(q, k, v, proj_k, proj_v, layout="bshd")  # (B, S, H, D)
        return self.out_proj(out.reshape(b, s, self.n_heads * self.head_dim))  # (B, S, d_model)


ATTENTION_MODULES["linformer"] = LinformerAttention
