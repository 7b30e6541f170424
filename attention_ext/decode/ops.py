"""Tier 1 of the decode family: the registered op torch.ops.attention_ext.decode_fwd (schema,
checks and Meta kernel in C++: csrc/torch/decode_binding.*, decode_cpu.cpp), its autograd
layer, and a keyword wrapper that falls back to the reference where no compiled kernel serves
the device. Forward only: a KV cache is inference
state (flash-attn's flash_attn_with_kvcache has no backward either)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._args import not_a_tensor
from .._ext import HAS_EXT, registered
from .._dtypes import DTYPES, acc_dtype
from . import reference
from .quant import is_quantized

_KERNELS = {dev: registered("attention_ext::decode_fwd", key) for dev, key in (("cpu", "CPU"), ("cuda", "CUDA"))}


def has_kernel(device: torch.device, dtype: Optional[torch.dtype] = None) -> bool:
    """True when a compiled decode kernel serves `device` (and `dtype`)."""
    if not _KERNELS.get(device.type, False):
        return False
    return dtype is None or (dtype in DTYPES and (dtype != torch.float64 or device.type == "cpu"))


if HAS_EXT:

    def _no_backward(ctx, dout, dlse):
        raise RuntimeError("attention_ext.decode_fwd has no backward (a KV cache is inference state, as flash-attn's "
                           "flash_attn_with_kvcache): run decoding under torch.no_grad(), or train through "
                           "attention_ext.attention")

    # An autograd kernel that refuses the backward: without one torch's fallback let a backward run
    # through the op with a deprecation warning and no gradient for q or the caches
    torch.library.register_autograd("attention_ext::decode_fwd", _no_backward)


# ---------------------------------------------------------------------------------- kernel selection
_cuda_kernels = dict(tensor_cores=False, quantized=False)


def set_cuda_kernels(tensor_cores: bool = False, quantized: bool = False) -> dict:
    """Process-wide: which CUDA decode kernel runs.

        tensor_cores  False (the default): the CUDA-core kernel for every call. True: the
                      tensor-core kernel (mma.sync, a cp.async pipeline per warp; docs/gpu.md) for
                      fp16 / bf16 calls whose cache rows are 16-byte aligned with a head dim that
                      is a multiple of 8; the others keep the CUDA-core kernel. It has passed the
                      CPU emulator only, no GPU run yet, so it is not the default.
        quantized     False (the default): decode_fwd / flash_attn_with_kvcache run int8 / fp8 e4m3
                      caches on CUDA through the dequantized PyTorch reference. True: the
                      CUDA-core kernel reads them (8-byte vectors widened in registers, the
                      descales on scores and probabilities); emulator-checked, no GPU run yet.
                      (torch.ops.attention_ext.decode_fwd refuses such caches on CUDA without it.)

    Returns the previous selection, so that `set_cuda_kernels(**old)` restores it."""
    new = dict(tensor_cores=bool(tensor_cores), quantized=bool(quantized))
    if HAS_EXT:
        torch.ops.attention_ext.decode_set_cuda_kernels(new["tensor_cores"], new["quantized"])
    old = dict(_cuda_kernels)
    _cuda_kernels.update(new)
    return old


def cuda_kernels() -> dict:
    """The current selection of set_cuda_kernels (its keyword)."""
    return dict(_cuda_kernels)


def check_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cache_seqlens: Optional[Tensor] = None,
                 block_table: Optional[Tensor] = None, cache_batch_idx: Optional[Tensor] = None,
                 cache_leftpad: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                 sinks: Optional[Tensor] = None, scale: float, softcap: float = 0.0, window_left: int = -1,
                 window_right: int = -1, num_splits: int = 0, k_descale: Optional[Tensor] = None,
                 v_descale: Optional[Tensor] = None) -> None:
    """decode_fwd's input rules (the op's, in C++: shapes, dtypes, devices, scalars; not the index
    values) on its arguments, computing nothing: for callers that must check before they act (the
    reference fallback; flash_attn_with_kvcache before it appends to the caches). No-op without
    the extension."""
    if HAS_EXT:
        torch.ops.attention_ext.decode_check(
            q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), cache_seqlens, block_table,
            cache_batch_idx, cache_leftpad, alibi_slopes, sinks, float(scale), float(softcap), int(window_left),
            int(window_right), int(num_splits), k_descale, v_descale)


def decode_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cache_seqlens: Optional[Tensor] = None,
               block_table: Optional[Tensor] = None, cache_batch_idx: Optional[Tensor] = None,
               cache_leftpad: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
               sinks: Optional[Tensor] = None, scale: float, softcap: float = 0.0, window_left: int = -1,
               window_right: int = -1, num_splits: int = 0, k_descale: Optional[Tensor] = None,
               v_descale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Decode attention in flash-attn's layout: q (B, Sq, H, D); k_cache / v_cache (B_cache,
    S_cache, H_k, D), or paged (num_pages, page_size, H_k, D) with block_table (B, max_pages)
    int32. Index tensors are int32 on q's device. Returns out (B, Sq, H, D) and lse (B, H, Sq)
    float32 (float64 for float64 inputs). num_splits: key splits per (batch, kv head), 0 = the
    kernel's heuristic. int8 / float8_e4m3fn caches (q float32 / float16 / bfloat16) come with
    float32 k_descale and v_descale (cache value = stored value x descale): per row (B_cache,
    S_cache, H_k) / (num_pages, page_size, H_k), or per batch entry and kv head (B, H_k)
    (decode.quantize_kv makes either); the CPU kernel reads them directly, CUDA through the
    dequantized reference unless set_cuda_kernels(quantized=True)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t, "decode_fwd")
        if t.dim() != 4:  # this function's layout (the op's rules name its own, transposed)
            dims = "B, Sq, H, D" if name == "q" else "B_cache, S_cache, H_k, D"
            raise ValueError(f"decode_fwd: {name} must be 4-D ({dims}), got shape {tuple(t.shape)}")
    quantized = is_quantized(k_cache) or is_quantized(v_cache)
    if has_kernel(q.device, q.dtype) and (not quantized or q.device.type == "cpu" or _cuda_kernels["quantized"]):
        out, lse = torch.ops.attention_ext.decode_fwd(
            q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), cache_seqlens, block_table,
            cache_batch_idx, cache_leftpad, alibi_slopes, sinks, float(scale), float(softcap), int(window_left),
            int(window_right), int(num_splits), k_descale, v_descale)
        return out.transpose(1, 2), lse
    # the reference below states no input rules of its own: the op's (C++) run first
    check_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                 cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes, sinks=sinks,
                 scale=scale, softcap=softcap, window_left=window_left, window_right=window_right,
                 num_splits=num_splits, k_descale=k_descale, v_descale=v_descale)
    acc = acc_dtype(q.dtype)
    out, lse = reference.decode_attention(
        q.to(acc), k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, softmax_scale=scale,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        k_descale=k_descale, v_descale=v_descale)
    return out.to(q.dtype), lse
