"""The CUDA decode kernels (csrc/decode/cuda) run on the CPU by the host emulator
(tests/cuda_emu, module attention_ext_emu_decode built by emulator.load_decode()) against
reference.decode_attention in float64, with the project rule: error <= 2x PyTorch's own
same-dtype error plus a small floor (tests/decode/cases.check).

torch.ops.attention_ext_emu_decode.decode_fwd runs the real binding's host steps
(csrc/torch/decode_cuda_steps.h) with out, lse and the split scratch starting as NaN, so an element
the kernels miss fails here. Covered: contiguous vs paged caches (page 16 and 5, pages shuffled),
one split vs several (the combine kernel), ragged cache_seqlens with 0 and 1, q_len 1 / 2 / 7,
GQA (8 / 2), MQA, MHA, the row-block loop (R = G x Sq > 8), window, causal, sinks, ALiBi,
softcap, cache_batch_idx, leftpad, fp16 / bf16 / fp32, head dims 64 / 128 / 80 / 256 / 33 (the
element-by-element load path), the split heuristic, two other warp interleavings (lockstep,
reverse: a missing barrier shows); int8 / fp8 e4m3 caches with per-row and per-(b, hk)
descales (against decode over the dequantized cache, tests/decode/test_quant.py's check). The module builds once into build/emu_decode (~50 s on two
cores); the tests then take ~10 s. Not covered: timing, real concurrency,
register spills, 16-byte alignment faults (the emulator does not fault on them).
"""
from __future__ import annotations

import pytest
import torch

from tests.cuda_emu import emulator as cuda_emu
from tests.decode.cases import Case, check, make_inputs, op_args, option_sets

SMS = 132
SELECTED = {"tensor_cores": False}  # the emu fixture's kernel selection


@pytest.fixture(scope="module", params=["cuda_cores", "tensor_cores"])
def emu(request):
    """The emulator module with one kernel selection (decode/cuda/entry.h DecodeCudaKernels): every
    test runs on the CUDA-core kernel and on the tensor-core one (fp16 / bf16 calls with
    16-byte-aligned rows; the others fall back to the CUDA-core kernel, which run() asserts)."""
    e = cuda_emu.load_decode()
    if e is None:
        pytest.skip(f"CUDA emulator unavailable: {cuda_emu.why}")
    SELECTED["tensor_cores"] = request.param == "tensor_cores"
    e.set_kernels(SELECTED["tensor_cores"])
    yield e
    e.set_kernels(False)
    SELECTED["tensor_cores"] = False


def expect_kernel(emu, c: Case):
    """The decode kernel the selection gives this case: the tensor-core one for 16-bit data whose
    head dim fills whole 16-byte vectors, up to 128."""
    mma = SELECTED["tensor_cores"] and c.dtype != torch.float32 and c.d % 8 == 0 and c.d <= 128
    return "decode_mma_kernel" if mma else "decode_kernel<"


def run(emu, c: Case, what="", sms=SMS):
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    emu.launches()
    out, lse = emu.decode_fwd(*op_args(c, q, k, v, idx, kw, alibi, sinks), c.num_splits, sms)
    names = emu.launches()
    if q.numel() and max(c.seqlens) > 0:
        assert any(expect_kernel(emu, c) in n for n in names), names
    check(c, out.transpose(1, 2), lse, q, k, v, idx, kw, alibi, sinks, what or repr(c))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page", [None, 16, 5], ids=["contiguous", "page16", "page5"])
@pytest.mark.parametrize("sq", [1, 2, 7])
def test_layouts(emu, page, splits, sq):
    run(emu, Case(sq=sq, page=page, num_splits=splits, dtype=torch.bfloat16 if sq != 2 else torch.float16))


OPTIONS = option_sets(1)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_options(emu, opt, splits):
    run(emu, Case(sq=7 if splits == 1 else 2, num_splits=splits, dtype=torch.float16, **OPTIONS[opt]))


@pytest.mark.parametrize("h,hk", [(8, 1), (8, 8), (8, 2)], ids=["mqa", "mha", "gqa"])
def test_heads(emu, h, hk):
    # MQA with Sq 7: 56 rows in 7 row blocks per CTA
    run(emu, Case(h=h, hk=hk, sq=7 if hk == 1 else 1, num_splits=2, sinks=True, window=(-1, 0), b=2,
                  seqlens=(1, 70)))


