"""The decode family: attention of a few new query rows over a (paged) KV cache.

    decode_fwd(q, k_cache, v_cache, cache_seqlens=..., block_table=...)   the op (ops.py)
    reference.decode_attention                                             the float64 oracle
"""
from . import ops, reference
from .ops import decode_fwd, has_kernel

__all__ = ["decode_fwd", "has_kernel", "ops", "reference"]
