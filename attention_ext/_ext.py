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

    # a library built from older sources (an in-place build the checkout moved past) lacks ops
    # this Python calls: say so here, once, rather than fail on the first missing name
    if not hasattr(torch.ops.attention_ext, "softmax_fwd_routed"):
        raise ImportError("attention_ext._C was built from older sources (it has no op softmax_fwd_routed): "
                          "rebuild it (./dev.sh build, or pip install --no-build-isolation -e .)")

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
    """True when the extension registers a kernel of `op` ("attention_ext::softmax_fwd") for
    `dispatch_key` ("CPU", "CUDA")."""
    return HAS_EXT and torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)


def refuse_double_backward(op: str, what: str, twice: str) -> None:
    """Give the backward op `op` ("attention_ext::softmax_bwd") an autograd that raises: a second
    backward through the gradients (create_graph=True: a gradient penalty, gradgradcheck) would
    otherwise go through an op with no derivative, which torch answers with zeros and a warning.
    `what` names the backward in the message, `twice` the PyTorch form that differentiates twice."""
    def refuse(ctx, *grads):
        raise RuntimeError(f"attention_ext: the {what} backward has no derivative (double backward, e.g. a gradient "
                           f"penalty through create_graph=True or gradgradcheck, is not supported); {twice} is "
                           f"differentiable twice")

    torch.library.register_autograd(op, refuse, setup_context=lambda ctx, inputs, output: None)


def call_below_autograd(op, args) -> tuple:
    """op(*args) for a call with nothing to differentiate: straight to the device kernel below the
    Autograd key, which is what a registered Python autograd layer would do itself, without its
    Python (a pytree walk over every argument, most of a small call's fixed cost:
    benchmarks/results/2026-11-29-newcomer-cpu-zen5.md).
    torch.compile and functorch transforms keep the full dispatch. The one home of that rule."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def eager_autograd(name: str, setup_context, backward) -> type:
    """An autograd.Function that is an op's registered autograd (`setup_context(ctx, inputs,
    output)` and `backward(ctx, *grads)`, as given to torch.library.register_autograd) for eager
    calls: `.apply(op, *args)` runs the op below the Autograd key, then the same setup_context, and
    its backward is the same backward. torch's generated layer rebuilds the op schema's argument
    list for every argument it fills in (torch._library.utils.fill_defaults reads
    `schema.arguments`, a fresh list of pybind objects, once per argument: quadratic in the
    argument count), 30-250 us of every differentiable call of the families' ops
    (benchmarks/results/2026-12-02-eager-autograd-overhead.md). call_autograd picks it."""
    def forward(ctx, op, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = op(*args)
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[1:]  # as the op's own inputs (op is the first here)
        try:
            setup_context(ctx, args, output)
        finally:
            ctx.needs_input_grad = needs
        return output

    def backward_(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[1:]
        try:
            return (None, *backward(ctx, *grads))
        finally:
            ctx.needs_input_grad = needs

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward_)})


def call_autograd(op, args, fn: type, grad: bool):
    """op(*args), `grad` saying whether autograd records it (grad mode on and a tensor argument
    requiring grad): below the Autograd key when not; through `fn` (eager_autograd's Function of
    the op's registered autograd) in eager mode; the op's full dispatch, whose registered layer
    torch.compile and functorch transforms see, else."""
    if not grad:
        return call_below_autograd(op, args)
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return op(*args)
    return fn.apply(op, *args)


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream: no host reads of
    tensor values then (a sync), and no host values that a replay would repeat. The C++ host
    steps ask the same of their device (csrc/torch/cuda_device.h).

    While torch.compile traces, False: Dynamo cannot put the query (a host bool) in a graph
    (asking once broke `fullgraph=True` on a GPU); the ops' own host steps ask again when the
    compiled graph runs."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return False
    return torch.cuda.is_current_stream_capturing()


def empty_cpu_cache() -> int:
    """Frees the CPU output blocks the kernels keep for reuse and returns their bytes.

    Outputs of 2 MB and up (the linear family's) come from huge-page blocks that are kept after
    the tensor dies, up to 1 GiB, so the next call of the same size skips the page faults
    (csrc/torch/alloc.h). Like torch.cuda.empty_cache(), this hands them back to the OS."""
    return int(torch.ops.attention_ext.empty_cpu_cache()) if HAS_EXT else 0


def cpu_isa() -> str:
    """The ISA level the CPU kernels run now: "base" (any x86-64), "avx2" (AVX2 + FMA),
    "avx2vnni" (avx2 with AVX-VNNI in the int8 Q.K^T), "avx512" (AVX-512 F/BW/VL/DQ), "avx512vnni"
    (avx512 with VNNI in the int8 Q.K^T), "avx512bf16" (+ BF16 and VNNI), "avx512amx" (avx512bf16
    with AMX tiles in the bf16 and int8 products) or "native" (a build with
    ATTENTION_EXT_NATIVE=1); "none" without the extension. The default is the highest level this
    build has and this CPU runs."""
    return _C.cpu_isa() if HAS_EXT else "none"


def cpu_isas(all: bool = False) -> tuple:
    """The ISA levels this build has that this CPU runs, lowest first (all=True: every level
    built, runnable here or not)."""
    return tuple(x for x in _C.cpu_isas(bool(all)).split(",") if x) if HAS_EXT else ()


def set_cpu_isa(isa: Optional[str]) -> str:
    """Process-wide: runs the CPU kernels at ISA level `isa` (one of cpu_isas()), e.g. "base" to
    check or time the portable path on a machine that has AVX2; None restores the default (the
    highest level this CPU runs). Raises ValueError for a level this build lacks or this CPU
    cannot run. Returns the previous level, so that set_cpu_isa(old) restores it."""
    old = cpu_isa()
    if not HAS_EXT:
        raise ValueError("attention_ext.set_cpu_isa: the compiled extension is not available")
    if isa is not None and not isinstance(isa, str):
        raise TypeError(f"attention_ext.set_cpu_isa: isa must be a str or None, got {type(isa).__name__}")
    _C.set_cpu_isa(isa)
    return old


@torch.compiler.assume_constant_result
def delta_chunk_takes(chunked: int, dtype: torch.dtype, k: int, v: int, per_key: bool, plain: bool, s: int,
                      backward: bool) -> bool:
    """Whether the CUDA delta-rule chunk kernels (the forward, or with `backward` the backward) run
    a call of this dtype and these sizes under the selection `chunked` (-1 auto, 0 never, 1 every
    call they take): the C++ rule
    (csrc/common/delta_params.h delta_chunk_takes). False without the extension."""
    if not HAS_EXT:
        return False
    return bool(_C.delta_chunk_takes(int(chunked), str(dtype).replace("torch.", ""), int(k), int(v), bool(per_key),
                                     bool(plain), int(s), bool(backward)))
