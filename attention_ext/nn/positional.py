"""Positional information: sinusoidal (Vaswani et al.), learned, rotary (RoPE) and ALiBi.

Absolute encodings (sinusoidal, learned) are added to the token embeddings. RoPE rotates q and k
inside the attention layer. ALiBi is a per-head linear bias that the fused kernel adds to the
scores itself, so here it is only the slopes.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class Embeddings(nn.Module):
    """Token embeddings scaled by sqrt(d_model), as in "Attention Is All You Need" (section 3.4)."""

    def __init__(self, vocab_size: int, d_model: int, padding_idx=None, scale: bool = True):
        super().__init__()
        self.d_model = d_model
        self.lut = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
        self.scale = math.sqrt(d_model) if scale else 1.0

    @property
    def weight(self) -> Tensor:
        return self.lut.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lut(tokens) * self.scale  # (B, S, d_model)


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)),  PE[pos, 2i+1] = cos(pos / 10000^(2i/d)).  (max_len, d)"""
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    inv = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)[:, : d_model // 2]
    return pe.float()


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal table to x (B, S, d_model), starting at position `offset`."""

    def __init__(self, d_model: int, max_len: int = 4096, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pe", sinusoidal_table(max_len, d_model), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        s = x.shape[1]
        if offset + s > self.pe.shape[0]:
            raise ValueError(f"sequence of {offset + s} positions exceeds max_len={self.pe.shape[0]}")
        return self.dropout(x + self.pe[offset: offset + s].to(x.dtype))


class LearnedPositionalEmbedding(nn.Module):
    """Adds a trained (max_len, d_model) table to x (B, S, d_model), starting at position `offset`."""

    def __init__(self, d_model: int, max_len: int = 1024, dropout: float = 0.0):
        super().__init__()
        self.max_len = max_len
        self.wpe = nn.Embedding(max_len, d_model)
        self.dropout = nn.Dropout(dropout)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, x: Tensor, offset=0) -> Tensor:
        """offset: an int, a (B,) tensor of per-sequence first positions (batched ragged decode), or
        a (B, S) tensor of every row's position (packed prefill)."""
        s = x.shape[1]
        if isinstance(offset, Tensor):
            pos = offset.long() if offset.dim() == 2 else offset.long()[:, None] + torch.arange(s, device=x.device)  # (B, S)
            if int(pos.max()) >= self.max_len:
                raise ValueError(f"sequence of {int(pos.max()) + 1} positions exceeds max_len={self.max_len}")
            return self.dropout(x + self.wpe(pos))
        if offset + s > self.max_len:
            raise ValueError(f"sequence of {offset + s} positions exceeds max_len={self.max_len}")
        pos = torch.arange(offset, offset + s, device=x.device)
        return self.dropout(x + self.wpe(pos))


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al.): rotates channel pair i by the angle pos * base^(-2i/D). The pairs are
    (x[i], x[i + D/2]), the GPT-NeoX / Llama layout.

    q·k after rotation depends only on the relative position, so it composes with any kernel.
    Applied to (B, S, H, D) tensors; `offset` is the position of the first row (KV-cache decode).
    The cos / sin tables are float32, computed in float64 from (head_dim, base) alone, and stay
    float32 through a module-wide dtype cast (model.to(torch.bfloat16)), which rebuilds them:
    angles of frequencies rounded to bf16 would be far off at long positions.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, max_len: int = 4096):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        self._build(max_len)

    def _build(self, n: int, device=None) -> None:
        device = device if device is not None else (self.cos.device if hasattr(self, "cos") else None)
        inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim)
        ang = torch.outer(torch.arange(n, dtype=torch.float64, device=device), inv_freq)  # (n, D/2)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:  # a dtype cast: the float32 tables again, on the new device
            self._build(self.cos.shape[0], self.cos.device)
        return self

    def forward(self, x: Tensor, offset=0) -> Tensor:
        """offset: an int, a (B,) tensor of per-sequence first positions (batched ragged decode), or
        a (B, S) tensor of every row's position (packed prefill)."""
        s = x.shape[1]
        if isinstance(offset, Tensor):
            pos = offset.long() if offset.dim() == 2 else offset.long()[:, None] + torch.arange(s, device=x.device)  # (B, S)
            if int(pos.max()) >= self.cos.shape[0]:
                self._build(max(2 * self.cos.shape[0], int(pos.max()) + 1))
            cos = self.cos[pos].to(x.dtype)[:, :, None, :]  # (B, S, 1, D/2)
            sin = self.sin[pos].to(x.dtype)[:, :, None, :]
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if offset + s > self.cos.shape[0]:
            self._build(max(2 * self.cos.shape[0], offset + s))
        cos = self.cos[offset: offset + s].to(x.dtype)[None, :, None, :]  # (1, S, 1, D/2)
        sin = self.sin[offset: offset + s].to(x.dtype)[None, :, None, :]
        x1, x2 = x.chunk(2, dim=-1)  # (B, S, H, D/2) each
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi slopes (Press et al.): the geometric sequence 2^(-8/n), 2^(-16/n), ... for n a power
    of two; otherwise the slopes of the next lower power of two, then every other slope of the
    next higher one (the paper's reference code). Returns (n_heads,) float32."""

    def pow2(n: int):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        s = pow2(n_heads)
    else:
        low = 2 ** math.floor(math.log2(n_heads))
        s = pow2(low) + pow2(2 * low)[0::2][: n_heads - low]
    return torch.tensor(s, dtype=torch.float32)
