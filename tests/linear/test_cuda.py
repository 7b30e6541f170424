"""The linear attention op on a GPU (csrc/linear/cuda): forward and every gradient against the
float64 reference with the project rule, through test_cpu.run_case with CUDA as the default
device. Skips without a GPU or without the compiled CUDA kernels; tests/cuda_emu runs the same
kernels on the CPU on every CI run."""
from __future__ import annotations

import warnings

import pytest
import torch

import attention_ext as ae
from attention_ext.linear import functional, ops, reference
from tests.linear.test_cpu import run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not ops.has_kernel(torch.device("cuda")),
                                reason="no GPU, or no CUDA linear kernel in this build")
LOW = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True, params=["chunk_parallel", "sequential", "chunk_states"])
def on_cuda(request):
    """Every test on the three schedules of the tensor-core kernels: the chunk-parallel default,
    the sequential kernels (set_cuda_kernels(chunk_parallel=False)) and the chunk-state forward
    (chunk_states=True; calls whose rows are not 16-byte vectors fall back to the default)."""
    old = ae.linear.set_cuda_kernels(chunk_parallel=request.param != "sequential",
                                     chunk_states=request.param == "chunk_states")
    try:
        with torch.device("cuda"):
            yield
    finally:
        ae.linear.set_cuda_kernels(**old)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s", [1, 7, 63, 65, 1000])
def test_sizes(s, causal, dtype):
    run_case(s, dtype, causal=causal, m=8, dv=12)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("m,dv", [(16, 40), (40, 16), (64, 64), (128, 96), (136, 8), (300, 20)])
def test_head_dims(m, dv, dtype):
    run_case(129, dtype, causal=True, m=m, dv=dv, decay=True, init=True)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("opt", ["decay", "init", "mask", "gqa_bshd", "all"])
def test_options(opt, dtype):
    kw = dict(decay=dict(decay=True), init=dict(init=True), mask=dict(mask=True),
              gqa_bshd=dict(b=2, h=6, hk=2, layout="bshd"), all=dict(decay=True, init=True, mask=True, b=2, h=4,
                                                                       hk=2))[opt]
    run_case(97, dtype, causal=True, **kw)
    if "decay" not in kw:
        run_case(97, dtype, causal=False, **kw)


@pytest.fixture
def chunk_parallel():
    """The chunk-parallel forward (linear.set_cuda_kernels) for one test, segments of 2 chunks so
    that a segment's state update runs too; the previous selection after it."""
    old = ae.linear.set_cuda_kernels(chunk_parallel=True, segment_chunks=2)
    yield
    ae.linear.set_cuda_kernels(**old)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s", [1, 65, 300, 1000])
