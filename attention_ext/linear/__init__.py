"""The linear attention family: kernelized attention phi(Q) (phi(K)^T V), causal (the chunked /
recurrent form, with optional decay gates) and non-causal, with fused and random feature maps.

    ops           tier 1: the custom ops linear_fwd / linear_bwd, their fake kernels and autograd;
                  set_cuda_kernels (the CUDA forward's schedule)
    functional    tier 2: linear_attention(), linear_attention_step(), LinearAttentionState
    feature_maps  elu / relu / identity (fused), favor, rfa, and the name registry
    reference     the pure-PyTorch definition: the test oracle, the fallback, the chunked peer
    delta         the delta rule (DeltaNet, Gated DeltaNet, KDA): delta_rule_attention,
                  delta_rule_step and their ops
"""
from . import delta, feature_maps, ops, reference
from .delta import delta_rule_attention, delta_rule_step
from .feature_maps import FeatureMap, get_feature_map, register_feature_map
from .functional import LinearAttentionState, linear_attention, linear_attention_step
from .ops import cuda_kernels, set_cuda_kernels

__all__ = ["linear_attention", "linear_attention_step", "LinearAttentionState", "FeatureMap", "register_feature_map",
           "get_feature_map", "feature_maps", "ops", "reference", "set_cuda_kernels", "cuda_kernels",
           "delta", "delta_rule_attention", "delta_rule_step"]
