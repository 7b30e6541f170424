"""CPU benchmark of the decode family (attention over a KV cache), against the machine's copy
bandwidth and torch SDPA measured in the same run (interleaved, in a shuffled order per round),
as ratios.

    python benchmarks/decode/bench_cpu.py [--quick] [--reps N] [--out FILE.md]

Sections (q_len 1, the issue's sizes):
1. Bandwidth: B4, Hq32, Hkv8, D128, cache 16k, fp32 and bf16: GB/s of K / V read
   (attention_ext.bench.decode_bytes) as a share of the copy bandwidth (bytes read + written
   of one large tensor copy, attention_ext.bench.copy_bandwidth); the same for torch SDPA with
   enable_gqa on a contiguous (B, H_k, S, D) cache, the layout SDPA reads best.
2. Latency: B1, H8, D64, cache 4096, fp32: ours against SDPA, in two regimes: each call after
   the other contenders ran (its K / V evicted, as in a model whose other layers read their
   caches in between), and back to back (`--warm` table: the 16.7 MB cache stays in L3).
3. Paged (page 16 and 256) against contiguous, on both cases.
4. MHA at D 128 (B1, H 32, cache 1024; contiguous only), cold and warm: the float32 rows run the
   kernel's 8-key score blocks and its short chunks (csrc/decode/cpu/decode.cpp), bf16 the chunks.
--quick divides the cache lengths by 4 (a smoke run, not the issue's sizes).
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import copy_bandwidth, decode_bytes, interleaved, interleaved_warm  # noqa: E402

import attention_ext as ae  # noqa: E402
from attention_ext._ext import HAS_EXT  # noqa: E402
from attention_ext.decode import decode_fwd  # noqa: E402


def paged(k: torch.Tensor, v: torch.Tensor, page: int):
    """(B, S, H_k, D) caches -> page pools (num_pages, page, H_k, D) in a shuffled page order,
    as an allocator hands pages out, and their block table."""
    b, s, hk, d = k.shape
    n = -(-s // page)
    perm = torch.randperm(b * n)
    pools = []
    for c in (k, v):
        pages = torch.cat([c, c.new_zeros(b, n * page - s, hk, d)], 1).view(b * n, page, hk, d)
        pool = torch.empty_like(pages)
        pool[perm] = pages
        pools.append(pool)
    return pools[0], pools[1], perm.view(b, n).int()


def case(b, h, hk, d, s, dtype, reps, copy_bw, pages=(16, 256)):
    q = torch.randn(b, 1, h, d).to(dtype)
    kc, vc = torch.randn(b, s, hk, d).to(dtype), torch.randn(b, s, hk, d).to(dtype)
    seqlens = torch.full((b,), s, dtype=torch.int32)
    scale = d ** -0.5
    # SDPA's strongest form: q (B, H, 1, D) against a contiguous (B, H_k, S, D) cache, enable_gqa
    qs, ks, vs = q.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    fns = {
        "ours": lambda: decode_fwd(q, kc, vc, cache_seqlens=seqlens, scale=scale),
        "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=hk != h),
    }
    for pg in pages:
        pool_k, pool_v, bt = paged(kc, vc, pg)
        fns[f"paged{pg}"] = (lambda pk=pool_k, pv=pool_v, t=bt: decode_fwd(q, pk, pv, cache_seqlens=seqlens,
                                                                            block_table=t, scale=scale))
    with torch.no_grad():
        # the kernels agree before they are timed
        ref = fns["sdpa"]().transpose(1, 2).float()
        for k_, fn in fns.items():
            out = fn()
            out = out[0] if isinstance(out, tuple) else out.transpose(1, 2)
            err = (out.float() - ref).abs().max().item()
            assert err < (2e-2 if dtype != torch.float32 else 1e-4), (k_, err)
        t = interleaved(fns, warmup=1, reps=reps, shuffle=True)
    nbytes = decode_bytes(b, hk, s, d, dtype)
    rows = []
    for k_, sec in t.items():
        bw = nbytes / sec
        rows.append((k_, sec * 1e3, bw / 1e9, bw / copy_bw, t["sdpa"] / sec, t["ours"] / sec))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    div = 4 if args.quick else 1
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(1 << 28)
    lines = [f"CPU: {platform.processor() or platform.machine()}, ISA {ae.cpu_isa()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}",
             f"copy bandwidth (256 MiB tensor copy, read + write): {copy_bw / 1e9:.1f} GB/s", ""]
    hdr = ("| case | dtype | kernel | ms | K/V GB/s | share of copy bw | vs SDPA (speedup) | vs contiguous |\n"
           "|---|---|---|---|---|---|---|---|")
    lines.append(hdr)
    both = (torch.float32, torch.bfloat16)
    for name, (b, h, hk, d, s), pages in (("B4 Hq32 Hkv8 D128", (4, 32, 8, 128, 16384 // div), (16, 256)),
                                          ("B1 H8 D64", (1, 8, 8, 64, 4096 // div), (16, 256)),
                                          ("B1 H32 D128", (1, 32, 32, 128, 1024 // div), ())):
        for dtype in both:
            # the batch-1 calls take about a millisecond: five times the rounds, so that a median
            # over shuffled neighbours settles
            reps = args.reps * (5 if b == 1 else 1)
            for k_, ms, gbs, share, vs_sdpa, vs_ours in case(b, h, hk, d, s, dtype, reps, copy_bw, pages):
                lines.append(f"| {name} S{s} | {str(dtype)[6:]} | {k_} | {ms:.3f} | {gbs:.1f} | {share:.0%} | "
                             f"{vs_sdpa:.2f}x | {vs_ours:.2f} |")
    lines += ["", "Back to back (each kernel's K / V warm in cache), median of 200 calls:", "",
              "| case | dtype | ours ms | sdpa ms | vs SDPA (speedup) |", "|---|---|---|---|---|"]
    for (b, h, d, s), dtype in itertools.product(((1, 8, 64, 4096 // div), (1, 32, 128, 1024 // div)), both):
        q = torch.randn(b, 1, h, d).to(dtype)
        kc, vc = torch.randn(b, s, h, d).to(dtype), torch.randn(b, s, h, d).to(dtype)
        seqlens = torch.full((b,), s, dtype=torch.int32)
        qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, kc, vc))
        with torch.no_grad():
            t = interleaved_warm({"ours": lambda: decode_fwd(q, kc, vc, cache_seqlens=seqlens, scale=d ** -0.5),
                                  "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=d ** -0.5)})
        lines.append(f"| B{b} H{h} D{d} S{s} | {str(dtype)[6:]} | {t['ours'] * 1e3:.3f} | {t['sdpa'] * 1e3:.3f} | "
                     f"{t['sdpa'] / t['ours']:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
