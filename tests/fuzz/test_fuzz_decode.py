"""Property-based fuzzing of the decode family: flash_attn_with_kvcache on contiguous caches
(cache_batch_idx, cache_leftpad, appended k / v written in place) and paged caches (page sizes
that divide nothing, shuffled block tables), with causal / window, softcap, ALiBi and sinks, and
the decode op itself. No gradients (the decode ops have none). Output and LSE against the float64
reference under the project's rule (tests/fuzz/common.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import attention_ext as ae
from attention_ext.decode import ops
from attention_ext.decode import reference
from tests.fuzz.common import F64, at_least, check_out, dtypes, head_dims, log_example, seeds

pytestmark = pytest.mark.skipif(not ops.has_kernel(torch.device("cpu")), reason="decode op has no CPU kernel")


@at_least(300)
@given(data=st.data(), paged=st.booleans())
def test_fuzz_decode(data, paged):
    draw = data.draw
    dtype = draw(dtypes)
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
    torch.manual_seed(draw(seeds))
    note(dict(dtype=dtype, b=b, h=h, hk=hk, d=d, sq=sq, s_new=s_new, paged=paged, cap=cap, lens=lens))
    lens_t = torch.tensor(lens, dtype=torch.int32)

    def rnd(*shape):
        return torch.randn(shape, dtype=F64).to(dtype)

    block_table = cache_batch_idx = cache_leftpad = None
    if paged:
        n_pages = b * max_pages + draw(st.integers(0, 3))
        kc, vc = rnd(n_pages, page, hk, d), rnd(n_pages, page, hk, d)
        block_table = torch.randperm(n_pages)[: b * max_pages].view(b, max_pages).to(torch.int32)
    else:
        n_rows = b + draw(st.integers(0, 2))
        kc, vc = rnd(n_rows, cap, hk, d), rnd(n_rows, cap, hk, d)
        if batch_idx:
            cache_batch_idx = torch.randperm(n_rows)[:b].to(torch.int32)
        if leftpad:
            cache_leftpad = (torch.rand(b) * (lens_t + s_new + 1).float()).long().clamp(max=lens_t + s_new)
            cache_leftpad = torch.minimum(cache_leftpad, lens_t).to(torch.int32)
    q = rnd(b, sq, h, d)
    knew = rnd(b, s_new, hk, d) if s_new else None
    vnew = rnd(b, s_new, hk, d) if s_new else None
    acc = torch.float64 if dtype == F64 else torch.float32
    slopes = None if alibi is None else torch.rand((h,) if alibi == "h" else (b, h), dtype=acc) * 0.5
    sink_t = torch.randn(h, dtype=acc) if sinks else None
    kc0, vc0 = kc.clone(), vc.clone()
    with torch.no_grad():
        res = ae.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=lens_t, cache_batch_idx=cache_batch_idx,
                                         cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=scale,
                                         causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                                         num_splits=num_splits, return_softmax_lse=lse_too, sinks=sink_t)
    out, lse = res if lse_too else (res, None)
    assert out.shape == q.shape and out.dtype == dtype
    # the appended rows were written in place, and nothing else changed
    if s_new:
        for i in range(b):
            for t in range(s_new):
                r = int(lens_t[i]) + t
                if paged:
                    pg, row = int(block_table[i, r // page]), r % page
                else:
                    pg, row = int(cache_batch_idx[i]) if cache_batch_idx is not None else i, r
                assert torch.equal(kc[pg, row], knew[i, t]) and torch.equal(vc[pg, row], vnew[i, t])
                kc0[pg, row], vc0[pg, row] = knew[i, t], vnew[i, t]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    win = (window[0], 0) if causal else window

    def ref_in(dt):
        return reference.decode_attention(q.to(dt), kc.to(dt), vc.to(dt), cache_seqlens=lens_t + s_new,
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
