"""attention_type="sparse": the SparseAttention layer against the functional API, its layout
cache, the models built on it, and KV-cache generation equal to recomputing every prefix."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.models import LanguageModel, LMConfig, Transformer, TransformerConfig
from attention_ext.nn import Attention, AttentionConfig, KVCache, SparseAttention, allocate_cache, \
    make_attention
from attention_ext.sparse import layouts as L


def projections(layer, x):
    b, s, _ = x.shape
    q = layer.q_proj(x).view(b, s, layer.n_heads, layer.head_dim)
    k = layer.k_proj(x).view(b, s, layer.n_kv_heads, layer.head_dim)
    v = layer.v_proj(x).view(b, s, layer.n_kv_heads, layer.head_dim)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern,kw", [("bigbird", dict(window_blocks=1, n_global=1, n_random=1, seed=2)),
                                        ("local_global", {}), ("fixed", dict(stride=2))])
def test_layer_is_block_sparse_attention_of_its_projections(causal, pattern, kw):
    cfg = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, attention_type="sparse", causal=causal,
                          sparse_pattern=pattern, sparse_block_size=16, sparse_kwargs=kw)
    layer = make_attention(cfg)
    assert isinstance(layer, SparseAttention)
    x = torch.randn(2, 70, 32)
    q, k, v = projections(layer, x)
    lay = layer.layout(70)
    assert lay.shape == (4, 5, 5)
    if causal:
        assert not lay.triu(1).any()
    ref = ae.block_sparse_attention(q, k, v, lay, block_size=16, causal=causal, layout="bshd")
    torch.testing.assert_close(layer(x), layer.out_proj(ref.reshape(2, 70, 32)))


def test_topk_layer_and_build():
    layer = SparseAttention.build(32, 4, pattern="topk", topk=3, causal=True)
    x = torch.randn(2, 20, 32)
    q, k, v = projections(layer, x)
    ref = ae.topk_attention(q, k, v, 3, causal=True, layout="bshd")
    torch.testing.assert_close(layer(x), layer.out_proj(ref.reshape(2, 20, 32)))


def test_layout_cache_per_length_and_device():
    layer = SparseAttention.build(32, 4, pattern="bigbird", block_size=16, n_random=1)
    a = layer.layout(64)
    assert layer.layout(60) is a  # same number of blocks
    assert layer.layout(65) is not a and layer.layout(65).shape == (4, 5, 5)
    assert torch.equal(a, L.bigbird(1, 1, 1, 0, seq_len=64, block_size=16, heads=4))
    for n in range(1, 60):
        layer.layout(16 * n)
    assert len(layer._layouts) <= 32


def test_weights_respect_the_layout():
    layer = SparseAttention.build(32, 2, pattern="sliding_window", block_size=16, window_blocks=0)
    layer.keep_weights = True
    layer(torch.randn(1, 40, 32))
    w = layer.last_weights
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 40))
    elem = ae.sparse.layout_to_mask(layer.layout(40), 16, 40, 40)
    assert (w[:, :, ~elem[0]] == 0).all()


def test_padding_with_lengths():
    for pattern in ("local_global", "topk"):
        layer = make_attention(AttentionConfig(d_model=16, n_heads=2, attention_type="sparse", sparse_pattern=pattern,
                                               sparse_block_size=16, topk=4))
        x = torch.randn(2, 40, 16)
        out = layer(x, seqlens_k=torch.tensor([40, 25]))
        assert torch.isfinite(out).all()
        if pattern == "topk":  # padded keys are never among the kept ones
            torch.testing.assert_close(out[1, :25], layer(x[1:, :25])[0], rtol=1e-5, atol=1e-5)


def test_bad_configs():
    def mk(**kw):
        return make_attention(AttentionConfig(d_model=16, n_heads=2, attention_type="sparse", **kw))

    with pytest.raises(ValueError, match="unknown sparse_pattern"):
        mk(sparse_pattern="nope")
    with pytest.raises(ValueError, match="topk >= 1"):
        mk(sparse_pattern="topk")
    with pytest.raises(ValueError, match="explicit stride"):
        mk(sparse_pattern="strided", causal=True)
    with pytest.raises(ValueError, match="random"):
        mk(sparse_pattern="random", causal=True, sparse_kwargs=dict(density=0.5))
    with pytest.raises(ValueError, match="multiple of 16"):
        mk(sparse_block_size=24)
    with pytest.raises(ValueError, match="window_blocks must be >= 0"):
        mk(sparse_kwargs=dict(window_blocks=-1))
    # the old key `window` (a (left, right) pair of keys elsewhere) names window_blocks, per pattern
    for pattern in ("local_global", "longformer", "bigbird", "sliding_window"):
        with pytest.raises(TypeError, match=r"takes window_blocks \(key blocks .*window is its old name"):
            mk(sparse_pattern=pattern, sparse_kwargs=dict(window=1))
    with pytest.raises(ValueError, match="needs a block layout"):
        Attention(AttentionConfig(d_model=16, n_heads=2, attention_type="sparse"))(torch.randn(1, 4, 16))


def test_attn_mask_and_rows_of_a_step_go_through_the_element_mask():
    layer = SparseAttention.build(16, 2, pattern="local_global", block_size=16, causal=True)
    x = torch.randn(1, 50, 16)
    full = layer(x)
    keep = torch.ones(50, 50, dtype=torch.bool)
    torch.testing.assert_close(layer(x, attn_mask=keep), full)
    cache = allocate_cache(layer.config, 1, 64)
    assert isinstance(cache, KVCache)
    parts = [layer(x[:, :20], cache=cache), layer(x[:, 20:21], cache=cache), layer(x[:, 21:50], cache=cache)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern,kw", [("bigbird", dict(n_random=2)), ("topk", None), ("longformer", None),
                                        ("strided", dict(stride=2))])
def test_lm_generate_with_cache_equals_recompute(pattern, kw):
    lm = LanguageModel(LMConfig(vocab_size=40, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                                attention_type="sparse", sparse_pattern=pattern, sparse_block_size=16,
                                sparse_kwargs=kw, topk=5)).eval()
    prompt = torch.randint(0, 40, (2, 5))
    a = lm.generate(prompt, 45, greedy=True)  # crosses three block boundaries
    b = lm.generate(prompt, 45, greedy=True, use_cache=False)
    assert torch.equal(a, b)
    caches = lm.allocate_caches(2, 64)
    full = lm(a)
    parts = [lm(a[:, :18], caches=caches), lm(a[:, 18:19], caches=caches, offset=18),
             lm(a[:, 19:50], caches=caches, offset=19)]  # prefill, one step, a long continuation
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pattern", ["bigbird", "topk"])
def test_transformer_with_sparse_self_attention(pattern):
    cfg = TransformerConfig(src_vocab_size=20, d_model=32, n_heads=4, n_encoder_layers=1, n_decoder_layers=1,
                            d_ff=64, dropout=0.0, attention_type="sparse", sparse_pattern=pattern,
                            sparse_block_size=16, topk=4)
    model = Transformer(cfg).eval()
    assert isinstance(model.decoder.layers[0].self_attn, SparseAttention)
    assert model.decoder.layers[0].cross_attn.cross  # dense over the memory
    src = torch.randint(3, 20, (2, 37))
    lengths = torch.tensor([37, 30])
    out = model.greedy_decode(src, lengths, 1, 2, 20)
    assert torch.equal(out, model.greedy_decode(src, lengths, 1, 2, 20, use_cache=False))
    logits = model(src, torch.randint(3, 20, (2, 9)), lengths)
    assert logits.shape == (2, 9, 20) and torch.isfinite(logits).all()


@pytest.mark.parametrize("pattern", ["topk", "bigbird"])
def test_options_compose_and_weights_match(pattern):
    """Window, ALiBi and softcap pass through to the sparse kernels; the stored weights are the
    probabilities the output averages v with."""
    cfg = AttentionConfig(d_model=32, n_heads=4, attention_type="sparse", causal=True, window=(20, 0),
                          positional="alibi", softcap=5.0, sparse_pattern=pattern, sparse_block_size=16, topk=6,
                          bias=False)
    layer = make_attention(cfg)
    x = torch.randn(2, 45, 32)
    q, k, v = projections(layer, x)
    opts = dict(causal=True, window=(20, 0), alibi_slopes=layer.alibi_slopes, softcap=5.0, layout="bshd")
    if pattern == "topk":
        ref = ae.topk_attention(q, k, v, 6, **opts)
    else:
        ref = ae.block_sparse_attention(q, k, v, layer.layout(45), block_size=16, **opts)
    layer.keep_weights = True
    torch.testing.assert_close(layer(x), layer.out_proj(ref.reshape(2, 45, 32)))
    w = layer.last_weights  # (B, H, S, S)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 45))
    if pattern == "topk":
        assert ((w > 0).sum(-1) <= 6).all()
    torch.testing.assert_close(layer.out_proj((w @ v.transpose(1, 2).float()).transpose(1, 2).reshape(2, 45, 32)),
                               layer(x), rtol=1e-4, atol=1e-5)
