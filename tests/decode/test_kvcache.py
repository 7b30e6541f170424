"""flash_attn_with_kvcache against the float64 reference over the cache as it must look after
the append (rotary computed here independently, in float64), the in-place write, the flash-attn
varlen packed / paged drop-ins against the unpacked path, and bad input."""
from __future__ import annotations

import itertools

import pytest
import torch

import attention_ext as ae
from attention_ext.decode import reference
from attention_ext.decode.ops import HAS_EXT, decode_fwd
from tests.helpers import FLOOR, assert_close_fa2, rel_err

pytestmark = pytest.mark.skipif(not HAS_EXT, reason="compiled extension not built")

LOW = [torch.float32, torch.bfloat16, torch.float16]


def rotary64(x, cos, sin, pos, interleaved):
    """x (B, S, H, D) float64 rotated at positions pos (B, S): written from the GPT-J / NeoX
    definitions, one pair of channels at a time."""
    x = x.double().clone()
    rd = 2 * cos.shape[1]
    out = x.clone()
    for i in range(rd // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rd // 2)
        c = cos.double()[pos, i][:, :, None]
        s = sin.double()[pos, i][:, :, None]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., a] * s + x[..., b] * c
    return out


def make_cache(b, hk, d, cap, dtype, paged, page=8, batch_idx=False):
    """A random cache, and where sequence b's row r lives: (cache, block_table, cache_batch_idx,
    loc(b, r) -> (row0, row1))."""
    if paged:
        max_pages = -(-cap // page)
        n_pages = b * max_pages + 3
        perm = torch.randperm(n_pages)[: b * max_pages].view(b, max_pages)
        bt = perm.to(torch.int32)
        kc = torch.randn(n_pages, page, hk, d).to(dtype)
        vc = torch.randn(n_pages, page, hk, d).to(dtype)
        return kc, vc, bt, None, lambda i, r: (int(bt[i, r // page]), r % page)
    bc = b + 2 if batch_idx else b
    kc = torch.randn(bc, cap, hk, d).to(dtype)
    vc = torch.randn(bc, cap, hk, d).to(dtype)
    idx = torch.randperm(bc)[:b].to(torch.int32) if batch_idx else None
    return kc, vc, None, idx, (lambda i, r: (int(idx[i]) if idx is not None else i, r))


VARIANTS = [
    dict(),
    dict(causal=True),
    dict(causal=True, hk=1),  # MQA
    dict(window=(3, 1)),
    dict(causal=True, window=(4, 0), softcap=4.0),
    dict(alibi=True, causal=True),
    dict(alibi="batch"),
    dict(sinks=True, causal=True),
    dict(leftpad=True, causal=True),
    dict(batch_idx=True, causal=True),
]


def run_case(dtype, paged, sq, rot, append, variant, seqlens=(0, 1, 13), d=40, h=4):
    v_ = dict(variant)
    hk = v_.get("hk", 2)
    b = len(seqlens)
    causal = v_.get("causal", False)
    window = v_.get("window", (-1, -1))
    cap = 24
    batch_idx = v_.get("batch_idx", False) and not paged
    kc, vc, bt, idx, loc = make_cache(b, hk, d, cap, dtype, paged, batch_idx=batch_idx)
    seq_t = torch.tensor(seqlens, dtype=torch.int32)
    leftpad = torch.tensor([min(s, p) for s, p in zip(seqlens, (0, 1, 5))][:b], dtype=torch.int32) \
        if v_.get("leftpad") else None
    s_new = sq if append else 0
    q = torch.randn(b, sq, h, d).to(dtype)
    kn = torch.randn(b, s_new, hk, d).to(dtype) if append else None
    vn = torch.randn(b, s_new, hk, d).to(dtype) if append else None
    cos = sin = None
    if rot is not None:
        rd = 16
        ang = torch.rand(cap + 8, rd // 2, dtype=torch.float64) * 6.0
        cos, sin = ang.cos().float(), ang.sin().float()
    slopes = None
    if v_.get("alibi") == "batch":
        slopes = torch.rand(b, h) * 0.5
    elif v_.get("alibi"):
        slopes = torch.rand(h) * 0.5
    sinks = torch.randn(h) if v_.get("sinks") else None
    softcap = v_.get("softcap", 0.0)
    kc0, vc0 = kc.clone(), vc.clone()

    out, lse = ae.flash_attn_with_kvcache(
        q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seq_t, cache_batch_idx=idx,
        cache_leftpad=leftpad, block_table=bt, causal=causal, window_size=window, softcap=softcap,
        rotary_interleaved=(rot == "interleaved"), alibi_slopes=slopes, return_softmax_lse=True, sinks=sinks)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, sq) and lse.dtype == torch.float32

    # the cache as it must be: the old one with exactly the new rows written
    pos = seq_t.long()[:, None] + torch.arange(s_new)[None, :]
    k64 = kn.double() if append else None
    if append and rot is not None:
        k64 = rotary64(kn, cos, sin, pos, rot == "interleaved")
    kexp, vexp = kc0.double().clone(), vc0.double().clone()
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i in range(b):
        for t in range(s_new):
            r0, r1 = loc(i, int(seqlens[i]) + t)
            kexp[r0, r1] = k64[i, t]
            vexp[r0, r1] = vn[i, t].double()
            written[r0, r1] = True
    assert torch.equal(kc[~written], kc0[~written]), "k_cache changed outside the written slots"
    assert torch.equal(vc[~written], vc0[~written]), "v_cache changed outside the written slots"
    assert torch.equal(vc[written].double(), vexp[written])
    if rot is None:
        assert torch.equal(kc[written].double(), kexp[written])
    else:  # rotary in float32 then rounded, against float64 then rounded: at most one rounding step apart
        assert rel_err(kc[written], kexp[written]) <= 2 * FLOOR[dtype] + (1e-2 if dtype != torch.float32 else 0)

    q64 = q.double()
    if rot is not None:
        qpos = seq_t.long()[:, None] + (torch.arange(sq)[None, :] if (causal or window != (-1, -1))
                                        else torch.zeros(1, sq, dtype=torch.long))
        q64 = rotary64(q, cos, sin, qpos, rot == "interleaved")
    wl, wr = window
    if causal:
        wr = 0
    kw = dict(cache_seqlens=seq_t + s_new, block_table=bt, cache_batch_idx=idx, cache_leftpad=leftpad,
              softmax_scale=d ** -0.5, window_size=(wl, wr), softcap=softcap)
    ref, ref_lse = reference.decode_attention(q64, kexp, vexp, alibi_slopes=None if slopes is None else slopes.double(),
                                              sinks=None if sinks is None else sinks.double(), **kw)
    low, _ = reference.decode_attention(q64.to(dtype), kexp.to(dtype), vexp.to(dtype),
                                        alibi_slopes=None if slopes is None else slopes.to(dtype),
                                        sinks=None if sinks is None else sinks.to(dtype), **kw)
    assert_close_fa2(out, low, ref, dtype, what=f"out {variant}")
    assert rel_err(lse, ref_lse) <= 1e-4 + FLOOR[dtype], "lse"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}{v[k]}" for k in v) or "plain")
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
@pytest.mark.parametrize("sq", [1, 2, 7])
def test_kvcache_variants(variant, paged, sq):
    for dtype in LOW:
        run_case(dtype, paged, sq, rot=None, append=True, variant=variant)


@pytest.mark.parametrize("rot", ["interleaved", "neox"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
@pytest.mark.parametrize("sq", [1, 2, 7])
def test_kvcache_rotary(rot, mask, paged, sq):
    # q rotates at cache_seqlens + t when causal or local, at cache_seqlens otherwise
    variant = dict(causal=True) if mask == "causal" else dict(window=(5, 2)) if mask == "window" else dict()
    for dtype in LOW:
        run_case(dtype, paged, sq, rot=rot, append=True, variant=variant)


@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
@pytest.mark.parametrize("rot", [None, "interleaved"])
def test_kvcache_no_append(paged, rot):
    # seqlens >= 1: an empty sequence with nothing appended has no keys at all
    for dtype in LOW:
        run_case(dtype, paged, 2, rot=rot, append=False, variant=dict(causal=True), seqlens=(1, 6, 13))


def test_paged_equals_contiguous():
    b, hk, d, cap, page = 3, 2, 32, 32, 8
    kc = torch.randn(b, cap, hk, d)
    vc = torch.randn(b, cap, hk, d)
    pages = torch.randperm(b * 4 + 1)[: b * 4].view(b, 4)
    kp = torch.randn(b * 4 + 1, page, hk, d)
    vp = torch.randn(b * 4 + 1, page, hk, d)
    for i in range(b):
        for j in range(4):
            kp[pages[i, j]] = kc[i, j * page:(j + 1) * page]
            vp[pages[i, j]] = vc[i, j * page:(j + 1) * page]
    seq = torch.tensor([5, 0, 20], dtype=torch.int32)
    q = torch.randn(b, 3, 4, d)
    kn, vn = torch.randn(b, 3, hk, d), torch.randn(b, 3, hk, d)
    o1 = ae.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seq, causal=True)
    o2 = ae.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=seq, block_table=pages.to(torch.int32),
                                    causal=True)
    assert rel_err(o1, o2) < 1e-5


def test_int_cache_seqlens():
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    kn, vn = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    k2, v2 = kc.clone(), vc.clone()
    o1 = ae.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=4)
    o2 = ae.flash_attn_with_kvcache(q, k2, v2, kn, vn, cache_seqlens=torch.tensor([4, 4], dtype=torch.int32))
    assert torch.equal(o1, o2) and torch.equal(kc, k2) and torch.equal(kc[:, 4], kn[:, 0])
    for n in (2 ** 31, -2 ** 31 - 1, 2 ** 70):  # past int32: the argument named, not torch's overflow
        with pytest.raises(ValueError, match="cache_seqlens=.*does not fit int32"):
            ae.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n)


def test_none_cache_seqlens_is_full_cache():
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    o = ae.flash_attn_with_kvcache(q, kc, vc)
    ref = ae.flash_attn_func(q, kc, vc)
    assert rel_err(o, ref) < 1e-5


def _bad_inputs():
    q = torch.randn(2, 1, 4, 16)
    kp, vp = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq = torch.tensor([3, 5], dtype=torch.int32)
    kn, vn = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    return q, kp, vp, bt, seq, kn, vn


@pytest.mark.parametrize("case", ["page_oob", "page_neg", "bt_int64", "bt_shape", "bt_1d", "overflow",
                                  "overflow_contig", "seq_int64", "seq_shape", "seq_neg", "dtype", "k_shape",
                                  "k_only", "gqa", "rotary_dim", "rotary_len", "leftpad", "batch_idx", "grad",
                                  "alibi_shape", "alibi_dtype"])
def test_bad_input_raises(case):
    q, kp, vp, bt, seq, kn, vn = _bad_inputs()
    kw = dict(k=kn, v=vn, cache_seqlens=seq, block_table=bt)
    kc, vc = kp, vp
    if case == "page_oob":
        kw["block_table"] = torch.tensor([[0, 1], [2, 6]], dtype=torch.int32)
    elif case == "page_neg":
        kw["block_table"] = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    elif case == "bt_int64":
        kw["block_table"] = bt.long()
    elif case == "bt_shape":
        kw["block_table"] = bt[:1]
    elif case == "bt_1d":
        kw["block_table"] = bt.flatten()
    elif case == "overflow":
        kw["cache_seqlens"] = torch.tensor([3, 8], dtype=torch.int32)  # 8 + 1 > 2 pages of 4
    elif case == "overflow_contig":
        kc, vc = torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16)
        kw = dict(k=kn, v=vn, cache_seqlens=5)
    elif case == "seq_int64":
        kw["cache_seqlens"] = seq.long()
    elif case == "seq_shape":
        kw["cache_seqlens"] = seq[:1]
    elif case == "seq_neg":
        kw["cache_seqlens"] = torch.tensor([-1, 2], dtype=torch.int32)
    elif case == "dtype":
        kw["k"] = kn.double()
    elif case == "k_shape":
        kw["k"], kw["v"] = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 16)
    elif case == "k_only":
        kw["v"] = None
    elif case == "gqa":
        q = torch.randn(2, 1, 3, 16)
    elif case == "rotary_dim":
        kw["rotary_cos"], kw["rotary_sin"] = torch.randn(16, 10), torch.randn(16, 10)
    elif case == "rotary_len":
        kw["rotary_cos"], kw["rotary_sin"] = torch.randn(4, 4), torch.randn(4, 4)
    elif case == "leftpad":
        kw["cache_leftpad"] = torch.tensor([4, 0], dtype=torch.int32)
    elif case == "batch_idx":
        kw["cache_batch_idx"] = torch.tensor([0, 1], dtype=torch.int32)
    elif case == "grad":
        q.requires_grad_()
    elif case == "alibi_shape":
        kw["alibi_slopes"] = torch.rand(3)
    elif case == "alibi_dtype":
        kw["alibi_slopes"] = torch.rand(4, dtype=torch.float16)
    k0, v0 = kc.clone(), vc.clone()
    with pytest.raises((ValueError, TypeError)) as e:
        ae.flash_attn_with_kvcache(q, kc, vc, **kw)
    assert "flash_attn_with_kvcache" in str(e.value)
    assert torch.equal(kc, k0) and torch.equal(vc, v0), "a rejected call wrote into the cache"


