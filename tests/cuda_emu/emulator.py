"""Builds (JIT, cached in build/emu) and loads the host emulator of the CUDA kernels:
torch.ops.attention_ext_emu.fwd / bwd / path and linear_fwd / linear_bwd (this folder), and, as
separate small modules: torch.ops.attention_ext_emu_decode.decode_fwd (load_decode) and
torch.ops.attention_ext_emu_delta.delta_fwd / delta_step (load_delta).

The emulator compiles csrc/softmax/cuda's mma.sync, SIMT and (sm_90) wgmma kernels with g++ (ATTN_CUDA_EMULATE), with
the real CUDA headers for the half / bfloat16 types (so it needs a CUDA toolkit's include
directory, not a GPU). load() returns None, with the reason in `why`, when that cannot work.
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager

import torch

EMU = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(EMU))
BUILD = os.path.join(ROOT, "build", "emu")

why = ""
build_seconds = None


def cuda_include() -> str | None:
    from torch.utils import cpp_extension

    for home in (os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME, "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_fp16.h")):
            return os.path.join(home, "include")
    return None


_ops = None


def _toolchain():
    """(the CUDA include dir, None) when the emulator can be built here, else (None, why not)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return None, "no C++ compiler"
    inc = cuda_include()
    if inc is None:
        return None, "no CUDA headers (cuda_fp16.h) for the emulator's half / bfloat16 types"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return None, "no ninja (torch's JIT extension build needs it)"
    return inc, None


# the linear selection (chunk_parallel, segment_chunks) the compiled dispatch starts with
initial_linear_kernels = None


def load():
    """torch.ops.attention_ext_emu, built on first use; None (see `why`) without a toolchain."""
    global _ops, why, build_seconds, initial_linear_kernels
    if _ops is not None:
        return _ops
    inc, why_not = _toolchain()
    if inc is None:
        why = why_not
        return None
    from torch.utils import cpp_extension

    os.makedirs(BUILD, exist_ok=True)
    t0 = time.time()
    cpp_extension.load(
        name="attention_ext_emu",
        sources=[os.path.join(EMU, f) for f in
                 ("emu_binding.cpp", "emu_runtime.cpp", "emu_kernels_sm80.cpp", "emu_kernels_sm90.cpp")]
        # tensors -> params, as in _C
        + [os.path.join(ROOT, "csrc", "torch", f) for f in ("softmax_binding.cpp", "linear_binding.cpp",
                                                             "block_index.cpp")],
        # -O1: the kernels' unrolled loops stay cheap to compile and the emulation is still fast
        extra_cflags=["-O1", "-std=c++20", "-DATTN_CUDA_EMULATE", "-Wno-unknown-pragmas",
                      "-I" + os.path.join(EMU, "target"), "-I" + os.path.join(ROOT, "csrc"), "-I" + EMU,
                      "-I" + inc],
        build_directory=BUILD,
        is_python_module=False,
        verbose=os.environ.get("ATTENTION_EXT_EMU_VERBOSE") == "1",
    )
    build_seconds = time.time() - t0
    _ops = torch.ops.attention_ext_emu
    initial_linear_kernels = tuple(_ops.linear_cuda_kernels())  # dispatch.cu's default, before any test sets it
    return _ops


def _load_module(tag: str, sources, torch_sources):
    """torch.ops.attention_ext_emu_<tag>, a small emulator module of its own (one family's
    kernels, no arch-specific code: one sm_80 build stands for both archs), built on first use
    into build/emu_<tag>. Its runtime copy is renamed (attn_emu -> attn_emu_<tag>) so every
    module loads into one process. Returns (ops, build seconds), or (None, None) (see `why`)."""
    global why
    inc, why_not = _toolchain()
    if inc is None:
        why = why_not
        return None, None
    from torch.utils import cpp_extension

    build = BUILD + "_" + tag
    os.makedirs(build, exist_ok=True)
    t0 = time.time()
    cpp_extension.load(
        name="attention_ext_emu_" + tag,
        sources=[os.path.join(EMU, f) for f in sources] + [os.path.join(ROOT, "csrc", "torch", f) for f in torch_sources],
        extra_cflags=["-O1", "-std=c++20", "-DATTN_CUDA_EMULATE", "-Dattn_emu=attn_emu_" + tag,
                      "-Wno-unknown-pragmas", "-I" + os.path.join(EMU, "target"), "-I" + os.path.join(ROOT, "csrc"), "-I" + EMU,
                      "-I" + inc],
        build_directory=build,
        is_python_module=False,
        verbose=os.environ.get("ATTENTION_EXT_EMU_VERBOSE") == "1",
    )
    return getattr(torch.ops, "attention_ext_emu_" + tag), time.time() - t0


_decode_ops = None
decode_build_seconds = None


def load_decode():
    """torch.ops.attention_ext_emu_decode (the CUDA decode kernels, csrc/decode/cuda), built on
    first use; None (see `why`) without a toolchain. A module of its own (_load_module): the
    decode kernels need neither the softmax instantiations nor a second arch."""
    global _decode_ops, decode_build_seconds
    if _decode_ops is None:
        _decode_ops, decode_build_seconds = _load_module(
            "decode", ("emu_decode_binding.cpp", "emu_runtime.cpp", "emu_decode_kernels.cpp"),
            ("decode_binding.cpp", "softmax_binding.cpp"))
    return _decode_ops


_delta_ops = None
delta_build_seconds = None


def load_delta():
    """torch.ops.attention_ext_emu_delta (the delta rule's CUDA kernel, csrc/linear/cuda/delta.cu),
    built on first use; None (see `why`) without a toolchain."""
    global _delta_ops, delta_build_seconds
    if _delta_ops is None:
        _delta_ops, delta_build_seconds = _load_module(
            "delta", ("emu_delta_binding.cpp", "emu_runtime.cpp", "emu_delta_kernels.cpp"),
            ("linear_delta_binding.cpp",))
    return _delta_ops


@contextmanager
def capture(ops):
    """Inside the block, the emulated host steps of `ops` (load() or load_decode()) act as under a
    CUDA-graph capture (what torch.cuda.is_current_stream_capturing() tells the real binding):
    no host read of device values, cached or clamped indices instead."""
    ops.set_capturing(True)
    try:
        yield
    finally:
        ops.set_capturing(False)
