"""Feed-forward networks, norms and the Transformer blocks, post-LN and pre-LN.

post-LN (Vaswani et al., torch.nn.Transformer's default):  x = Norm(x + Dropout(Sublayer(x)))
pre-LN  (Xiong et al. 2020, GPT-2 and later):             x = x + Dropout(Sublayer(Norm(x)))
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._args import key_padding_mask_renamed
from .layers import ATTENTION_MODULES, AttentionConfig, KVCache, make_attention


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight  (Zhang & Sennrich 2019): LayerNorm without centering."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind: str, dim: int, eps: float = 1e-5) -> nn.Module:
    """The normalization layer `kind` names: "layernorm" (nn.LayerNorm) or "rmsnorm" (RMSNorm)."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")


class FeedForward(nn.Module):
    """Position-wise FFN. relu/gelu: w2(dropout(act(w1 x))). swiglu (Shazeer 2020):
    w2(dropout(silu(w1 x) * w3 x)), usually with d_ff about 2/3 of the relu width."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if activation not in ("relu", "gelu", "swiglu"):
            raise ValueError(f"activation must be 'relu', 'gelu' or 'swiglu', got {activation!r}")
        self.activation = activation
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w3 = nn.Linear(d_model, d_ff, bias=bias) if activation == "swiglu" else None
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.activation == "swiglu":
            h = F.silu(self.w1(x)) * self.w3(x)
        elif self.activation == "gelu":
            h = F.gelu(self.w1(x))
        else:
            h = F.relu(self.w1(x))
        return self.w2(self.dropout(h))


@dataclass
class BlockConfig:
    attn: AttentionConfig
    d_ff: int = 2048
    activation: str = "relu"
    norm: str = "layernorm"
    norm_first: bool = False      # False: post-LN (the original paper); True: pre-LN
    dropout: float = 0.1          # on each sublayer's output and inside the FFN
    norm_eps: float = 1e-5


def cross_config(attn: AttentionConfig) -> AttentionConfig:
    """Cross-attention sees the whole memory: no causal mask, window or in-sequence positions. A
    type with no cross form (LSH attention: shared queries and keys) cross-attends with its
    module's `cross_attention_type` (softmax)."""
    kind = getattr(ATTENTION_MODULES.get(attn.attention_type), "cross_attention_type", attn.attention_type)
    return dataclasses.replace(attn, attention_type=kind, causal=False, window=(-1, -1), positional="none")


class EncoderBlock(nn.Module):
    """Self-attention + FFN. With a causal attention config it is also the decoder-only LM block."""

    def __init__(self, config: BlockConfig):
        super().__init__()
        c = config
        self.norm_first = c.norm_first
        self.self_attn = make_attention(c.attn)
        self.ffn = FeedForward(c.attn.d_model, c.d_ff, c.activation, c.dropout, c.attn.bias)
        self.norm1 = make_norm(c.norm, c.attn.d_model, c.norm_eps)
        self.norm2 = make_norm(c.norm, c.attn.d_model, c.norm_eps)
        self.dropout1 = nn.Dropout(c.dropout)
        self.dropout2 = nn.Dropout(c.dropout)

    def forward(self, x: Tensor, *, key_mask: Optional[Tensor] = None, seqlens_k: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None, cache: Optional[KVCache] = None,
                context_parallel=None, key_padding_mask: None = None) -> Tensor:
        """x (B, S, d_model); key_mask (B, S) True = a real key (torch's key_padding_mask, True =
        padding, is refused: pass key_mask=~it); with context_parallel
        (attention_ext.distributed.ContextParallel) x is this rank's sequence shard and the
        self-attention runs across the group."""
        if key_padding_mask is not None:
            raise key_padding_mask_renamed("EncoderBlock.forward()")
        cp = {} if context_parallel is None else {"context_parallel": context_parallel}

        def sa(h):
            return self.dropout1(self.self_attn(h, key_mask=key_mask, seqlens_k=seqlens_k,
                                                attn_mask=attn_mask, cache=cache, **cp))
        if self.norm_first:
            x = x + sa(self.norm1(x))
            x = x + self.dropout2(self.ffn(self.norm2(x)))
        else:
            x = self.norm1(x + sa(x))
            x = self.norm2(x + self.dropout2(self.ffn(x)))
        return x


class DecoderBlock(nn.Module):
    """Causal self-attention + cross-attention over the encoder memory + FFN."""

    def __init__(self, config: BlockConfig):
        super().__init__()
        c = config
        d = c.attn.d_model
        self.norm_first = c.norm_first
        self.self_attn = make_attention(c.attn)
        self.cross_attn = make_attention(cross_config(c.attn), cross=True)
        self.ffn = FeedForward(d, c.d_ff, c.activation, c.dropout, c.attn.bias)
        self.norm1, self.norm2, self.norm3 = (make_norm(c.norm, d, c.norm_eps) for _ in range(3))
        self.dropout1, self.dropout2, self.dropout3 = (nn.Dropout(c.dropout) for _ in range(3))

    def forward(self, x: Tensor, memory: Tensor, *, key_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None, memory_key_mask: Optional[Tensor] = None,
                memory_seqlens: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
                cache: Optional[KVCache] = None, cross_cache: Optional[KVCache] = None,
                key_padding_mask: None = None, memory_key_padding_mask: None = None) -> Tensor:
        """x (B, T, d_model) over memory (B, S, d_model). key_mask (B, T) / memory_key_mask (B, S):
        True = a real key of the self- / cross-attention (torch's key_padding_mask and
        memory_key_padding_mask, True = padding, are refused: pass the masks inverted)."""
        if key_padding_mask is not None:
            raise key_padding_mask_renamed("DecoderBlock.forward()")
        if memory_key_padding_mask is not None:
            raise key_padding_mask_renamed("DecoderBlock.forward()", "memory_key_padding_mask", "memory_key_mask")

        def sa(h):
            return self.dropout1(self.self_attn(h, key_mask=key_mask, attn_mask=attn_mask, cache=cache))

        def ca(h):
            return self.dropout2(self.cross_attn(h, memory, key_mask=memory_key_mask,
                                                 seqlens_k=memory_seqlens, attn_mask=memory_mask,
                                                 cache=cross_cache))
        if self.norm_first:
            x = x + sa(self.norm1(x))
            x = x + ca(self.norm2(x))
            x = x + self.dropout3(self.ffn(self.norm3(x)))
        else:
            x = self.norm1(x + sa(x))
            x = self.norm2(x + ca(x))
            x = self.norm3(x + self.dropout3(self.ffn(x)))
        return x