@pytest.mark.parametrize("case", ["softcap_nan", "scale_nan", "num_splits", "alibi_strided", "mixed_8bit",
                                  "descale_shape", "descale_1d", "descale_mixed", "rotary_list"])
def test_op_rules_run_before_the_append(case):
    """Rules of the decode op (C++) that flash_attn_with_kvcache does not state itself also refuse
    the call before anything is appended (they ran only in decode_fwd, after the rows and their
    descales were written): the caches and descales keep every bit."""
    q, kn, vn = torch.randn(2, 1, 4, 32), torch.ones(2, 1, 2, 32), torch.ones(2, 1, 2, 32)
    kc, vc = torch.zeros(2, 16, 2, 32), torch.zeros(2, 16, 2, 32)
    kw = dict(cache_seqlens=3)
    if case == "softcap_nan":
        kw["softcap"] = float("nan")
    elif case == "scale_nan":
        kw["softmax_scale"] = float("nan")
    elif case == "num_splits":
        kw["num_splits"] = -1
    elif case == "alibi_strided":
        kw["alibi_slopes"] = torch.rand(2, 8)[:, ::2]
    elif case in ("mixed_8bit", "descale_shape", "descale_1d", "descale_mixed"):
        kc = torch.zeros(2, 16, 2, 32, dtype=torch.int8)
        vc = torch.zeros(2, 16, 2, 32, dtype=torch.float32 if case == "mixed_8bit" else torch.int8)
        ks, vs = torch.ones(2, 16, 2), torch.ones(2, 16, 2)
        if case == "descale_shape":
            ks, vs = torch.ones(3, 2), torch.ones(3, 2)
        elif case == "descale_1d":
            ks, vs = torch.ones(2), torch.ones(2)
        elif case == "descale_mixed":
            vs = torch.ones(2, 2)
        kw.update(k_descale=ks, v_descale=vs)
    elif case == "rotary_list":
        kw.update(rotary_cos=[[1.0]], rotary_sin=[[0.0]])
    before = [t.clone() for t in (kc, vc, kw.get("k_descale"), kw.get("v_descale")) if t is not None]
    with pytest.raises((ValueError, TypeError), match="k_cache and v_cache must share|descale|softcap|scale|"
                                                      "num_splits|alibi_slopes|rotary_cos"):
        ae.flash_attn_with_kvcache(q, kc, vc, kn, vn, **kw)
    after = [t for t in (kc, vc, kw.get("k_descale"), kw.get("v_descale")) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "a rejected call changed the cache"


def test_strided_index_vectors():
    """Index vectors that are strided views read as their values (flash_attn_with_kvcache makes
    them dense); decode_fwd, which passes them to the op as given, names a strided one. Before, the
    kernel read raw memory: a crash with cache_batch_idx, wrong rows with the others."""
    torch.manual_seed(0)
    q, kc, vc = torch.randn(2, 1, 4, 16), torch.randn(5, 20, 2, 16), torch.randn(5, 20, 2, 16)
    strided = lambda *xs: torch.tensor([[x, 10 ** 6] for x in xs], dtype=torch.int32)[:, 0]  # noqa: E731
    idx, pad, lens = strided(4, 0), strided(1, 3), strided(5, 12)
    with torch.no_grad():
        got = ae.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad)
        want = ae.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens.contiguous(), cache_batch_idx=idx.contiguous(),
                                          cache_leftpad=pad.contiguous())
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        with pytest.raises(ValueError, match="cache_seqlens must be contiguous"):
            decode_fwd(q, kc[:2], vc[:2], cache_seqlens=lens, scale=0.25)



