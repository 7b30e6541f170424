"""Block-sparse and top-k attention on a GPU (the CUDA kernels of csrc/softmax/cuda and the top-k
threshold pass of csrc/sparse/cuda) against reference.py in float64, with the layout or the
top-k selection as the reference's element mask, under test_cuda.py's rule: error <= 2x
PyTorch's own same-dtype error, plus a small floor. The allocator's free blocks are NaN before
each kernel call (tests/softmax/test_cuda.run_kernel), so an element a kernel skips by mistake
fails.

Skips cleanly without a GPU or without the compiled CUDA kernels; tests/cuda_emu/
test_sparse_emulated.py runs the same kernels (smaller) in the CPU emulator on every CI run and
imports the helpers below.
"""
from __future__ import annotations

import math

import pytest
import torch

import attention_ext as ae
from attention_ext.softmax import ops
from attention_ext.sparse.functional import layout_to_mask
from tests.softmax import test_cuda as tc

pytestmark = pytest.mark.skipif(not tc.CUDA, reason="needs a GPU and the compiled CUDA kernels")

INT32_MAX = 2**31 - 1


def random_layout(heads, sq, sk, block, density=0.5, device="cpu"):
    """(heads, ceil(sq / block), ceil(sk / block)) bool, each block on with probability density."""
    nqb, nkb = (sq + block - 1) // block, (sk + block - 1) // block
    return (torch.rand(heads, nqb, nkb) < density).to(device)


