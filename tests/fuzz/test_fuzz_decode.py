"""Property-based fuzzing of the decode family: flash_attn_with_kvcache on contiguous caches
(cache_batch_idx, cache_leftpad, appended k / v written in place) and paged caches (page sizes
that divide nothing, shuffled block tables), with causal / window, softcap, ALiBi, sinks and
rotary (GPT-J / NeoX, any even rotary_dim), and the decode op itself. q and the caches come in
strided storage too (heads-major, a wider last dim sliced, every other row), whose storage
outside the view is NaN: a read there fails the comparison, a write there fails the check of the
storage. No gradients (the decode ops have none). Output and LSE against the float64 reference
under the project's rule (tests/fuzz/common.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import attention_ext as ae
from attention_ext.decode import ops
from attention_ext.decode import quantize_kv, reference
from attention_ext.decode.kvcache import apply_rotary
from tests.decode.test_kvcache import rotary64
from tests.fuzz.common import F64, LOW, at_least, check_out, dtypes, head_dims, log_example, seeds
from tests.helpers import FLOOR, rel_err

pytestmark = pytest.mark.skipif(not ops.has_kernel(torch.device("cpu")), reason="decode op has no CPU kernel")

# how a (N, S, H, D) tensor is stored: contiguous; heads-major (N, H, S, D) storage transposed, as a
# cache kept bhsd; the last dim 3 wider, sliced [..., 1:D+1]; every other row of a 2S-row buffer
STORAGES = ["contig", "contig", "heads_major", "sliced", "every_other_row"]


def stored(shape, dtype, storage):
    """(view, backing, inside): a random tensor of `shape` in `storage` whose backing buffer is NaN
    everywhere outside the view; inside is the bool mask of the view's positions in the backing."""
    n, s, h, d = shape
    if storage == "contig":
        back_shape, view = shape, (lambda t: t)
    elif storage == "heads_major":
        back_shape, view = (n, h, s, d), (lambda t: t.transpose(1, 2))
    elif storage == "sliced":
        back_shape, view = (n, s, h, d + 3), (lambda t: t[..., 1:d + 1])
    else:
        back_shape, view = (n, 2 * s, h, d), (lambda t: t[:, ::2])
    back = torch.full(back_shape, float("nan"), dtype=dtype)
    view(back).copy_(torch.randn(shape, dtype=F64).to(dtype))
    inside = torch.zeros(back_shape, dtype=torch.bool)
    view(inside).fill_(True)
    return view(back), back, inside


def draw_problem(draw):
    """The problem both decode fuzz tests draw: (B, H_k, H, D, S_q, S_new, causal, window, softcap,
    alibi, sinks, scale)."""
    b = draw(st.integers(1, 4))
    # now and then 20 kv heads: rows wide enough (H_k * D * element past 4 KB) that the CPU
    # kernel's chunks shrink below 32 keys (kChunkBytes, csrc/decode/cpu/decode.cpp)
    hk = draw(st.sampled_from([1, 2, 3, 1, 2, 3, 20]))
    h = hk * draw(st.integers(1, 4))
    d = draw(head_dims)
    sq = draw(st.sampled_from([1, 1, 1, 2, 3, 5, 8, 9]))
    s_new = draw(st.sampled_from([0, 0, 1, 2, 5]))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1), (-1, -1), (7, 0), (0, 0), (30, 2)]))
    softcap = draw(st.sampled_from([0.0, 0.0, 5.0]))
    alibi = draw(st.sampled_from([None, "h", "bh"]))
    sinks = draw(st.booleans())
    scale = draw(st.sampled_from([None, 0.3]))
    return b, hk, h, d, sq, s_new, causal, window, softcap, alibi, sinks, scale


