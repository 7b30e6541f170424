"""compute-sanitizer's representative cases for the decode, linear and sparse families' CUDA kernels
(the softmax family's are inline in gpu_check.sh's "sanitize" stage). Run by gpu_check.sh's
"fsanitize" stage under memcheck, racecheck, synccheck and initcheck:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 3 \\
        python3 benchmarks/gpu_sanitize_families.py [--family decode] [--device cuda]

The cases cover each kernel's code paths, not its accuracy (the families' test_cuda.py files do
that): odd head dims and lengths (partial tiles and vectors), GQA, paged caches with odd pages,
key splits and their merge, every score option, forward and backward. Small on purpose: under
racecheck a kernel runs 10-100x slower. `--device cpu` runs the same calls on the CPU kernels
(a check of the script itself, where no GPU is). Prints one line per family and "sanitizer cases
done" at the end.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attention_ext as ae  # noqa: E402
from attention_ext.decode import ops as decode_ops  # noqa: E402
from tests.decode.cases import Case, make_inputs, option_sets  # noqa: E402

bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32


def decode(dev):
    n = 0
    cases = [Case(sq=sq, page=page, num_splits=splits, dtype=bf if sq != 2 else f16, seqlens=(0, 1, 377, 700))
             for sq in (1, 2, 7) for page in (None, 16, 5) for splits in (1, 3, 0)]
    cases += [Case(d=d, hk=hk, h=8, dtype=f32 if d == 33 else bf, seqlens=(3, 64, 129, 300), num_splits=2)
              for d in (33, 80, 128, 256) for hk in (1, 8)]
    cases += [Case(sq=2, num_splits=s, dtype=bf, seqlens=(0, 1, 200, 500), **o)
              for o in option_sets(3).values() for s in (1, 4)]
    for c in cases:
        q, k, v, idx, kw, alibi, sinks = make_inputs(c, dev)
        decode_ops.decode_fwd(q, k, v, **idx, alibi_slopes=alibi, sinks=sinks, scale=kw["softmax_scale"],
                              softcap=kw["softcap"], window_left=kw["window_size"][0],
                              window_right=kw["window_size"][1], num_splits=c.num_splits)
        n += 1
    # the drop-in: in-place append with rotary, then attention over the cache
    b, h, hk, d, cap = 3, 8, 2, 64, 300
    q, kn, vn = (torch.randn(b, 2, x, d, device=dev, dtype=bf) for x in (h, hk, hk))
    kc, vc = (torch.randn(b, cap, hk, d, device=dev, dtype=bf) for _ in range(2))
    cos, sin = torch.rand(cap, d // 2, device=dev, dtype=bf), torch.rand(cap, d // 2, device=dev, dtype=bf)
    ae.flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, causal=True,
                               cache_seqlens=torch.tensor([0, 5, 250], device=dev, dtype=torch.int32))
    return n + 1


def _backward(out, *xs):
    grads = torch.autograd.grad(out.float().square().sum(), [x for x in xs if x is not None and x.requires_grad])
    return grads


def linear(dev):
    n = 0
    for dtype in (f32, bf, f16):
        for s, m, dv in ((1, 8, 12), (65, 16, 40), (129, 136, 8), (300, 64, 64)):
            for causal in (True, False):
                q = (0.5 * torch.randn(2, 4, s, m, device=dev)).to(dtype).requires_grad_()
                k = (0.5 * torch.randn(2, 2, s, m, device=dev)).to(dtype).requires_grad_()
                v = torch.randn(2, 2, s, dv, device=dev).to(dtype).requires_grad_()
                kpm = torch.rand(2, s, device=dev) > 0.25
                decay = (-0.2 * torch.rand(2, 4, s, device=dev)).requires_grad_() if causal else None
                out = ae.linear_attention(q, k, v, causal=causal, key_mask=kpm, decay=decay)
                _backward(out, q, k, v, decay)
                n += 1
    # the recurrent step
    st = None
    for _ in range(3):
        q, k, v = (torch.randn(2, 4, 1, 32, device=dev, dtype=bf) for _ in range(3))
        _, st = ae.linear_attention_step(q, k, v, st)
    n += 1
    # the delta rule's forward (no autograd: the CUDA kernel) and in-place step: every lane split
    # of a column (K 5 .. 600), partial value tiles, gates, varlen with an empty sequence
    with torch.no_grad():
        for kd, vd, gate in ((5, 9, None), (64, 40, "head"), (128, 128, "key"), (200, 33, "head"), (600, 6, "key")):
            s = 37
            q, k = (torch.randn(1, 2, s, kd, device=dev, dtype=bf) for _ in range(2))
            v = torch.randn(1, 4, s, vd, device=dev, dtype=bf)
            beta = torch.rand(1, 4, s, device=dev)
            g = None if gate is None else -torch.rand(*((1, 4, s) if gate == "head" else (1, 4, s, kd)), device=dev)
            cu = torch.tensor([0, 10, 10, 37], device=dev, dtype=torch.int32)
            h0 = torch.randn(3, 4, kd, vd, device=dev)
            ae.delta_rule_attention(q, k, v, beta, gate=g, initial_state=h0, cu_seqlens=cu, qk_l2norm=True)
            state = torch.zeros(1, 4, kd, vd, device=dev)
            ae.delta_rule_step(q[:, :, :3], k[:, :, :3], v[:, :, :3], beta[:, :, :3].contiguous(), state,
                               gate=g[:, :, :3].contiguous() if g is not None else None, inplace=True)
            n += 2
        # the chunk-parallel forward (delta_chunked=True): both kernel widths, bf16 and fp16, a
        # partial value tile, a pack whose sequences start mid-chunk
        old = ae.linear.set_cuda_kernels(**{**ae.linear.cuda_kernels(), "delta_chunked": True})
        try:
            for kd, vd, dt in ((64, 72, bf), (128, 128, bf), (128, 72, f16)):
                s = 205
                q, k = (torch.randn(1, 2, s, kd, device=dev, dtype=dt) for _ in range(2))
                v = torch.randn(1, 4, s, vd, device=dev, dtype=dt)
                beta = torch.rand(1, 4, s, device=dev)
                g = -torch.rand(1, 4, s, device=dev)
                cu = torch.tensor([0, 70, 70, 135, 200], device=dev, dtype=torch.int32)
                h0 = torch.randn(4, 4, kd, vd, device=dev)
                ae.delta_rule_attention(q, k, v, beta, gate=g, initial_state=h0, cu_seqlens=cu, qk_l2norm=True)
                # per-key gates (KDA): the per-key prep and out kernels, the walk's per-channel decay
                gk = -torch.rand(1, 4, s, kd, device=dev)
                ae.delta_rule_attention(q, k, v, beta, gate=gk, initial_state=h0, cu_seqlens=cu, qk_l2norm=True)
                n += 4  # with the backwards below
                # the chunk-parallel backward, per-head and per-key gates (grad mode is off here: turn
                # it on for these calls)
                with torch.enable_grad():
                    for gate in (g, gk):
                        leaves = [t.clone().requires_grad_() for t in (q, k, v, beta, gate, h0)]
                        out = ae.delta_rule_attention(*leaves[:4], gate=leaves[4], initial_state=leaves[5],
                                                      cu_seqlens=cu, qk_l2norm=True)
                        torch.autograd.grad(out.float().square().sum(), leaves)
        finally:
            ae.linear.set_cuda_kernels(**old)
    return n


def sparse(dev):
    n = 0
    for dtype in (bf, f16):
        for block, sq, sk, d, hk in ((16, 70, 130, 64, 2), (64, 257, 300, 128, 4), (128, 300, 260, 80, 1)):
            for causal in (False, True):
                g = torch.Generator().manual_seed(n)
                layout = (torch.rand(4, -(-sq // block), -(-sk // block), generator=g) < 0.5).to(dev)
                q = torch.randn(1, 4, sq, d, device=dev, dtype=dtype).requires_grad_()
                k = torch.randn(1, hk, sk, d, device=dev, dtype=dtype).requires_grad_()
                v = torch.randn(1, hk, sk, d, device=dev, dtype=dtype).requires_grad_()
                out = ae.block_sparse_attention(q, k, v, layout, block_size=block, causal=causal)
                _backward(out, q, k, v)
                n += 1
        for k_top in (1, 16, 500):
            q = torch.randn(1, 2, 70, 64, device=dev, dtype=dtype).requires_grad_()
            k = torch.randn(1, 2, 300, 64, device=dev, dtype=dtype).requires_grad_()
            v = torch.randn(1, 2, 300, 64, device=dev, dtype=dtype).requires_grad_()
            out = ae.topk_attention(q, k, v, k_top, causal=k_top == 16)
            _backward(out, q, k, v)
            n += 1
    return n


FAMILIES = {"decode": decode, "linear": linear, "sparse": sparse}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=list(FAMILIES), action="append")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    torch.manual_seed(0)
    for name in a.family or list(FAMILIES):
        n = FAMILIES[name](a.device)
        if a.device == "cuda":
            torch.cuda.synchronize()
        print(f"{name}: {n} cases", flush=True)
    print("sanitizer cases done", flush=True)


if __name__ == "__main__":
    main()
