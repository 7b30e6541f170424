"""The "avx512amx" variant (csrc/cpu/amx.h): AMX tiles in the int8 Q.K^T (cpu/q8dot.h) and in the
bf16 products (cpu/bf16dot.h) of the softmax forward and backward. It is listed, and these tests
run, only where the CPU has AMX (Sapphire Rapids and later) and the OS grants the tile state;
tests/test_isa.py also holds it to the float64 reference with every other level."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from tests.helpers import assert_close_fa2, reference_in

AMX = ae._ext.HAS_EXT and "avx512amx" in ae.cpu_isas()
pytestmark = pytest.mark.skipif(not AMX, reason="this CPU (or its OS) gives no AMX tiles: the variant is not listed")

# head dims: whole 64-byte tile rows (64, 128, 256) and part-full last chunks (24, 40, 96, 100);
# query rows that are no whole 16-row tile; key counts whose last tile is 16 keys
SHAPES = [(1, 2, 1, 47, 200, 64), (2, 4, 2, 100, 260, 128), (1, 2, 2, 17, 33, 96), (1, 3, 1, 130, 130, 40),
          (1, 2, 2, 50, 300, 256), (2, 2, 2, 64, 129, 100), (1, 2, 1, 61, 144, 24)]


def at(level, fn):
    old = ae.cpu_isa()
    try:
        ae.set_cpu_isa(level)
        return fn()
    finally:
        ae.set_cpu_isa(old)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_int8_scores_are_vnni_bits(shape, causal):
    """The int8 sums are exact integers on AMX as on vpdpbusd: with P V in float32 (fp16 and fp32
    inputs) the output equals the avx512bf16 level's bit for bit."""
    b, h, hk, sq, sk, d = shape
    g = torch.Generator().manual_seed(sq * d)
    for dtype in (torch.float32, torch.float16):
        q = torch.randn(b, h, sq, d, generator=g).to(dtype)
        k = (torch.randn(b, hk, sk, d, generator=g) + 1.0).to(dtype)
        v = torch.randn(b, hk, sk, d, generator=g).to(dtype)
        with torch.no_grad():
            run = lambda: ae.attention(q, k, v, causal=causal, qk_quant="int8")  # noqa: E731
            amx, vnni = at("avx512amx", run), at("avx512bf16", run)
        assert torch.equal(amx, vnni), f"{dtype}: max diff {(amx.float() - vnni.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_forward_backward(shape, causal):
    """bf16 on AMX tiles (Q K^T and P V forward, Q K^T and dO V^T backward) against float64,
    within 2x PyTorch's bf16 error."""
    b, h, hk, sq, sk, d = shape
    torch.manual_seed(sq + d)
    q0, k0, v0 = (torch.randn(b, n, s, d, dtype=torch.bfloat16) for n, s in ((h, sq), (hk, sk), (hk, sk)))
    dout = torch.randn(b, h, sq, d, dtype=torch.bfloat16)

    def run():
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = ae.attention(q, k, v, causal=causal)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    got = at("avx512amx", run)
    rkw = dict(window=(-1, 0) if causal else (-1, -1), bottom_right=False)
    ref, _, ref_leaves = reference_in(torch.float64, q0, k0, v0, **rkw)
    low, _, low_leaves = reference_in(torch.bfloat16, q0, k0, v0, **rkw)
    ref.backward(dout.double())
    low.backward(dout)
    for i, (g, lo, r) in enumerate(zip(got, (low,) + tuple(t.grad for t in low_leaves[:3]),
                                       (ref,) + tuple(t.grad for t in ref_leaves[:3]))):
        assert_close_fa2(g, lo, r, torch.bfloat16, f"{shape} causal={causal} [out, dq, dk, dv][{i}]")


@pytest.mark.parametrize("d", [24, 64])
def test_bf16_hidden_nan_redo_keeps_bits(d):
    """A NaN in a value row that a padding mask hides makes the tile's P V NaN; the kernel redoes
    the product without the hidden keys (on AMX, on a copy of V with those rows zeroed), which must
    give the clean run's bits in every row."""
    torch.manual_seed(d + 1)
    b, h, sq, sk = 2, 2, 61, 300
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for s in (sq, sk, sk))
    kpm = torch.rand(b, sk) > 0.3
    vp = v.masked_fill(~kpm.view(b, 1, sk, 1), float("nan"))
    with torch.no_grad():
        clean = at("avx512amx", lambda: ae.attention(q, k, v, key_mask=kpm, causal=True))
        poisoned = at("avx512amx", lambda: ae.attention(q, k, vp, key_mask=kpm, causal=True))
    assert torch.equal(clean.isnan(), poisoned.isnan())
    assert torch.equal(clean.nan_to_num(), poisoned.nan_to_num())


def test_interleaves_with_torchs_amx_kernels():
    """torch's bf16 matmul and SDPA run on AMX too (oneDNN), in the same threads: our tasks load
    and release the tile configuration around themselves, so calls in any order give the same
    results every time (no kernel runs on another's configuration)."""
    torch.manual_seed(0)
    x, w = torch.randn(256, 512).bfloat16(), torch.randn(512, 512).bfloat16()
    q, k, v = (torch.randn(2, 4, 300, 64).bfloat16() for _ in range(3))
    first = None
    with torch.no_grad():
        for _ in range(20):
            y = x @ w
            s = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            ours = (at("avx512amx", lambda: ae.attention(q, k, v, causal=True)),
                    at("avx512amx", lambda: ae.attention(q, k, v, qk_quant="int8")))
            assert torch.equal(x @ w, y) and torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, v), s)
            first = first or ours
            assert all(torch.equal(a, b) for a, b in zip(ours, first))
