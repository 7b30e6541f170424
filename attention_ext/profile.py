"""`python -m attention_ext profile`: one op of a family in a loop, each iteration inside ranges
named attention_ext/<family>/<variant> (fwd, bwd; the warm-up in attention_ext/<family>/warmup),
and on CUDA the ncu and nsys command lines that wrap this very invocation.

On CUDA the ranges are NVTX push / pop ranges nested three deep (attention_ext > family > variant):
ncu's --nvtx-include "attention_ext/softmax/fwd/" reads '/' as nesting, so it selects exactly the
kernels launched inside them, the C++ side's own ranges (attention_ext::softmax::fwd (CUDA), ...)
included, and nsys shows the same stack on its timeline. On the CPU the same names are
torch.profiler.record_function ranges and the loop runs under torch.profiler, whose table of the
heaviest ops is printed: the command works without a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
import time
from typing import Callable, Iterator, Optional, Tuple

import torch

from attention_ext.bench import (DTYPES, SPARSE_BLOCK, decode_bytes, flops, layout_pairs, linear_flops, machine_line,
                                 sparse_layout)

FAMILIES = ("softmax", "linear", "sparse", "decode")


@contextlib.contextmanager
def nvtx_range(family: str, variant: str, cuda: bool) -> Iterator[None]:
    """The range attention_ext/<family>/<variant>: nested NVTX push / pop on CUDA (one level per
    name, as ncu's --nvtx-include syntax reads '/'), a record_function on the CPU."""
    if cuda:
        for name in ("attention_ext", family, variant):
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            for _ in range(3):
                torch.cuda.nvtx.range_pop()
    else:
        with torch.profiler.record_function(f"attention_ext/{family}/{variant}"):
            yield


def build(family: str, b: int, h: int, hk: int, s: int, d: int, dtype: torch.dtype, device: str, causal: bool,
          backward: bool) -> Tuple[Callable[[], torch.Tensor], Tuple[torch.Tensor, ...], str, float]:
    """The op to profile on fresh inputs: (fwd, leaves, work unit, forward work). fwd() returns
    the output the backward differentiates; leaves are q, k, v when backward. Work: the shared
    FLOP formulas (flops / linear_flops), bytes of K / V (decode_bytes) for decode."""
    import attention_ext as ae

    if family == "decode":
        from attention_ext.decode import decode_fwd

        # q (B, 1, H, D) against a (B, S, H_k, D) cache of S keys, flash-attn's layout
        q = torch.randn(b, 1, h, d, dtype=dtype, device=device)
        kc, vc = (torch.randn(b, s, hk, d, dtype=dtype, device=device) for _ in range(2))
        lens = torch.full((b,), s, dtype=torch.int32, device=device)
        return (lambda: decode_fwd(q, kc, vc, cache_seqlens=lens, scale=d ** -0.5)[0]), (), "GB/s", \
            decode_bytes(b, hk, s, d, dtype)
    q = torch.randn(b, h, s, d, dtype=dtype, device=device, requires_grad=backward)
    k, v = (torch.randn(b, hk, s, d, dtype=dtype, device=device, requires_grad=backward) for _ in range(2))
    if family == "softmax":
        return (lambda: ae.attention(q, k, v, causal=causal)), (q, k, v), "TFLOP/s", flops(b, h, s, s, d, causal=causal)
    if family == "linear":
        return ((lambda: ae.linear_attention(q, k, v, causal=causal, feature_map="elu")), (q, k, v), "TFLOP/s",
                linear_flops(b, h, s, d, d))
    lay = sparse_layout(s, h, SPARSE_BLOCK, causal).to(device)
    return ((lambda: ae.block_sparse_attention(q, k, v, lay, block_size=SPARSE_BLOCK, causal=causal)), (q, k, v),
            "TFLOP/s", flops(b, h, s, s, d, pairs=layout_pairs(lay.cpu(), SPARSE_BLOCK, s, s, causal)))


def commands(argv: list, family: str, variants: Tuple[str, ...]) -> list:
    """ncu (one per variant) and nsys command lines around `python -m attention_ext profile ARGV`."""
    # this interpreter by its path: under ncu / nsys (often run with sudo) `python` may be another one
    inv = f"{shlex.quote(sys.executable)} -m attention_ext profile {shlex.join(argv)}"
    out = [f'ncu --nvtx --nvtx-include "attention_ext/{family}/{v}/" --set full -o attention_ext_{family}_{v} {inv}'
           for v in variants]
    out.append(f"nsys profile -t cuda,nvtx -o attention_ext_{family} {inv}")
    return out


def main(argv: Optional[list] = None) -> int:
    """`python -m attention_ext profile`: see the parser's help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cuda_ok = torch.cuda.is_available()
    ap = argparse.ArgumentParser(
        prog="python -m attention_ext profile",
        description="Run one op in a loop inside ranges attention_ext/<family>/<fwd|bwd> (NVTX on CUDA, "
                    "torch.profiler record_function on the CPU, with the profiler's table) and, on CUDA, print "
                    "the ncu / nsys command lines that wrap this invocation.")
    ap.add_argument("--family", required=True, choices=FAMILIES)
    ap.add_argument("--shape", required=True, help="B,H,S,D (decode: S is the KV-cache length, q_len 1)")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="H_k, the key / value heads (GQA / MQA: a divisor of H; default H)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda_ok else "cpu")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", action="store_true", help="a backward after each forward (not for decode)")
    ap.add_argument("--iters", type=int, default=5, help="profiled iterations")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed iterations before them, in the range attention_ext/<family>/warmup (default 2)")
    args = ap.parse_args(argv)
    try:
        b, h, s, d = (int(x) for x in args.shape.split(","))
    except ValueError:
        ap.error(f"--shape takes B,H,S,D, got {args.shape!r}")
    if min(b, h, s, d) < 1:
        ap.error(f"--shape takes four positive sizes B,H,S,D, got {args.shape!r}")
    if args.kv_heads is not None and (args.kv_heads < 1 or h % args.kv_heads):
        ap.error(f"--kv-heads must divide the {h} heads of --shape, got {args.kv_heads}")
    if args.iters < 1 or args.warmup < 0:
        ap.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if args.device == "cuda" and not cuda_ok:
        ap.error("--device cuda: no CUDA device visible")
    if args.backward and args.family == "decode":
        ap.error("--backward: the decode family has no backward")
    hk = args.kv_heads or h
    cuda = args.device == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    try:
        return _profile(args, argv, b, h, hk, s, d, dtype, cuda)
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        if not (isinstance(e, torch.OutOfMemoryError) or "allocate" in str(e)):
            raise
        ap.error(f"--shape {args.shape}: the {args.family} op's tensors do not fit in {args.device} memory "
                 f"({str(e).strip().splitlines()[0][:200]}); give a smaller B, H, S or D")


def _profile(args, argv: list, b: int, h: int, hk: int, s: int, d: int, dtype: torch.dtype, cuda: bool) -> int:
    """main() after the arguments: the op in its ranges, the report."""
    fwd, leaves, unit, work = build(args.family, b, h, hk, s, d, dtype, args.device, args.causal, args.backward)
    dout = torch.randn_like(fwd().detach()) if args.backward else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fam = args.family

    def step(variant: Optional[str], times: Optional[list]) -> None:
        for t in leaves:
            t.grad = None
        with torch.set_grad_enabled(args.backward):
            t0 = time.perf_counter()
            with (nvtx_range(fam, "fwd", cuda) if variant else contextlib.nullcontext()):
                out = fwd()
                sync()
            if times is not None:
                times.append(time.perf_counter() - t0)
            if args.backward:
                with (nvtx_range(fam, "bwd", cuda) if variant else contextlib.nullcontext()):
                    out.backward(dout)
                    sync()

    with nvtx_range(fam, "warmup", cuda):
        for _ in range(args.warmup):
            step(None, None)
    times: list = []
    prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if not cuda
            else contextlib.nullcontext())
    with prof:
        for _ in range(args.iters):
            step("fwd", times)
    variants = ("fwd", "bwd") if args.backward else ("fwd",)
    med = statistics.median(times)
    scale = 1e9 if unit == "GB/s" else 1e12
    print(f"attention_ext profile: {fam} ({b}, {h}, {s}, {d}) Hkv{hk} {str(dtype)[6:]} on {args.device}"
          f"{' causal' if args.causal else ''}; {args.warmup} warm-up + {args.iters} iterations; forward median "
          f"{med * 1e3:.3f} ms, {work / med / scale:.4g} {unit}; {machine_line(torch.get_num_threads(), gpu=cuda)}")
    print(f"ranges: {', '.join(f'attention_ext/{fam}/{v}' for v in variants)} "
          f"({'NVTX push/pop, nested' if cuda else 'torch.profiler record_function'})")
    if not cuda:  # Nsight profiles CUDA kernels only: no command line to offer for a CPU run
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        return 0
    print("Nsight Compute (kernels inside the range) and Nsight Systems:")
    for line in commands(argv, fam, variants):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
