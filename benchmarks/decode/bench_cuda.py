"""CUDA decode (attention_ext.decode.ops.decode_fwd) vs the device's copy bandwidth and torch SDPA
on one decode step, bf16, in one run.

    python benchmarks/decode/bench_cuda.py [--quick] [--md results.md]

Shape: B = 8, H_q = 32, H_kv = 8 (GQA 4), D = 128, one query row, caches of 4k .. 64k keys per
sequence (every sequence full), contiguous and paged (page 16 and 256, pages shuffled over the
pool). The decode step must read K and V once: GB/s = 2 * B * H_kv * L * D * 2 bytes / time (the
q / out / lse / split-scratch traffic is < 0.1% of it). The ceiling is a measured device-to-device
copy of a 2 GiB tensor, counted as bytes read + written. SDPA is the best of what a user would
write on the same contiguous cache in (B, H, L, D) layout (it has no paged cache): the flash
backend with enable_gqa, and flash / cuDNN / memory-efficient on K / V already repeated to 32
heads (the repeat is not timed, so that baseline reads 4x the bytes but gets them for free); the
table names the fastest. Each layout runs both of our kernels (ops.set_cuda_kernels: CUDA cores,
the default, and tensor cores). Times are medians of CUDA-event timings after warm-up, and include our
op's host work (input checks: the index tensors' values are copied to the host once per call).
The contiguous and page-16 layouts also run int8 and fp8 e4m3 caches (per-row descales,
decode.quantize_kv) on the CUDA-core kernel's 8-bit build (set_cuda_kernels(quantized=True)):
their GB/s count their own bytes (a byte per element plus the float32 descales), and their
"max abs diff" is against SDPA on the unquantized cache (the quantization's error included).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import copy_bandwidth, cuda_time  # noqa: E402  (common puts the repository on sys.path)

from attention_ext.decode import ops, quantize_kv  # noqa: E402

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover
    SDPBackend = sdpa_kernel = None

B, HQ, HKV, D = 8, 32, 8, 128
DT = torch.bfloat16
# ops.set_cuda_kernels: the CUDA-core kernel (the default) and the tensor-core one, each row both
KERNELS = ("cuda cores", "tensor cores")


def make_inputs(L):
    """q (B, 1, H_q, D) and a contiguous cache (B, L, H_kv, D) in flash-attn layout."""
    q = torch.randn(B, 1, HQ, D, dtype=DT, device="cuda")
    k = torch.randn(B, L, HKV, D, dtype=DT, device="cuda")
    v = torch.randn(B, L, HKV, D, dtype=DT, device="cuda")
    return q, k, v


def as_layout(k, v, page):
    """The same keys contiguous (page None) or paged: (num_pages, page, H_kv, D) pools with the
    pages shuffled and a block table; with the op's index kwargs (every sequence full)."""
    L = k.shape[1]
    seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    if page is None:
        return k, v, dict(cache_seqlens=seqlens)
    per = L // page
    perm = torch.randperm(B * per, device="cuda")
    kp = torch.empty(B * per, page, HKV, D, dtype=DT, device="cuda")
    vp = torch.empty_like(kp)
    kp[perm] = k.reshape(B * per, page, HKV, D)
    vp[perm] = v.reshape(B * per, page, HKV, D)
    table = perm.reshape(B, per).to(torch.int32)
    return kp, vp, dict(cache_seqlens=seqlens, block_table=table)