@pytest.mark.parametrize("d,dtype", [(64, torch.float32), (128, torch.bfloat16), (80, torch.float16),
                                     (80, torch.float32), (256, torch.bfloat16), (33, torch.float16),
                                     (200, torch.float32), (256, torch.float32)], ids=str)
def test_head_dims(emu, d, dtype):
    # 6 packed rows: one pass of 8 (or of 16 on tensor cores), two of 4 for fp32 at 256
    run(emu, Case(d=d, dtype=dtype, b=2, h=4, hk=2, sq=3, seqlens=(45, 9), num_splits=2, page=16))


def test_heuristic(emu):
    # num_splits = 0: the kernel's heuristic (decode/cuda/heuristics.h) with a small device
    assert emu.num_splits(2, 8, 1000, 0) == 3  # 2 CTAs, 16 wanted -> 8, bounded by 1000 / 256 keys
    assert emu.num_splits(2, 8, 100, 0) == 1
    assert emu.num_splits(64, 8, 1 << 16, 0) == 1
    assert emu.num_splits(2, 8, 40, 5) == 3  # requested, at most one split per 16 keys
    run(emu, Case(b=2, h=4, hk=2, seqlens=(600, 1000), num_splits=0, sinks=True), sms=8)


@pytest.mark.parametrize("warp_serial,reverse", [(False, False), (True, True)], ids=["lockstep", "reverse"])
def test_schedules(emu, warp_serial, reverse):
    # the CTA merge through shared memory and the row-block loop under other warp interleavings:
    # a missing barrier reads another warp's stale or unwritten partials
    emu.set_schedule(warp_serial, reverse)
    try:
        run(emu, Case(h=8, hk=1, sq=3, num_splits=2, sinks=True, b=2, seqlens=(5, 90), page=5))
        run(emu, Case(h=4, hk=2, sq=1, num_splits=1, window=(-1, 0), b=2, seqlens=(0, 77)))
    finally:
        emu.set_schedule(True, False)


