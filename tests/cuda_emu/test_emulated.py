"""The CUDA kernels (mma.sync forward and backward, SIMT) run on the CPU by the host emulator
(tests/cuda_emu), against reference.py in float64 with test_cuda.py's rule: error <= 2x PyTorch's
own same-dtype error, plus a small floor.

The emulator compiles the kernels and their launch sequence (dispatch.cu, launch_template.cuh)
with g++, emulating ldmatrix / mma.sync / cp.async / shuffles with the PTX fragment layouts and
running the threads of a block as fibers (see tests/cuda_emu/cuda_emu.h). The default kernels
passed test_cuda.py on an H100, so a failure here on a default kernel points at the emulator
first. What this catches on every CI run: index math, masking, tiling, launch grids and shared
memory sizes, missing barriers between cp.async and readers. What it cannot: timing, real
concurrency between blocks, register spills, the approximation error of ex2.approx.

test_cuda.py's checks are reused as they are: its run_kernel (the op call) and device are
swapped for the emulator and the CPU. Outputs and scratch start as NaN (emu_binding.cpp).
Skips when there is no C++ compiler or no CUDA headers (cuda_fp16.h); needs no GPU.
"""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from attention_ext import reference
from attention_ext.softmax import ops
from tests.cuda_emu import emulator as cuda_emu
from tests.softmax import test_cuda as tc
from tests.softmax.test_cuda import (check_inf_key_hidden, check_inf_under_softcap, check_long_row_exact, check_long_row_random,
                                     check_low_bits_of_a_column,
                                     check_low_bits_of_a_row, check_nan_hidden_key, check_nan_lse_split,
                                     check_nan_query_row, check_poison_mark_scope)

# arch 90 is the path the H100 verified (16-byte dQ atomics); 80 the sm_80 one (scalar atomics)
ARCHS = (90, 80)


@pytest.fixture(scope="module")
def emu_ops():
    e = cuda_emu.load()
    if e is None:
        pytest.skip(f"CUDA emulator unavailable: {cuda_emu.why}")
    return e


@pytest.fixture
def emu(emu_ops):
    """The emulator with the default kernels and schedule, restored after each test."""
    emu_ops.set_cuda_kernels(0, 0, 0, 0, False)
    emu_ops.set_schedule(True, False)
    yield emu_ops
    emu_ops.set_cuda_kernels(0, 0, 0, 0, False)
    emu_ops.set_schedule(True, False)


def emulate(monkeypatch, emu, arch=90, num_splits=1):
    """Route test_cuda's helpers to the emulator on CPU tensors (the forward split num_splits
    ways, unless a call names its own)."""

    def run_kernel(q, k, v, dout, *, bias_grad=False, deterministic=False, num_splits=num_splits, zero_dlse=False,
                   **o):
        args = tc.call_fwd(q, k, v, **o)
        out, lse = emu.fwd(q, k, v, *args, num_splits, deterministic, arch)
        dlse = torch.zeros_like(lse) if zero_dlse else None
        grads = emu.bwd(dout, q, k, v, out, lse, *args, bias_grad, deterministic, dlse, arch)
        return out, lse, grads

    monkeypatch.setattr(tc, "DEV", "cpu")
    monkeypatch.setattr(tc, "run_kernel", run_kernel)
    return run_kernel


def needs_dropout_mask(o):
    if o.get("dropout_p", 0.0) > 0 and not ops.HAS_EXT:
        pytest.skip("the dropout reference needs attention_ext's compiled dropout_mask")


def test_emulator_unit(tmp_path):
    """tests/cuda_emu/test_runtime.cpp: ldmatrix + mma products through SmemTile (exact), and the
    deadlock, divergence, bounds and missing-barrier checks."""
    inc = cuda_emu.cuda_include()
    if inc is None or cuda_emu.shutil.which("g++") is None:
        pytest.skip("needs g++ and the CUDA headers")
    exe = tmp_path / "test_cuda_emu"
    subprocess.run(["g++", "-std=c++20", "-O1", "-DATTN_CUDA_EMULATE", "-Wno-unknown-pragmas",
                    "-I", os.path.join(cuda_emu.EMU, "target"), "-I", os.path.join(cuda_emu.ROOT, "csrc"),
                    "-I", cuda_emu.EMU, "-I", inc,
                    os.path.join(cuda_emu.EMU, "test_runtime.cpp"),
                    os.path.join(cuda_emu.EMU, "emu_runtime.cpp"), "-o", str(exe)], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------- shapes and dtypes
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [40, 64, 96, 128])
@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 129), (129, 7), (200, 160)])
def test_shapes(monkeypatch, emu, dtype, d, sq, sk):
    emulate(monkeypatch, emu)
    torch.manual_seed(sq * 1000 + sk + d)
    tc.run_and_compare(2 if sq < 100 else 1, 2, 2, sq, sk, d, dtype)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,o", [(torch.float16, dict(window=(-1, 0), bottom_right=True)),
                                     (torch.bfloat16, dict(window=(50, 20), deterministic=True))])
