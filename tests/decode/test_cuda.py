"""The CUDA decode kernels (csrc/decode/cuda) on a real GPU against reference.decode_attention in
float64, through ops.decode_fwd (flash-attn layout) and the registered op, with the project rule
(tests/decode/cases.check: <= 2x PyTorch's same-dtype error + a floor). The caching allocator's
free memory is filled with NaN before each call, so an unwritten element cannot pass. The same
cases run in the CPU emulator in CI (tests/cuda_emu/test_decode_emulated.py); here the hardware
confirms them, with bigger caches and the heuristic's real SM count.

Skips cleanly without a GPU or without the compiled CUDA kernels.
"""
from __future__ import annotations

import pytest
import torch

from attention_ext.decode import ops
from tests.decode.cases import Case, check, make_inputs, op_args, option_sets

CUDA = torch.cuda.is_available() and ops.HAS_EXT and ops.has_kernel(torch.device("cuda"))
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a GPU and the compiled CUDA decode kernel")
DEV = "cuda"


@pytest.fixture(autouse=True, params=["cuda_cores", "tensor_cores"])
def kernel(request):
    """Every test on both CUDA kernels (ops.set_cuda_kernels): the CUDA-core one (the default) and
    the tensor-core one (fp16 / bf16, head dims that are multiples of 8 up to 128; the other calls
    take the CUDA-core kernel under either selection)."""
    old = ops.set_cuda_kernels(tensor_cores=request.param == "tensor_cores")
    yield request.param
    ops.set_cuda_kernels(**old)


def poison_allocator(nbytes: int) -> None:
    blocks = []
    for n in (nbytes, nbytes // 2, nbytes // 4, 1 << 20, 1 << 16):
        t = torch.empty(max(n // 4, 1), device=DEV, dtype=torch.float32)
        t.fill_(float("nan"))
        blocks.append(t)
    del blocks


def run(c: Case, what=""):
    q, k, v, idx, kw, alibi, sinks = make_inputs(c, DEV)
    poison_allocator(4 * (q.numel() * 64 + (1 << 20)))
    out, lse = ops.decode_fwd(q, k, v, **idx, alibi_slopes=alibi, sinks=sinks, scale=kw["softmax_scale"],
                              softcap=kw["softcap"], window_left=kw["window_size"][0],
                              window_right=kw["window_size"][1], num_splits=c.num_splits)
    torch.cuda.synchronize()
    check(c, out, lse, q, k, v, idx, kw, alibi, sinks, what or repr(c))


@pytest.mark.parametrize("splits", [1, 3, 0])
@pytest.mark.parametrize("page", [None, 16, 5, 256], ids=["contiguous", "page16", "page5", "page256"])
@pytest.mark.parametrize("sq", [1, 2, 7])
def test_layouts(page, splits, sq):
    run(Case(sq=sq, page=page, num_splits=splits, dtype=torch.bfloat16 if sq != 2 else torch.float16,
             seqlens=(0, 1, 377, 1000)))


OPTIONS = option_sets(10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [1, 4, 0])
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_options(opt, splits, dtype):
    run(Case(sq=7 if splits == 1 else 2, num_splits=splits, dtype=dtype, seqlens=(0, 1, 500, 2000),
             **OPTIONS[opt]))


@pytest.mark.parametrize("h,hk,sq", [(8, 1, 7), (8, 8, 1), (8, 2, 1), (32, 8, 1), (16, 2, 3)], ids=str)
def test_heads(h, hk, sq):
    run(Case(h=h, hk=hk, sq=sq, num_splits=0, sinks=True, window=(-1, 0), b=3, seqlens=(1, 700, 4000)))


@pytest.mark.parametrize("d", [32, 40, 64, 80, 96, 128, 160, 200, 256, 33])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_head_dims(d, dtype):
    run(Case(d=d, dtype=dtype, b=2, h=4, hk=2, sq=2, seqlens=(450, 9), num_splits=0, page=16))


def test_long_cache_heuristic():
    # B 2 x H_k 2 = 4 CTAs unsplit: the heuristic splits a 64k cache over the SMs
    run(Case(b=2, h=16, hk=2, d=128, seqlens=(65536, 30001), num_splits=0, page=256))


def test_unaligned_cache():
    # a cache view whose rows are not 16-byte aligned: the element-by-element load path
    c = Case(b=2, h=4, hk=2, d=64, dtype=torch.float16, seqlens=(300, 41), num_splits=2)
    q, k, v, idx, kw, alibi, sinks = make_inputs(c, DEV)
    k2 = torch.empty(*k.shape[:-1], 65, dtype=k.dtype, device=DEV)[..., 1:]
    v2 = torch.empty_like(k2)
    k2.copy_(k)
    v2.copy_(v)
    out, lse = torch.ops.attention_ext.decode_fwd(*op_args(c, q, k2, v2, idx, kw, alibi, sinks), c.num_splits)
    check(c, out.transpose(1, 2), lse, q, k, v, idx, kw, alibi, sinks, "unaligned")


def test_matches_cpu_kernel():
    # the CUDA and CPU kernels of the same op agree (both fp32-accumulating)
    c = Case(b=3, h=8, hk=2, sq=2, d=128, seqlens=(0, 333, 1200), page=16, sinks=True, alibi=True, num_splits=0)
    q, k, v, idx, kw, alibi, sinks = make_inputs(c, DEV)
    args = op_args(c, q, k, v, idx, kw, alibi, sinks)
    out, lse = torch.ops.attention_ext.decode_fwd(*args, 0)
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    out_c, lse_c = torch.ops.attention_ext.decode_fwd(*cpu_args, 0)
    torch.testing.assert_close(out.cpu().float(), out_c.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), lse_c, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("granularity", ["token", "head"])
@pytest.mark.parametrize("qdt", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("layout", [dict(), dict(page=16), dict(page=5, leftpad=True), dict(batch_idx=True)],
                         ids=["contiguous", "page16", "page5_leftpad", "batch_idx"])
def test_8bit_caches(layout, qdt, granularity, kernel):
    """int8 / e4m3 caches on the CUDA-core kernel (decode.set_cuda_kernels(quantized=True)) against
    decode over the dequantized cache, as in the emulator (tests/cuda_emu/test_decode_emulated.py)."""
    from tests.decode.test_quant import quantize_case, run_check

    c = Case(b=4, h=8, hk=2, sq=1, d=128, dtype=torch.bfloat16, seqlens=(0, 1, 977, 3000), num_splits=0, **layout)
    old = ops.set_cuda_kernels(**{**ops.cuda_kernels(), "quantized": True})
    try:
        def fwd(q, kq, vq, ks, vs, idx, kw, alibi, sinks):
            to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
            out, lse = ops.decode_fwd(to(q), to(kq), to(vq), **{n: to(t) for n, t in idx.items()},
                                      alibi_slopes=to(alibi), sinks=to(sinks), scale=kw["softmax_scale"],
                                      softcap=kw["softcap"], window_left=kw["window_size"][0],
                                      window_right=kw["window_size"][1], num_splits=c.num_splits,
                                      k_descale=to(ks), v_descale=to(vs))
            torch.cuda.synchronize()
            return out.cpu(), lse.cpu()

        run_check(c, qdt, granularity, f"{qdt} {granularity} {layout}", fwd=fwd)
    finally:
        ops.set_cuda_kernels(**old)
