"""The sm_90a wgmma kernels (csrc/softmax/cuda/sm90) in the CPU emulator: the warp-specialized
forward and backward with their cp.async producer, mbarrier ring, named barriers and wgmma
products emulated (target/cuda/wgmma_ops.cuh, cuda_emu.h), against the float64 reference with
test_cuda's rule, selected by set_cuda_kernels(hopper_fwd=1, hopper_bwd=1) on the emulated sm_90.

What this cannot check: the async proxy (the emulator runs a wgmma when it is issued, so a
missing wgmma.wait or proxy fence is invisible), timing, register budgets (setmaxnreg)."""
from __future__ import annotations

import pytest
import torch

from tests.cuda_emu.test_emulated import emu_ops, emulate, needs_dropout_mask  # noqa: F401  (emu_ops: the module fixture)
from tests.softmax import test_cuda as tc


@pytest.fixture
def hopper(emu_ops):
    """The wgmma forward and backward selected (the product's defaults on sm_90), then the
    mma.sync kernels again."""
    emu_ops.set_cuda_kernels(1, 1, 0, 0, False)
    emu_ops.set_schedule(True, False)
    yield emu_ops
    emu_ops.set_cuda_kernels(0, 0, 0, 0, False)
    emu_ops.set_schedule(True, False)


def test_path(hopper):
    q = torch.randn(1, 2, 64, 64).bfloat16()
    assert hopper.path(q, q, q, 90) == "hopper-wgmma"
    assert hopper.path(q, q, q, 80) == "tensor-core"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 128, 40])
@pytest.mark.parametrize("sq,sk,causal", [(1, 1, False), (70, 200, False), (200, 130, True), (129, 129, True)])
def test_forward_backward(monkeypatch, hopper, dtype, d, sq, sk, causal):
    """Odd lengths (partial tiles of queries and keys, ring wrap-around), both head-dim buckets
    and a padded one (d = 40 in the 64 bucket), causal bottom-right and not."""
    emulate(monkeypatch, hopper, arch=90)
    hopper.launches()
    torch.manual_seed(sq * 7 + sk + d)
    tc.run_and_compare(1, 2, 1, sq, sk, d, dtype, window=(-1, 0) if causal else (-1, -1), bottom_right=True)
    names = hopper.launches()
    assert any("hopper::fwd_kernel" in n for n in names), names
    assert any("hopper::bwd_kernel" in n for n in names), names


@pytest.mark.parametrize("o", [dict(window=(40, 10)), dict(h_k=1), dict(seqlens_k=True)], ids=str)
def test_options(monkeypatch, hopper, o):
    """What the wgmma kernels take besides plain causal: a sliding window, GQA (MQA here) and
    per-batch key lengths."""
    emulate(monkeypatch, hopper, arch=90)
    torch.manual_seed(5)
    kw = dict(o)
    hk = kw.pop("h_k", 2)
    if kw.pop("seqlens_k", False):
        kw["seqlens_k"] = torch.tensor([150, 37], dtype=torch.int32)
    tc.run_and_compare(2, 2, hk, 130, 150, 64, torch.bfloat16, **kw)


@pytest.mark.parametrize("warp_serial,reverse", [(False, False), (True, True)])
def test_schedules(monkeypatch, hopper, warp_serial, reverse):
    """Lockstep and last-warp-first interleavings of the producer and consumer warpgroups: a
    consumer that read a ring slot before its "full" barrier, or a producer that refilled one
    before its "empty" barrier, would read the NaN fill of an unfinished cp.async."""
    hopper.set_schedule(warp_serial, reverse)
    emulate(monkeypatch, hopper, arch=90)
    torch.manual_seed(9)
    tc.run_and_compare(1, 2, 1, 150, 300, 64, torch.bfloat16, window=(-1, 0))


def _mask(kind):
    """(B = 2, ., Sq = 130, Sk = 150) masks of test_score_options: a float bias without its
    gradient (the backward stays on wgmma), a bool key mask, a bool mask with a fully masked row."""
    g = torch.Generator().manual_seed(3)
    if kind == "bias":
        return torch.randn(1, 2, 130, 150, generator=g)
    if kind == "row_bias":  # broadcast over the query rows: dbias sums them (atomics)
        return torch.randn(2, 1, 1, 150, generator=g)
    if kind == "key_mask":
        return torch.rand(2, 1, 1, 150, generator=g) > 0.3
    m = torch.rand(2, 1, 130, 150, generator=g) > 0.4
    m[:, :, 7] = False
    return m


@pytest.mark.parametrize("o", [dict(softcap=5.0), dict(alibi=True), dict(softcap=3.0, alibi=True, window=(-1, 0)),
                               dict(alibi=True, window=(40, 10), h_k=1), dict(mask="bias", h_k=1),
                               dict(mask="key_mask", window=(-1, 0)), dict(mask="bool_rows", softcap=4.0),
                               dict(dropout_p=0.2, seed=1234, offset=7),
                               dict(dropout_p=0.3, seed=5, offset=0, window=(-1, 0), h_k=1, alibi=True),
                               dict(mask="bias", bias_grad=True, h_k=1), dict(mask="row_bias", bias_grad=True,
                                                                              window=(-1, 0), dropout_p=0.1, seed=3)],
                         ids=str)