def test_hdim256(monkeypatch, emu, arch, dtype, o):
    """Bucket 256: 64 x 32 forward tiles; dK/dV in two head-dim slices, 64 keys per block on sm_80
    and 128 on sm_90."""
    emulate(monkeypatch, emu, arch)
    torch.manual_seed(arch)
    tc.run_and_compare(1, 2, 1, 100, 150, 256, dtype, **o)


@pytest.mark.parametrize("d", [40, 128])
def test_shapes_fp32_simt(monkeypatch, emu, d):
    emulate(monkeypatch, emu)
    torch.manual_seed(d)
    q = torch.randn(1, 1, 8, d)
    assert emu.path(q, q, q, 90) == "simt"
    tc.run_and_compare(1, 2, 1, 33, 70, d, torch.float32, window=(-1, 0), bottom_right=True)


def test_paths(emu):
    """The dispatch the emulated device makes: tensor cores for fp16/bf16 with d % 8 == 0."""
    mk = lambda d, dt: torch.randn(1, 1, 8, d).to(dt)
    assert emu.path(mk(64, torch.bfloat16), mk(64, torch.bfloat16), mk(64, torch.bfloat16), 90) == "tensor-core"
    assert emu.path(mk(36, torch.float16), mk(36, torch.float16), mk(36, torch.float16), 80) == "simt"


@pytest.mark.parametrize("arch", ARCHS)
def test_launch_sequence(monkeypatch, emu, arch):
    """dispatch.cu's sequence and launch_template.cuh's tiles per arch, as kernel names: forward;
    preprocess, dK/dV (sm_90: 128 keys x 8 warps at D = 256, sm_80: 64 x 4), dQ conversion."""
    q = torch.randn(1, 2, 100, 256).to(torch.bfloat16)
    args = tc.call_fwd(q, q, q)
    emu.launches()
    out, lse = emu.fwd(q, q, q, *args, 1, False, arch)
    emu.bwd(q, q, q, q, out, lse, *args, False, False, None, arch)
    names = [n.split("(")[0] for n in emu.launches()]
    ns = f"attn_emu_sm{arch}"
    tiles = "256, 128, 32, 128, 8" if arch == 90 else "256, 128, 32, 64, 4"
    assert names == [
        f"void {ns}::tc::fwd_kernel<__nv_bfloat16, 256, 64, 32, 4, false, {ns}::tc::FwdVariant<0> >",
        f"void {ns}::simt::bwd_preprocess_kernel<__nv_bfloat16>",
        f"void {ns}::tc::bwd_dkdv_kernel<__nv_bfloat16, {tiles}, false, {ns}::tc::BwdVariant<1, false, false, 0> >",
        f"void {ns}::simt::bwd_convert_dq_kernel<__nv_bfloat16>",
    ], names


# ---------------------------------------------------------------- the option matrix
OPTION_NAMES = tc.OPTION_NAMES
HEADS = list(tc.HEADS)


@pytest.mark.parametrize("opt", OPTION_NAMES)
def test_options(monkeypatch, emu, opt):
    """Every option once per 16-bit dtype, heads and head dim rotating over the cases."""
    emulate(monkeypatch, emu)
    i = OPTION_NAMES.index(opt)
    for j, dtype in enumerate((torch.bfloat16, torch.float16)):
        heads = HEADS[(i + j) % len(HEADS)]
        d = (64, 96)[(i + j) % 2]
        torch.manual_seed(1000 * i + j)
        h, hk = tc.HEADS[heads]
        o = tc.option_cases()[opt](h)
        needs_dropout_mask(o)
        tc.run_and_compare(2, h, hk, 129, 200, d, dtype, **o)


