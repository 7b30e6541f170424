"""attention_ext: fused attention kernels for PyTorch (CPU SIMD + CUDA tensor cores).

    import attention_ext as ae
    out = ae.attention(q, k, v, causal=True)                     # every option
    out = ae.scaled_dot_product_attention(q, k, v, is_causal=True)  # SDPA drop-in
    out = ae.flash_attn_func(q, k, v, causal=True)               # flash-attn drop-in
    out = ae.linear_attention(q, k, v, causal=True)              # linearized attention
    out = ae.delta_rule_attention(q, k, v, beta, gate=g)         # (Gated) DeltaNet, KDA
    out = ae.block_sparse_attention(q, k, v, layout)             # block-sparse (attention_ext.sparse)
    out = ae.lsh_attention(qk, v, n_buckets=8)                   # Reformer's LSH attention
    out = ae.linformer_attention(q, k, v, proj_k)                # Linformer
    ae.nn.MultiheadAttention(...), ae.models.LanguageModel(...)   # modules and models

One subpackage per kernel family (softmax, linear; each with ops.py, functional.py, reference.py),
compat/ for the drop-ins, nn/ and models/ on top (imported on first use).
"""
import importlib

__version__ = "0.1.0"

from . import decode, linear, reference, softmax, sparse  # noqa: E402  (the families' ops.py attach fakes and autograd)
from .compat import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    scaled_dot_product_attention,
)
from ._ext import cpu_isa, cpu_isas, empty_cpu_cache, set_cpu_isa  # noqa: E402
from .linear import (  # noqa: E402
    LinearAttentionState,
    delta_rule_attention,
    delta_rule_step,
    linear_attention,
    linear_attention_step,
)
from .softmax import attention, attention_weights, dropout_mask, linformer_attention  # noqa: E402
from .sparse import block_sparse_attention, lsh_attention, topk_attention  # noqa: E402

# subpackages imported on first attribute access: `import attention_ext` stays light
_LAZY = ("nn", "models", "viz", "demo", "bench", "distributed")

__all__ = [
    "attention",
    "attention_weights",
    "scaled_dot_product_attention",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "dropout_mask",
    "empty_cpu_cache",
    "cpu_isa",
    "cpu_isas",
    "set_cpu_isa",
    "linear_attention",
    "linear_attention_step",
    "LinearAttentionState",
    "delta_rule_attention",
    "delta_rule_step",
    "block_sparse_attention",
    "topk_attention",
    "linformer_attention",
    "lsh_attention",
    "reference",
    "softmax",
    "linear",
    "sparse",
    "decode",
    "nn",
    "models",
]


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
