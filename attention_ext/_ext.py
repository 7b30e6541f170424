"""The compiled extension, attention_ext._C, loaded once for every family.

Importing it registers the custom ops (torch.ops.attention_ext.*, schemas in csrc/). When it is
missing, `HAS_EXT` is False, `IMPORT_ERROR` says why, and the functional layers run the
pure-PyTorch references instead, with a warning.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.attention_ext)

    HAS_EXT = True
    IMPORT_ERROR: Optional[BaseException] = None
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    _C = None
    HAS_EXT = False
    IMPORT_ERROR = e
    warnings.warn(
        f"attention_ext: compiled kernels not available ({e}); falling back to the pure-PyTorch reference",
        RuntimeWarning,
        stacklevel=2,
    )


def registered(op: str, dispatch_key: str) -> bool:
    """True when the extension registers a kernel of `op` ("attention_ext::fwd") for
    `dispatch_key` ("CPU", "CUDA")."""
    return HAS_EXT and torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)


def empty_cpu_cache() -> int:
    """Frees the CPU output blocks the kernels keep for reuse and returns their bytes.

    Outputs of 2 MB and up (the linear family's) come from huge-page blocks that are kept after
    the tensor dies, up to 1 GiB, so the next call of the same size skips the page faults
    (csrc/torch/alloc.h). Like torch.cuda.empty_cache(), this hands them back to the OS."""
    return int(torch.ops.attention_ext.empty_cpu_cache()) if HAS_EXT else 0