def sdpa_best(q, k, v):
    """The fastest SDPA variant on the contiguous cache: (seconds, name, out (B, 1, H, D))."""
    qh = q.transpose(1, 2)                      # (B, H_q, 1, D)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # (B, H_kv, L, D) views
    kh_c, vh_c = kh.contiguous(), vh.contiguous()
    rep = HQ // HKV
    kr, vr = kh_c.repeat_interleave(rep, 1), vh_c.repeat_interleave(rep, 1)
    cands = []
    if sdpa_kernel is not None:
        cands += [("flash gqa", SDPBackend.FLASH_ATTENTION, kh_c, vh_c, True),
                  ("flash rep", SDPBackend.FLASH_ATTENTION, kr, vr, False),
                  ("cudnn rep", SDPBackend.CUDNN_ATTENTION, kr, vr, False),
                  ("efficient rep", SDPBackend.EFFICIENT_ATTENTION, kr, vr, False)]
    best = None
    for name, backend, kk, vv, gqa in cands:
        ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        try:
            with ctx:
                fn = lambda: F.scaled_dot_product_attention(qh, kk, vv, enable_gqa=gqa)  # noqa: E731
                out = fn()
                t = cuda_time(fn)
        except RuntimeError:
            continue
        if best is None or t < best[0]:
            best = (t, name, out.transpose(1, 2))
    del kr, vr
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="caches 4k and 32k only")
    ap.add_argument("--md", help="append the table to this markdown file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not ops.has_kernel(torch.device("cuda"), DT):
        print("needs a GPU and the compiled CUDA decode kernel")
        return 1
    torch.manual_seed(0)
    bw = copy_bandwidth(2 << 30, device="cuda")
    torch.cuda.empty_cache()
    name = torch.cuda.get_device_name()
    lines = [f"decode step, {name}, B={B} H_q={HQ} H_kv={HKV} D={D} bf16, q_len 1; "
             f"device copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", "",
             "| cache | layout | our kernel | ours us | ours GB/s | % of copy | SDPA us | SDPA GB/s | SDPA variant | ours / SDPA | "
             "max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    caches = [4096, 32768] if args.quick else [4096, 8192, 16384, 32768, 65536]
    for L in caches:
        kv_bytes = 2 * B * HKV * L * D * 2
        q, k, v = make_inputs(L)
        sd = sdpa_best(q, k, v)  # SDPA on the contiguous cache
        sd_t = sd[0] if sd is not None else float("nan")

        def timed_row(fn, selection, layout, kernel, nbytes):
            """One table row: fn timed under the kernel selection (ops.set_cuda_kernels keywords),
            GB/s in nbytes, the max abs diff against SDPA on the unquantized cache."""
            old = ops.set_cuda_kernels(**{**ops.cuda_kernels(), **selection})
            try:
                out, _ = fn()
                t = cuda_time(fn)
            finally:
                ops.set_cuda_kernels(**old)
            diff = (out.float() - sd[2].float()).abs().max().item() if sd is not None else float("nan")
            row = (f"| {L // 1024}k | {layout} | {kernel} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | "
                   f"{100 * nbytes / t / bw:.0f}% | {sd_t * 1e6:.1f} | {kv_bytes / sd_t / 1e9:.0f} | "
                   f"{sd[1] if sd else '-'} | {sd_t / t:.2f}x | {diff:.3g} |")
            lines.append(row)
            print(row, flush=True)

        for page in (None, 16, 256):
            kc, vc, idx = as_layout(k, v, page)
            scale = D ** -0.5
            layout = "contiguous" if page is None else f"paged {page}"
            for kernel in KERNELS:
                timed_row(lambda: ops.decode_fwd(q, kc, vc, **idx, scale=scale),
                          dict(tensor_cores=kernel == "tensor cores"), layout, kernel, kv_bytes)
            if page in (None, 16):  # 8-bit caches: the CUDA-core kernel's 8-bit build
                for qdt, qname in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8 e4m3")):
                    (k8, kd), (v8, vd) = quantize_kv(kc, qdt, "token"), quantize_kv(vc, qdt, "token")
                    nb = sum(x.numel() * x.element_size() for x in (k8, v8, kd, vd))
                    timed_row(lambda: ops.decode_fwd(q, k8, v8, **idx, scale=scale, k_descale=kd, v_descale=vd),
                              dict(quantized=True), layout, f"{qname} cache", nb)
                    del k8, v8, kd, vd
            del kc, vc, idx
        del q, k, v, sd
        torch.cuda.empty_cache()
    if args.md:
        with open(args.md, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