@pytest.mark.parametrize("opt", ["causal_br", "window", "bias_row_bcast_grad", "sinks", "dropout", "dropout_coords",
                                 "everything"])
def test_options_sm80(monkeypatch, emu, opt):
    """The sm_80 build: scalar dQ atomics instead of sm_90's 16-byte quad swap."""
    emulate(monkeypatch, emu, arch=80)
    torch.manual_seed(OPTION_NAMES.index(opt))
    o = tc.option_cases()[opt](4)
    needs_dropout_mask(o)
    tc.run_and_compare(2, 4, 2, 129, 200, 128, torch.bfloat16, **o)


@pytest.mark.parametrize("splits", ["3", "64"])
@pytest.mark.parametrize("opt", ["none"] + tc.SPLIT_OPTIONS)
def test_split_kv(monkeypatch, emu, opt, splits):
    """Split-KV forward (num_splits=N: FwdSplit kernels + the combine) with test_cuda.py's
    split options, at a decode step (Sq = 1, D = 128) and a ragged few-row call (Sq = 7, D = 64);
    64 splits over 3 key blocks leave most splits empty."""
    emulate(monkeypatch, emu, num_splits=int(splits))
    torch.manual_seed(len(opt) * 100 + int(splits))
    b, h, hk = 2, 4, 2
    for sq, d, dtype in ((1, 128, torch.bfloat16), (7, 64, torch.float16)):
        o = tc.split_options(b, h, sq, 300)[opt] if opt != "none" else {}
        needs_dropout_mask(o)
        tc.run_and_compare(b, h, hk, sq, 300, d, dtype, **o)
    # split against unsplit on the same inputs, tightly, with V = 1: every output is then the
    # total weight of its row (1, less a sink's share, scaled by dropout), ~1, so a wrong split
    # weight shows as a shift while the rounding stays at the final bf16 ulp (2^-8 at 1)
    o = dict(tc.split_options(b, h, 1, 300)[opt]) if opt != "none" else {}
    o.pop("bias_grad", None)
    wl, wr = o.pop("window", (-1, -1))
    q = torch.randn(b, h, 1, 128).to(torch.bfloat16)
    k, v = torch.randn(b, hk, 300, 128).to(torch.bfloat16), torch.ones(b, hk, 300, 128, dtype=torch.bfloat16)
    args = tc.call_fwd(q, k, v, window_left=wl, window_right=wr, **o)
    emu.launches()
    o_s, l_s = emu.fwd(q, k, v, *args, int(splits), False, 90)
    assert any("fwd_combine_kernel" in n for n in emu.launches()), "the split path did not run"
    o_1, l_1 = emu.fwd(q, k, v, *args, 1, False, 90)
    assert not any("fwd_combine_kernel" in n for n in emu.launches())
    diff = (o_s.float() - o_1.float()).abs().max().item()
    assert diff <= 4e-3, f"split O off by {diff:.3e} (> one bf16 ulp at 1)"
    assert torch.allclose(l_s, l_1, rtol=0, atol=1e-4, equal_nan=True), (l_s - l_1).abs().max()


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("case", ["gqa_split", "mqa_split", "gqa_unsplit_sm90", "fp32_simt", "topleft_causal"])
def test_gqa_row_packing(monkeypatch, emu, case, layout):
    """One query row per head of a GQA / MQA call runs with each kv group's heads as rows of one
    query block (softmax/cuda/heuristics.h pack_gqa_rows): right against float64 and, where it
    packs, G times fewer CTAs. Top-left causal (the one row sees key 0 only) does not pack."""
    run_kernel = emulate(monkeypatch, emu, arch=90 if case == "gqa_unsplit_sm90" else 80,
                         num_splits=1 if case == "gqa_unsplit_sm90" else 3)
    torch.manual_seed(len(case) + len(layout))
    hk = 1 if case == "mqa_split" else 2
    dtype = torch.float32 if case == "fp32_simt" else torch.bfloat16
    o = dict(window=(-1, 0), bottom_right=case != "topleft_causal", softcap=10.0 if case == "gqa_split" else 0.0)
    emu.launch_stats()
    tc.run_and_compare(2, 8, hk, 1, 300, 64, dtype, seqlens_k=torch.tensor([300, 77], dtype=torch.int32),
                       layout=layout, **o)
    fwd_ctas = int(emu.launch_stats()[0, 0])  # the forward's first launch (the backward follows)
    packed = case != "topleft_causal"
    heads = 2 * (hk if packed else 8)  # batch x heads the grid spans
    # one query block per (batch, head) of the grid, times the splits (the SIMT path is unsplit)
    splits = 1 if case in ("gqa_unsplit_sm90", "fp32_simt") else 3
    assert fwd_ctas == heads * splits, fwd_ctas


