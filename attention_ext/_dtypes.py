"""The dtype rules every family's Python side shares: the input dtypes the kernels take, the
accumulation dtype of the float side tensors, and c10's dtype names as the C++ messages print
them (the C++ side: csrc/torch/tensor_rules.h)."""
from __future__ import annotations

import torch

# the input dtypes the kernels take; float64 has a CPU kernel only
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the float side tensors (lse, additive bias, ALiBi slopes, sinks, states and
    their gradients) for inputs of `dtype`: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """c10's name of `dtype` (Float, Half, BFloat16, Long, ...), as the C++ messages print it."""
    try:
        return torch.empty(0, dtype=dtype).type().rsplit(".", 1)[-1].removesuffix("Tensor")
    except (RuntimeError, TypeError):
        return str(dtype)


def shape_of(t: torch.Tensor) -> list:
    """t's shape as a list, as the C++ messages print sizes."""
    return list(t.shape)
