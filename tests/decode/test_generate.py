"""Batched ragged generation on the paged KV cache: nn.PagedKVCache bookkeeping, and
LanguageModel.generate([prompts...]) against generating each prompt alone."""
import numpy as np
import pytest
import torch

from attention_ext.models.lm import LanguageModel, LMConfig
from attention_ext.nn import KVCache, PagedKVCache


def _lm(**kw):
    torch.manual_seed(0)
    c = dict(vocab_size=64, n_layers=2, n_heads=4, d_model=64, block_size=128)
    c.update(kw)
    return LanguageModel(LMConfig(**c)).eval()


def _prompts(lens=(3, 17, 9, 30), vocab=64):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (t,), generator=g) for t in lens]


@pytest.mark.parametrize("kw", [dict(), dict(positional="learned"), dict(n_kv_heads=2), dict(n_kv_heads=1),
                                dict(positional="alibi"), dict(window=(8, -1)), dict(sinks=True)])
def test_ragged_greedy_equals_each_alone(kw):
    model = _lm(**kw)
    prompts = _prompts()
    outs = model.generate(prompts, 20, greedy=True, page_size=4)
    for p, o in zip(prompts, outs):
        assert o.shape == (p.numel() + 20,)
        torch.testing.assert_close(o, model.generate(p[None], 20, greedy=True)[0], rtol=0, atol=0)


def test_old_tensor_call_still_works():
    model = _lm()
    idx = torch.randint(0, 64, (2, 5))
    assert model.generate(idx, 7, greedy=True).shape == (2, 12)


def test_paged_cache_append_view_free_reuse():
    c = PagedKVCache(3, num_pages=6, page_size=4, n_kv_heads=2, head_dim=8, max_len=16)
    k0, v0 = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    c.select([0]).append(k0, v0)
    assert c.lengths.tolist() == [6, 0, 0] and c.num_free_pages == 4
    k2, v2 = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    c.select([2]).append(k2, v2)
    # a batched step over sequences 2 and 0 (sequence 1 inactive)
    ks, vs = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    c.select([2, 0]).append(ks, vs)
    assert c.lengths.tolist() == [7, 0, 4]
    k, v = c.view(0)
    torch.testing.assert_close(k, torch.cat([k0[0], ks[1]]))
    torch.testing.assert_close(v, torch.cat([v0[0], vs[1]]))
    k, v = c.view(2)
    torch.testing.assert_close(k, torch.cat([k2[0], ks[0]]))
    pages0 = set(c._pages[0])
    c.free(0)
    assert c.lengths.tolist() == [0, 0, 4] and c.num_free_pages == 5
    kn = torch.randn(1, 8, 2, 8)
    c.select([1]).append(kn, kn)
    assert set(c._pages[1]) == pages0  # freed pages are reused
    torch.testing.assert_close(c.view(1)[0], kn[0])
    torch.testing.assert_close(c.view(2)[1], torch.cat([v2[0], vs[0]]))  # untouched by the reuse


def test_pool_exhaustion_raises():
    c = PagedKVCache(2, num_pages=2, page_size=4, n_kv_heads=1, head_dim=4)
    c.select([0]).append(torch.randn(1, 8, 1, 4), torch.randn(1, 8, 1, 4))
    with pytest.raises(RuntimeError, match="pool exhausted"):
        c.select([1]).append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    model = _lm()
    with pytest.raises(RuntimeError, match="pool exhausted"):
        model.generate(_prompts(), 20, greedy=True, page_size=4, num_pages=6)


def test_max_len_is_rows_not_pages():
    """max_len bounds a sequence's rows exactly (100 rows with 16-row pages, not the 112 its 7
    pages hold), refused before anything is written; a bad max_len is named."""
    c = PagedKVCache(1, num_pages=8, page_size=16, n_kv_heads=1, head_dim=4, max_len=100)
    k = torch.randn(1, 100, 1, 4)
    c.append(k, k)
    with pytest.raises(ValueError, match="needs 101 rows, more than max_len=100"):
        c.append(k[:, :1], k[:, :1])
    assert c.lengths.tolist() == [100]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_len must be a positive int"):
            PagedKVCache(1, num_pages=8, page_size=16, n_kv_heads=1, head_dim=4, max_len=bad)
    for n in (np.int64(100), torch.tensor(100)):
        assert PagedKVCache(1, num_pages=8, page_size=16, n_kv_heads=1, head_dim=4, max_len=n).max_len == 100