@pytest.mark.parametrize("opt", ["causal_tl", "bool_mask", "dropout", "dropout_coords"])
def test_options_fp32_simt(monkeypatch, emu, opt):
    emulate(monkeypatch, emu)
    torch.manual_seed(OPTION_NAMES.index(opt))
    o = tc.option_cases()[opt](2)
    needs_dropout_mask(o)
    tc.run_and_compare(2, 2, 1, 129, 200, 40, torch.float32, **o)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lse_gradient(emu, dtype):
    """A gradient flowing into the returned LSE enters the preprocess as D_i -= dlse_i."""
    torch.manual_seed(7)
    b, h, sq, sk, d = 1, 2, 70, 90, 64
    q, k, v = (torch.randn(b, h, s, d).to(dtype) for s in (sq, sk, sk))
    dout, dlse = torch.randn(b, h, sq, d).to(dtype), torch.randn(b, h, sq)
    args = tc.call_fwd(q, k, v, window_left=-1, window_right=0)
    out, lse = emu.fwd(q, k, v, *args, 1, False, 90)
    dq, dk, dv, _, _ = emu.bwd(dout, q, k, v, out, lse, *args, False, False, dlse, 90)

    def ref(dt):
        qq, kk, vv = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        o, l = reference.attention(qq, kk, vv, scale=d ** -0.5, window=(-1, 0))
        ((o * dout.to(dt)).sum() + (l * dlse.to(l.dtype)).sum()).backward()
        return qq.grad, kk.grad, vv.grad

    r64, rlo = ref(torch.float64), ref(dtype)
    for name, x, a, r in zip(("dq", "dk", "dv"), (dq, dk, dv), r64, rlo):
        tc.check(name, x, a, r, dtype)


def test_force_simt_path(monkeypatch, emu):
    """The SIMT fallback on 16-bit inputs (sm < 80, misaligned tensors)."""
    emulate(monkeypatch, emu)
    emu.set_cuda_kernels(0, 0, 0, 0, True)
    torch.manual_seed(5)
    o = dict(window=(-1, 0), bottom_right=True, sinks=torch.randn(4), dropout_p=0.1, seed=3)
    needs_dropout_mask(o)
    tc.run_and_compare(1, 4, 2, 65, 70, 64, torch.bfloat16, **o)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.float16, 128)])
def test_deterministic(monkeypatch, emu, arch, dtype, d):
    emulate(monkeypatch, emu, arch)
    torch.manual_seed(d)
    a = tc.run_and_compare(1, 4, 2, 150, 131, d, dtype, window=(-1, 0), deterministic=True, seed=0)
    torch.manual_seed(d)
    b = tc.run_and_compare(1, 4, 2, 150, 131, d, dtype, window=(-1, 0), deterministic=True, seed=0)
    for x, y in zip(a, b):
        assert torch.equal(x, y), "deterministic mode must be bitwise reproducible"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_dropout(monkeypatch, emu, d):
    """Dropout with deterministic=True: the dQ kernel (S's fragment layout) and the dK / dV kernel
    (S^T's) each draw their keep bits ahead of the elementwise pass (kernel_common.cuh,
    dropout_keep_mask), against the reference with the forward's mask."""
    o = dict(dropout_p=0.2, seed=11, offset=5)
    needs_dropout_mask(o)
    emulate(monkeypatch, emu)
    torch.manual_seed(d)
    tc.run_and_compare(1, 4, 2, 150, 131, d, torch.bfloat16, window=(-1, 0), deterministic=True, **o)


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 96)])
def test_layout_bshd(monkeypatch, emu, dtype, d):
    emulate(monkeypatch, emu)
    torch.manual_seed(3)
    tc.run_and_compare(2, 4, 2, 130, 131, d, dtype, layout="bshd", window=(-1, 0), bottom_right=True)


