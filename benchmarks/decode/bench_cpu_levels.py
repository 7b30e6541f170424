"""The decode kernel at each CPU ISA level (csrc/cpu/isa.h) against each other, in one process:
levels alternate call batch by call batch (set_cpu_isa), so that a shared machine's noise hits
every level alike. One thread, process CPU time per call (best of the rounds), which a VM's
neighbours disturb less than wall time; each level's time as a ratio to the first level's, and
each level's error against the float64 reference (decode.reference) beside torch's own error in
the same dtype (SDPA with enable_gqa), the project's accuracy yardstick.

On a CPU with AVX512-BF16 the avx512bf16 level runs bf16 caches on vdpbf16ps (both products;
csrc/decode/cpu/decode.cpp's kDots), so avx512 against avx512bf16 in one build isolates that
path: float32 is bit-identical at the two levels.

    python benchmarks/decode/bench_cpu_levels.py [--levels avx512,avx512bf16] [--rounds 5]
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

import attention_ext as ae
from attention_ext._cli import isa_levels
from attention_ext.decode import decode_fwd
from attention_ext.decode.reference import decode_attention

# (B, H, H_k, D, cache length): issue 12's GQA case at 1k (L2 / L3-resident), 4k and 32k keys
# (memory-bound), and its MHA latency case
CASES = ((1, 32, 8, 128, 1024), (4, 32, 8, 128, 4096), (1, 32, 8, 128, 32768), (1, 8, 8, 64, 4096))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default=None, help="comma-separated; default: every level this CPU runs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="calls per timed batch")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    levels = isa_levels(ap, "--levels", args.levels) if args.levels is not None else list(ae.cpu_isas())
    print(f"CPU: {platform.machine()}, levels {', '.join(levels)}, 1 thread, torch {torch.__version__}")
    print("| dtype | (B, H, H_k, D, S) | " + " | ".join(f"{lv} us" for lv in levels) +
          f" | vs {levels[0]} | max abs err: " + " / ".join(levels) + " / torch |")
    print("|---|---|" + "---|" * (len(levels) + 2))
    for name in args.dtypes.split(","):
        dt = getattr(torch, name)
        for b, h, hk, d, s in CASES:
            torch.manual_seed(0)
            q = torch.randn(b, 1, h, d).to(dt)
            kc, vc = torch.randn(b, s, hk, d).to(dt), torch.randn(b, s, hk, d).to(dt)
            lens = torch.full((b,), s, dtype=torch.int32)
            scale = d ** -0.5
            call = lambda: decode_fwd(q, kc, vc, cache_seqlens=lens, scale=scale)  # noqa: E731
            ref = decode_attention(q.double(), kc.double(), vc.double(), cache_seqlens=lens, softmax_scale=scale)[0]
            qs, ks, vs = (t.transpose(1, 2) for t in (q, kc, vc))
            torch_err = (F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True).transpose(1, 2)
                         .double() - ref).abs().max().item()
            best, err = {lv: float("inf") for lv in levels}, {}
            old = ae.set_cpu_isa(levels[0])
            try:
                for _ in range(args.rounds):
                    for lv in levels:
                        ae.set_cpu_isa(lv)
                        out = call()[0]
                        err[lv] = (out.double() - ref).abs().max().item()
                        t0 = time.process_time()
                        for _ in range(args.calls):
                            call()
                        best[lv] = min(best[lv], (time.process_time() - t0) / args.calls)
            finally:
                ae.set_cpu_isa(old)
            ratios = " / ".join(f"{best[levels[0]] / best[lv]:.2f}x" for lv in levels[1:]) or "-"
            print(f"| {name} | {(b, h, hk, d, s)} | " + " | ".join(f"{best[lv] * 1e6:.0f}" for lv in levels) +
                  f" | {ratios} | " + " / ".join(f"{err[lv]:.1e}" for lv in levels) + f" / {torch_err:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
