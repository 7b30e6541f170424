"""Drop-ins that keep their originals' conventions exactly:

    sdpa        scaled_dot_product_attention (torch.nn.functional's: bool mask True = attend,
                is_causal aligned top-left)
    flash_attn  flash_attn_func and friends (flash-attn 2.x: (B, S, H, D), causal aligned
                bottom-right)
"""
from .flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                         flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .sdpa import scaled_dot_product_attention

__all__ = ["scaled_dot_product_attention", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_with_kvcache"]