@pytest.mark.parametrize("dtype,d,causal", [(torch.bfloat16, 64, True), (torch.float16, 128, False)])
def test_varlen(monkeypatch, emu, dtype, d, causal):
    emulate(monkeypatch, emu)
    tc.test_varlen(dtype, d, causal)
@pytest.mark.parametrize("schedule,reverse", [("warp-serial", "1"), ("lockstep", "0"), ("lockstep", "1")])
def test_schedules(monkeypatch, emu, schedule, reverse):
    """Other interleavings of the warps. The default, warp-serial in warp order, runs one warp to
    its next barrier before the next starts, so a reader that lacks a barrier after a later warp's
    shared-memory writes (or cp.async wait) reads the NaN fill; reversed, for earlier warps.
    Lockstep: every warp advances one collective per round."""
    emulate(monkeypatch, emu)
    emu.set_schedule(schedule == "warp-serial", reverse == "1")
    torch.manual_seed(11)
    tc.run_and_compare(2, 4, 2, 129, 200, 64, torch.bfloat16, window=(-1, 0), bottom_right=True)
    tc.run_and_compare(1, 4, 1, 100, 300, 128, torch.float16, window=(17, 5), deterministic=True)
    tc.run_and_compare(1, 2, 1, 40, 50, 40, torch.float32, sinks=torch.randn(2))
    # the hidden-key votes and zeroing (nonfinite.cuh) under this interleaving
    run = emulate(monkeypatch, emu)
    check_nan_hidden_key(run, torch.bfloat16, "v", "bool", False)
    check_nan_hidden_key(run, torch.float16, "k", "causal", False)
    check_nan_hidden_key(run, torch.bfloat16, "k", "bool", True)
    # inf keys' restored scores, and the inf-q zeroing between S and dS^T Q (its two barriers)
    check_inf_under_softcap(run, torch.float16, False, "k", False)
    check_inf_under_softcap(run, torch.bfloat16, False, "q", True)


# ---------------------------------------------------------------- tuning candidates (sm_90 build)
# emu_kernels_sm90.cpp compiles launch_template.cuh's -DATTN_TUNING candidates (FwdAlt, BwdAlt),
# picked by set_cuda_kernels' tune_fwd / tune_bwd. Each runs one of test_cuda's tuning cases
# (smaller), rotating cases, head dims and dtypes, after a check that it reaches a kernel other
# than the default.
TUNE_CANDIDATES = [f"fwd{v}" for v in range(1, 8)] + [f"bwd{v}" for v in range(1, 13)]


def _tune_cases():
    return [
        lambda d, dt: tc.run_and_compare(1, 4, 2, 200, 177, d, dt, window=(-1, 0)),
        lambda d, dt: tc.run_and_compare(2, 4, 1, 129, 200, d, dt, window=(40, 0), bottom_right=True,
                                         seqlens_k=torch.tensor([200, 61], dtype=torch.int32)),
        lambda d, dt: tc.run_and_compare(1, 4, 2, 150, 131, d, dt, window=(-1, 0), deterministic=True),
        lambda d, dt: tc.run_and_compare(1, 4, 2, 129, 200, d, dt, softcap=5.0, scale=0.5,
                                         bias=torch.randn(1, 4, 129, 200), bias_grad=True),
        lambda d, dt: tc.run_and_compare(1, 2, 2, 256, 256, d, dt),
    ]


@pytest.mark.parametrize("cand", TUNE_CANDIDATES)
def test_tune_candidate(monkeypatch, emu, cand):
    run_kernel = emulate(monkeypatch, emu, arch=90)
    v = int(cand[3:])
    q, k, vv, dout = (torch.randn(1, 2, 130, 128).to(torch.bfloat16) for _ in range(4))
    emu.launches()
    run_kernel(q, k, vv, dout)
    base = emu.launches()
    emu.set_cuda_kernels(0, 0, v if cand.startswith("fwd") else 0, v if cand.startswith("bwd") else 0, False)
    run_kernel(q, k, vv, dout)
    names = emu.launches()
    assert names != base, f"{cand} ran the default kernels {base}"
    torch.manual_seed(v)
    case = _tune_cases()[v % 5]
    d, dtype = [(64, torch.bfloat16), (128, torch.float16), (96, torch.bfloat16), (128, torch.bfloat16)][v % 4]
    case(d, dtype)


