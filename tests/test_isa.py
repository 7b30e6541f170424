"""The CPU kernels' ISA levels (csrc/cpu/isa.h): every level this machine runs gives results within
the error rule (tests/helpers.py) of the float64 reference and of the other levels, for one op of
each family; `python -m attention_ext info` names the level; set_cpu_isa refuses levels that were
not built or that this CPU cannot run, and restores."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import attention_ext as ae
from attention_ext.decode import ops as decode_ops
from attention_ext.decode.reference import decode_attention
from attention_ext.linear import reference as linear_ref
from attention_ext.sparse import layouts
from attention_ext.sparse.reference import block_sparse_attention_ref, topk_attention_ref
from tests.helpers import FLOOR, assert_close_fa2, reference_in, rel_err

pytestmark = pytest.mark.skipif(not ae._ext.HAS_EXT, reason="compiled extension not built")

LEVELS = ae.cpu_isas() if ae._ext.HAS_EXT else ()
# a sanitized build (ATTENTION_EXT_SANITIZE=1) links only the machine's highest level (setup.py)
one_level = pytest.mark.skipif(ae._ext.HAS_EXT and "base" not in ae.cpu_isas(all=True),
                               reason="this build has one ISA level (a sanitized build)")


@pytest.fixture
def at_level():
    """at_level(name): run the CPU kernels at ISA level `name`; the default is restored after."""
    old = ae.cpu_isa()
    yield ae.set_cpu_isa
    ae.set_cpu_isa(old)


def per_level(at_level, run):
    """{level: run()} for every level this machine runs."""
    outs = {}
    for level in LEVELS:
        at_level(level)
        outs[level] = run()
    return outs


def check_levels(outs, low, ref, dtype, what):
    """Every level's outputs (a tuple of tensors) meet the error rule against the float64
    reference `ref`, with PyTorch's same-dtype `low` as the yardstick, and differ from the lowest
    level's by no more than the rule allows either of them to differ from float64."""
    first = outs[LEVELS[0]]
    for level, got in outs.items():
        for i, (g, lo, r) in enumerate(zip(got, low, ref)):
            assert_close_fa2(g, lo, r, dtype, f"{what}[{i}] at {level}")
            bound = 2.0 * rel_err(lo, r) + FLOOR[dtype]
            e = rel_err(g, first[i])
            assert e <= bound, f"{what}[{i}]: {level} vs {LEVELS[0]} differ by {e:.3g} > {bound:.3g}"


