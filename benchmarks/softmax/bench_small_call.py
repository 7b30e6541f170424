"""The fixed cost of one small attention call on the CPU: ours against torch SDPA, one thread.

At (1, 8, 16, 64) the kernel's arithmetic is ~0.5 MFLOP (a few microseconds), so what is timed
is mostly the per-call overhead: argument handling in Python, the dispatcher, input checks and
output allocation. Rows:
  sdpa                torch.nn.functional.scaled_dot_product_attention (the peer)
  ae.sdpa             attention_ext.scaled_dot_product_attention (the drop-in)
  ae.attention        attention_ext.attention
  entry               attention_ext._C.softmax_fwd_plain: the plain call's op without the Python above it
  torch.ops           torch.ops.attention_ext.softmax_fwd_plain: the same op through torch.ops' generic
                      argument conversion (what the plain call avoids)
and the Python above the op (attention() over entry, the drop-in over entry) as the difference
of medians. Every contender is timed in blocks of back-to-back calls, the blocks taken
round-robin, so noise on a shared machine hits all alike; the ratio `sdpa / row` is the figure of
merit (>= 1: as cheap as torch).

    python benchmarks/softmax/bench_small_call.py [--threads 1] [--rounds 30] [--causal | --mask bool|key]
"""
import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import attention_ext as ae
from attention_ext import _ext

SHAPES = [(1, 8, 16, 64), (1, 8, 1, 64), (1, 8, 64, 64), (4, 8, 16, 64)]


def contenders(b, h, s, d, dtype, causal, mask="none"):
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype) for _ in range(3))
    if mask != "none":
        # a (B, 1, S, S) bool mask (True = attend), or a key mask (B, S) (torch: (B, 1, 1, S)), the
        # last key of each sequence masked; the plain call takes neither: the general path's cost
        keep = torch.ones(b, s, dtype=torch.bool)
        keep[:, -1] = s == 1
        m = (torch.rand(b, 1, s, s) > 0.2) | torch.eye(s, dtype=torch.bool) if mask == "bool" else keep.view(b, 1, 1, s)
        ours = dict(attn_mask=m) if mask == "bool" else dict(key_mask=keep)
        return {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            "ae.sdpa": lambda: ae.scaled_dot_product_attention(q, k, v, attn_mask=m),
            "ae.attention": lambda: ae.attention(q, k, v, **ours),
        }
    plain = (q, k, v, None, -1, 0 if causal else -1, False, "bhsd", 0, False)
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "ae.sdpa": lambda: ae.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "ae.attention": lambda: ae.attention(q, k, v, causal=causal),
        "entry": lambda: _ext._C.softmax_fwd_plain(*plain),
        "torch.ops": lambda: torch.ops.attention_ext.softmax_fwd_plain(*plain),
    }


def warm_blocks(fns: dict, *, block: int, rounds: int) -> dict:
    """Per-call seconds of each fn, one sample per block of `block` back-to-back calls (the
    clock's own cost amortized), the blocks taken round-robin over `rounds`."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(block):
            fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
            times[k].append((time.perf_counter() - t0) / block)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30, help="round-robin rounds of 50-call blocks")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--mask", default="none", choices=("none", "bool", "key"),
                    help="a bool attn_mask or a key mask (attention()'s key_mask): the general path")
    args = ap.parse_args()
    if args.causal and args.mask != "none":
        ap.error("--causal and --mask: one at a time")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"small-call bench: torch {torch.__version__}, {platform.machine()} {_ext.cpu_isa()}, "
          f"{args.threads} thread(s), {args.dtype}{', causal' if args.causal else ''}"
          f"{'' if args.mask == 'none' else ', ' + args.mask + ' mask'}; median over "
          f"{args.rounds} rounds of 50-call blocks, interleaved; ratio = sdpa / row")
    print(f"{'shape (B, H, S, D)':<20} {'impl':<14} {'us':>8} {'ratio':>7}   spread (p10-p90 us)")
    for shape in SHAPES:
        fns = contenders(*shape, dtype, args.causal, args.mask)
        with torch.no_grad():
            times = warm_blocks(fns, block=50, rounds=args.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, ts in times.items():
            qs = statistics.quantiles(ts, n=10)
            print(f"{str(shape):<20} {name:<14} {med[name] * 1e6:8.1f} {med['sdpa'] / med[name]:7.2f}   "
                  f"{qs[0] * 1e6:.1f}-{qs[-1] * 1e6:.1f}")
        if "entry" in med:
            print(f"{'':<20} Python above the op: drop-in {1e6 * (med['ae.sdpa'] - med['entry']):.1f} us, attention() "
                  f"{1e6 * (med['ae.attention'] - med['entry']):.1f} us; torch.ops' conversion "
                  f"{1e6 * (med['torch.ops'] - med['entry']):.1f} us")


if __name__ == "__main__":
    main()