def test_strided_paged_inputs_say_how_to_fix():
    """A block_table whose rows are strided, and strided alibi_slopes, name the call that fixes
    them (.contiguous()), and the fixed call reads what the dense one does."""
    torch.manual_seed(0)
    q, kc, vc = torch.randn(2, 1, 4, 16), torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([9, 12], dtype=torch.int32)
    wide = torch.zeros(2, 6, dtype=torch.int32)
    wide[:, ::2] = bt  # the same pages, every other column
    with pytest.raises(ValueError, match=r"block_table rows must be contiguous .*block_table\.contiguous\(\)"):
        decode_fwd(q, kc, vc, cache_seqlens=lens, block_table=wide[:, ::2], scale=0.25)
    slopes = torch.rand(4, 2)[:, 0]
    with pytest.raises(ValueError, match=r"alibi_slopes must be contiguous .*alibi_slopes\.contiguous\(\)"):
        decode_fwd(q, kc, vc, cache_seqlens=lens, block_table=bt, alibi_slopes=slopes, scale=0.25)
    got, _ = decode_fwd(q, kc, vc, cache_seqlens=lens, block_table=wide[:, ::2].contiguous(), scale=0.25,
                        alibi_slopes=slopes.contiguous())
    want, _ = decode_fwd(q, kc, vc, cache_seqlens=lens, block_table=bt, scale=0.25, alibi_slopes=slopes.contiguous())
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_paged_cache_checks_its_sizes_and_q():
    """nn.PagedKVCache: a size that is not a positive int is refused by name at construction (a
    float page size failed inside torch.zeros, 0 kv heads was accepted), and attend() with a q
    batch other than the selected sequences' names q and select() (it named block_table)."""
    from attention_ext import nn as aenn
    for kw, name in ((dict(page_size=4.0), "page_size"), (dict(n_kv_heads=0), "n_kv_heads"),
                     (dict(head_dim=-1), "head_dim"), (dict(num_pages=0), "num_pages"), (dict(batch=0), "batch")):
        args = dict(batch=2, num_pages=4, page_size=4, n_kv_heads=2, head_dim=8) | kw
        with pytest.raises(ValueError, match=f"PagedKVCache: {name} must be a positive int"):
            aenn.PagedKVCache(**args)
    c = aenn.PagedKVCache(2, 4, 4, 2, 8)
    c.append(torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8))
    with pytest.raises(ValueError, match=r"PagedKVCache.attend: q must be \(b, S_q, H, D\) with b = 2.*select\(\)"):
        c.attend(torch.randn(1, 1, 4, 8), scale=0.5)
    c.select([1])
    out = c.attend(torch.randn(1, 1, 4, 8), scale=0.5)
    assert out.shape == (1, 1, 4, 8) and torch.isfinite(out).all()


