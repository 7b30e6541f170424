"""8-bit KV caches: int8 and float8_e4m3fn storage with float32 descales (cache value = stored
value x descale), the form decode_fwd and flash_attn_with_kvcache read.

    quantize_kv(x, dtype=torch.int8, granularity="token")  -> (x_q, descale)
    dequantize_kv(x_q, descale)                               -> float32 (the reference's view)

Granularity: "token", one scale per (row, kv head): descale (B, S, H_k) for x (B, S, H_k, D),
amax over D / the type's largest value (127 for int8, 448 for e4m3); "head", one per (sequence,
kv head): descale (B, H_k), amax over S and D (flash-attn 3's fp8 descale shape). int8 rounds to
nearest even; fp8 by torch's cast (nearest even). A zero row gets scale 0 and stores zeros (and
rows appended later under a per-head scale of 0 are refused: use "token" for a cache that starts
empty). A paged pool (num_pages, page_size, H_k, D) takes "token": "head" would give one scale per
page, while decode reads per-head scales per sequence.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .._args import not_a_tensor

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


# what a KV cache may store: the attention dtypes, or 8 bits with float32 descales
CACHE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, *QMAX)


def check_cache_dtype(dtype, who: str) -> None:
    """A TypeError naming `dtype` unless a cache may store it (CACHE_DTYPES): an integer or other
    8-bit type would take appended values with a wrapping or missing conversion."""
    if dtype not in CACHE_DTYPES:
        raise TypeError(f"{who}: dtype must be a floating type (float32, float16, bfloat16, float64) or an 8-bit "
                        f"cache type (torch.int8, torch.float8_e4m3fn), got {dtype}")


def is_quantized(t: Tensor) -> bool:
    return isinstance(t, Tensor) and t.dtype in QMAX


def quantize_rows(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """x / scale (scale broadcast to x, 0 where the rows are 0) saturated into `dtype`."""
    qmax = QMAX[dtype]
    y = x.float() / torch.where(scale == 0, torch.ones_like(scale), scale)
    y = y.clamp(-qmax, qmax)
    return y.round().to(dtype) if dtype == torch.int8 else y.to(dtype)


def quantize_kv(x: Tensor, dtype: torch.dtype = torch.int8, granularity: str = "token") -> Tuple[Tensor, Tensor]:
    """(x_q, descale) for a cache x (B, S, H_k, D) (flash-attn's layout; paged pools
    (num_pages, page_size, H_k, D) alike): module docstring."""
    if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"quantize_kv: x must be a floating (B, S, H_k, D) tensor, got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if dtype not in QMAX:
        raise ValueError(f"quantize_kv: dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    if granularity not in ("token", "head"):
        raise ValueError(f"quantize_kv: granularity must be 'token' or 'head', got {granularity!r}")
    if x.numel() == 0:  # amax over an empty dim has no identity in torch: the scales of nothing are 0
        shape = x.shape[:3] if granularity == "token" else (x.shape[0], x.shape[2])
        return torch.empty(x.shape, dtype=dtype, device=x.device), torch.zeros(shape, dtype=torch.float32,
                                                                               device=x.device)
    if granularity == "token":
        amax = x.detach().float().abs().amax(-1)  # (B, S, H_k)
        scale = amax / QMAX[dtype]
        return quantize_rows(x, scale[..., None], dtype), scale.contiguous()
    if granularity == "head":
        amax = x.detach().float().abs().amax(dim=(1, 3))  # (B, H_k)
        scale = amax / QMAX[dtype]
        return quantize_rows(x, scale[:, None, :, None], dtype), scale.contiguous()


def dequantize_kv(x_q: Tensor, descale: Tensor) -> Tensor:
    """float32 x_q * descale: descale (B, S, H_k) per row or (B, H_k) per sequence."""
    for name, t in (("x_q", x_q), ("descale", descale)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t, "dequantize_kv")
    if x_q.dim() != 4:
        raise ValueError(f"dequantize_kv: x_q must be 4-D (B, S, H_k, D) as quantize_kv returns it, got shape "
                         f"{tuple(x_q.shape)}")
    # any other shape would broadcast into the wrong rows (or a larger result) without an error
    per_row, per_seq = tuple(x_q.shape[:3]), (x_q.shape[0], x_q.shape[2])
    if tuple(descale.shape) not in (per_row, per_seq):
        raise ValueError(f"dequantize_kv: descale must be per row (B, S, H_k) = {per_row} or per sequence "
                         f"(B, H_k) = {per_seq} for x_q {tuple(x_q.shape)} (the descale quantize_kv returned "
                         f"with it), got {tuple(descale.shape)}")
    if descale.dim() == 3:
        return x_q.float() * descale[..., None]
    return x_q.float() * descale[:, None, :, None]