def test_pool_exhaustion_mid_batch_writes_nothing():
    """A batched append whose later sequence finds the pool empty leaves every sequence as it was
    (the pages of all are sized before any is claimed): no length advanced over unwritten rows."""
    c = PagedKVCache(2, num_pages=3, page_size=4, n_kv_heads=2, head_dim=8)
    k = torch.randn(2, 4, 2, 8)
    c.append(k, k)
    before = (c.lengths.tolist(), c.num_free_pages, c.block_table.clone(), c.view(0)[0].clone())
    with pytest.raises(RuntimeError, match="nothing was written"):
        c.append(k[:, :1], k[:, :1])  # sequence 0 takes the last page, sequence 1 finds none
    assert c.lengths.tolist() == before[0] and c.num_free_pages == before[1]
    assert torch.equal(c.block_table, before[2]) and torch.equal(c.view(0)[0], before[3])
    c.select([0]).append(k[:1, :1], k[:1, :1])  # the cache still works
    assert c.lengths.tolist() == [5, 4]


def test_select_rules():
    c = PagedKVCache(3, num_pages=4, page_size=4, n_kv_heads=1, head_dim=4)
    for rows in ([0, 0], [-1], [3], [0.5]):
        with pytest.raises(ValueError, match="rows must be distinct sequence indices in \\[0, 3\\)"):
            c.select(rows)
    with pytest.raises(ValueError, match="packed must give a row count"):
        c.select([0, 1], packed=[2])
    assert c.select(range(3)).rows == [0, 1, 2]


def test_packed_call_into_sequences_with_rows_is_refused_before_writing():
    """A packed (ragged) call is a prefill from scratch: into sequences that hold rows it is
    refused before the cache changes (it used to append the rows, then fail in the decode call)."""
    from attention_ext.nn.layers import Attention, AttentionConfig

    a = Attention(AttentionConfig(d_model=32, n_heads=4, causal=True)).eval()
    c = PagedKVCache(2, num_pages=8, page_size=4, n_kv_heads=4, head_dim=8)
    with torch.no_grad():
        c.select([0, 1], packed=[4, 4])
        a(torch.randn(1, 8, 32), cache=c)
        c.select([0, 1], packed=[2, 3])
        with pytest.raises(ValueError, match="prefill of sequences with no rows"):
            a(torch.randn(1, 5, 32), cache=c)
    assert c.lengths.tolist() == [4, 4]


def test_paged_generation_needs_a_paged_reader():
    """Ragged prompts and kv_cache_dtype run on paged caches: a model whose layers do not read them
    (linear attention's state, the sparse layer's kernels) is told so by generate()."""
    for at in ("linear", "sparse"):
        model = _lm(attention_type=at)
        for kw in (dict(), dict(kv_cache_dtype=torch.int8)):
            with pytest.raises(NotImplementedError, match=f"attention_type='{at}' does not read"):
                model.generate(_prompts((3, 5)), 2, **kw)


