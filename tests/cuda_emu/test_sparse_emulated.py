"""Block-sparse attention on the CUDA kernels, run by the host emulator (tests/cuda_emu): the
mma.sync forward walking the layout's CSR tile index, the dK / dV backward walking its CSC index,
the deterministic dQ kernel and the SIMT kernels reading the layout per block, against
reference.py in float64 with the layout as its element mask (repeat_interleave of the blocks),
under test_cuda.py's rule: error <= 2x PyTorch's own same-dtype error, plus a small floor.

Outputs and scratch start as NaN (emu_binding.cpp), so an element a kernel skips by mistake
fails. The layout's block need not match the kernels' tiles (16 / 48 / 80 against 128 x 64
forward and 64 x 128 backward tiles at D = 64): tiles the index does not mark full take the
per-element path.
"""
from __future__ import annotations

import math

import pytest
import torch

from attention_ext.sparse.functional import layout_to_mask
from tests.cuda_emu import emulator as cuda_emu
from tests.cuda_emu.test_emulated import ARCHS, emu, emu_ops  # noqa: F401  (the emulator fixtures)
from tests.softmax import test_cuda as tc
from tests.sparse.test_cuda import (INT32_MAX, check_thresholds, random_layout, topk_reference,
                                    with_duplicate_keys)


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def run_sparse(emu, layout, block, b, h, hk, sq, sk, d, dtype, *, arch=90, causal=False, bottom_right=False,
               deterministic=False, num_splits=0, sinks=None, softcap=0.0):
    """The emulated forward + backward with `layout`, checked against the float64 reference with
    the equivalent element mask. num_splits = 0 lets the heuristic pick (sparse calls run unsplit).
    Returns (out, lse, dq, dk, dv)."""
    q, k, v = randn(b, h, sq, d, dtype=dtype), randn(b, hk, sk, d, dtype=dtype), randn(b, hk, sk, d, dtype=dtype)
    dout = randn(b, h, sq, d, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    window = (-1, 0) if causal else (-1, -1)
    args = tc.call_fwd(q, k, v, scale=scale, window_left=window[0], window_right=window[1],
                       bottom_right=bottom_right, sinks=sinks, softcap=softcap,
                       block_layout=layout, block_size=block)
    out, lse = emu.fwd(q, k, v, *args, num_splits, deterministic, arch)
    dq, dk, dv, _, dsinks = emu.bwd(dout, q, k, v, out, lse, *args, False, deterministic, None, arch)
    mask = layout_to_mask(layout, block, sq, sk).unsqueeze(0)  # (1, H or 1, Sq, Sk)
    kw = dict(scale=scale, window=window, bottom_right=bottom_right, softcap=softcap)
    r64 = tc.ref_run(q, k, v, dout, torch.float64, bias=mask, sinks=sinks, **kw)
    rlo = tc.ref_run(q, k, v, dout, dtype, bias=mask, sinks=sinks, **kw)
    tc.check("out", out, r64[0], rlo[0], dtype)
    tc.check("lse", lse, r64[1], rlo[1].float(), dtype)
    tc.check("dq", dq, r64[2], rlo[2], dtype)
    tc.check("dk", dk, r64[3], rlo[3], dtype)
    tc.check("dv", dv, r64[4], rlo[4], dtype)
    if sinks is not None:
        tc.check("dsinks", dsinks.sum(0), r64[6], rlo[6], dtype)
    return out, lse, dq, dk, dv


def fwd_kernel_names(emu):
    return [n.split("<")[0] for n in emu.launches()]


# ---------------------------------------------------------------- layouts and block sizes
@pytest.mark.parametrize("block,dtype,heads", [(16, torch.float16, 2), (64, torch.bfloat16, 1),
                                               (128, torch.float16, 2), (48, torch.bfloat16, 2),
                                               (80, torch.float16, 1)])
def test_block_sizes(emu, block, dtype, heads):
    """Per-head and shared layouts; blocks smaller than, equal to, larger than and not nesting in
    the kernels' tiles; Sq = Sk = 130 (a partial last block)."""
    torch.manual_seed(block)
    layout = random_layout(heads, 130, 130, block)
    emu.launches()
    run_sparse(emu, layout, block, 1, 2, 2, 130, 130, 64, dtype)
    names = fwd_kernel_names(emu)
    assert any(n.endswith("tc::fwd_kernel") for n in names), names
    assert any(n.endswith("tc::bwd_dkdv_kernel") for n in names), names
    assert not any("combine" in n for n in names), "block-sparse calls run unsplit"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_causal_gqa(emu, arch, dtype):
    """Causal (top-left), GQA (4 query heads on 2 kv heads: the dK / dV kernel sums a group whose
    heads have different layouts), Sq = Sk = 100."""
    torch.manual_seed(arch + (dtype == torch.float16))
    layout = random_layout(4, 100, 100, 32, density=0.6)
    run_sparse(emu, layout, 32, 2, 4, 2, 100, 100, 64, dtype, arch=arch, causal=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_causal_bottom_right_rectangular(emu, arch):
    torch.manual_seed(7)
    layout = random_layout(1, 70, 150, 16, density=0.4)
    run_sparse(emu, layout, 16, 1, 2, 1, 70, 150, 64, torch.bfloat16, arch=arch, causal=True, bottom_right=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_empty_rows_and_columns(emu, arch):
    """A query block with no on block gives out = 0 and lse = -inf with no NaN, and zero dQ; a key
    block no query block sees gets zero dK / dV."""
    torch.manual_seed(arch)
    layout = random_layout(2, 130, 130, 64, density=1.0)
    layout[:, 1, :] = False  # query rows 64..127: nothing
    layout[:, :, 2] = False  # keys 128..129: never seen
    out, lse, dq, dk, dv = run_sparse(emu, layout, 64, 1, 2, 2, 130, 130, 64, torch.float16, arch=arch)
    assert torch.all(out[:, :, 64:128] == 0)
    assert torch.all(lse[:, :, 64:128] == float("-inf"))
    assert torch.all(dq[:, :, 64:128] == 0)
    assert torch.all(dk[:, :, 128:] == 0) and torch.all(dv[:, :, 128:] == 0)


def test_all_empty(emu):
    """A layout with nothing on: every output row 0 and every gradient 0."""
    torch.manual_seed(3)
    layout = torch.zeros(1, 2, 2, dtype=torch.bool)
    out, lse, dq, dk, dv = run_sparse(emu, layout, 64, 1, 2, 2, 100, 100, 64, torch.bfloat16)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv == 0)


def test_full_layout_is_dense(emu):
    """Every block on: the index marks every tile full, and the result is dense attention's."""
    torch.manual_seed(5)
    layout = torch.ones(1, 3, 3, dtype=torch.bool)
    run_sparse(emu, layout, 64, 1, 2, 2, 130, 130, 64, torch.float16, causal=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_deterministic(emu, arch):
    """The deterministic backward: the dQ kernel reads the layout under each of its tiles."""
    torch.manual_seed(11 + arch)
    layout = random_layout(2, 100, 130, 16, density=0.4)
    run_sparse(emu, layout, 16, 1, 2, 1, 100, 130, 64, torch.bfloat16, arch=arch, deterministic=True)


@pytest.mark.parametrize("d,block", [(128, 64), (96, 48), (256, 32)])
def test_head_dims(emu, d, block):
    """Buckets 128 (64 x 128 forward tiles of 48 keys) and 256 (64 x 32; dK / dV in two head-dim
    slices), and a padded head dim."""
    torch.manual_seed(d)
    layout = random_layout(2, 100, 100, block, density=0.5)
    run_sparse(emu, layout, block, 1, 2, 2, 100, 100, d, torch.float16, causal=d == 96)


def test_general_policy(emu):
    """The general forward / backward (softcap, sinks) with a layout."""
    torch.manual_seed(13)
    layout = random_layout(2, 100, 100, 32, density=0.5)
    sinks = torch.randn(2)
    run_sparse(emu, layout, 32, 1, 2, 2, 100, 100, 64, torch.bfloat16, sinks=sinks, softcap=5.0)


# ---------------------------------------------------------------- SIMT
@pytest.mark.parametrize("dtype,causal", [(torch.float16, False), (torch.bfloat16, True)])
def test_simt_forced(emu, dtype, causal):
    """set_cuda_kernels(force_simt): the SIMT kernels skip off layout blocks per row."""
    emu.set_cuda_kernels(0, 0, 0, 0, True)
    torch.manual_seed(17)
    layout = random_layout(2, 70, 100, 16, density=0.4)
    layout[:, 2, :] = False
    emu.launches()
    out, *_ = run_sparse(emu, layout, 16, 1, 2, 1, 70, 100, 64, dtype, causal=causal)
    names = fwd_kernel_names(emu)
    assert not any("tc::" in n for n in names), names
    assert torch.all(out[:, :, 32:48] == 0)


def test_simt_fp32(emu):
    """fp32 inputs take the SIMT kernels on their own."""
    torch.manual_seed(19)
    layout = random_layout(1, 100, 100, 48, density=0.5)
    run_sparse(emu, layout, 48, 1, 2, 2, 100, 100, 40, torch.float32, arch=80)


# ---------------------------------------------------------------- top-k
def topk_inputs(b, h, hk, sq, sk, d, dtype, dup=False):
    q, k = randn(b, h, sq, d, dtype=dtype), randn(b, hk, sk, d, dtype=dtype)
    return q, with_duplicate_keys(k) if dup else k


def run_topk(emu, q, k, k_top, *, arch=90, causal=False, softcap=0.0):
    scale = 1.0 / math.sqrt(q.shape[-1])
    args = tc.call_fwd(q, k, k, scale=scale, window_left=-1, window_right=0 if causal else -1, softcap=softcap)
    thr, jcut = emu.topk_threshold(q, k, *args, k_top, arch)
    rthr, rjcut, keep = topk_reference(q, k, k_top, scale, causal=causal, softcap=softcap)
    check_thresholds(thr, jcut, rthr, rjcut)
    return thr, jcut, keep


@pytest.mark.parametrize("dtype,k_top,causal,dup", [(torch.float16, 1, False, False), (torch.bfloat16, 5, True, True),
                                                    (torch.float16, 40, False, True),
                                                    (torch.float32, 17, True, False)])
def test_topk_threshold(emu, dtype, k_top, causal, dup):
    """The streaming per-row top-k against a float64 sort: k = 1 (argmax), ties from duplicate key
    rows (to the lower key), k = 40 of 100 (the candidate buffer pruned), causal rows with fewer
    allowed keys than k (keep all), GQA."""
    torch.manual_seed(k_top)
    q, k = topk_inputs(2, 4, 2, 50, 100, 64, dtype, dup=dup)
    run_topk(emu, q, k, k_top, causal=causal)


def test_topk_threshold_persistent(emu):
    """More rows than the persistent grid's warps (132 SMs x 64 on the emulated sm_90): each warp
    takes several rows in turn through the same scratch."""
    torch.manual_seed(23)
    q, k = topk_inputs(2, 8, 8, 600, 24, 32, torch.bfloat16)
    run_topk(emu, q, k, 3)


def test_topk_threshold_k_ge_sk(emu):
    """k >= Sk: every row keeps every key, no launch."""
    q, k = topk_inputs(1, 2, 2, 20, 30, 64, torch.float16)
    emu.launches()
    thr, jcut, _ = run_topk(emu, q, k, 30)
    assert torch.all(thr == float("-inf")) and torch.all(jcut == INT32_MAX)
    assert emu.launches() == []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,k_top,causal,softcap", [(torch.float16, 8, False, 0.0),
                                                        (torch.bfloat16, 20, True, 5.0)])
def test_topk_attention(emu, arch, dtype, k_top, causal, softcap):
    """The fused forward + backward with the threshold pass's rows: SIMT kernels only (they compute
    each logit as the pass did), against the float64 reference with the selected keys as its mask."""
    torch.manual_seed(arch + k_top)
    b, h, hk, sq, sk, d = 1, 4, 2, 40, 90, 64
    q, k = topk_inputs(b, h, hk, sq, sk, d, dtype, dup=True)
    v, dout = randn(b, hk, sk, d, dtype=dtype), randn(b, h, sq, d, dtype=dtype)
    thr, jcut, keep = run_topk(emu, q, k, k_top, arch=arch, causal=causal, softcap=softcap)
    scale = 1.0 / math.sqrt(d)
    window = (-1, 0) if causal else (-1, -1)
    args = tc.call_fwd(q, k, v, scale=scale, window_left=window[0], window_right=window[1], softcap=softcap,
                       topk_thr=thr, topk_jcut=jcut)
    emu.launches()
    out, lse = emu.fwd(q, k, v, *args, 0, False, arch)
    dq, dk, dv, _, _ = emu.bwd(dout, q, k, v, out, lse, *args, False, False, None, arch)
    names = fwd_kernel_names(emu)
    assert not any("tc::" in n for n in names), names
    kw = dict(scale=scale, window=window, softcap=softcap)
    r64 = tc.ref_run(q, k, v, dout, torch.float64, bias=keep, **kw)
    rlo = tc.ref_run(q, k, v, dout, dtype, bias=keep, **kw)
    for name, x, i in (("out", out, 0), ("lse", lse, 1), ("dq", dq, 2), ("dk", dk, 3), ("dv", dv, 4)):
        tc.check(name, x, r64[i], rlo[i].float() if name == "lse" else rlo[i], dtype)


@pytest.mark.parametrize("what", ["dout"])
def test_topk_nan_row_reaches_kept_keys_only(emu, what):
    """A NaN in row 7 of head 1's dout under top-k: the dK / dV of the keys that row keeps are
    NaN, those it drops keep their clean bits (the SIMT backward added 0 x NaN for a dropped pair
    before it skipped zero terms), and so does every other row's dq. (A NaN in q makes every
    logit of the row NaN, and top-k drops no NaN logit: that row reads every key.)"""
    torch.manual_seed(31)
    b, h, hk, sq, sk, d, row, k_top = 1, 2, 1, 16, 40, 32, 7, 6
    q, k = topk_inputs(b, h, hk, sq, sk, d, torch.float32)
    v, dout = randn(b, hk, sk, d, dtype=torch.float32), randn(b, h, sq, d, dtype=torch.float32)
    thr, jcut, keep = run_topk(emu, q, k, k_top)
    args = tc.call_fwd(q, k, v, topk_thr=thr, topk_jcut=jcut)
    runs = []
    for bad in (False, True):
        qq, dd = q.clone(), dout.clone()
        if bad:
            (qq if what == "q" else dd)[0, 1, row, 3] = float("nan")
        out, lse = emu.fwd(qq, k, v, *args, 0, False, 90)
        runs.append(emu.bwd(dd, qq, k, v, out, lse, *args, False, False, None, 90)[:3])
    kept = keep[0, 1, row].view(1, 1, sk, 1).expand(b, hk, sk, d)
    for name, c, g in zip(("dk", "dv"), runs[0][1:], runs[1][1:]):
        assert (g[kept].isnan() | g[kept].isinf()).view(-1, d).any(-1).all(), f"{name}: a kept key is clean"
        assert torch.equal(g[~kept], c[~kept]), f"{name}: a dropped key changed"
    rows = torch.ones(b, h, sq, dtype=torch.bool)
    rows[0, 1, row] = False
    assert torch.equal(runs[1][0][rows], runs[0][0][rows]), "dq of another row changed"


# ---------------------------------------------------------------- CUDA-graph capture
def test_capture_uses_the_cached_tile_index(emu):
    # Under a CUDA-graph capture the tile index cannot be built (its build syncs with the host:
    # csrc/torch/block_index.h). A layout never seen before raises a clear error; one an eager
    # call indexed is served from the cache, bit for bit the eager result, and pinned: filling the
    # cache past its 64 entries afterwards does not evict it. cuda_emu.capture makes the emulator's
    # host steps act as under a capture.
    torch.manual_seed(0)
    q, k, v, dout = (randn(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(4))
    layout = random_layout(2, 64, 64, 16)
    args = tc.call_fwd(q, k, v, block_layout=layout, block_size=16)

    def call():
        out, lse = emu.fwd(q, k, v, *args, 0, False, 90)
        return (out, lse, *emu.bwd(dout, q, k, v, out, lse, *args, False, False, None, 90)[:3])
    with cuda_emu.capture(emu):
        with pytest.raises(RuntimeError, match="tile index built before the capture"):
            call()
    eager = call()
    with cuda_emu.capture(emu):
        for a, b in zip(call(), eager):
            assert torch.equal(a, b)
    others = [random_layout(1, 16, 16, 16, density=1.0) for _ in range(70)]
    qs, ks, vs = (randn(1, 1, 16, 32, dtype=torch.bfloat16) for _ in range(3))
    for lay in others:
        emu.fwd(qs, ks, vs, *tc.call_fwd(qs, ks, vs, block_layout=lay, block_size=16), 0, False, 90)
    with cuda_emu.capture(emu):
        for a, b in zip(call(), eager):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- the sm_90a wgmma forward
@pytest.mark.parametrize("case", ["block16_causal", "block64_gqa", "block128_br", "block80_d128", "empty_rows",
                                  "softcap_block48"])
def test_wgmma_kernels(emu, case):
    """hopper_fwd = hopper_bwd = 2: block-sparse calls on the sm_90a wgmma forward, walking the CSR
    tile index at its 128 x 128 tiles, and backward, walking the CSC index at its (64 or 128) x
    128 tiles per head of the kv group (full tiles skip the layout per element, partial ones check
    it). Blocks smaller than, equal to and larger than the tiles, GQA with per-head layouts, causal
    top-left and bottom-right, both head-dim buckets, a query tile with nothing on, softcap. At
    level 1 block-sparse calls stay on mma.sync."""
    torch.manual_seed(len(case))
    block = int(case.split("_")[0].removeprefix("block")) if case.startswith("block") else (64 if case == "empty_rows" else 48)
    if case == "softcap_block48":
        block = 48
    b, h, hk, sq, sk, d = 1, 4, 2, 200, 300, 64
    kw = {}
    if case == "block16_causal":
        kw = dict(causal=True)
    elif case == "block64_gqa":
        h, hk = 4, 1
    elif case == "block128_br":
        sq, kw = 150, dict(causal=True, bottom_right=True)
    elif case == "block80_d128":
        d = 128
    elif case == "softcap_block48":
        kw = dict(softcap=8.0)
    layout = random_layout(h, sq, sk, block, density=0.5)
    if case == "empty_rows":
        layout[:, 2:4, :] = False  # query rows 128..255: nothing on (the second 128-row tile, and more)
    try:
        emu.set_cuda_kernels(2, 2, 0, 0, False)
        emu.launches()
        out, lse, dq, *_ = run_sparse(emu, layout, block, b, h, hk, sq, sk, d, torch.bfloat16, arch=90, **kw)
        names = [n.split("(")[0] for n in emu.launches()]
        assert any("hopper::fwd_kernel" in n for n in names), names
        assert any("hopper::bwd_kernel" in n for n in names), names
        if case == "empty_rows":
            assert torch.all(out[:, :, 128:] == 0) and torch.all(lse[:, :, 128:] == float("-inf"))
            assert torch.all(dq[:, :, 128:] == 0)
        emu.set_cuda_kernels(1, 1, 0, 0, False)
        emu.launches()
        run_sparse(emu, layout, block, b, h, hk, sq, sk, d, torch.bfloat16, arch=90, **kw)
        assert not any("hopper::" in n for n in emu.launches())
    finally:
        emu.set_cuda_kernels(0, 0, 0, 0, False)
