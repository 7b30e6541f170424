"""The delta rule's CUDA forwards (csrc/linear/cuda/delta_kernel.cuh, recurrent, and
delta_chunk_kernel.cuh, chunk-parallel: the tests with `chunked`) on a GPU, through the public
functions: outputs and final states against the float64 recurrence with the project rule (2x
PyTorch's same-dtype error), every lane split of a column (K from 5 to 600), GVA, the gates, the
L2 norm, varlen packs, hard resets, the in-place step, and calls that need gradients (PyTorch
on CUDA: the chunked WY form or the recurrence). Skips without a GPU or without the compiled CUDA kernel;
tests/cuda_emu/test_delta_emulated.py and test_delta_chunk_emulated.py run the same kernels on the
CPU on every CI run."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.linear import delta, reference
from tests.cuda_emu.test_delta_emulated import CASES
from tests.helpers import assert_close_fa2
from tests.linear.test_delta import problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not delta.has_kernel(torch.device("cuda")),
                                reason="no GPU, or no CUDA delta kernel in this build")
F64 = torch.float64


def check(dtype, q, k, v, beta, g, h0, *, l2=False, cu=None, what=""):
    dev = "cuda"
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    bd, gd = beta.float(), g.float() if g is not None else None
    h = h0.float() if h0 is not None else None
    out, st = ae.delta_rule_attention(*(t.to(dev) for t in (qd, kd, vd, bd)), gate=gd.to(dev) if gd is not None else None,
                                      initial_state=h.to(dev) if h is not None else None, return_state=True,
                                      qk_l2norm=l2, cu_seqlens=cu.to(dev) if cu is not None else None)
    out, st = out.cpu(), st.cpu()
    ins64 = [t.to(F64) for t in (qd, kd, vd, bd)]
    ref_out, ref_st = reference.delta_rule(*ins64, gd.to(F64) if gd is not None else None, None,
                                           h.to(F64) if h is not None else None, cu, l2)
    t_out, t_st = reference.delta_rule(qd, kd, vd, bd.to(dtype), gd.to(dtype) if gd is not None else None, None,
                                       h.to(dtype) if h is not None else None, cu, l2, acc=dtype)
    assert torch.isfinite(out).all() and torch.isfinite(st).all(), what
    assert_close_fa2(out, t_out, ref_out, dtype, f"{what} out")
    assert_close_fa2(st, t_st, ref_st, dtype, f"{what} final state")
    return out, st


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES + [(2, 4, 1000, 128, 128, "head", True), (1, 2, 300, 256, 64, "key", True)],
                         ids=lambda c: "-".join(map(str, c)))
def test_forward(case, dtype):
    hk, hv, s, kd, vd, gate, l2 = case
    check(dtype, *problem(b=2, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate), l2=l2, what=str(case))


def test_varlen_and_hard_reset():
    cu = torch.tensor([0, 9, 9, 30, 41], dtype=torch.int32)
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=45, kd=24, vd=10, gate="key", nseq=4)
    g[:, :, 20] = float("-inf")
    out, st = check(torch.float32, q, k, v, beta, g, h0, l2=True, cu=cu)
    assert (out[:, :, 41:] == 0).all()


@pytest.fixture
def chunked():
    """The chunk-parallel forward (delta_chunk_kernel.cuh) for every call it takes."""
    old = ae.linear.set_cuda_kernels(**{**ae.linear.cuda_kernels(), "delta_chunked": True})
    yield
    ae.linear.set_cuda_kernels(**old)


@pytest.mark.parametrize("case", [(1, 1, 1, 8, 8, None, False), (1, 2, 63, 16, 24, None, False),
                                  (2, 4, 64, 64, 72, "head", True), (1, 3, 130, 72, 8, "head", False),
                                  (2, 4, 1000, 128, 128, "head", True), (1, 2, 3000, 128, 136, "head", True),
                                  (2, 2, 700, 120, 64, None, True), (2, 4, 64, 64, 72, "key", True),
                                  (1, 3, 130, 72, 8, "key", False), (2, 4, 1000, 128, 128, "key", True),
                                  (1, 2, 3000, 128, 136, "key", True)],
                         ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_chunked(chunked, case, dtype):
    """The chunk kernels (bf16, fp16) on the same rule; the cases of
    tests/cuda_emu/test_delta_chunk_emulated.py and longer ones."""
    hk, hv, s, kd, vd, gate, l2 = case
    check(dtype, *problem(b=2, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate), l2=l2, what=str(case))


@pytest.mark.parametrize("r", [17, 64, 100])
def test_chunked_varlen_and_hard_resets(chunked, r):
    """A pack whose sequences start mid-chunk (an empty one included), and a -inf gate at row r."""
    cu = torch.tensor([0, 70, 70, 135, 200], dtype=torch.int32)
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=205, kd=64, vd=24, gate="head", nseq=4)
    g[:, :, r] = float("-inf")
    out, _ = check(torch.bfloat16, q, k, v, beta, g, h0, l2=True, cu=cu)
    assert (out[:, :, 200:] == 0).all()


@pytest.mark.parametrize("r", [5, 64, 100])
def test_chunked_per_key_hard_resets(chunked, r):
    """Per-key gates (KDA) with -inf in some channels at row r and in every channel 20 rows later."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=205, kd=64, vd=24, gate="key")
    g[:, :, r, ::3] = float("-inf")
    g[:, :, r + 20] = float("-inf")
    check(torch.bfloat16, q, k, v, beta, g, h0, l2=True)