def test_generate_argument_rules():
    model = _lm()
    prompts = _prompts((3, 5))
    assert [o.shape[0] for o in model.generate(prompts, 0)] == [3, 5]  # max_new_tokens 0: the prompts
    assert model.generate(torch.stack([prompts[0]] * 2), 0).shape == (2, 3)
    for kw, msg in ((dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens=2, page_size=0), "page_size"),
                    (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
                    (dict(max_new_tokens=2, top_k=-2), "top_k"), (dict(max_new_tokens=2, top_p=1.5), "top_p")):
        with pytest.raises(ValueError, match=msg):
            model.generate(prompts, **kw)
    with pytest.raises(ValueError, match="T0 >= 1"):
        model.generate(torch.zeros(2, 0, dtype=torch.long), 3)
    # top_k 0 filters nothing (Hugging Face's sense); top_p 0 keeps the most likely token alone
    g = torch.Generator().manual_seed(0)
    assert model.generate(prompts, 3, top_k=0, generator=g)[0].shape == (6,)
    greedy = model.generate(prompts, 4, greedy=True)
    nucleus = model.generate(prompts, 4, top_p=0.0, generator=g)
    for a, b in zip(greedy, nucleus):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_eos_stops_and_frees_pages():
    model = _lm()
    prompts = _prompts()
    full = model.generate(prompts, 12, greedy=True, page_size=4)
    eos = int(full[1][prompts[1].numel() + 2])  # sequence 1's third new token
    caches = []
    orig = model.allocate_paged_caches

    def spy(*a, **k):
        caches.extend(orig(*a, **k))
        return caches
    model.allocate_paged_caches = spy
    outs = model.generate(prompts, 12, greedy=True, page_size=4, eos_token_id=eos)
    for p, o, f in zip(prompts, outs, full):
        new = f[p.numel():].tolist()
        stop = new.index(eos) + 1 if eos in new else len(new)
        assert o.tolist() == f[: p.numel() + stop].tolist()
    assert outs[1].numel() <= prompts[1].numel() + 3
    for c in caches:  # every sequence finished: all pages back in the pool
        assert c.num_free_pages == c.k_pages.shape[0] and c.lengths.tolist() == [0] * len(prompts)


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_heads=2, positional="learned")])
def test_paged_and_contiguous_cache_give_the_same_logits(kw):
    model = _lm(**kw)
    idx = torch.randint(0, 64, (3, 11))
    a = model.config.block().attn
    dense = model.allocate_caches(3, 16)
    paged = model.allocate_paged_caches(3, num_pages=12, page_size=4, max_len=16)
    torch.testing.assert_close(model(idx, caches=paged), model(idx, caches=dense))
    for t in range(4):
        tok = torch.randint(0, 64, (3, 1))
        ref = model(tok, caches=dense, offset=11 + t)
        got = model(tok, caches=paged, offset=paged[0].positions())
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert paged[0].lengths.tolist() == dense[0].lengths.tolist() == [15] * 3


@pytest.mark.parametrize("qdt", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_8bit_paged_cache(qdt):
    """PagedKVCache(dtype=int8 / e4m3): appended rows are quantized with a scale per row and kv
    head (view() reads them back within half a step), and a model stepping through it gives the
    float cache's logits up to the quantization: teacher-forced perplexity within 1%, and
    generate(..., kv_cache_dtype=) runs the same path (a (B, T0) idx included)."""
    c = PagedKVCache(2, num_pages=6, page_size=4, n_kv_heads=2, head_dim=8, max_len=16, dtype=qdt)
    k, v = torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)
    c.append(k, v)
    for s in range(2):
        kk, vv = c.view(s)
        step = k[s].abs().amax(-1, keepdim=True) / (127 if qdt == torch.int8 else 448)
        tol = 0.5 * step if qdt == torch.int8 else 2.0 ** -4 * k[s].abs() + step
        assert ((kk - k[s]).abs() <= tol * (1 + 1e-6)).all()
    model = _lm(n_kv_heads=2)
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))
    nll = {}
    for dtype in (torch.float32, qdt):  # (under no_grad: a cache is inference state)
        caches = model.allocate_paged_caches(2, num_pages=24, page_size=4, max_len=48, dtype=dtype)
        with torch.no_grad():
            logits = [model(idx[:, :1], caches=caches, offset=caches[0].positions())]
            for t in range(1, idx.shape[1] - 1):
                logits.append(model(idx[:, t:t + 1], caches=caches, offset=caches[0].positions()))
        lg = torch.cat(logits, 1)  # (2, 39, V): predicts idx[:, 1:]
        nll[dtype] = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), idx[:, 1:].reshape(-1))
    assert abs(float(torch.exp(nll[qdt]) / torch.exp(nll[torch.float32])) - 1) < 0.01
    out = model.generate(idx[:, :5], 6, greedy=True, kv_cache_dtype=qdt)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], idx[:, :5])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.generate(idx[:, :5], 2, kv_cache_dtype=torch.float16)


@pytest.mark.parametrize("qdt", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_8bit_contiguous_kvcache(qdt):
    """KVCache(dtype=int8 / e4m3): rows quantized per row and kv head on append, read back within
    the quantization; a model stepping through contiguous 8-bit caches gives the float cache's
    teacher-forced perplexity within 1% (the paged 8-bit cache's test, on the contiguous layout)."""
    from attention_ext.nn.layers import KVCache

    c = KVCache(2, 16, 2, 8, dtype=qdt)
    k, v = torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)
    kq, _ = c.append(k, v)
    step = k.abs().amax(-1, keepdim=True) / (127 if qdt == torch.int8 else 448)
    tol = 0.5 * step if qdt == torch.int8 else 2.0 ** -4 * k.abs() + step
    assert ((kq.float() * c.k_descale[:, :5, :, None] - k).abs() <= tol * (1 + 1e-6)).all()
    model = _lm(n_kv_heads=2)
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(4))
    nll = {}
    for dtype in (torch.float32, qdt):
        caches = model.allocate_caches(2, 48, dtype=dtype)
        with torch.no_grad():
            logits = [model(idx[:, :8], caches=caches)]  # a prefill, then steps
            for t in range(8, idx.shape[1] - 1):
                logits.append(model(idx[:, t:t + 1], caches=caches, offset=t))
        lg = torch.cat(logits, 1)  # (2, 39, V): predicts idx[:, 1:]
        nll[dtype] = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), idx[:, 1:].reshape(-1))
    assert abs(float(torch.exp(nll[qdt]) / torch.exp(nll[torch.float32])) - 1) < 0.01
    assert not torch.equal(nll[qdt], nll[torch.float32])  # the 8-bit rows were read


