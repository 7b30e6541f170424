"""nn modules built on the fused attention kernels (tier 3 of the Python layer)."""
from .blocks import BlockConfig, DecoderBlock, EncoderBlock, FeedForward, RMSNorm, make_norm
from .classic import AdditiveAttention, LuongAttention
from .layers import (ATTENTION_MODULES, ATTENTION_TYPES, Attention, AttentionConfig, KVCache, allocate_cache,
                     make_attention, register_attention_type)
from .paged_cache import PagedKVCache
from .linear import LinearAttention, LinearCache
from .delta import DeltaCache, GatedDeltaNet
from .linformer import LinformerAttention
from .lsh import LSHAttention
from .multihead import MultiheadAttention
from .sparse import SparseAttention
from .positional import (Embeddings, LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding,
                         alibi_slopes, sinusoidal_table)

__all__ = [
    "MultiheadAttention",
    "Attention", "AttentionConfig", "KVCache", "PagedKVCache", "ATTENTION_TYPES", "register_attention_type",
    "ATTENTION_MODULES", "make_attention", "allocate_cache", "LinearAttention", "LinearCache",
    "GatedDeltaNet", "DeltaCache",
    "SparseAttention", "LinformerAttention", "LSHAttention",
    "AdditiveAttention", "LuongAttention",
    "Embeddings", "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding", "RotaryEmbedding",
    "alibi_slopes", "sinusoidal_table",
    "FeedForward", "RMSNorm", "make_norm", "BlockConfig", "EncoderBlock", "DecoderBlock",
]
