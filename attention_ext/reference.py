"""Pure-PyTorch definitions of every op: the test oracle and the CPU fallback.

A facade over the families' references (attention_ext/<family>/reference.py), so that
`attention_ext.reference.attention` names the softmax family's definition and
`attention_ext.reference.linear_attention` the linear family's.
"""
from .linear.reference import linear_attention
from .softmax.reference import (alibi_bias, attention, attention_probs, attention_qk_int8, attention_qk_quant,
                                attention_varlen, mask_structure, qk_quant_scores)

__all__ = ["alibi_bias", "attention", "attention_probs", "attention_qk_int8", "attention_qk_quant", "attention_varlen",
           "linear_attention", "mask_structure", "qk_quant_scores"]