@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_hidden_key_sequential_bwd(monkeypatch, emu, which):
    """bwd4, the sequential dK / dV schedule (kSeq: dS from the 16-bit P), selects dS = 0 where
    P = 0 and takes the NaN scores of a non-finite k like the default kernel."""
    run = emulate(monkeypatch, emu, arch=90)
    emu.set_cuda_kernels(0, 0, 0, 4, False)
    check_nan_hidden_key(run, torch.bfloat16, which, "causal", False)


@pytest.mark.parametrize("where", ["q", "k"])
def test_inf_under_softcap_sequential_bwd(monkeypatch, emu, where):
    """bwd4 (kSeq) restores the scores of inf keys and zeroes Q's inf elements under softcap
    like the default dK / dV kernel."""
    run = emulate(monkeypatch, emu, arch=90)
    emu.set_cuda_kernels(0, 0, 0, 4, False)
    check_inf_under_softcap(run, torch.bfloat16, False, where, True)


@pytest.mark.parametrize("what", ["q", "dout"])
def test_nan_query_row_sequential_bwd(monkeypatch, emu, what):
    """bwd4 (kSeq) zeroes poisoned query rows like the default dK / dV kernel."""
    run = emulate(monkeypatch, emu, arch=90)
    emu.set_cuda_kernels(0, 0, 0, 4, False)
    check_nan_query_row(run, torch.bfloat16, what, "causal", False)




def _nan_padded_run(emu, dtype, arch, kind):
    """(clean, poisoned) [out, lse, dq, dk, dv] of the default kernels with NaN in the k and v rows
    of keys that must not be read: past seqlens_k, or hidden by a key-padding bool mask."""
    torch.manual_seed(12)
    b, h, s, d = 2, 2, 150, 64
    q, k, v, dout = (torch.randn(b, h, s, d).to(dtype) for _ in range(4))
    if kind == "seqlens_k":
        o = dict(seqlens_k=torch.tensor([150, 97], dtype=torch.int32))
        hide = torch.zeros(b, s, dtype=torch.bool)
        hide[1, 97:] = True
    else:
        keep = torch.rand(b, s) > 0.3
        o = dict(bias=keep.view(b, 1, 1, s))
        hide = ~keep
    kp, vp = k.clone(), v.clone()
    for t in (kp, vp):
        t.transpose(1, 2)[hide] = float("nan")
    runs = []
    for kk, vv in ((k, v), (kp, vp)):
        args = tc.call_fwd(q, kk, vv, **o)
        out, lse = emu.fwd(q, kk, vv, *args, 1, False, arch)
        grads = emu.bwd(dout, q, kk, vv, out, lse, *args, False, False, None, arch)
        runs.append([out, lse] + list(grads[:3]))
    return runs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_nan_past_seqlens_k(emu, dtype, arch):
    """Keys past seqlens_k are never read: NaN there changes no bit of out, lse, dq, dk or dv."""
    clean, got = _nan_padded_run(emu, dtype, arch, "seqlens_k")
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, clean):
        assert torch.equal(a, r), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_nan_key_padding_bool_mask(emu, dtype, arch):
    """Keys hidden by a key-padding bool mask: bit-identical results with NaN in their k and v.
    The tensor-core kernels zero such elements before their products (nonfinite.cuh); they
    failed this before (a hidden key cost 0 x NaN in P V and dS K)."""
    clean, got = _nan_padded_run(emu, dtype, arch, "key_padding")
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, clean):
        assert torch.equal(a, r), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("mask", ["causal", "bool"])
