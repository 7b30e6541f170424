"""The softmax attention family: fused softmax attention with every variant (causal, sliding
window, masks, ALiBi, softcap, sinks, dropout, MQA / GQA, variable-length packs).

    ops         tier 1: the custom ops, their fake kernels and autograd; set_cuda_kernels
    functional  tier 2: attention(), attention_varlen(), attention_weights()
    linformer   linformer_attention(): k and v projected along the sequence, then the fused op
    reference   the pure-PyTorch definition: the test oracle and the fallback
"""
from . import ops, reference
from .functional import attention, attention_varlen, attention_weights
from .linformer import linformer_attention
from .ops import cuda_kernels, dropout_mask, set_cuda_kernels

__all__ = ["attention", "attention_varlen", "attention_weights", "linformer_attention", "dropout_mask", "set_cuda_kernels", "cuda_kernels",
           "ops", "reference"]