def test_chunked_gla_per_feature_decay(chunked):
    """linear_attention with GLA's per-feature decay (the plain write over per-key gates) on the
    chunk kernels, against the same call in float64 on the CPU's PyTorch reference, under the
    bf16 rule's tolerance of the module (loose: the feature map's output is compared)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 300, 64, generator=g) for _ in range(3))
    dec = -torch.rand(2, 2, 300, 64, generator=g) * 0.3
    got = ae.linear_attention(*(t.cuda().bfloat16() for t in (q, k, v)), decay=dec.cuda(), causal=True)
    ref = ae.linear_attention(*(t.double() for t in (q, k, v)), decay=dec.double(), causal=True)
    torch.testing.assert_close(got.cpu().double(), ref, rtol=3e-2, atol=3e-2)


def test_chunked_gla_per_feature_decay_backward(chunked):
    """The same call's gradients (the chunk backward's plain write) against float64 on the CPU,
    compared by relative norm (bf16 inputs)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=g) for _ in range(3))
    dec = -torch.rand(1, 2, 200, 64, generator=g) * 0.3
    dout = torch.randn(1, 2, 200, 64, generator=g)
    ins = [t.cuda().bfloat16().requires_grad_() for t in (q, k, v)] + [dec.cuda().requires_grad_()]
    got = torch.autograd.grad(ae.linear_attention(*ins[:3], decay=ins[3], causal=True), ins, dout.cuda().bfloat16())
    ref_ins = [t.double().requires_grad_() for t in (q, k, v, dec)]
    ref = torch.autograd.grad(ae.linear_attention(*ref_ins[:3], decay=ref_ins[3], causal=True), ref_ins, dout.double())
    for a, r in zip(got, ref):
        assert (a.cpu().double() - r).norm() <= 3e-2 * r.norm()