@pytest.mark.parametrize("fault", ["overflow", "seq_neg", "leftpad", "batch_idx", "page", "rotary_len"])
def test_capture_marks_bad_sequences(monkeypatch, fault):
    # Under a CUDA-graph capture the index values cannot be read on the host: a bad one gives NaN
    # rows for its sequence instead of the ValueError, and the other sequences' out, lse and cache
    # rows are the eager call's. The capture is simulated on the CPU (_ext.capturing says yes),
    # which runs the same Python branch; the CUDA host steps' own capture path runs in the
    # emulator (tests/cuda_emu/test_decode_emulated.py::test_capture_clamps_bad_indices).
    from attention_ext import _ext
    torch.manual_seed(0)
    b, h, hk, d, cap, s_new = 3, 4, 2, 16, 24, 2
    paged = fault == "page"
    kc, vc, bt, _, loc = make_cache(b, hk, d, cap, torch.float32, paged, page=8)
    if fault == "batch_idx":  # one spare cache row, which only the clamped index reaches
        kc, vc = torch.randn(b + 1, cap, hk, d), torch.randn(b + 1, cap, hk, d)
    q, kn, vn = torch.randn(b, s_new, h, d), torch.randn(b, s_new, hk, d), torch.randn(b, s_new, hk, d)
    good = dict(cache_seqlens=torch.tensor([5, 3, 9], dtype=torch.int32), block_table=bt, causal=True,
                num_splits=1)
    if fault == "leftpad":
        good["cache_leftpad"] = torch.tensor([1, 1, 2], dtype=torch.int32)
    if fault == "batch_idx":
        good["cache_batch_idx"] = torch.tensor([0, 1, 2], dtype=torch.int32)
    if fault == "rotary_len":
        good["rotary_cos"], good["rotary_sin"] = torch.rand(12, d // 2), torch.rand(12, d // 2)
    bad = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in good.items()}
    if fault == "overflow":
        bad["cache_seqlens"][1] = cap - 1  # + 2 new rows > cap
    elif fault == "seq_neg":
        bad["cache_seqlens"][1] = -4
    elif fault == "leftpad":
        bad["cache_leftpad"][1] = 6  # past cache_seqlens[1] = 3
    elif fault == "batch_idx":
        bad["cache_batch_idx"][1] = b + 9
    elif fault == "page":
        bad["block_table"][1, 0] = kc.shape[0] + 3
    elif fault == "rotary_len":
        bad["cache_seqlens"][1] = 20  # positions 20, 21 >= seqlen_ro 12
    k0, v0 = kc.clone(), vc.clone()
    with pytest.raises(ValueError):
        ae.flash_attn_with_kvcache(q, kc, vc, kn, vn, return_softmax_lse=True, **bad)
    k_want, v_want = k0.clone(), v0.clone()
    want = ae.flash_attn_with_kvcache(q, k_want, v_want, kn, vn, return_softmax_lse=True, **good)
    monkeypatch.setattr(_ext, "capturing", lambda dev: True)
    k_got, v_got = k0.clone(), v0.clone()
    got = ae.flash_attn_with_kvcache(q, k_got, v_got, kn, vn, return_softmax_lse=True, **bad)
    for g, w in zip(got, want):  # out (B, Sq, H, D), lse (B, H, Sq)
        assert g[1].isnan().all()
        assert torch.equal(g[0::2], w[0::2])
    # the good sequences' new rows hold their appends; every other cache row is as it was (the bad
    # sequence's clamped append writes back what it finds)
    rest = torch.ones(kc.shape[:2], dtype=torch.bool)
    for i in (0, 2):
        for r in range(int(good["cache_seqlens"][i]), int(good["cache_seqlens"][i]) + s_new):
            at = loc(i, r) if fault != "batch_idx" else (i, r)
            assert torch.equal(k_got[at], k_want[at]) and torch.equal(v_got[at], v_want[at])
            rest[at] = False
    assert torch.equal(k_got[rest], k0[rest]) and torch.equal(v_got[rest], v0[rest])

