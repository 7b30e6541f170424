"""attention_ext: fused attention kernels for PyTorch (CPU SIMD + CUDA tensor cores).

    import attention_ext as ae
    out = ae.attention(q, k, v, causal=True)                     # every option
    out = ae.scaled_dot_product_attention(q, k, v, is_causal=True)  # SDPA drop-in
    out = ae.flash_attn_func(q, k, v, causal=True)               # flash-attn drop-in
"""
__version__ = "0.1.0"

from . import ops, reference  # noqa: E402  (ops registers the custom ops)
from .functional import (  # noqa: E402
    attention,
    attention_weights,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    scaled_dot_product_attention,
)
from .ops import dropout_mask  # noqa: E402

from . import functional  # noqa: E402

__all__ = [*functional.__all__, "dropout_mask", "reference", "ops"]