@pytest.mark.parametrize("which", ["k", "v", "q", "dout"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_nan_hidden_key_reaches_readers_only(monkeypatch, emu, dtype, which, mask, deterministic, arch):
    """A NaN row hidden by a mask from some rows (keys) of its tiles reaches what reads it and
    changes no other bit. k / v: test_cuda.check_nan_hidden_key; 40 of these 48 failed on the
    kernels before nonfinite.cuh and finish_lse (every fp16 / bf16 case; fp32 with k: the LSE).
    q / dout: test_cuda.check_nan_query_row (a NaN query row and the dK / dV of the keys hidden
    from it); 32 of these 48 failed before the dK / dV kernel zeroed poisoned rows (every fp16 /
    bf16 case: dS^T Q and P^T dO added 0 x NaN; the fp32 SIMT kernels visit allowed pairs only)."""
    check = check_nan_hidden_key if which in ("k", "v") else check_nan_query_row
    check(emulate(monkeypatch, emu, arch), dtype, which, mask, deterministic)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_inf_under_softcap(monkeypatch, emu, dtype, deterministic, where, causal, arch):
    """test_cuda.check_inf_under_softcap: an inf q or k element under softcap leaves every output
    and gradient finite (its zero-derivative terms left out, as on the CPU). The fp16 / bf16
    kernels before gave NaN in dq (inf k) and dk (inf q)."""
    check_inf_under_softcap(emulate(monkeypatch, emu, arch), dtype, deterministic, where, causal)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_inf_key_hidden(monkeypatch, emu, dtype, deterministic, arch):
    """test_cuda.check_inf_key_hidden: an inf k element behind a causal edge keeps the dq of the
    rows before it (0 x inf NaN there before, fp16 / bf16)."""
    check_inf_key_hidden(emulate(monkeypatch, emu, arch), dtype, deterministic)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_nan_lse_split(monkeypatch, emu, dtype):
    """test_cuda.check_nan_lse_split: split-KV's merge keeps a NaN LSE."""
    check_nan_lse_split(emulate(monkeypatch, emu), dtype)


# ---------------------------------------------------------------- long rows (float32, SIMT)
def test_low_bits_of_a_row(monkeypatch, emu):
    """test_cuda.check_low_bits_of_a_row: the SIMT forward's l and O and its dQ keep terms below
    half an ulp of their running sums (compensated.cuh). The per-key sums before failed it."""
    check_low_bits_of_a_row(emulate(monkeypatch, emu))


def test_low_bits_of_a_column(monkeypatch, emu):
    """test_cuda.check_low_bits_of_a_column: the SIMT dK / dV sums over a key's queries."""
    check_low_bits_of_a_column(emulate(monkeypatch, emu))


@pytest.mark.bigmem
def test_long_row_exact(monkeypatch, emu):
    """test_cuda.check_long_row_exact at S = 2^24 + 2^19 (D = 8: the emulated warp spends its time
    per key, not per element; 0.6 GB of V): about 2 min."""
    monkeypatch.setattr(tc, "DEV", "cpu")
    check_long_row_exact(lambda q, k, v: emu.fwd(q, k, v, *tc.call_fwd(q, k, v), 1, False, 90), d=8)


@pytest.mark.bigmem
def test_long_row_random(monkeypatch, emu):
    """test_cuda.check_long_row_random in float32 at D = 8 (K and V 0.6 GB each): the SIMT kernel's
    error at most 2x torch SDPA's (CPU) on the same inputs. About 3 min."""
    monkeypatch.setattr(tc, "DEV", "cpu")
    check_long_row_random(lambda q, k, v: emu.fwd(q, k, v, *tc.call_fwd(q, k, v), 1, False, 90), torch.float32, d=8)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_poison_mark_scope(monkeypatch, emu, dtype, arch):
    """test_cuda.check_poison_mark_scope: an inf q under softcap and a NaN q row that sees no key
    (with sinks) keep their finite results."""
    check_poison_mark_scope(emulate(monkeypatch, emu, arch), dtype)


def test_dropout_refused_under_capture(emu):
    """The rule of the CUDA host steps (csrc/torch/softmax_cuda_steps.h): dropout inside a
    CUDA-graph capture raises (a replay would repeat one mask), the same call outside runs. It is
    the op's, so a torch.compile'd graph run inside a capture meets it too."""
    q = torch.randn(1, 2, 8, 16)
    args = tc.call_fwd(q, q, q, dropout_p=0.1, seed=1)
    emu.fwd(q, q, q, *args, 1, False, 80)
    with cuda_emu.capture(emu):
        with pytest.raises(RuntimeError, match="one dropout mask"):
            emu.fwd(q, q, q, *args, 1, False, 80)
        emu.fwd(q, q, q, *tc.call_fwd(q, q, q), 1, False, 80)  # no dropout: fine