def test_score_options(monkeypatch, hopper, o):
    """hopper_fwd = hopper_bwd = 2: softcap, ALiBi, an additive bias and its gradient (also one
    broadcast over the query rows: atomics), bool masks and dropout (the mma.sync kernels' Philox
    stream) on the wgmma forward and backward (every element through the policy, GQA heads each
    with their own slope and bias); at 1 they stay on mma.sync."""
    emulate(monkeypatch, hopper, arch=90)
    torch.manual_seed(11)
    kw = dict(o)
    needs_dropout_mask(kw)
    hk = kw.pop("h_k", 2)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(2, 2) * 0.3  # (B, H)
    if "mask" in kw:
        kw["bias"] = _mask(kw.pop("mask"))
    for level in (1, 2):
        hopper.set_cuda_kernels(level, level, 0, 0, False)
        hopper.launches()
        tc.run_and_compare(2, 2, hk, 130, 150, 64, torch.bfloat16, bottom_right=True, **kw)
        names = hopper.launches()
        assert any("hopper::fwd_kernel" in n for n in names) == (level == 2), names
        assert any("hopper::bwd_kernel" in n for n in names) == (level == 2), names


@pytest.mark.parametrize("o", [dict(softcap=5.0, window=(-1, 0)), dict(alibi=True, h_k=1),
                               dict(dropout_p=0.2, seed=77, offset=3, window=(-1, 0)),
                               dict(dropout_p=0.1, seed=5, offset=0, bias=True, bias_grad=True)], ids=str)
def test_score_options_hd128(monkeypatch, hopper, o):
    """hopper_fwd = hopper_bwd = 2 at the 128 bucket (one 64-query block per ring slot in the
    backward, the other dQ split), GQA heads with their own ALiBi slopes, dropout (the backward
    draws a sub-block's keep bits first, then the per-element pass reads them) and dbias."""
    emulate(monkeypatch, hopper, arch=90)
    torch.manual_seed(12)
    kw = dict(o)
    needs_dropout_mask(kw)
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(1, 4, 100, 140)
    hk = kw.pop("h_k", 2)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(4) * 0.3  # (H,)
    hopper.set_cuda_kernels(2, 2, 0, 0, False)
    hopper.launches()
    tc.run_and_compare(1, 4, hk, 100, 140, 128, torch.float16, bottom_right=True, **kw)
    names = hopper.launches()
    assert any("hopper::fwd_kernel" in n for n in names) and any("hopper::bwd_kernel" in n for n in names), names


@pytest.mark.parametrize("form", ["bf16_level1", "bf16_level2", "fp16_level2", "int8", "fp8"])
@pytest.mark.parametrize("mask", ["causal", "bool", "key_mask", "causal_d128"])
def test_nan_v_hidden_key_reaches_readers_only(hopper, form, mask):
    """test_cuda.check_nan_v_forward on the wgmma forward (every instance: the 16-bit one at levels 1
    and 2, the int8 and fp8 Q.K^T ones): the producer zeroes the non-finite elements of a V tile
    that may hide keys and the consumers give them back to their readers (sm90/fwd_kernel.cuh);
    before, 0 x NaN reached every row of the tile (a mutation that skips either half fails)."""
    if form == "bf16_level1" and mask in ("bool", "key_mask"):
        pytest.skip("a bool mask runs on the wgmma forward at level 2 only")
    level = 1 if form == "bf16_level1" else 2
    hopper.set_cuda_kernels(level, level, 0, 0, False)

    def run_fwd(q, k, v, **o):
        hopper.launches()
        if form in ("int8", "fp8"):
            res = hopper.fwd_quant(q, k, v, *tc.call_fwd(q, k, v, **o), form, 90)
        else:
            res = hopper.fwd(q, k, v, *tc.call_fwd(q, k, v, **o), 1, False, 90)
        assert any("hopper::fwd_kernel" in n for n in hopper.launches())
        return res
    tc.check_nan_v_forward(run_fwd, torch.float16 if form == "fp16_level2" else torch.bfloat16,
                           mask.removesuffix("_d128"), d=128 if mask.endswith("_d128") else 64)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("what,mask,level", tc.HOPPER_BWD_NONFINITE, ids=lambda x: str(x))
def test_bwd_nonfinite(monkeypatch, hopper, dtype, what, mask, level):
    """test_cuda.check_hopper_bwd_nonfinite (the NaN policy on the wgmma backward) in the
    emulator; every case failed before the kernel zeroed K's non-finite elements for dQ, poisoned
    query rows and, under softcap, Q's inf elements for dK (disabling any one fails its cases)."""
    hopper.set_cuda_kernels(min(level, 2), min(level, 2), 0, 0, False)
    run = emulate(monkeypatch, hopper, arch=90)

    def run_checked(*a, **o):
        hopper.launches()
        res = run(*a, **o)
        names = hopper.launches()
        assert any("hopper::bwd_kernel" in n for n in names), names
        return res
    tc.check_hopper_bwd_nonfinite(run_checked, dtype, what, mask, level)