@at_least(300)
@given(data=st.data(), paged=st.booleans())
def test_fuzz_decode(data, paged):
    draw = data.draw
    dtype = draw(dtypes)
    b, hk, h, d, sq, s_new, causal, window, softcap, alibi, sinks, scale = draw_problem(draw)
    lse_too = draw(st.booleans())
    num_splits = draw(st.sampled_from([0, 1, 3]))
    if paged:
        page = draw(st.sampled_from([1, 3, 16, 17, 64]))
        max_pages = draw(st.integers(1, 6))
        cap = page * max_pages
    else:
        cap = draw(st.sampled_from([1, 5, 16, 33, 64, 130]))
    lens = draw(st.lists(st.integers(0, max(cap - s_new, 0)), min_size=b, max_size=b))
    if s_new > cap:
        s_new = 0
    leftpad = (not paged) and draw(st.booleans())
    batch_idx = (not paged) and draw(st.booleans())
    q_storage, cache_storage = draw(st.sampled_from(STORAGES)), draw(st.sampled_from(STORAGES))
    rotary = draw(st.sampled_from([None, None, "interleaved", "neox"])) if d >= 2 else None
    rotary_dim = 2 * draw(st.integers(1, d // 2)) if rotary else 0
    torch.manual_seed(draw(seeds))
    note(dict(dtype=dtype, b=b, h=h, hk=hk, d=d, sq=sq, s_new=s_new, paged=paged, cap=cap, lens=lens,
              q_storage=q_storage, cache_storage=cache_storage, rotary=rotary, rotary_dim=rotary_dim))
    lens_t = torch.tensor(lens, dtype=torch.int32)

    def rnd(*shape):
        return torch.randn(shape, dtype=F64).to(dtype)

    block_table = cache_batch_idx = cache_leftpad = None
    if paged:
        n_pages = b * max_pages + draw(st.integers(0, 3))
        cache_shape = (n_pages, page, hk, d)
        block_table = torch.randperm(n_pages)[: b * max_pages].view(b, max_pages).to(torch.int32)
    else:
        n_rows = b + draw(st.integers(0, 2))
        cache_shape = (n_rows, cap, hk, d)
    kc, k_back, k_inside = stored(cache_shape, dtype, cache_storage)
    vc, v_back, v_inside = stored(cache_shape, dtype, cache_storage)
    if not paged:
        if batch_idx:
            cache_batch_idx = torch.randperm(n_rows)[:b].to(torch.int32)
        if leftpad:
            cache_leftpad = (torch.rand(b) * (lens_t + s_new + 1).float()).long().clamp(max=lens_t + s_new)
            cache_leftpad = torch.minimum(cache_leftpad, lens_t).to(torch.int32)
    q = stored((b, sq, h, d), dtype, q_storage)[0]
    knew = rnd(b, s_new, hk, d) if s_new else None
    vnew = rnd(b, s_new, hk, d) if s_new else None
    acc = torch.float64 if dtype == F64 else torch.float32
    slopes = None if alibi is None else torch.rand((h,) if alibi == "h" else (b, h), dtype=acc) * 0.5
    sink_t = torch.randn(h, dtype=acc) if sinks else None
    cos = sin = None
    if rotary:
        # positions up to cache_seqlens + max(S_q, S_new) - 1, and a few rows to spare
        ang = torch.rand(cap + max(sq, s_new) + draw(st.integers(0, 3)), rotary_dim // 2, dtype=F64) * 6.0
        cos, sin = ang.cos().float(), ang.sin().float()
    kc0, vc0 = kc.clone(), vc.clone()
    with torch.no_grad():
        res = ae.flash_attn_with_kvcache(q, kc, vc, knew, vnew, rotary_cos=cos, rotary_sin=sin,
                                         rotary_interleaved=rotary == "interleaved",
                                         cache_seqlens=lens_t, cache_batch_idx=cache_batch_idx,
                                         cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=scale,
                                         causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                                         num_splits=num_splits, return_softmax_lse=lse_too, sinks=sink_t)
    out, lse = res if lse_too else (res, None)
    assert out.shape == q.shape and out.dtype == dtype
    # the appended rows were written in place (k after rotary, computed here in float64: one
    # rounding apart), nothing else in the view changed, and the storage outside it is still NaN
    k64 = rotary64(knew, cos, sin, lens_t.long()[:, None] + torch.arange(s_new)[None, :], rotary == "interleaved") \
        if s_new and rotary else None
    if s_new:
        for i in range(b):
            for t in range(s_new):
                r = int(lens_t[i]) + t
                if paged:
                    pg, row = int(block_table[i, r // page]), r % page
                else:
                    pg, row = int(cache_batch_idx[i]) if cache_batch_idx is not None else i, r
                assert torch.equal(vc[pg, row], vnew[i, t])
                if rotary:
                    tol = 2 * FLOOR[dtype] + (1e-2 if dtype in LOW else 0)
                    assert rel_err(kc[pg, row], k64[i, t]) <= tol, "rotated k row"
                else:
                    assert torch.equal(kc[pg, row], knew[i, t])
                kc0[pg, row], vc0[pg, row] = kc[pg, row], vnew[i, t]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    for back, inside in ((k_back, k_inside), (v_back, v_inside)):
        assert back[~inside].isnan().all(), "a write outside the cache's view"
    win = (window[0], 0) if causal else window
    q_in = q
    if rotary:
        # q rows at cache_seqlens + t when causal or local, else all at cache_seqlens. The kernel is
        # given q rotated then rounded to its dtype: the references start from that same q (as they
        # start from the cache with its rotated rows), after it is held, like k, within one rounding
        # of the rotation computed here in float64
        local = causal or window != (-1, -1)
        q_pos = lens_t.long()[:, None] + (torch.arange(sq)[None, :] if local else torch.zeros(1, sq, dtype=torch.long))
        q_in = apply_rotary(q, cos, sin, q_pos, rotary == "interleaved")
        tol = 2 * FLOOR[dtype] + (1e-2 if dtype in LOW else 0)
        assert rel_err(q_in, rotary64(q, cos, sin, q_pos, rotary == "interleaved")) <= tol, "rotated q"

    def ref_in(dt):
        return reference.decode_attention(q_in.to(dt), kc.to(dt), vc.to(dt), cache_seqlens=lens_t + s_new,
                                          block_table=block_table, cache_batch_idx=cache_batch_idx,
                                          cache_leftpad=cache_leftpad, softmax_scale=scale, window_size=win,
                                          softcap=softcap, alibi_slopes=None if slopes is None else slopes.to(dt),
                                          sinks=None if sink_t is None else sink_t.to(dt))

    ref, ref_lse = ref_in(F64)
    low, _ = ref_in(dtype)
    check_out(out, low, ref, dtype, "kvcache out")
    if lse is not None:
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin), "lse finiteness"
        if fin.any():
            assert (lse[fin].double() - ref_lse[fin]).abs().max().item() <= 1e-3, "lse"
    log_example("decode", "paged" if paged else "contiguous")


def test_kvcache_larger_cache_than_batch():
    """Found by test_fuzz_decode (B = 1 over a 2-row contiguous cache, no cache_batch_idx): the
    Python layer accepted the cache (flash-attn reads rows [0, B)), appended k / v in place, then
    the decode op raised "the cache has 2 sequences and q 1". Now: rows [0, B) are read, the append
    lands in the caller's cache, and nothing raises."""
    torch.manual_seed(0)
    q = torch.randn(1, 1, 2, 8)
    kc, vc = torch.randn(3, 10, 2, 8), torch.randn(3, 10, 2, 8)
    kn, vn = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
    lens = torch.tensor([4], dtype=torch.int32)
    with torch.no_grad():
        out = ae.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens)
    assert torch.equal(kc[0, 4], kn[0, 0]) and torch.equal(vc[0, 4], vn[0, 0])
    ref, _ = reference.decode_attention(q.double(), kc.double(), vc.double(), cache_seqlens=lens + 1)
    assert (out.double() - ref).abs().max().item() < 1e-5


@at_least(200)
@given(data=st.data(), paged=st.booleans())
def test_fuzz_decode_quantized(data, paged):
    """flash_attn_with_kvcache over int8 / float8_e4m3fn caches (contiguous or paged) with per-row or
    per-(batch, kv head) descales, every mask and score option, appended rows quantized in place,
    against decode over the dequantized cache (stored value x descale) in float64 under the
    project's rule. The NaN policy: every cache byte no row reads (past cache_seqlens, before
    cache_leftpad, rows and pages no sequence owns) is random, fp8's NaN bytes included, and its
    per-row descales NaN; the output must not see them. Appended rows hold quantize_rows' bytes
    and (per row) amax / the type's largest value as their descales; nothing else changes."""
    from attention_ext.decode.quant import QMAX, quantize_rows
    draw = data.draw
    qdt = draw(st.sampled_from([torch.int8, torch.float8_e4m3fn]))
    per_row = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    b, hk, h, d, sq, s_new, causal, window, softcap, alibi, sinks, scale = draw_problem(draw)
    num_splits = draw(st.sampled_from([0, 1, 3]))
    if paged:
        page = draw(st.sampled_from([1, 3, 16, 17, 64]))
        max_pages = draw(st.integers(1, 6))
        cap = page * max_pages
    else:
        cap = draw(st.sampled_from([1, 5, 16, 33, 64, 130]))
    if s_new > cap:
        s_new = 0
    lens = draw(st.lists(st.integers(0, cap - s_new), min_size=b, max_size=b))
    leftpad = (not paged) and draw(st.booleans())
    batch_idx = (not paged) and draw(st.booleans())
    torch.manual_seed(draw(seeds))
    note(dict(qdt=qdt, per_row=per_row, dtype=dtype, b=b, h=h, hk=hk, d=d, sq=sq, s_new=s_new, paged=paged,
              cap=cap, lens=lens))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    block_table = cache_batch_idx = cache_leftpad = None
    if paged:
        n_pages = b * max_pages + draw(st.integers(0, 3))
        shape = (n_pages, page, hk, d)
        block_table = torch.randperm(n_pages)[: b * max_pages].view(b, max_pages).to(torch.int32)
    else:
        n_rows = b + draw(st.integers(0, 2))
        shape = (n_rows, cap, hk, d)
        if batch_idx:
            cache_batch_idx = torch.randperm(n_rows)[:b].to(torch.int32)
        if leftpad:
            cache_leftpad = torch.minimum((torch.rand(b) * (lens_t + 1).float()).long(), lens_t.long()).to(torch.int32)
    # the positions some sequence reads: [leftpad, cache_seqlens + s_new) of its rows
    read = torch.zeros(shape[:2], dtype=torch.bool)
    for i in range(b):
        lo = int(cache_leftpad[i]) if cache_leftpad is not None else 0
        for j in range(lo, lens[i] + s_new):
            if paged:
                read[int(block_table[i, j // page]), j % page] = True
            else:
                read[int(cache_batch_idx[i]) if cache_batch_idx is not None else i, j] = True
    # values with a spread of row magnitudes (outlier rows), quantized per row or per sequence
    caches, scales = [], []
    for _ in range(2):
        x = torch.randn(shape) * torch.exp(2 * torch.randn(shape[:3] + (1,)))
        if per_row:
            xq, s = quantize_kv(x, qdt, "token")
            s[~read] = float("nan")
        else:
            s = torch.rand(b, hk) * 0.05 + 1e-3  # as given: saturating rows above 127 or 448 x s
            xq = quantize_rows(x, (x.abs().amax(-1, keepdim=True) / QMAX[qdt]).clamp(min=1e-30), qdt)
        junk = torch.randint(0, 256, shape, dtype=torch.uint8)
        junk[..., :: max(d // 4, 1)] = 0x7F  # fp8 NaN (int8: 127)
        xq.view(torch.uint8)[~read] = junk[~read]
        caches.append(xq)
        scales.append(s)
    (kc, vc), (ks, vs) = caches, scales
    knew, vnew = ((torch.randn(b, s_new, hk, d) * 3).to(dtype) for _ in range(2)) if s_new else (None, None)
    q = torch.randn(b, sq, h, d).to(dtype)
    acc = torch.float32
    slopes = None if alibi is None else torch.rand((h,) if alibi == "h" else (b, h), dtype=acc) * 0.5
    sink_t = torch.randn(h, dtype=acc) if sinks else None
    before = [t.clone() for t in (kc, vc, ks, vs)]
    with torch.no_grad():
        out = ae.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=lens_t, cache_batch_idx=cache_batch_idx,
                                         cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=scale,
                                         causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                                         num_splits=num_splits, sinks=sink_t, k_descale=ks, v_descale=vs)
    assert out.shape == q.shape and out.dtype == dtype
    # the appended rows: quantize_rows' bytes, their descales (per row) amax / the type's largest
    written = torch.zeros(shape[:2], dtype=torch.bool)
    for i in range(b):
        for t in range(s_new):
            r = lens[i] + t
            pg, row = (int(block_table[i, r // page]), r % page) if paged else \
                (int(cache_batch_idx[i]) if cache_batch_idx is not None else i, r)
            written[pg, row] = True
            for new, cache, sc, s0 in ((knew, kc, ks, before[2]), (vnew, vc, vs, before[3])):
                x = new[i, t].float()
                if per_row:
                    want_s = x.abs().amax(-1) / QMAX[qdt]
                    assert torch.equal(sc[pg, row], want_s), "appended row's descale"
                    want = quantize_rows(x, want_s[:, None], qdt)
                else:
                    want = quantize_rows(x, s0[i][:, None], qdt)
                assert torch.equal(cache[pg, row].view(torch.uint8), want.view(torch.uint8)), "appended row"
    for now, was in zip((kc, vc), before[:2]):
        assert torch.equal(now.view(torch.uint8)[~written], was.view(torch.uint8)[~written]), "a write elsewhere"
    if per_row:
        for now, was in zip((ks, vs), before[2:]):
            assert torch.equal(now[~written].nan_to_num(-1.0), was[~written].nan_to_num(-1.0)), "a descale written"
    # the reference reads what the kernel may read: the unread bytes zeroed, their descales 1
    clean = []
    for c_, s_ in ((kc, ks), (vc, vs)):
        c2 = c_.clone()
        c2.view(torch.uint8)[~read] = 0
        s2 = s_.clone()
        if per_row:
            s2[~read] = 1.0
        clean.append((c2, s2))
    (kcl, ksl), (vcl, vsl) = clean
    win = (window[0], 0) if causal else window

    def ref_in(dt):
        return reference.decode_attention(q.to(dt), kcl, vcl, cache_seqlens=lens_t + s_new, block_table=block_table,
                                          cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                                          softmax_scale=scale, window_size=win, softcap=softcap,
                                          alibi_slopes=None if slopes is None else slopes.to(dt),
                                          sinks=None if sink_t is None else sink_t.to(dt), k_descale=ksl,
                                          v_descale=vsl)

    ref, _ = ref_in(F64)
    low, _ = ref_in(dtype)
    check_out(out, low, ref, dtype, "quantized kvcache out")
    log_example("decode", "quantized " + ("paged" if paged else "contiguous"))
