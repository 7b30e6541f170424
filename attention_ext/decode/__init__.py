"""The decode family: attention of a few new query rows over a (paged) KV cache.

    decode_fwd(q, k_cache, v_cache, cache_seqlens=..., block_table=...)   the op (ops.py)
    reference.decode_attention                                             the float64 oracle
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, ...)                flash-attn's drop-in (kvcache.py)
    set_cuda_kernels(tensor_cores=False) / cuda_kernels()                 the CUDA kernel selection
    quantize_kv(x, dtype=torch.int8, granularity="token")                 8-bit caches (quant.py)
"""
from . import kvcache, ops, quant, reference
from .kvcache import flash_attn_with_kvcache
from .ops import cuda_kernels, decode_fwd, has_kernel, set_cuda_kernels
from .quant import dequantize_kv, quantize_kv

__all__ = ["cuda_kernels", "decode_fwd", "dequantize_kv", "flash_attn_with_kvcache", "has_kernel", "kvcache", "ops",
           "quant", "quantize_kv", "reference", "set_cuda_kernels"]