@pytest.mark.parametrize("window", [(-1, 0), (30, 0), (25, 3)], ids=["causal", "window_left", "window_lr"])
@pytest.mark.parametrize("splits", [1, 3])
def test_nan_key_hidden_from_some_rows(emu, window, splits):
    """A NaN in the value of a key that the causal diagonal or the window hides from some query
    rows (S_q = 5) but not from the others: the rows that see it come out NaN, the others
    bit-identical to the clean run (the NaN policy; the CPU kernel's test is
    tests/fuzz/test_invariants.py::test_nan_decode_key_hidden_from_some_rows). Before the kernel
    skipped unseen keys in P V, 0 x NaN reached every row of the block."""
    c = Case(b=2, h=4, hk=2, sq=5, d=64, dtype=torch.float16, seqlens=(70, 41), num_splits=splits,
             window=window, page=16)
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    clean, _ = emu.decode_fwd(*op_args(c, q, k, v, idx, kw, alibi, sinks), splits, SMS)
    bt = idx["block_table"]
    for bi in range(c.b):
        n = int(c.seqlens[bi])
        for key in {n - 1, n - 3, n - c.sq - window[0] if window[0] >= 0 else 0}:
            vp = v.clone()
            vp[int(bt[bi, key // c.page]), key % c.page, 1] = float("nan")  # kv head 1: query heads 2, 3
            got, _ = emu.decode_fwd(*op_args(c, q, k, vp, idx, kw, alibi, sinks), splits, SMS)
            for r in range(c.sq):
                pos = r + n - c.sq
                sees = (window[0] < 0 or key >= pos - window[0]) and key <= pos + window[1]
                what = f"window {window} batch {bi} key {key} row {r}"
                assert torch.equal(got[bi, :2, r], clean[bi, :2, r]), what + ": kv head 0's query heads changed"
                if sees:
                    assert got[bi, 2:, r].isnan().all(), what + ": a row that reads the NaN value is not NaN"
                else:
                    assert torch.equal(got[bi, 2:, r], clean[bi, 2:, r]), what + ": NaN from a key the row does not see"
            assert torch.equal(got[1 - bi], clean[1 - bi]), "the other sequence changed"


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout", ["paged", "batch_idx"])
def test_capture_clamps_bad_indices(emu, layout, splits):
    # Under a CUDA-graph capture the host steps cannot read the index values (decode_cuda_steps.h):
    # they go unchecked and every index is clamped into the cache instead. Bad values must then
    # give exactly the answer of the clamped values (and read nothing out of bounds), while the
    # same call outside a capture raises.
    c = Case(b=4, sq=2, num_splits=splits, seqlens=(0, 5, 40, 70), leftpad=True,
             page=5 if layout == "paged" else None, batch_idx=layout == "batch_idx")
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    cap = k.shape[1] * (idx["block_table"].shape[1] if layout == "paged" else 1)
    bad = {n: t.clone() for n, t in idx.items()}
    bad["cache_seqlens"][3] = cap + 50  # past the capacity
    bad["cache_leftpad"][1] = 9  # past its sequence's end (5)
    if layout == "paged":
        bad["block_table"][2, 0] = -3
        bad["block_table"][2, 1] = k.shape[0] + 7  # not a page of the pool
    else:
        bad["cache_batch_idx"][0] = -1
        bad["cache_batch_idx"][2] = k.shape[0] + 2
    clamped = {n: t.clone() for n, t in bad.items()}
    clamped["cache_seqlens"].clamp_(0, cap)
    clamped["cache_leftpad"] = torch.minimum(clamped["cache_leftpad"].clamp(min=0), clamped["cache_seqlens"])
    if layout == "paged":
        clamped["block_table"].clamp_(0, k.shape[0] - 1)
    else:
        clamped["cache_batch_idx"].clamp_(0, k.shape[0] - 1)
    with pytest.raises(ValueError):
        emu.decode_fwd(*op_args(c, q, k, v, bad, kw, alibi, sinks), splits, SMS)
    with cuda_emu.capture(emu):
        got = emu.decode_fwd(*op_args(c, q, k, v, bad, kw, alibi, sinks), splits, SMS)
    want = emu.decode_fwd(*op_args(c, q, k, v, clamped, kw, alibi, sinks), splits, SMS)
    for g, w, name in zip(got, want, ("out", "lse")):
        assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)), name
    # and the clamped call itself is right (the reference, on the clamped values)
    check(c, want[0].transpose(1, 2), want[1], q, k, v, clamped, kw, alibi, sinks, "clamped")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page,splits", [(None, 1), (48, 1), (48, 3), (256, 2)], ids=str)
def test_long_cache(emu, page, splits, d):
    # caches long enough that every warp of the tensor-core kernel wraps its cp.async pipeline
    # several times (1500 keys, 1 split: 6 tiles of 16 keys per warp), pages that a warp's 64-key
    # stride crosses by one, several or none, a window with both edges inside the split (tiles
    # that are not full take P V on CUDA cores) and the causal diagonal of 3 query rows
    run(emu, Case(b=2, h=8, hk=2, sq=3, d=d, dtype=torch.bfloat16, seqlens=(1500, 700), page=page,
                  num_splits=splits, window=(300, 0) if splits != 3 else (-1, 0), leftpad=page is None))


@pytest.mark.parametrize("warp_serial,reverse", [(False, False), (True, True)], ids=["lockstep", "reverse"])
def test_long_cache_schedules(emu, warp_serial, reverse):
    # the warps' pipelines run independently until the CTA merge reuses their shared memory: under
    # other interleavings a warp that finishes first must not overwrite tiles another still reads
    emu.set_schedule(warp_serial, reverse)
    try:
        run(emu, Case(b=1, h=16, hk=1, sq=1, d=64, dtype=torch.float16, seqlens=(1100,), num_splits=1,
                      sinks=True))
    finally:
        emu.set_schedule(True, False)


def decode_mma_count(seqlens, hk, rows, d, splits):
    """The tensor-core kernel's mma.sync instructions (benchmarks/gpu_cost.py's formula): per
    tile of 16 keys and block of 16 packed rows, d / 8 for Q K^T and d / 8 for P V (full tiles),
    over each split's keys (split_range: runs of a multiple of 64 keys)."""
    kd = 64 if d <= 64 else 128
    total = 0
    for n in seqlens:
        per = -(-(-(-n // splits)) // 64) * 64
        for s in range(splits):
            a, e = min(n, s * per), min(n, s * per + per)
            total += -(-(e - a) // 16) * -(-rows // 16) * kd // 4
    return total * hk


def test_mma_count(emu):
    # the emulator's count of mma.sync instructions equals the cost report's formula (no window:
    # every tile full), and the CTA's cp.async bytes are the keys' K and V rows
    if not SELECTED["tensor_cores"]:
        pytest.skip("the tensor-core kernel's count")
    c = Case(b=3, h=8, hk=2, sq=5, d=128, seqlens=(300, 41, 1000), num_splits=3)
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    emu.launch_stats()
    emu.decode_fwd(*op_args(c, q, k, v, idx, kw, alibi, sinks), c.num_splits, SMS)
    stats = emu.launch_stats()
    assert len(stats) == 10, stats  # the decode kernel and the combine
    ctas, mma, copied = stats[0], stats[2], stats[4]
    assert ctas == c.b * c.hk * 3
    assert mma == decode_mma_count(c.seqlens, c.hk, c.h // c.hk * c.sq, c.d, 3)
    assert copied == 2 * sum(c.seqlens) * c.hk * c.d * 2 * -(-(c.h // c.hk * c.sq) // 16)


QLAYOUTS = {"contiguous": dict(), "page16": dict(page=16), "page5_leftpad": dict(page=5, leftpad=True),
            "batch_idx": dict(batch_idx=True)}


@pytest.mark.parametrize("granularity", ["token", "head"])
@pytest.mark.parametrize("qdt", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("layout", list(QLAYOUTS))
def test_8bit_caches(emu, layout, qdt, granularity):
    """The CUDA-core kernel over int8 / e4m3 caches (8-byte vectors widened in registers, the
    descales on q.k and on P V's probabilities) equals decode over the dequantized cache within
    the project rule, as the CPU kernel must (tests/decode/test_quant.py)."""
    from tests.decode.test_quant import run_check

    dtype = {"contiguous": torch.bfloat16, "page16": torch.float16, "page5_leftpad": torch.float32,
             "batch_idx": torch.bfloat16}[layout]
    c = Case(b=4, h=8, hk=2, sq=1, d=64, dtype=dtype, seqlens=(0, 1, 97, 300), num_splits=2, **QLAYOUTS[layout])

    def fwd(q, kq, vq, ks, vs, idx, kw, alibi, sinks):
        emu.launches()
        out, lse = emu.decode_fwd(*op_args(c, q, kq, vq, idx, kw, alibi, sinks), c.num_splits, SMS, ks, vs)
        assert any("decode_kernel<" in n for n in emu.launches())  # never the tensor-core kernel
        return out.transpose(1, 2), lse

    run_check(c, qdt, granularity, f"{qdt} {granularity} {layout}", fwd=fwd)


@pytest.mark.parametrize("qdt", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("opts", [dict(sq=3, window=(-1, 0), d=128), dict(sq=2, window=(40, 2), sinks=True, softcap=5.0),
                                  dict(h=6, hk=1, d=256, num_splits=1), dict(h=2, hk=2, d=33, alibi=True)],
                         ids=["causal_d128", "window_sinks_softcap", "mqa_d256", "odd_d_alibi"])
def test_8bit_cache_options(emu, qdt, opts):
    from tests.decode.test_quant import run_check

    c = Case(**{**dict(b=3, h=8, hk=2, d=64, dtype=torch.bfloat16, seqlens=(5, 150, 333), num_splits=3), **opts})

    def fwd(q, kq, vq, ks, vs, idx, kw, alibi, sinks):
        out, lse = emu.decode_fwd(*op_args(c, q, kq, vq, idx, kw, alibi, sinks), c.num_splits, SMS, ks, vs)
        return out.transpose(1, 2), lse

    for gran in ("token", "head"):
        run_check(c, qdt, gran, f"{qdt} {gran} {opts}", fwd=fwd)


def test_8bit_caches_need_the_selection(emu):
    """Without decode.set_cuda_kernels(quantized=True) the CUDA op refuses 8-bit caches (the
    Python layer then runs the dequantized reference), naming the switch."""
    from tests.decode.test_quant import quantize_case

    c = Case(b=2, h=4, hk=2, sq=1, d=64, dtype=torch.bfloat16, seqlens=(5, 40), num_splits=1)
    q, kq, vq, ks, vs, idx, kw, alibi, sinks = quantize_case(c, torch.int8, "token")
    emu.set_kernels(SELECTED["tensor_cores"], False)
    try:
        with pytest.raises(ValueError, match=r"set_cuda_kernels\(quantized=True\)"):
            emu.decode_fwd(*op_args(c, q, kq, vq, idx, kw, alibi, sinks), 1, SMS, ks, vs)
    finally:
        emu.set_kernels(SELECTED["tensor_cores"], True)