@one_level
def test_levels_listed():
    """base runs everywhere; the active level is the highest one this CPU runs (what info prints);
    the levels this CPU runs are among those built, in the build's order."""
    built = ae.cpu_isas(all=True)
    assert LEVELS[0] == "base" and set(LEVELS) <= set(built)
    assert [x for x in built if x in LEVELS] == list(LEVELS)
    assert ae.cpu_isa() == LEVELS[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_fwd_bwd(at_level, dtype, causal):
    torch.manual_seed(0)
    b, h, hk, sq, sk, d = 2, 4, 2, 77, 133, 64  # GQA, lengths that are no whole tile
    q0, k0, v0 = (torch.randn(b, n, s, d, dtype=dtype) for n, s in ((h, sq), (hk, sk), (hk, sk)))
    dout = torch.randn(b, h, sq, d, dtype=dtype)

    def run():
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = ae.attention(q, k, v, causal=causal)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    rkw = dict(window=(-1, 0) if causal else (-1, -1), bottom_right=False)
    ref, _, ref_leaves = reference_in(torch.float64, q0, k0, v0, **rkw)
    low, _, low_leaves = reference_in(dtype, q0, k0, v0, **rkw)
    ref.backward(dout.double())
    low.backward(dout)
    check_levels(per_level(at_level, run), (low,) + tuple(t.grad for t in low_leaves[:3]),
                 (ref,) + tuple(t.grad for t in ref_leaves[:3]), dtype, "attention out, dq, dk, dv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fwd_bwd(at_level, dtype):
    torch.manual_seed(1)
    b, h, s, d = 2, 3, 150, 32
    q0, k0, v0 = (torch.randn(b, h, s, d, dtype=dtype) for _ in range(3))
    dout = torch.randn(b, h, s, d, dtype=dtype)

    def run():
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = ae.linear_attention(q, k, v, feature_map="elu", causal=True, scale=1.0)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def reference(dt):
        q, k, v = (t.detach().to(dt).requires_grad_() for t in (q0, k0, v0))
        out = linear_ref.linear_attention(q, k, v, feature_map=1, causal=True)[0]
        out.backward(dout.to(dt))
        return out.detach(), q.grad, k.grad, v.grad

    check_levels(per_level(at_level, run), reference(dtype), reference(torch.float64), dtype,
                 "linear out, dq, dk, dv")


@pytest.mark.parametrize("heads", ["few", "many"])
@pytest.mark.parametrize("gate", ["head", "key"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_fwd_bwd(at_level, dtype, gate, heads):
    """The delta rule's recurrence (forward, and the backward's replay from checkpoints) with
    per-head and per-key gates, GVA and 70 tokens (a checkpoint past 64). "few": 2 value heads, 40
    columns (a full block of the level's vectors and a part block). "many": 8 value heads of 100
    columns on 2 threads, tasks enough for AVX-512's 64-column forward blocks (one full, one part)."""
    g = torch.Generator().manual_seed(2)
    b, hk, hv, s, kd, vd = (1, 1, 2, 70, 24, 40) if heads == "few" else (1, 2, 8, 70, 24, 100)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    q0 = torch.randn(b, hk, s, kd, generator=g).to(dtype)
    k0 = linear_ref._l2n(torch.randn(b, hk, s, kd, generator=g)).to(dtype)
    v0 = torch.randn(b, hv, s, vd, generator=g).to(dtype)
    beta0 = torch.rand(b, hv, s, generator=g).to(dtype)
    g0 = -0.5 * torch.rand((b, hv, s) + ((kd,) if gate == "key" else ()), generator=g)
    dout = torch.randn(b, hv, s, vd, generator=g).to(dtype)

    def run():
        q, k, v, beta, gt = (t.clone().requires_grad_() for t in (q0, k0, v0, beta0, g0))
        out = ae.delta_rule_attention(q, k, v, beta, gate=gt)
        out.backward(dout)
        with torch.no_grad():  # the forward without the backward's checkpoints: its own instances
            plain = ae.delta_rule_attention(q0, k0, v0, beta0, gate=g0)
        return out.detach(), q.grad, k.grad, v.grad, beta.grad, gt.grad, plain

    def reference(dt):
        q, k, v, beta, gt = (t.detach().to(dt).requires_grad_() for t in (q0, k0, v0, beta0, g0))
        out = linear_ref.delta_rule(q, k, v, beta, gt, kd ** -0.5, None, acc=dt)[0]
        out.backward(dout.to(dt))
        return out.detach(), q.grad, k.grad, v.grad, beta.grad, gt.grad, out.detach()

    try:
        outs = per_level(at_level, run)
    finally:
        torch.set_num_threads(threads)
    check_levels(outs, reference(dtype), reference(torch.float64), dtype,
                 "delta out, dq, dk, dv, dbeta, dgate, no-grad out")


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("s", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_step_levels(at_level, dtype, s, inplace):
    """delta_rule_step over a V = 128 state (whole 512-byte rows: AVX-512's wide blocks on the
    state's own rows; out of place, the first pass reads the given state and writes the new one,
    which must leave the given one as it was), 64 (sequence, head) pairs (one task per pair on up
    to 32 threads) and a V = 40 one (a part block through the copy), against the float64
    recurrence."""
    g = torch.Generator().manual_seed(3)
    for b, hv, kd, vd in ((8, 8, 24, 128), (2, 2, 16, 40)):
        q0 = torch.randn(b, 1, s, kd, generator=g).to(dtype)
        k0 = linear_ref._l2n(torch.randn(b, 1, s, kd, generator=g)).to(dtype)
        v0 = torch.randn(b, hv, s, vd, generator=g).to(dtype)
        beta0 = torch.rand(b, hv, s, generator=g).to(dtype)
        g0 = -0.5 * torch.rand(b, hv, s, kd, generator=g)
        h0 = 0.3 * torch.randn(b, hv, kd, vd, generator=g)

        def run():
            st = h0.clone()
            with torch.no_grad():
                out, new = ae.delta_rule_step(q0, k0, v0, beta0, st, gate=g0, inplace=inplace)
            assert (new is st) == inplace
            if not inplace:
                assert torch.equal(st, h0), "delta_rule_step(inplace=False) changed the given state"
            return out, new

        def reference(dt):
            out, st = linear_ref.delta_rule(q0.to(dt), k0.to(dt), v0.to(dt), beta0.to(dt), g0.to(dt), kd ** -0.5,
                                            h0.to(dt if dt == torch.float64 else torch.float32), acc=dt)
            return out, st

        check_levels(per_level(at_level, run), reference(dtype), reference(torch.float64), dtype,
                     f"step (inplace={inplace}) V {vd}: out, state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_block_and_topk(at_level, dtype):
    torch.manual_seed(2)
    b, h, n, d, bs = 2, 4, 200, 64, 32
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for _ in range(3))
    lay = layouts.bigbird(1, 1, 1, 3, seq_len=n, block_size=bs, heads=h)

    def run():
        return (ae.block_sparse_attention(q, k, v, lay, block_size=bs, causal=True),
                ae.topk_attention(q, k, v, 24, causal=True))

    def reference(dt):
        qq, kk, vv = (t.to(dt) for t in (q, k, v))
        return (block_sparse_attention_ref(qq, kk, vv, lay, bs, causal=True)[0],
                topk_attention_ref(qq, kk, vv, 24, causal=True)[0])

    check_levels(per_level(at_level, run), reference(dtype), reference(torch.float64), dtype,
                 "block-sparse, top-k out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode(at_level, dtype):
    torch.manual_seed(3)
    b, sq, h, hk, s_cache, d = 3, 2, 8, 2, 300, 64
    q = torch.randn(b, sq, h, d, dtype=dtype)
    kc, vc = (torch.randn(b, s_cache, hk, d, dtype=dtype) for _ in range(2))
    lens = torch.tensor([300, 17, 161], dtype=torch.int32)
    scale = 1 / math.sqrt(d)

    def run():
        return (decode_ops.decode_fwd(q, kc, vc, cache_seqlens=lens, scale=scale)[0],)

    def reference(dt):
        return (decode_attention(q.to(dt), kc.to(dt), vc.to(dt), cache_seqlens=lens, softmax_scale=scale)[0],)

    check_levels(per_level(at_level, run), reference(dtype), reference(torch.float64), dtype, "decode out")


@one_level
def test_set_cpu_isa_validates_and_restores(at_level):
    top = ae.cpu_isa()
    assert at_level("base") == top
    # x86's base level (SSE2) is one 4-float register wide (csrc/cpu/simd.h)
    assert ae.cpu_isa() == "base" and ae._ext._C.simd_width() == 4
    with pytest.raises(ValueError, match="no such level"):
        ae.set_cpu_isa("avx9000")
    assert ae.cpu_isa() == "base"  # unchanged by a refused call
    for level in set(ae.cpu_isas(all=True)) - set(LEVELS):  # built, but this CPU lacks it
        with pytest.raises(ValueError, match="this CPU lacks"):
            ae.set_cpu_isa(level)
    with pytest.raises(TypeError):
        ae.set_cpu_isa(2)
    assert ae.set_cpu_isa(None) == "base" and ae.cpu_isa() == top


def test_info_names_the_level():
    res = subprocess.run([sys.executable, "-m", "attention_ext", "info"], capture_output=True, text=True, check=True)
    line = next(x for x in res.stdout.splitlines() if x.startswith("CPU kernels"))
    assert f"ISA {LEVELS[-1]} " in line and ", ".join(LEVELS) in line, line


@pytest.mark.skipif(not {"avx512", "avx512bf16"} <= set(LEVELS),
                    reason="this CPU has no AVX512-BF16 (the bf16 dot-product level), or the build lacks avx512")
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_dot_products_only_change_bf16(at_level, causal):
    """avx512bf16 differs from avx512 only in the bf16 products (csrc/cpu/bf16dot.h): float32
    results are bit-identical at both levels, bf16 ones are not (P is rounded to bf16 for P V,
    and the sums run in another order), which shows the dot-product path ran; both meet the
    error rule (test_softmax_fwd_bwd, test_decode). The softmax's few-row calls (the direct
    mode, here with gradients, so not sent to the decode kernel) keep float32 products; the
    decode kernel (a few query rows against a cache; 80 columns: two dot-product blocks and a
    float32 tail) uses them."""
    torch.manual_seed(5)
    for dtype, rows in ((torch.float32, 70), (torch.bfloat16, 70), (torch.bfloat16, 5)):
        q = torch.randn(1, 4, rows, 72, dtype=dtype)
        k, v = (torch.randn(1, 4, 150, 72, dtype=dtype) for _ in range(2))
        dout = torch.randn(1, 4, rows, 72, dtype=dtype)

        def run():
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = ae.attention(qq, kk, vv, causal=causal)
            out.backward(dout)
            return out.detach(), qq.grad, kk.grad, vv.grad

        at_level("avx512")
        wide = run()
        at_level("avx512bf16")
        dot = run()
        same = all(torch.equal(a, b) for a, b in zip(wide, dot))
        assert same == (dtype == torch.float32 or rows <= 8), (dtype, rows)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 3, 8, 80, dtype=dtype)
        kc, vc = (torch.randn(2, 301, 2, 80, dtype=dtype) for _ in range(2))
        lens = torch.tensor([301, 77], dtype=torch.int32)

        def run():
            return decode_ops.decode_fwd(q, kc, vc, cache_seqlens=lens, scale=0.1,
                                        window_right=0 if causal else -1)

        at_level("avx512")
        wide = run()
        at_level("avx512bf16")
        dot = run()
        same = all(torch.equal(a, b) for a, b in zip(wide, dot))
        assert same == (dtype == torch.float32), ("decode", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_softcap_tile_before_its_block(at_level, dtype):
    """Found by test_fuzz_sparse on the first AVX-512 machine (block_sparse, 16-key blocks,
    softcap 4, S = 65, D = 1; error 9.3e-3 in fp32, LSE off by 0.019): where kPanel (2 vectors:
    32 floats at AVX-512) is wider than a layout block, a key tile starts before its block and the
    keys before it are masked to -inf, but the mask ran before the softcap, which maps -inf to
    -softcap, so those keys were read (forward and backward). The mask now follows the score
    (csrc/softmax/cpu/tile.h's mask_outside). At every level; on AVX2 (kPanel 16) tiles never start
    early."""
    torch.manual_seed(6)
    s, d, bs = 65, 8, 16
    q, k, v = (torch.randn(1, 2, s, d, dtype=dtype) for _ in range(3))
    dout = torch.randn(1, 2, s, d, dtype=dtype)
    lay = torch.rand(2, 5, 5) < 0.3
    lay[:, :, 1] = True  # every row reads block 1 (keys 16..31): its tile starts at key 0 on AVX-512
    allowed = lay.repeat_interleave(bs, 1).repeat_interleave(bs, 2)[:, :s, :s].unsqueeze(0)

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = ae.block_sparse_attention(qq, kk, vv, lay, block_size=bs, softcap=4.0)
        out.backward(dout)
        return out.detach(), qq.grad, kk.grad, vv.grad

    def reference(dt):
        qq, kk, vv = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        from attention_ext.softmax import reference as sm_ref
        out, _ = sm_ref.attention(qq, kk, vv, softcap=4.0, bias=allowed)
        out.backward(dout.to(dt))
        return out.detach(), qq.grad, kk.grad, vv.grad

    check_levels(per_level(at_level, run), reference(dtype), reference(torch.float64), dtype,
                 "block-sparse softcap out, dq, dk, dv")