# ---------------------------------------------------------------- varlen packed and paged drop-ins

def _varlen(dtype, h=4, hk=2, d=32, lens_q=(3, 1, 7), lens_k=(5, 1, 9)):
    cq = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
    ck = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
    return cq, ck, max(lens_q), max(lens_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_qkvpacked(dtype):
    cq, _, mq, _ = _varlen(dtype)
    qkv = torch.randn(int(cq[-1]), 3, 4, 32).to(dtype).requires_grad_()
    out = ae.flash_attn_varlen_qkvpacked_func(qkv, cq, mq, causal=True)
    qkv2 = qkv.detach().clone().requires_grad_()
    ref = ae.flash_attn_varlen_func(qkv2[:, 0], qkv2[:, 1], qkv2[:, 2], cq, cq, mq, mq, causal=True)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(qkv.grad, qkv2.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_kvpacked(dtype):
    cq, ck, mq, mk = _varlen(dtype)
    q = torch.randn(int(cq[-1]), 4, 32).to(dtype)
    kv = torch.randn(int(ck[-1]), 2, 2, 32).to(dtype)
    out = ae.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, mq, mk, window_size=(2, 1))
    ref = ae.flash_attn_varlen_func(q, kv[:, 0].contiguous(), kv[:, 1].contiguous(), cq, ck, mq, mk,
                                    window_size=(2, 1))
    assert torch.equal(out, ref)
    with pytest.raises(ValueError):
        ae.flash_attn_varlen_kvpacked_func(q, kv[:, :1], cq, ck, mq, mk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_paged(dtype):
    cq, ck, mq, mk = _varlen(dtype, lens_k=(5, 0, 9))
    page, hk, d, b = 4, 2, 32, 3
    n_pages = 10
    bt = torch.randperm(n_pages)[: b * 3].view(b, 3).to(torch.int32)
    kp = torch.randn(n_pages, page, hk, d).to(dtype).requires_grad_()
    vp = torch.randn(n_pages, page, hk, d).to(dtype).requires_grad_()
    q = torch.randn(int(cq[-1]), 4, d).to(dtype)
    out = ae.flash_attn_varlen_func(q, kp, vp, cq, ck, mq, mk, causal=True, block_table=bt)
    # the packed keys by hand
    rows = [(int(bt[i, r // page]), r % page) for i in range(b) for r in range(int(ck[i + 1] - ck[i]))]
    k = torch.stack([kp[p_, s] for p_, s in rows]).detach()
    v = torch.stack([vp[p_, s] for p_, s in rows]).detach()
    ref = ae.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=True)
    assert torch.equal(out, ref)
    out.float().sum().backward()  # differentiable to the pages
    assert kp.grad is not None and vp.grad.abs().sum() > 0
    with pytest.raises(ValueError):
        ae.flash_attn_varlen_func(q, kp, vp, cq, ck, mq, mk, block_table=torch.full((b, 3), 10, dtype=torch.int32))
    with pytest.raises(TypeError):
        ae.flash_attn_varlen_func(q, kp, vp, cq, ck, mq, mk, block_table=bt.long())


def test_exports():
    from attention_ext.compat import flash_attn as fa
    for name in ("flash_attn_with_kvcache", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"):
        assert name in fa.__all__ and getattr(ae, name) is getattr(fa, name)
    assert ae.decode.flash_attn_with_kvcache is ae.flash_attn_with_kvcache


@pytest.mark.parametrize("case", ["head_dim_0", "page_size_0"])
def test_degenerate_sizes_get_the_op_rule(case):
    """A head dim of 0 (softmax_scale defaulting to D ** -0.5) and a page pool of 0-row pages
    (the pages a sequence uses, counted by division) raised a bare ZeroDivisionError in Python
    before the op's own rule could name them."""
    q, kc, vc = torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    kw = dict(cache_seqlens=0)
    if case == "head_dim_0":
        q, kc, vc, match = q[..., :0], kc[..., :0], vc[..., :0], "head dim must be in"
    else:
        kc, vc, match = kc[:, :0], vc[:, :0], "page pool is empty"
        kw["block_table"] = torch.zeros(2, 1, dtype=torch.int32)
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        ae.flash_attn_with_kvcache(q, kc, vc, **kw)


@pytest.mark.parametrize("case", ["batch_idx", "pages", "pages_one_seq"])
def test_appends_to_one_cache_row_are_refused(monkeypatch, case):
    """Two new rows bound for one cache row (a repeated cache_batch_idx entry, or block_table pages
    shared where sequences append) kept only the last write: the other sequence attended over a
    key and value that were not its own, silently. Refused before any write (under a simulated
    capture: those sequences' rows of out / lse are NaN, the rest are the eager call's); pages
    shared only where sequences read (a common prefix) stay allowed."""
    from attention_ext import _ext
    torch.manual_seed(0)
    b, h, hk, d, s_new = 3, 4, 2, 16, 2
    q, kn, vn = torch.randn(b, 1, h, d), torch.randn(b, s_new, hk, d), torch.randn(b, s_new, hk, d)
    lens = torch.tensor([3, 3, 2], dtype=torch.int32)
    if case == "batch_idx":
        kc, vc = torch.randn(4, 8, hk, d), torch.randn(4, 8, hk, d)
        good, bad = dict(cache_batch_idx=torch.tensor([2, 0, 1], dtype=torch.int32)), \
            dict(cache_batch_idx=torch.tensor([2, 2, 1], dtype=torch.int32))
        name, culprits = "cache_batch_idx", [0, 1]
    elif case == "pages":
        kc, vc = torch.randn(8, 4, hk, d), torch.randn(8, 4, hk, d)
        lens = torch.tensor([4, 4, 2], dtype=torch.int32)
        # sequences 0 and 1 share page 5 as their common prefix (read only), then append to their own
        # page (0 / 1); bad: to page 0 both
        good = dict(block_table=torch.tensor([[5, 0, 7], [5, 1, 7], [2, 7, 7]], dtype=torch.int32))
        bad = dict(block_table=torch.tensor([[5, 0, 7], [5, 0, 7], [2, 7, 7]], dtype=torch.int32))
        culprits = [0, 1]
    else:  # one sequence whose logical pages 0 and 1 are one page, appending rows 3..8 across them
        kc, vc = torch.randn(8, 4, hk, d), torch.randn(8, 4, hk, d)
        s_new = 6
        kn, vn = torch.randn(b, s_new, hk, d), torch.randn(b, s_new, hk, d)
        lens = torch.tensor([0, 0, 3], dtype=torch.int32)
        good = dict(block_table=torch.tensor([[0, 1, 6, 6], [3, 4, 6, 6], [2, 5, 6, 6]], dtype=torch.int32))
        bad = dict(block_table=torch.tensor([[0, 1, 6, 6], [3, 4, 6, 6], [2, 2, 6, 6]], dtype=torch.int32))
        culprits = [2]  # its rows 3 and 7 are both row 3 of page 2
    if case != "batch_idx":
        name = "block_table"
    k0, v0 = kc.clone(), vc.clone()
    with torch.no_grad():
        with pytest.raises(ValueError, match=f"flash_attn_with_kvcache: .*same cache row.*{name}"):
            ae.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, **bad)
        assert torch.equal(kc, k0) and torch.equal(vc, v0), "a refused append wrote into the cache"
        want = ae.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens,
                                          return_softmax_lse=True, **good)  # shared read-only pages: fine
        monkeypatch.setattr(_ext, "capturing", lambda dev: True)
        got = ae.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens,
                                         return_softmax_lse=True, **bad)
    for g, w in zip(got, want):
        for i in range(b):
            if i in culprits:
                assert g[i].isnan().all()
            else:
                assert torch.equal(g[i], w[i])


def test_append_into_one_tensor_as_both_caches_is_refused():
    """k_cache and v_cache passed as one tensor: the append wrote each new key, then the new value
    over it, and attention read the values as keys, silently. Refused before any write; reading
    such a cache (no append) and a packed KV cache's two views stay allowed."""
    q, kn, vn = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    c = torch.randn(2, 8, 2, 16)
    c0 = c.clone()
    with torch.no_grad():
        with pytest.raises(ValueError, match="flash_attn_with_kvcache: k_cache and v_cache are one tensor"):
            ae.flash_attn_with_kvcache(q, c, c, kn, vn, cache_seqlens=3)
        assert torch.equal(c, c0)
        ae.flash_attn_with_kvcache(q, c, c, cache_seqlens=3)
        kv = torch.randn(2, 8, 2, 2, 16)
        ae.flash_attn_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], kn, vn, cache_seqlens=3)
        assert torch.equal(kv[:, 3, 0], kn[:, 0]) and torch.equal(kv[:, 3, 1], vn[:, 0])


def test_cache_in_bhsd_order_says_how_to_read_it():
    """A (B, H_k, S, D) cache (Hugging Face's order) or a (B, H, 1, D) q: the heads error shows how
    each tensor was read and that .transpose(1, 2) reads it in place; the transposed cache then
    gives decode over its rows."""
    b, h, hk, d, s = 2, 8, 2, 16, 32
    kc, vc = torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)            # (B, H_k, S, D)
    q, lens = torch.randn(b, 1, h, d), torch.tensor([10, 20], dtype=torch.int32)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"k_cache \(B_cache, S_cache, H_k, D\).* = \(2, 2, 32, 16\): .*"
                                             r"\.transpose\(1, 2\)"):
            ae.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        with pytest.raises(ValueError, match=r"q \(B, Sq, H, D\) = \(2, 8, 1, 16\)"):
            ae.flash_attn_with_kvcache(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), cache_seqlens=lens)
        out = ae.flash_attn_with_kvcache(q, kc.transpose(1, 2), vc.transpose(1, 2), cache_seqlens=lens)
    want = ae.attention(q[1:].transpose(1, 2), kc[1:, :, :20], vc[1:, :, :20]).transpose(1, 2)
    torch.testing.assert_close(out[1:], want)
