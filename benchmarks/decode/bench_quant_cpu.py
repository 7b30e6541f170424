"""CPU decode over 8-bit KV caches (int8, float8_e4m3fn) against the same kernel over a bf16 cache,
measured in the same run (interleaved, shuffled order per round), at each ISA level asked for.

    python benchmarks/decode/bench_quant_cpu.py [--levels avx2,avx512bf16] [--quick] [--out FILE.md]

The issue's shape: B 4, Hq 32, Hkv 8, D 128, q_len 1, a 16k cache; q bf16. Rows: the bf16 cache
(the baseline), int8 and e4m3 caches with per-row descales (quantize_kv's "token") and per
(sequence, kv head) ones ("head"). Columns: ms per call, the ratio to the bf16 cache (> 1:
faster), and GB/s of cache bytes read (elements and descales) against the copy bandwidth (bytes
read + written of one large copy). A level forced below the machine's (set_cpu_isa) runs that
level's code on this CPU: it is not a measurement of an older CPU. --quick divides the cache by 4.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import at_isa_levels, copy_bandwidth, emit, interleaved, isa_levels  # noqa: E402

import attention_ext as ae  # noqa: E402
from attention_ext.decode import decode_fwd, quantize_kv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default=None, help="comma-separated ISA levels (default: this machine's)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    levels = isa_levels(ap, "--levels", args.levels) if args.levels is not None else [ae.cpu_isa()]
    b, h, hk, d, s = 4, 32, 8, 128, 16384 // (4 if args.quick else 1)
    torch.manual_seed(0)
    q = torch.randn(b, 1, h, d).bfloat16()
    kf, vf = torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
    caches = {"bf16": (kf.bfloat16(), vf.bfloat16(), None, None)}
    for qdt, name in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8 e4m3")):
        for gran in ("token", "head"):
            (kq, ks), (vq, vs) = quantize_kv(kf, qdt, gran), quantize_kv(vf, qdt, gran)
            caches[f"{name}, per {'row' if gran == 'token' else 'sequence'}"] = (kq, vq, ks, vs)
    scale = d ** -0.5

    def call(kc, vc, ks, vs):
        return lambda: decode_fwd(q, kc, vc, scale=scale, k_descale=ks, v_descale=vs)

    def nbytes(kc, vc, ks, vs):
        return sum(t.numel() * t.element_size() for t in (kc, vc, ks, vs) if t is not None)

    bw = copy_bandwidth()
    lines = [f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
             f"{torch.__version__}; copy bandwidth {bw / 1e9:.1f} GB/s; (B, Hq, Hkv, D) = ({b}, {h}, {hk}, {d}), "
             f"cache {s}, q bf16", ""]
    for level in at_isa_levels(levels):
        fns = {n: call(*c) for n, c in caches.items()}
        t = interleaved(fns, reps=args.reps, shuffle=True)
        lines += [f"ISA level {level}:", "", "| cache | ms | x bf16 cache | GB/s of cache bytes (% of copy) |",
                  "|---|---|---|---|"]
        for n, c in caches.items():
            gbs = nbytes(*c) / t[n]
            lines.append(f"| {n} | {t[n] * 1e3:.2f} | {t['bf16'] / t[n]:.2f}x | {gbs / 1e9:.1f} ({gbs / bw:.0%}) |")
        lines.append("")
    emit("\n".join(lines) + "\nCommand: python benchmarks/decode/bench_quant_cpu.py" +
         (f" --levels {args.levels}" if args.levels else "") + (" --quick" if args.quick else "") + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