@pytest.mark.parametrize("qdt", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_8bit_cross_attention_memory(qdt):
    """A static 8-bit KVCache (a cross-attention memory): quantized once on the first call, then
    read by the decode kernel on every call (the first included), with the memory's lengths as
    seqlens_k. Equals the layer over a float cache holding the dequantized memory (masks:
    test_8bit_caches_with_masks); an encoder-decoder's greedy decoding and teacher-forced
    perplexity through 8-bit caches stay within 1% of the float caches'."""
    from attention_ext.decode import dequantize_kv
    from attention_ext.models import Transformer, TransformerConfig
    from attention_ext.nn import AttentionConfig
    from attention_ext.nn.layers import Attention, KVCache

    torch.manual_seed(5)
    layer = Attention(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, causal=False), cross=True).eval()
    mem, x = torch.randn(2, 19, 32), torch.randn(2, 3, 32)
    lens = torch.tensor([19, 11], dtype=torch.int32)
    c8 = KVCache(2, 19, 2, 8, dtype=qdt, static=True)
    with torch.no_grad():
        first = layer(x, mem, cache=c8, seqlens_k=lens)
        again = layer(x, mem, cache=c8, seqlens_k=lens)
        cf = KVCache(2, 19, 2, 8, static=True)
        cf.k.copy_(dequantize_kv(c8.k, c8.k_descale))
        cf.v.copy_(dequantize_kv(c8.v, c8.v_descale))
        cf.pos = 19
        want = layer(x, mem, cache=cf, seqlens_k=lens)
    assert c8.pos == 19 and torch.equal(first, again)
    torch.testing.assert_close(first, want, atol=2e-5, rtol=1e-4)

    cfg = TransformerConfig(src_vocab_size=40, d_model=32, n_heads=4, n_kv_heads=2, n_encoder_layers=1,
                            n_decoder_layers=2, d_ff=64, dropout=0.0, max_len=64)
    model = Transformer(cfg).eval()
    g = torch.Generator().manual_seed(6)
    src, tgt = torch.randint(0, 40, (2, 17), generator=g), torch.randint(0, 40, (2, 24), generator=g)
    src_len = torch.tensor([17, 12])
    nll = {}
    with torch.no_grad():
        memory = model.encode(src, src_len)
        for dtype in (torch.float32, qdt):
            caches = model.decoder.allocate_caches(2, 24, 17, dtype=dtype)
            logits = [model.decode(tgt[:, t:t + 1], memory, src_len, caches=caches, offset=t) for t in range(23)]
            lg = torch.cat(logits, 1)
            nll[dtype] = torch.nn.functional.cross_entropy(lg.reshape(-1, 40), tgt[:, 1:].reshape(-1))
    assert abs(float(torch.exp(nll[qdt]) / torch.exp(nll[torch.float32])) - 1) < 0.01
    assert not torch.equal(nll[qdt], nll[torch.float32])
    out = model.greedy_decode(src, src_len, bos_id=1, eos_id=2, max_new_tokens=6, kv_cache_dtype=qdt)
    assert out.shape[0] == 2 and 1 <= out.shape[1] <= 6
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.greedy_decode(src, src_len, 1, 2, 3, kv_cache_dtype=torch.float16)


def _float_copy(c8, static=True):
    """A float static KVCache holding c8's dequantized rows (the layer's float path reads it)."""
    from attention_ext.nn.layers import KVCache

    b, n, hk, d = c8.k.shape
    cf = KVCache(b, n, hk, d, static=static)
    k, v = c8.dequantized(torch.float32)
    cf.k[:, : c8.pos], cf.v[:, : c8.pos] = k, v
    cf.pos = c8.pos
    return cf