def topk_reference(q, k, k_top, scale, *, causal=False, softcap=0.0):
    """float64: per row the k_top-th best logit thr, the key jcut it belongs to (ties to the lower
    key: a stable descending sort) and the kept keys (B, H, Sq, Sk); rows with <= k_top allowed
    keys keep all (thr = -inf, jcut = INT32_MAX)."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    kk = k.double().repeat_interleave(h // k.shape[1], dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    s = s.masked_fill(~allowed, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    few = (allowed.sum(-1) <= k_top).expand(b, h, sq)
    kth = order[..., min(k_top, sk) - 1]
    thr = s.gather(-1, kth.unsqueeze(-1)).squeeze(-1)
    thr = torch.where(few, torch.full_like(thr, float("-inf")), thr)
    jcut = torch.where(few, torch.full_like(kth, INT32_MAX), kth)
    j = torch.arange(sk, device=q.device)
    keep = allowed & ((s > thr.unsqueeze(-1)) | ((s == thr.unsqueeze(-1)) & (j <= jcut.unsqueeze(-1))))
    keep = torch.where(few.unsqueeze(-1), allowed.expand_as(keep), keep)
    return thr, jcut.to(torch.int32), keep


def with_duplicate_keys(k):
    """Exact ties: repeated key rows give bit-identical logits in every pass."""
    sk = k.shape[2]
    k[:, :, 10:20] = k[:, :, 0:10]
    k[:, :, 50:sk:7] = k[:, :, 3:4]
    return k


def check_thresholds(thr, jcut, rthr, rjcut):
    assert thr.dtype == torch.float32 and jcut.dtype == torch.int32
    assert torch.equal(jcut, rjcut), f"jcut differs at {int((jcut != rjcut).sum())} rows"
    fin = torch.isfinite(rthr)
    assert torch.equal(torch.isfinite(thr), fin)
    assert torch.allclose(thr[fin].double(), rthr[fin], rtol=1e-5, atol=1e-5)


def run_sparse(layout, block, b, h, hk, sq, sk, d, dtype, *, causal=False, deterministic=False, **o):
    """Forward + backward with `layout` on the GPU against the float64 reference with the
    equivalent element mask."""
    q, k, v = (tc.randn(b, h, sq, d, dtype=dtype), tc.randn(b, hk, sk, d, dtype=dtype),
               tc.randn(b, hk, sk, d, dtype=dtype))
    dout = tc.randn(b, h, sq, d, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    window = (-1, 0) if causal else (-1, -1)
    out, lse, (dq, dk, dv, _, _) = tc.run_kernel(q, k, v, dout, scale=scale, window_left=window[0],
                                                 window_right=window[1], deterministic=deterministic,
                                                 num_splits=0, block_layout=layout, block_size=block, **o)
    mask = layout_to_mask(layout, block, sq, sk).unsqueeze(0)
    kw = dict(scale=scale, window=window, softcap=o.get("softcap", 0.0))
    r64 = tc.ref_run(q, k, v, dout, torch.float64, bias=mask, **kw)
    rlo = tc.ref_run(q, k, v, dout, dtype, bias=mask, **kw)
    tc.check("out", out, r64[0], rlo[0], dtype)
    tc.check("lse", lse, r64[1], rlo[1].float(), dtype)
    tc.check("dq", dq, r64[2], rlo[2], dtype)
    tc.check("dk", dk, r64[3], rlo[3], dtype)
    tc.check("dv", dv, r64[4], rlo[4], dtype)
    return out, lse, dq, dk, dv


@pytest.fixture
def kernels():
    old = ops.cuda_kernels()
    yield lambda **fields: ops.set_cuda_kernels(**{**ops.cuda_kernels(), **fields})
    ops.set_cuda_kernels(**old)


# ---------------------------------------------------------------- block-sparse
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 48, 64, 80, 128])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse(dtype, block, heads, causal):
    torch.manual_seed(block + heads)
    layout = random_layout(heads, 1000, 1000, block, device="cuda")
    run_sparse(layout, block, 2, 4, 4, 1000, 1000, 64, dtype, causal=causal)


@pytest.mark.skipif(not tc.SM90, reason="needs an sm_90 GPU (H100 / H200)")
@pytest.mark.parametrize("block", [16, 64, 128, 80])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_wgmma(kernels, block, d, causal):
    """hopper_fwd = hopper_bwd = 2: the forward and backward on the sm_90a wgmma kernels (each with
    a tile index at its own tiles); not yet the default."""
    kernels(hopper_fwd=2, hopper_bwd=2)
    torch.manual_seed(block + d)
    layout = random_layout(4, 1000, 1000, block, device="cuda")
    assert tc.hopper_ran(lambda: run_sparse(layout, block, 2, 4, 2, 1000, 1000, d, torch.bfloat16, causal=causal))


@pytest.mark.parametrize("d", [40, 64, 96, 128, 256])
@pytest.mark.parametrize("sq,sk", [(100, 100), (130, 130), (129, 700), (1000, 77)])
def test_shapes_gqa(d, sq, sk):
    torch.manual_seed(d + sq)
    layout = random_layout(4, sq, sk, 32, density=0.4, device="cuda")
    run_sparse(layout, 32, 1, 4, 2, sq, sk, d, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_empty_rows_and_columns(dtype):
    torch.manual_seed(1)
    layout = torch.ones(2, 5, 5, dtype=torch.bool)
    layout[:, 1] = False
    layout[:, :, 3] = False
    out, lse, dq, dk, dv = run_sparse(layout.cuda(), 64, 1, 2, 2, 300, 300, 64, dtype)
    assert torch.all(out[:, :, 64:128] == 0) and torch.all(lse[:, :, 64:128] == float("-inf"))
    assert torch.all(dq[:, :, 64:128] == 0)
    assert torch.all(dk[:, :, 192:256] == 0) and torch.all(dv[:, :, 192:256] == 0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_and_general(deterministic):
    torch.manual_seed(2)
    layout = random_layout(4, 500, 500, 16, density=0.3, device="cuda")
    run_sparse(layout, 16, 2, 4, 1, 500, 500, 64, torch.float16, causal=True, deterministic=deterministic,
               softcap=10.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_simt(kernels, dtype):
    kernels(force_simt=dtype != torch.float32)
    torch.manual_seed(3)
    layout = random_layout(2, 200, 300, 32, density=0.4, device="cuda")
    run_sparse(layout, 32, 1, 2, 2, 200, 300, 64, dtype, causal=True)


def test_public_api_matches_dense_with_mask():
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    layout = random_layout(1, 512, 512, 64, density=0.3, device="cuda")
    out = ae.block_sparse_attention(q, k, v, layout, block_size=64)
    mask = layout_to_mask(layout, 64, 512, 512).unsqueeze(0)
    ref = ae.attention(q, k, v, attn_mask=mask)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2)


# ---------------------------------------------------------------- top-k
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k_top", [1, 7, 64, 300])
@pytest.mark.parametrize("causal", [False, True])
def test_topk_threshold(dtype, k_top, causal):
    torch.manual_seed(k_top)
    q = tc.randn(2, 4, 200, 64, dtype=dtype)
    k = with_duplicate_keys(tc.randn(2, 2, 500, 64, dtype=dtype))
    scale = 0.125
    args = tc.call_fwd(q, k, k, scale=scale, window_left=-1, window_right=0 if causal else -1)
    thr, jcut = torch.ops.attention_ext.topk_threshold(q, k, *args, k_top)
    check_thresholds(thr, jcut, *topk_reference(q, k, k_top, scale, causal=causal)[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_top,causal,softcap", [(8, False, 0.0), (32, True, 5.0), (1000, False, 0.0)])
def test_topk_attention(dtype, k_top, causal, softcap):
    torch.manual_seed(k_top)
    b, h, hk, sq, sk, d = 2, 4, 2, 150, 400, 64
    q = tc.randn(b, h, sq, d, dtype=dtype)
    k = with_duplicate_keys(tc.randn(b, hk, sk, d, dtype=dtype))
    v, dout = tc.randn(b, hk, sk, d, dtype=dtype), tc.randn(b, h, sq, d, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    window = (-1, 0) if causal else (-1, -1)
    args = tc.call_fwd(q, k, k, scale=scale, window_left=window[0], window_right=window[1], softcap=softcap)
    thr, jcut = torch.ops.attention_ext.topk_threshold(q, k, *args, k_top)
    rthr, rjcut, keep = topk_reference(q, k, k_top, scale, causal=causal, softcap=softcap)
    check_thresholds(thr, jcut, rthr, rjcut)
    out, lse, (dq, dk, dv, _, _) = tc.run_kernel(q, k, v, dout, scale=scale, window_left=window[0],
                                                 window_right=window[1], softcap=softcap, topk_thr=thr,
                                                 topk_jcut=jcut)
    kw = dict(scale=scale, window=window, softcap=softcap)
    r64 = tc.ref_run(q, k, v, dout, torch.float64, bias=keep, **kw)
    rlo = tc.ref_run(q, k, v, dout, dtype, bias=keep, **kw)
    for name, x, i in (("out", out, 0), ("lse", lse, 1), ("dq", dq, 2), ("dk", dk, 3), ("dv", dv, 4)):
        tc.check(name, x, r64[i], rlo[i].float() if name == "lse" else rlo[i], dtype)


def test_topk_public_api():
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = ae.topk_attention(q, k, v, 16, causal=True)
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()


def test_exit_with_cached_tile_index_and_no_caching_allocator():
    """The tile-index cache outlives the CUDA runtime at exit: with the caching allocator off (as
    under compute-sanitizer) freeing its tensors then threw 'driver shutting down' and aborted the
    process (H200, 2026-11-29). The cache is never destroyed now: the process exits 0."""
    import os
    import subprocess
    import sys
    code = ("import torch, attention_ext as ae\n"
            "q, k, v = (torch.randn(1, 2, 128, 64, device='cuda', dtype=torch.bfloat16) for _ in range(3))\n"
            "layout = torch.ones(2, 2, 2, dtype=torch.bool, device='cuda')\n"
            "ae.block_sparse_attention(q, k, v, layout, block_size=64)\n"
            "torch.cuda.synchronize()\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
