"""8-bit KV caches (int8, float8_e4m3fn) in the decode family: the CPU kernel (csrc/decode/cpu,
its I8 / F8 element types) against decode over the dequantized cache (stored value x descale)
in float64, under the project rule (2x PyTorch's error in q's dtype over the same dequantized
cache, + a floor): per-row and per-(batch, kv head) descales, contiguous and paged caches, GQA,
q_len > 1 with causal / window, cache_batch_idx, leftpad, splits; quantize_kv's rounding; the
in-place quantized append of flash_attn_with_kvcache; the NaN policy (unread cache bytes may be
anything, fp8 NaN included); CUDA-less reference fallback; the input errors; opcheck."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.decode import dequantize_kv, ops, quantize_kv, reference
from tests.decode.cases import Case, make_inputs, op_args
from tests.helpers import assert_close_fa2

pytestmark = pytest.mark.skipif(not ops.has_kernel(torch.device("cpu")), reason="needs the compiled CPU kernels")

F64 = torch.float64
QDT = [torch.int8, torch.float8_e4m3fn]


def quantize_case(c: Case, qdt, granularity, seed=0):
    """make_inputs(c) with the caches quantized: per row (quantize_kv on the cache or page pool),
    or per (batch entry, kv head): one scale per entry where entry b owns cache row b, else one
    per kv head shared by every entry (pages and cache_batch_idx rows hold any entry's keys)."""
    torch.manual_seed(seed)
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    k, v = k.float() * 2.0, v.float()
    if granularity == "token":
        (kq, ks), (vq, vs) = quantize_kv(k, qdt, "token"), quantize_kv(v, qdt, "token")
    elif c.page is None and not c.batch_idx:
        (kq, ks), (vq, vs) = quantize_kv(k, qdt, "head"), quantize_kv(v, qdt, "head")
    else:
        from attention_ext.decode.quant import QMAX, quantize_rows
        kq, vq, scales = [], [], []
        for x in (k, v):
            s = x.abs().amax(dim=(0, 1, 3)) / QMAX[qdt]  # (H_k,)
            scales.append(s[None, :].expand(c.b, -1).contiguous())
            (kq if x is k else vq).append(quantize_rows(x, s[None, None, :, None], qdt))
        (kq,), (vq,), (ks, vs) = kq, vq, scales
    return q, kq, vq, ks, vs, idx, kw, alibi, sinks


def dequant(x_q, s, c: Case):
    if s.dim() == 3:
        return dequantize_kv(x_q, s)
    if c.page is None and not c.batch_idx:
        return dequantize_kv(x_q, s)
    return x_q.float() * s[0][None, None, :, None]  # one scale per kv head


def run_check(c: Case, qdt, granularity, what="", fwd=None):
    """fwd(q, kq, vq, ks, vs, idx, kw, alibi, sinks) -> (out (B, Sq, H, D), lse): the kernel under
    test (default: ops.decode_fwd; the CUDA emulator's)."""
    q, kq, vq, ks, vs, idx, kw, alibi, sinks = quantize_case(c, qdt, granularity)
    if fwd is None:
        out, lse = ops.decode_fwd(q, kq, vq, **idx, alibi_slopes=alibi, sinks=sinks, scale=kw["softmax_scale"],
                                  softcap=kw["softcap"], window_left=kw["window_size"][0],
                                  window_right=kw["window_size"][1], num_splits=c.num_splits, k_descale=ks,
                                  v_descale=vs)
    else:
        out, lse = fwd(q, kq, vq, ks, vs, idx, kw, alibi, sinks)
    kd, vd = dequant(kq, ks, c), dequant(vq, vs, c)
    args = dict(**idx, **kw, alibi_slopes=alibi, sinks=sinks)
    ref, ref_lse = reference.decode_attention(q.to(F64), kd.to(F64), vd.to(F64),
                                              **{n: (t.to(F64) if n in ("alibi_slopes", "sinks") and t is not None
                                                     else t) for n, t in args.items()})
    low, _ = reference.decode_attention(q, kd.to(q.dtype), vd.to(q.dtype), **args)
    _, lse32 = reference.decode_attention(q.float(), kd, vd, **args)
    assert out.dtype == q.dtype and not out.isnan().any(), what
    assert_close_fa2(out, low, ref, q.dtype, f"{what} out")
    assert_close_fa2(lse, lse32, ref_lse, torch.float32, f"{what} lse")
    return out


@pytest.mark.parametrize("granularity", ["token", "head"])
@pytest.mark.parametrize("qdt", QDT, ids=str)
@pytest.mark.parametrize("layout", [dict(), dict(page=16), dict(page=5, leftpad=True), dict(batch_idx=True)],
                         ids=["contiguous", "page16", "page5_leftpad", "batch_idx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_dequantized_decode(granularity, qdt, layout, dtype):
    c = Case(b=4, h=8, hk=2, sq=1, d=64, dtype=dtype, seqlens=(0, 1, 97, 300), num_splits=2, **layout)
    run_check(c, qdt, granularity, f"{qdt} {granularity} {layout} {dtype}")


@pytest.mark.parametrize("qdt", QDT, ids=str)
@pytest.mark.parametrize("opts", [dict(sq=3, window=(-1, 0)), dict(sq=2, window=(40, 2), sinks=True, softcap=5.0),
                                  dict(h=4, hk=4, d=80), dict(h=6, hk=1, d=128, num_splits=0),
                                  dict(h=2, hk=2, d=33, alibi=True)],
                         ids=["causal", "window_sinks_softcap", "mha_d80", "mqa_d128", "odd_d_alibi"])
def test_options(qdt, opts):
    c = Case(**{**dict(b=3, h=8, hk=2, d=64, dtype=torch.bfloat16, seqlens=(5, 150, 333), num_splits=3), **opts})
    for gran in ("token", "head"):
        run_check(c, qdt, gran, f"{qdt} {gran} {opts}")


@pytest.mark.parametrize("qdt", QDT, ids=str)
def test_quantize_kv_rounding(qdt):
    """Per row: |dequantized - x| <= half a step (int8) or e4m3's relative half-ulp (2^-4) of
    amax; per head the same against the head's amax; zero rows stay zero; the descales' shapes."""
    x = torch.randn(2, 50, 3, 16) * torch.rand(2, 50, 3, 1) * 4
    x[0, 7] = 0.0
    for gran, shape in (("token", (2, 50, 3)), ("head", (2, 3))):
        xq, s = quantize_kv(x, qdt, gran)
        assert xq.dtype == qdt and s.shape == shape and s.dtype == torch.float32
        err = (dequantize_kv(xq, s) - x).abs()
        step = s[..., None] if gran == "token" else s[:, None, :, None]
        bound = 0.5 * step if qdt == torch.int8 else 2.0 ** -4 * x.abs() + 2.0 ** -9 * step * 448
        assert (err <= bound * (1 + 1e-6) + 1e-12).all()
        assert (dequantize_kv(xq, s)[0, 7] == 0).all()
    with pytest.raises(ValueError, match="granularity"):
        quantize_kv(x, qdt, "channel")
    with pytest.raises(ValueError, match="dtype"):
        quantize_kv(x, torch.float16)


@pytest.mark.parametrize("qdt", QDT, ids=str)
@pytest.mark.parametrize("paged", [False, True])
def test_append_quantizes_in_place(qdt, paged):
    """flash_attn_with_kvcache with new k / v rows on an 8-bit cache with per-row descales: the
    new rows' scales are written (amax / the type's max), only the new rows and their scales
    change, and the output equals decode over the dequantized cache."""
    torch.manual_seed(1)
    b, hk, h, d, cap = 2, 2, 4, 32, 64
    lens = torch.tensor([10, 33], dtype=torch.int32)
    if paged:
        kf, vf = torch.randn(14, 8, hk, d), torch.randn(14, 8, hk, d)
        bt = torch.randperm(14)[:12].reshape(b, 6).to(torch.int32)
        kw = dict(block_table=bt)
    else:
        kf, vf = torch.randn(b, cap, hk, d), torch.randn(b, cap, hk, d)
        kw = {}
    (kq, ks), (vq, vs) = quantize_kv(kf, qdt), quantize_kv(vf, qdt)
    k0, s0 = kq.clone(), ks.clone()
    q, kn, vn = (torch.randn(b, 3, n, d).bfloat16() for n in (h, hk, hk))
    out = ae.flash_attn_with_kvcache(q, kq, vq, kn, vn, cache_seqlens=lens, causal=True, k_descale=ks, v_descale=vs,
                                     **kw)
    rows = lens.long()[:, None] + torch.arange(3)[None, :]
    if paged:
        page, slot = torch.gather(bt.long(), 1, rows // 8), rows % 8
    else:
        page, slot = torch.arange(b)[:, None].expand(b, 3), rows
    from attention_ext.decode.quant import QMAX
    torch.testing.assert_close(ks[page, slot], kn.float().abs().amax(-1) / QMAX[qdt], rtol=0, atol=0)
    changed = (kq.view(torch.uint8) != k0.view(torch.uint8)).any(-1)  # (rows, H_k)
    changed[page, slot] = False
    assert not changed.any()
    mask = torch.ones_like(ks, dtype=torch.bool)
    mask[page, slot] = False
    assert torch.equal(ks[mask], s0[mask])
    ref, _ = reference.decode_attention(q.to(F64), dequantize_kv(kq, ks).to(F64), dequantize_kv(vq, vs).to(F64),
                                        cache_seqlens=lens + 3, softmax_scale=d ** -0.5, window_size=(-1, 0), **kw)
    low, _ = reference.decode_attention(q, dequantize_kv(kq, ks).bfloat16(), dequantize_kv(vq, vs).bfloat16(),
                                        cache_seqlens=lens + 3, softmax_scale=d ** -0.5, window_size=(-1, 0), **kw)
    assert_close_fa2(out, low, ref, torch.bfloat16, "append")


@pytest.mark.parametrize("qdt", QDT, ids=str)
def test_unread_bytes_change_nothing(qdt):
    """Cache rows past cache_seqlens hold any byte (fp8: 0x7f, NaN): the output does not change."""
    c = Case(b=2, h=4, hk=2, d=64, dtype=torch.bfloat16, seqlens=(40, 77), num_splits=2)
    q, kq, vq, ks, vs, idx, kw, alibi, sinks = quantize_case(c, qdt, "token")
    call = lambda k, v: ops.decode_fwd(q, k, v, **idx, scale=kw["softmax_scale"], k_descale=ks,  # noqa: E731
                                       v_descale=vs)[0]
    want = call(kq, vq)
    kb, vb = kq.clone(), vq.clone()
    for t in (kb, vb):
        t.view(torch.uint8)[0, 40:] = 0x7F
        t.view(torch.uint8)[1, 77:] = 0xFF
    assert torch.equal(call(kb, vb), want)


@pytest.mark.parametrize("level", ae.cpu_isas() if ae._ext.HAS_EXT else ())
@pytest.mark.parametrize("d", [128, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_whole_chunks_nan_and_inf_descales(dtype, d, level):
    """One query row, int8 cache: whole 64-key chunks take the int8 kernel's fused softmax pass
    (every key seen, plain scores), the last partial chunk the general one. A NaN k descale
    inside a whole chunk (kv head 1 of sequence 0) and an inf v descale (kv head 0 of sequence
    1) fall back to the general path: their group's rows are not finite, every other row equals
    decode over the dequantized cache (float64) under the project rule. D 80 leaves 16 columns
    past the int16 products' 32-column blocks, which read P in float32. Every ISA level."""
    old = ae.cpu_isa()
    try:
        ae.set_cpu_isa(level)
        torch.manual_seed(4)
        b, hq, hk, s = 2, 8, 2, 64 * 3 + 17
        q = torch.randn(b, 1, hq, d).to(dtype)
        kf, vf = torch.randn(b, s, hk, d) * 2.0, torch.randn(b, s, hk, d)
        (kq, ks), (vq, vs) = quantize_kv(kf, torch.int8, "token"), quantize_kv(vf, torch.int8, "token")
        kw = dict(softmax_scale=d ** -0.5)
        kd, vd = dequantize_kv(kq, ks), dequantize_kv(vq, vs)
        for poison in (False, True):
            if poison:
                ks[0, 70, 1] = float("nan")
                vs[1, 100, 0] = float("inf")
            out, _ = ops.decode_fwd(q, kq, vq, scale=d ** -0.5, k_descale=ks, v_descale=vs)
            ref, _ = reference.decode_attention(q.double(), kd.double(), vd.double(), **kw)
            low, _ = reference.decode_attention(q, kd.to(dtype), vd.to(dtype), **kw)
            bad = torch.zeros(b, 1, hq, dtype=torch.bool)
            if poison:
                bad[0, :, 4:] = True  # kv head 1's query heads
                bad[1, :, :4] = True
                assert not out[bad].isfinite().any(), f"{level} {dtype} D{d}"
            assert_close_fa2(out[~bad], low[~bad], ref[~bad], dtype, f"{level} {dtype} D{d} poison={poison}")
    finally:
        ae.set_cpu_isa(old)


@pytest.mark.parametrize("level", ae.cpu_isas() if ae._ext.HAS_EXT else ())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qdt", QDT, ids=str)
def test_hidden_key_descales_and_signs(qdt, dtype, level):
    """Found by review: with several causal query rows, a key that only the last row sees may
    carry NaN descales (an appended row with a NaN), which must reach that row only; negative v
    descales (used as given) flip the values' signs on every path; a chunk whose scores sit ~100
    below the row's max (probabilities near 1e-44) changes nothing visible. At every ISA level,
    bf16 and fp16 queries (the int8 cache's int16 products included), against the dequantized
    cache in float64 (the NaN key zeroed for the rows that do not see it)."""
    old = ae.cpu_isa()
    try:
        ae.set_cpu_isa(level)
        torch.manual_seed(3)
        b, hq, hk, d, s, sq = 2, 8, 2, 64, 150, 3
        u = torch.randn(d)
        u /= u.norm()
        q = (0.1 * torch.randn(b, sq, hq, d) + 4.0 * u).to(dtype)
        kf, vf = torch.randn(b, s, hk, d), torch.randn(b, s, hk, d)
        kf[:, 64:128] -= 200.0 * u  # the second chunk's scores ~100 below the first's
        (kq, ks), (vq, vs) = quantize_kv(kf, qdt, "token"), quantize_kv(vf, qdt, "token")
        vs[1] = -vs[1]  # sequence 1: negative v descales
        ks[0, s - 1], vs[0, s - 1] = float("nan"), float("nan")  # sequence 0: the last key, seen by row 2 only
        out, _ = ops.decode_fwd(q, kq, vq, scale=d ** -0.5, window_left=-1, window_right=0, k_descale=ks,
                                v_descale=vs)
        kd, vd = dequantize_kv(kq, ks), dequantize_kv(vq, vs)
        assert out[0, 2].isnan().all() and not out[0, :2].isnan().any() and not out[1].isnan().any()
        kd[0, s - 1], vd[0, s - 1] = 0.0, 0.0
        kw = dict(window_size=(-1, 0), softmax_scale=d ** -0.5)
        ref, _ = reference.decode_attention(q.double(), kd.double(), vd.double(), **kw)
        low, _ = reference.decode_attention(q, kd.to(dtype), vd.to(dtype), **kw)
        for sel in ((0, slice(0, 2)), (1, slice(None))):
            assert_close_fa2(out[sel], low[sel], ref[sel], dtype, f"{level} {qdt} {dtype} {sel}")
    finally:
        ae.set_cpu_isa(old)


@pytest.mark.parametrize("level", ae.cpu_isas() if ae._ext.HAS_EXT else ())
def test_every_e4m3_byte_reads_exactly(level):
    """Each of the 256 e4m3 bytes (subnormals, both zeros, NaN) read as a value (a V row of all
    256 under one key: out is that row) and as a key (256 sequences of one key, each its byte in
    every column, q one-hot: the LSE is the byte's value): exactly float8_e4m3fn's value, NaN
    where it is NaN, at every ISA level (the bf16 byte tables of CPUs with VBMI included)."""
    old = ae.cpu_isa()
    try:
        ae.set_cpu_isa(level)
        every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
        want = every.float()
        one = torch.ones(1, 1)
        for dtype in (torch.bfloat16, torch.float32):
            q = torch.randn(1, 1, 1, 256).to(dtype)
            out, _ = ops.decode_fwd(q, torch.zeros(1, 1, 1, 256, dtype=torch.float8_e4m3fn), every.view(1, 1, 1, 256),
                                    scale=1.0, k_descale=one, v_descale=one)
            torch.testing.assert_close(out.flatten().float(), want, rtol=0, atol=0, equal_nan=True)
            q = torch.zeros(256, 1, 1, 32, dtype=dtype)
            q[..., 0] = 1
            k = every.view(256, 1, 1, 1).expand(256, 1, 1, 32).contiguous()
            _, lse = ops.decode_fwd(q, k, torch.zeros_like(k), scale=1.0, k_descale=torch.ones(256, 1),
                                    v_descale=torch.ones(256, 1))
            torch.testing.assert_close(lse.flatten(), want, rtol=0, atol=0, equal_nan=True)
    finally:
        ae.set_cpu_isa(old)


def test_kernel_equals_the_reference_fallback():
    """The reference the CUDA calls fall back to (no 8-bit CUDA kernel yet) reads the cache as the
    CPU kernel does: both agree to float32 rounding."""
    c = Case(b=2, h=4, hk=2, d=32, dtype=torch.float32, seqlens=(9, 30), num_splits=1)
    q, kq, vq, ks, vs, idx, kw, alibi, sinks = quantize_case(c, torch.int8, "token")
    out, lse = ops.decode_fwd(q, kq, vq, **idx, scale=kw["softmax_scale"], k_descale=ks, v_descale=vs)
    ref, ref_lse = reference.decode_attention(q, kq, vq, **idx, softmax_scale=kw["softmax_scale"], k_descale=ks,
                                              v_descale=vs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_input_errors():
    c = Case(b=2, h=4, hk=2, d=32, dtype=torch.bfloat16, seqlens=(9, 30), page=8)
    q, kq, vq, ks, vs, idx, kw, alibi, sinks = quantize_case(c, torch.int8, "token")
    call = lambda **o: ops.decode_fwd(q, o.get("k", kq), o.get("v", vq), **idx, scale=0.1,  # noqa: E731
                                      k_descale=o.get("ks", ks), v_descale=o.get("vs", vs))
    with pytest.raises(ValueError, match="needs k_descale"):
        call(ks=None)
    with pytest.raises(TypeError, match="k_descale must be float32"):
        call(ks=ks.half())
    with pytest.raises(ValueError, match=r"v_descale must be \(B, H_k\)"):
        call(vs=vs[:, :3])
    with pytest.raises(ValueError, match="both be per row"):
        call(vs=torch.ones(2, 2))
    with pytest.raises(TypeError, match="share a dtype"):
        call(v=vq.view(torch.uint8).view(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="q must be float32, float16 or bfloat16"):
        ops.decode_fwd(q.double(), kq, vq, **idx, scale=0.1, k_descale=ks, v_descale=vs)
    with pytest.raises(ValueError, match="go with int8 or float8_e4m3fn caches"):
        ops.decode_fwd(q, kq.bfloat16(), vq.bfloat16(), **idx, scale=0.1, k_descale=ks, v_descale=vs)
    with pytest.raises(ValueError, match="an int8 cache needs k_descale"):  # the op's rule, before the append
        ae.flash_attn_with_kvcache(q, kq, vq, q[:, :, :2], q[:, :, :2], cache_seqlens=idx["cache_seqlens"],
                                   block_table=idx["block_table"])


@pytest.mark.parametrize("qdt", QDT, ids=str)
def test_opcheck(qdt):
    for gran, page in (("token", 8), ("head", None)):
        c = Case(b=2, h=4, hk=2, sq=2, d=32, dtype=torch.bfloat16, seqlens=(5, 40), page=page)
        q, kq, vq, ks, vs, idx, kw, alibi, sinks = quantize_case(c, qdt, gran)
        args = op_args(c, q, kq, vq, idx, kw, alibi, sinks)
        # torch's schema check multiplies the inputs, which fp8 CPU tensors do not implement: the
        # other checks (fake tensors, autograd registration, AOT dispatch) run for both types
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(torch.ops.attention_ext.decode_fwd.default, (*args, 0, ks, vs),
                              test_utils=utils + (("test_schema",) if qdt == torch.int8 else ()))


LEVELS = ae.cpu_isas() if ae._ext.HAS_EXT else ()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qdt", QDT, ids=str)
def test_every_isa_level(level, qdt):
    """The 8-bit paths (AVX-512, AVX2, and the portable loops of the base level) at every ISA
    level this machine runs: the widening, and for int8 under bf16 / fp16 queries the int16-pair
    products (their 32 / 16-column blocks, a head dim that leaves a scalar tail or a masked K
    load, GQA blocks of 4, 3 and 2 rows, MHA's blocks across kv heads)."""
    old = ae.cpu_isa()
    try:
        ae.set_cpu_isa(level)
        for gran in ("token", "head"):
            # (d, q dtype, H, H_k, Sq): GQA blocks of 4 and 2 rows, of 3 (H 6 / H_k 2, one row),
            # MHA's blocks across kv heads (one row per kv head: 4, and 4 + 1)
            for d, dtype, h, hk, sq in ((64, torch.bfloat16, 4, 2, 2), (37, torch.bfloat16, 4, 2, 2),
                                        (128, torch.float16, 8, 2, 2), (72, torch.float16, 2, 2, 2),
                                        (100, torch.bfloat16, 6, 2, 1), (64, torch.bfloat16, 4, 4, 1),
                                        (72, torch.float16, 5, 5, 1), (128, torch.float16, 6, 2, 1)):
                c = Case(b=3, h=h, hk=hk, sq=sq, d=d, dtype=dtype, seqlens=(1, 70, 129), num_splits=2,
                         window=(-1, 0))
                run_check(c, qdt, gran, f"{level} {qdt} {gran} d={d} {dtype} h={h} hk={hk} sq={sq}")
    finally:
        ae.set_cpu_isa(old)


def test_cache_larger_than_batch_per_row_descales():
    """Found by the quantized decode fuzz: a contiguous 8-bit cache with more rows than q's batch
    (flash-attn reads rows [0, B)) and per-row descales raised 'k_descale must be (B, H_k) ...':
    the cache was cut to B rows, its descales not. Now both are, and the append lands in the
    caller's cache and descales."""
    torch.manual_seed(0)
    kf, vf = torch.randn(3, 12, 2, 16), torch.randn(3, 12, 2, 16)
    (kq, ks), (vq, vs) = quantize_kv(kf), quantize_kv(vf)
    q, kn, vn = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    with torch.no_grad():
        out = ae.flash_attn_with_kvcache(q, kq, vq, kn, vn, cache_seqlens=lens, k_descale=ks, v_descale=vs)
    from attention_ext.decode.quant import QMAX
    assert torch.equal(ks[1, 9], kn[1, 0].abs().amax(-1) / QMAX[torch.int8])
    ref, _ = reference.decode_attention(q.double(), dequantize_kv(kq, ks)[:2].double(),
                                        dequantize_kv(vq, vs)[:2].double(), cache_seqlens=lens + 1)
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("qdt", QDT, ids=str)
def test_append_under_per_head_scales(qdt):
    """Found by an audit: appends into a cache with per-(sequence, kv head) descales. A scale of 0
    (a zero cache quantized per head) stored new nonzero rows that read back as zeros, silently:
    refused by name, before anything is written. A NaN / inf appended under such a scale (int8
    has no NaN: the cast gave 0) now makes that entry's scale NaN, so its reads are NaN as over a
    float cache; the other entries are untouched. Finite values beyond the scale saturate."""
    torch.manual_seed(3)
    b, s, hk, h, d = 2, 16, 2, 4, 8
    kq, kd = quantize_kv(torch.zeros(b, s, hk, d), qdt, "head")
    vq, vd = quantize_kv(torch.zeros(b, s, hk, d), qdt, "head")
    k0, kd0 = kq.clone(), kd.clone()
    q, kn, vn = torch.randn(b, 1, h, d), torch.randn(b, 3, hk, d), torch.randn(b, 3, hk, d)
    with torch.no_grad(), pytest.raises(ValueError, match="k_descale holds a scale of 0"):
        ae.flash_attn_with_kvcache(q, kq, vq, kn, vn, cache_seqlens=0, k_descale=kd, v_descale=vd)
    assert torch.equal(kq.view(torch.uint8), k0.view(torch.uint8)) and torch.equal(kd, kd0)
    (kq, kd), (vq, vd) = quantize_kv(torch.randn(b, s, hk, d), qdt, "head"), quantize_kv(torch.randn(b, s, hk, d), qdt,
                                                                                           "head")
    kn[1, 0, 0, 2] = float("nan")
    vn[0, 2, 1, 5] = float("inf")
    with torch.no_grad():
        out = ae.flash_attn_with_kvcache(q, kq, vq, kn, vn, cache_seqlens=4, k_descale=kd, v_descale=vd)
    assert kd[1, 0].isnan() and vd[0, 1].isnan()
    assert kd.isnan().sum() == 1 and vd.isnan().sum() == 1
    assert out[1, :, :2].isnan().all() and out[0, :, 2:].isnan().all()  # GQA: kv head 0 = query heads 0, 1
    assert not out[1, :, 2:].isnan().any() and not out[0, :, :2].isnan().any()


def test_shared_descales_and_pools_and_dtypes():
    """Found by an audit: one per-row descale tensor as both k_descale and v_descale (an append
    wrote the keys' fresh scales, then the values' over them) is refused; per-head descales of a
    cache larger than the batch are cut to its rows as per-row ones are; quantize_kv of an empty
    cache gives empty results; caches refuse dtypes they cannot store by name."""
    kq, d = quantize_kv(torch.randn(2, 16, 2, 8))
    vq, _ = quantize_kv(torch.randn(2, 16, 2, 8))
    with torch.no_grad(), pytest.raises(ValueError, match="share memory"):
        ae.flash_attn_with_kvcache(torch.randn(2, 1, 4, 8), kq, vq, torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8),
                                   cache_seqlens=4, k_descale=d, v_descale=d)
    kf, vf = torch.randn(4, 16, 2, 8), torch.randn(4, 16, 2, 8)
    (kq, ks), (vq, vs) = quantize_kv(kf, granularity="head"), quantize_kv(vf, granularity="head")  # (4, H_k)
    q = torch.randn(2, 1, 4, 8)
    lens = torch.tensor([7, 12], dtype=torch.int32)
    with torch.no_grad():
        out = ae.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=lens, k_descale=ks, v_descale=vs)
    ref, _ = reference.decode_attention(q.double(), dequantize_kv(kq, ks)[:2].double(),
                                        dequantize_kv(vq, vs)[:2].double(), cache_seqlens=lens)
    assert (out.double() - ref).abs().max().item() < 1e-5
    for shape, gran in (((2, 0, 2, 16), "head"), ((2, 3, 2, 0), "token"), ((0, 3, 2, 8), "head")):
        x_q, sc = quantize_kv(torch.randn(shape), granularity=gran)
        assert x_q.shape == shape and x_q.dtype == torch.int8
        assert sc.shape == (shape[:3] if gran == "token" else (shape[0], shape[2]))
    for dt in (torch.uint8, torch.int16, torch.float8_e5m2):
        with pytest.raises(TypeError, match="dtype must be"):
            ae.nn.PagedKVCache(2, 8, 4, 2, 32, dtype=dt)
        with pytest.raises(TypeError, match="dtype must be"):
            ae.nn.KVCache(2, 8, 2, 32, dtype=dt)


def test_dequantize_kv_checks_descale_shape():
    """dequantize_kv reads descale as (B, S, H_k) per row or (B, H_k) per sequence: another shape
    raised torch's bare broadcast / indexing errors, or broadcast silently (a (S, H_k) descale for
    B = 1 gave a (S, S, H_k, D) result, a (B, 1, H_k) one gave every row the first row's scale)."""
    torch.manual_seed(0)
    x = torch.randn(1, 5, 2, 8)
    xq, s = quantize_kv(x, granularity="token")
    xh, sh = quantize_kv(x, granularity="head")
    torch.testing.assert_close(dequantize_kv(xq, s), xq.float() * s[..., None], atol=0, rtol=0)
    torch.testing.assert_close(dequantize_kv(xh, sh), xh.float() * sh[:, None, :, None], atol=0, rtol=0)
    for bad in (s[0], s[:, :1], s[0, 0], s[..., None], sh.t().contiguous()[:1]):
        with pytest.raises(ValueError, match=r"dequantize_kv: descale must be .*\(1, 5, 2\).*\(1, 2\)"):
            dequantize_kv(xq, bad)
    with pytest.raises(TypeError, match="dequantize_kv: descale must be a torch.Tensor"):
        dequantize_kv(xq, [1.0])
    with pytest.raises(ValueError, match=r"dequantize_kv: x_q must be 4-D"):
        dequantize_kv(xq[0], s[0])