def test_chunk_parallel_sizes(chunk_parallel, s, causal, dtype):
    run_case(s, dtype, causal=causal, m=64, dv=72, decay=causal, init=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("opt", ["mask", "gqa_bshd", "all", "odd_width"])
def test_chunk_parallel_options(chunk_parallel, opt, dtype):
    kw = dict(mask=dict(mask=True), gqa_bshd=dict(b=2, h=6, hk=2, layout="bshd"),
              all=dict(decay=True, init=True, mask=True, b=2, h=4, hk=2, m=128, dv=128),
              odd_width=dict(m=20, dv=36, decay=True))[opt]
    run_case(333, dtype, causal=True, **kw)
    if "decay" not in kw:
        run_case(333, dtype, causal=False, **kw)


def test_chunk_parallel_heuristic_long():
    """The default segment count (fill the device) on a long sequence, against the sequential forward."""
    q, k, v = (torch.randn(1, 2, 20000, 64, dtype=torch.bfloat16) * 0.5 for _ in range(3))
    g = -0.01 * torch.rand(1, 2, 20000)
    old = ae.linear.set_cuda_kernels(chunk_parallel=False)
    try:
        seq = ae.linear_attention(q, k, v, causal=True, decay=g)
    finally:
        ae.linear.set_cuda_kernels(**old)
    old = ae.linear.set_cuda_kernels(chunk_parallel=True)
    try:
        par = ae.linear_attention(q, k, v, causal=True, decay=g)
    finally:
        ae.linear.set_cuda_kernels(**old)
    torch.testing.assert_close(par.float(), seq.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_longer_than_max_seqlen(causal, dtype):
    """CUDA does not check max_seqlen against the offsets (they live on the device): a pack whose
    300-row sequence is past max_seqlen = 64 still gets that sequence computed whole, on every
    schedule (the chunk-state kernels stride over its chunks), gradients included: the same
    outputs as with the right max_seqlen, and the float64 reference's."""
    cu = torch.tensor([0, 50, 350, 351], dtype=torch.int32)
    h, m, dv, total = 2, 64, 72, 351
    acc = ops.acc_dtype(dtype)
    q, k = (0.5 * torch.randn(1, h, total, m)).to(dtype), (0.5 * torch.randn(1, 1, total, m)).to(dtype)
    v = torch.randn(1, 1, total, dv).to(dtype)
    g = -0.05 * torch.rand(1, h, total, dtype=acc) if causal else None

    def run(max_seqlen):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, _, final = ops.fwd(*xs, decay=g, initial_state=None, key_mask=None, cu_seqlens=cu,
                                max_seqlen=max_seqlen, feature_map=1, causal=causal, normalize=True, eps=1e-6,
                                scale=0.5)
        out.backward(torch.ones_like(out))
        return [out, final] + [t.grad for t in xs]

    right, short = run(300), run(64)
    for name, a, b in zip(("out", "final_state", "dq", "dk", "dv"), right, short):
        assert torch.isfinite(b).all(), name
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2, msg=name)
    r = reference.linear_attention(q.double(), k.double(), v.double(), causal=causal, scale=0.5,
                                   decay=None if g is None else g.double(), cu_seqlens=cu)
    torch.testing.assert_close(short[0].double(), r[0], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("fmap,normalize", [("relu", True), ("identity", False), ("favor", True)])
def test_feature_maps(fmap, normalize):
    run_case(65, torch.bfloat16, causal=True, fmap=fmap, normalize=normalize)


def test_float64_runs_the_reference_with_a_warning():
    q = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ae.linear_attention(q, q, q, causal=True)
    assert out.device.type == "cuda" and out.dtype == torch.float64
    assert ("cuda", torch.float64) in functional._warned_fallback  # warned once per (device, dtype)
    with pytest.raises(TypeError, match="float64"):
        ops.fwd(q, q, q, decay=None, initial_state=None, key_mask=None, cu_seqlens=None, max_seqlen=9, feature_map=1,
                causal=True, normalize=True, eps=1e-6, scale=1.0)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("code", [0, 1])
@pytest.mark.parametrize("t,decay,normalize,hk", [(1, False, True, 4), (1, True, True, 2), (3, True, True, 1),
                                                   (6, False, False, 2)])
@pytest.mark.parametrize("m,dv", [(7, 9), (64, 64), (128, 128), (33, 1)])
def test_step_kernel(m, dv, t, decay, normalize, hk, code, dtype):
    """The CUDA linear_step kernel against the float64 reference step (tests/linear/test_step.py's
    rule): out, and the state and normalizer advanced in place."""
    from attention_ext.linear import reference
    from tests.helpers import assert_close_fa2
    from tests.linear.test_step import step_problem

    assert ops.has_step_kernel(torch.device("cuda"), dtype)
    with torch.device("cpu"):
        cpu = step_problem(hk=hk, t=t, m=m, dv=dv, dtype=dtype, decay=decay, normalize=normalize)
    q, k, v, s0, z0, gate = (None if x is None else x.cuda() for x in cpu)
    s, z = s0.clone(), None if z0 is None else z0.clone()
    kw = dict(feature_map=code, eps=1e-6, scale=0.7)
    out = ops.step(q, k, v, s, z, gate, **kw)

    def ref(rdt):
        sdt = torch.float64 if rdt == torch.float64 else ops.acc_dtype(dtype)
        qc, kc, vc, sc, zc, gc = cpu
        return reference.linear_step(*(x.to(rdt) for x in (qc, kc, vc)), sc.to(sdt).clone(),
                                     None if zc is None else zc.to(sdt).clone(), None if gc is None else gc.to(sdt),
                                     inplace=True, **kw)

    with torch.device("cpu"):
        r_out, r_s, r_z = ref(torch.float64)
        lo_out, lo_s, lo_z = ref(dtype)
    assert_close_fa2(out.cpu(), lo_out, r_out, dtype, "out")
    assert_close_fa2(s.cpu(), lo_s, r_s, torch.float32, "state")
    if normalize:
        assert_close_fa2(z.cpu(), lo_z, r_z, torch.float32, "normalizer")