def _masks(b, n, ends_last):
    """key masks over n keys for b = 3 sequences: (name, mask, contiguous)"""
    pos = torch.arange(n)
    left = pos[None] >= torch.tensor([0, 4, n - 1])[:, None]  # left padding: runs end at the last key
    right = pos[None] < torch.tensor([n, 7, 1])[:, None]
    holes = left.clone()
    holes[1, 6] = False
    empty = left.clone()
    empty[2] = False
    return [("left", left, True), ("right", right, not ends_last), ("holes", holes, False), ("empty row", empty, True)]


@pytest.mark.parametrize("qdt", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("variant", ["plain", "window", "alibi", "sinks_softcap"])
def test_8bit_caches_with_masks(qdt, variant):
    """Masks over 8-bit KVCaches, a cross-attention memory and a causal self-attention cache's
    steps: key_mask, attn_mask and seqlens_k give the layer's answer over a float cache holding
    the dequantized rows. A key_mask whose real keys are one run per sequence (right padding for
    the memory, left padding for causal steps) goes to the decode kernel as (leftpad, length); a
    mask with holes, an attn_mask, or right padding under causal / window / ALiBi runs the fused
    kernel on the dequantized rows (the counts of decode calls are checked)."""
    from unittest import mock

    from attention_ext.nn import AttentionConfig
    from attention_ext.nn.layers import Attention, KVCache

    torch.manual_seed(11)
    extra = dict(plain={}, window=dict(window=(5, -1)), alibi=dict(positional="alibi"),
                 sinks_softcap=dict(sinks=True, softcap=20.0))[variant]
    b, hk, d = 3, 2, 8
    for cross in (True, False):
        cfg = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=hk, causal=not cross,
                              **{k: v for k, v in extra.items() if not (cross and k == "positional")})
        layer = Attention(cfg, cross=cross).eval()
        if cfg.sinks:
            torch.nn.init.normal_(layer.sinks)
        positional = not cross or "window" in extra  # ALiBi is self-attention's only
        with torch.no_grad():
            if cross:
                n = 13
                c8 = KVCache(b, n, hk, d, dtype=qdt, static=True)
                x = torch.randn(b, 2, 32)
                layer(x, torch.randn(b, n, 32), cache=c8)  # quantizes the memory
            else:
                n = 12
                c8 = KVCache(b, 16, hk, d, dtype=qdt)
                layer(torch.randn(b, n - 1, 32), cache=c8)  # the prefill
                x = torch.randn(b, 1, 32)
        cases = [(name, dict(key_mask=m), fits) for name, m, fits in _masks(b, n, positional)]
        cases += [("attn_mask", dict(attn_mask=torch.rand(b, 1, x.shape[1], n) > 0.3), False),
                  ("seqlens_k", dict(seqlens_k=torch.tensor([n, 9, 5], dtype=torch.int32)), True),
                  ("left + seqlens_k", dict(key_mask=_masks(b, n, positional)[0][1],
                                            seqlens_k=torch.tensor([n, n, n], dtype=torch.int32)), True)]
        for name, masks, fits in cases:
            if not cross and name == "seqlens_k" and positional:
                fits = True  # lengths alone: the kernel's diagonal sits at each length, as the fused op's
            with torch.no_grad():
                if cross:
                    ref_cache = _float_copy(c8)
                    with mock.patch.object(KVCache, "attend", autospec=True, side_effect=KVCache.attend) as spy:
                        got = layer(x, cache=c8, **masks)
                else:
                    pos = c8.pos
                    with mock.patch.object(KVCache, "attend", autospec=True, side_effect=KVCache.attend) as spy:
                        got = layer(x, cache=c8, **masks)  # appends x's row, then reads n rows
                    ref_cache = _float_copy(c8)  # the step's own row included, as the 8-bit call read it
                    c8.pos = pos  # the next case steps from the same prefill
                want = layer(x, cache=ref_cache, **masks)
            where = f"{qdt} {variant} cross={cross} {name}"
            torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4, msg=where)
            assert spy.call_count == (1 if fits else 0), where
        if cross:  # the fused op's rule for the mask, whichever path would have read the cache
            with pytest.raises(TypeError, match="key_mask must be bool"), torch.no_grad():
                layer(x, cache=c8, key_mask=_masks(b, n, positional)[0][1].int())