def test_chunked_long_sequence_matches_recurrent():
    """S = 8192: the chunk kernels against the recurrent kernel (both bf16 in, fp32 state) and the
    float64 recurrence at the bench's Gated DeltaNet shape, one head."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=8192, kd=128, vd=128, gate="head")
    old = ae.linear.set_cuda_kernels(**{**ae.linear.cuda_kernels(), "delta_chunked": True})
    try:
        out_c, st_c = check(torch.bfloat16, q, k, v, beta, g, h0, l2=True, what="chunked")
    finally:
        ae.linear.set_cuda_kernels(**old)
    out_r, st_r = check(torch.bfloat16, q, k, v, beta, g, h0, l2=True, what="recurrent")
    torch.testing.assert_close(out_c.float(), out_r.float(), rtol=5e-2, atol=5e-2)


def test_chunked_kda_long_sequence_matches_recurrent():
    """The same at S = 8192 with per-key gates (KDA's shape, one head)."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=8192, kd=128, vd=128, gate="key")
    old = ae.linear.set_cuda_kernels(**{**ae.linear.cuda_kernels(), "delta_chunked": True})
    try:
        out_c, _ = check(torch.bfloat16, q, k, v, beta, g, h0, l2=True, what="chunked")
    finally:
        ae.linear.set_cuda_kernels(**old)
    out_r, _ = check(torch.bfloat16, q, k, v, beta, g, h0, l2=True, what="recurrent")
    torch.testing.assert_close(out_c.float(), out_r.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("case", [(1, 2, 63, 16, 24, "head", True), (2, 4, 300, 128, 128, "head", True),
                                  (1, 1, 1000, 64, 72, None, False), (2, 2, 700, 120, 136, "head", True),
                                  (1, 2, 63, 16, 24, "key", True), (2, 4, 300, 128, 128, "key", True),
                                  (2, 2, 700, 120, 136, "key", False)],
                         ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_backward_chunked(chunked, case, dtype):
    """Calls that need gradients under delta_chunked=True: the chunk-parallel backward, every
    gradient within 2x autograd's error in the call's dtype
    (tests/cuda_emu/test_delta_chunk_bwd_emulated.py's rule) against float64."""
    from tests.cuda_emu.test_delta_chunk_bwd_emulated import autograd
    hk, hv, s, kd, vd, gate, l2 = case
    q, k, v, beta, g, h0 = problem(b=2, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate)
    qd, kd_, vd_ = (t.to(dtype) for t in (q, k, v))
    bd, gd, hh = beta.to(dtype).float(), g.float() if g is not None else None, h0.float()
    leaves = [t.cuda().requires_grad_() for t in (qd, kd_, vd_, bd)] + \
        ([gd.cuda().requires_grad_()] if gd is not None else []) + [hh.cuda().requires_grad_()]
    gi = leaves[4] if gd is not None else None
    out, fin = ae.delta_rule_attention(*leaves[:4], gate=gi, initial_state=leaves[-1], return_state=True, qk_l2norm=l2)
    dout = torch.randn_like(out)
    dh = torch.randn_like(fin)
    grads = torch.autograd.grad((out * dout).sum() + (fin * dh).sum(), leaves)
    ins = (qd, kd_, vd_, bd, gd, hh)
    r64 = autograd(F64, *(t.double() if t is not None else None for t in ins), dout.cpu().double(), dh.cpu().double(),
                   l2, None)
    rt = autograd(dtype, *ins, dout.cpu(), dh.cpu(), l2, None)
    for a, r, t in zip(grads, r64, rt):
        assert torch.isfinite(a).all()
        assert_close_fa2(a.cpu().float(), t.float(), r, dtype, str(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_then_inplace_steps(dtype):
    q, k, v, beta, g, h0 = (t.cuda() for t in problem(b=2, hk=1, hv=2, s=20, kd=128, vd=128, gate="head"))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    beta, g, h0 = beta.float(), g.float(), h0.float()
    whole, final = ae.delta_rule_attention(q, k, v, beta, gate=g, initial_state=h0, return_state=True, qk_l2norm=True)
    out, state = ae.delta_rule_attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], beta[:, :, :12], gate=g[:, :, :12],
                                         initial_state=h0, return_state=True, qk_l2norm=True)
    outs = [out]
    for t in range(12, 20):
        o, state = ae.delta_rule_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], beta[:, :, t:t + 1].contiguous(),
                                      state, gate=g[:, :, t:t + 1].contiguous(), qk_l2norm=True, inplace=True)
        outs.append(o)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(torch.cat(outs, 2).float(), whole.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate", ["head", "key"])
def test_grad_calls_run_pytorch(gate):
    """No backward kernel on CUDA yet: a call that needs gradients runs PyTorch (the chunked WY
    form with a per-head gate, the recurrence with per-key gates), matching the forward kernel's
    output and the float64 gradients."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=70, kd=32, vd=16, gate=gate)
    cu = [t.float().cuda() for t in (q, k, v, beta, g, h0)]
    with torch.no_grad():
        fast = ae.delta_rule_attention(*cu[:4], gate=cu[4], initial_state=cu[5], qk_l2norm=True)
    ins = [t.clone().requires_grad_() for t in cu]
    slow = ae.delta_rule_attention(*ins[:4], gate=ins[4], initial_state=ins[5], qk_l2norm=True)
    torch.testing.assert_close(slow.detach(), fast, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(slow.sum(), ins)
    ins64 = [t.detach().cpu().double().requires_grad_() for t in cu]
    ref = ae.delta_rule_attention(*ins64[:4], gate=ins64[4], initial_state=ins64[5], qk_l2norm=True)
    refs = torch.autograd.grad(ref.sum(), ins64)
    for a, r in zip(grads, refs):
        torch.testing.assert_close(a.cpu().double(), r, rtol=1e-4, atol=1e-4)
