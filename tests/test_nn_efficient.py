"""attention_ext.nn's Linformer and LSH layers (attention_type="linformer" / "lsh"): the modules
against the functional API on the same projections and rotations, padding, gradients, the errors
of what each type cannot do (a causal Linformer, a cache), LSH's rotations in training and eval,
and tiny models of each type training a few steps."""
import pytest
import torch

import attention_ext as ae
from attention_ext.models import LanguageModel, LMConfig, Transformer, TransformerConfig
from attention_ext.nn import (Attention, AttentionConfig, BlockConfig, DecoderBlock, LinformerAttention, LSHAttention,
                              allocate_cache, make_attention)
from attention_ext.nn.blocks import cross_config

D_MODEL, HEADS = 32, 4


def _linformer(share="headwise", n_kv_heads=None, k=6, max_len=24, **kw):
    cfg = AttentionConfig(d_model=D_MODEL, n_heads=HEADS, n_kv_heads=n_kv_heads, attention_type="linformer",
                          linformer_k=k, linformer_max_len=max_len, linformer_share=share, **kw)
    return make_attention(cfg)


def _lsh(causal=False, buckets=4, hashes=2, chunk=4, **kw):
    cfg = AttentionConfig(d_model=D_MODEL, n_heads=HEADS, attention_type="lsh", causal=causal, lsh_buckets=buckets,
                          lsh_hashes=hashes, lsh_chunk_size=chunk, **kw)
    return make_attention(cfg)


def _heads(t, h):
    return t.view(*t.shape[:2], h, -1)  # (B, S, H, D)


# ----------------------------------------------------------------------------------------------
# Linformer


@pytest.mark.parametrize("share,n_kv_heads", [("headwise", None), ("kv", None), ("none", None), ("none", 2),
                                              ("headwise", 2)])
def test_linformer_matches_functional(share, n_kv_heads):
    torch.manual_seed(0)
    m = _linformer(share, n_kv_heads)
    assert isinstance(m, LinformerAttention)
    assert m.proj_k.shape == ((m.n_kv_heads, 6, 24) if share == "none" else (6, 24))
    assert (m.proj_v is None) == (share == "kv")
    x = torch.randn(2, 17, D_MODEL)
    q, k, v = _heads(m.q_proj(x), HEADS), _heads(m.k_proj(x), m.n_kv_heads), _heads(m.v_proj(x), m.n_kv_heads)
    pv = None if m.proj_v is None else m.proj_v[..., :17]
    want = m.out_proj(ae.linformer_attention(q, k, v, m.proj_k[..., :17], pv, layout="bshd").reshape(2, 17, -1))
    torch.testing.assert_close(m(x), want)


def test_linformer_cross_attention_projects_the_memory():
    torch.manual_seed(0)
    cfg = AttentionConfig(d_model=D_MODEL, n_heads=HEADS, attention_type="linformer", linformer_k=5,
                          linformer_max_len=16, kv_dim=24)
    m = make_attention(cfg, cross=True)
    x, mem = torch.randn(2, 7, D_MODEL), torch.randn(2, 11, 24)
    q, k, v = _heads(m.q_proj(x), HEADS), _heads(m.k_proj(mem), HEADS), _heads(m.v_proj(mem), HEADS)
    out = ae.linformer_attention(q, k, v, m.proj_k[:, :11], m.proj_v[:, :11], layout="bshd")
    torch.testing.assert_close(m(x, mem), m.out_proj(out.reshape(2, 7, -1)))


@pytest.mark.parametrize("share", ["headwise", "none"])
def test_linformer_padding_is_zeroed_before_the_projection(share):
    """A padded sequence computes exactly what it computes alone (E[..., :L] over its L real
    positions): its padded keys and values are zeroed before the projection."""
    torch.manual_seed(0)
    m = _linformer(share)
    x = torch.randn(3, 12, D_MODEL)
    lengths = torch.tensor([12, 7, 3])
    key_mask = torch.arange(12) < lengths[:, None]
    out = m(x, key_mask=key_mask)
    torch.testing.assert_close(m(x, seqlens_k=lengths), out)
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(out[i, :n], m(x[i: i + 1, :n])[0], atol=2e-6, rtol=1e-5)
    # a NaN in a padded row reaches nothing (masked out, not multiplied by 0)
    xn = x.clone()
    xn[1, 7:] = float("nan")
    torch.testing.assert_close(m(xn, key_mask=key_mask)[1, :7], out[1, :7], atol=0, rtol=0)
    # left padding or holes would project the real keys with other columns of E, F: refused
    for bad in (torch.arange(12) >= 5, (torch.arange(12) % 2) == 0):
        with pytest.raises(ValueError, match="right padding only"):
            m(x, key_mask=bad.expand(3, 12))


def test_linformer_backward_reaches_every_parameter():
    torch.manual_seed(0)
    for share in ("headwise", "kv", "none"):
        m = _linformer(share)
        x = torch.randn(2, 10, D_MODEL, requires_grad=True)
        m(x, seqlens_k=torch.tensor([10, 6])).square().mean().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0
        for name, p in m.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        # columns past the longest sequence get no gradient
        assert m.proj_k.grad[..., 10:].abs().sum() == 0 and m.proj_k.grad[..., :10].abs().sum() > 0


def test_linformer_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="no causal form.*lsh"):
        _linformer(causal=True)
    with pytest.raises(ValueError, match="no causal form"):
        LanguageModel(LMConfig(vocab_size=11, d_model=D_MODEL, n_heads=HEADS, attention_type="linformer"))
    with pytest.raises(ValueError, match="no causal form"):  # a decoder needs decoder_attention_type
        Transformer(TransformerConfig(src_vocab_size=11, d_model=D_MODEL, n_heads=HEADS, attention_type="linformer"))
    cfg = AttentionConfig(d_model=D_MODEL, n_heads=HEADS, attention_type="linformer")
    with pytest.raises(ValueError, match="no generation cache"):
        allocate_cache(cfg, 1, 8)
    m = _linformer()
    x = torch.randn(1, 8, D_MODEL)
    with pytest.raises(ValueError, match="no generation cache"):
        m(x, cache=object())
    with pytest.raises(ValueError, match="no attn_mask"):
        m(x, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="linformer_max_len=24"):
        m(torch.randn(1, 25, D_MODEL))
    with pytest.raises(TypeError, match="key_mask=~key_padding_mask"):
        m(x, key_padding_mask=torch.zeros(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="linformer_share"):
        _linformer("layerwise")
    with pytest.raises(ValueError, match="window"):
        _linformer(window=(2, 2))


# ----------------------------------------------------------------------------------------------
# LSH


def _lsh_functional(m, x, rotations, **kw):
    c = m.config
    qk, v = _heads(m.qk_proj(x), HEADS), _heads(m.v_proj(x), HEADS)
    out = ae.lsh_attention(qk, v, n_buckets=c.lsh_buckets, n_hashes=c.lsh_hashes, chunk_size=c.lsh_chunk_size,
                           causal=c.causal, rotations=rotations, layout="bshd", **kw)
    return m.out_proj(out.reshape(*x.shape[:2], -1))


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_matches_functional(causal):
    torch.manual_seed(0)
    m = _lsh(causal)
    assert isinstance(m, LSHAttention) and m.rotations.shape == (2, D_MODEL // HEADS, 2)
    x = torch.randn(2, 16, D_MODEL)
    m.eval()  # the stored rotations
    torch.testing.assert_close(m(x), _lsh_functional(m, x, m.rotations))
    m.train()  # one fresh draw from torch's RNG per forward
    torch.manual_seed(5)
    out = m(x)
    torch.manual_seed(5)
    torch.testing.assert_close(out, _lsh_functional(m, x, torch.randn_like(m.rotations)))


def test_lsh_rotations_fresh_in_training_fixed_in_eval():
    torch.manual_seed(0)
    m = _lsh(buckets=8, hashes=1, chunk=4)
    x = torch.randn(2, 32, D_MODEL)
    m.eval()
    torch.testing.assert_close(m(x), m(x), rtol=0, atol=0)
    m.train()
    assert not torch.equal(m(x), m(x))
    # the eval rotations are in the state dict: a copy evaluates the same
    assert "rotations" in m.state_dict()
    torch.manual_seed(1)
    other = _lsh(buckets=8, hashes=1, chunk=4).eval()
    other.load_state_dict(m.state_dict())
    torch.testing.assert_close(other(x), m.eval()(x), rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_right_padding_groups_by_length(causal):
    """A padded sequence computes what it computes alone (LSH has no key mask, and padding would
    move the sort's chunks), and its padded rows output the out_proj bias alone (zeros before it)."""
    torch.manual_seed(0)
    m = _lsh(causal).eval()
    x = torch.randn(4, 12, D_MODEL)
    lengths = torch.tensor([12, 5, 9, 5])
    out = m(x, seqlens_k=lengths)
    torch.testing.assert_close(m(x, key_mask=torch.arange(12) < lengths[:, None]), out)
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(out[i, :n], m(x[i: i + 1, :n])[0])
        torch.testing.assert_close(out[i, n:], m.out_proj.bias.expand(12 - n, -1))
    holes = torch.ones(4, 12, dtype=torch.bool)
    holes[1, 3] = False
    with pytest.raises(ValueError, match="right padding only"):
        m(x, key_mask=holes)


def test_lsh_layer_builds_without_a_warning():
    """The config check (one lsh_attention call on meta tensors) says nothing: its "no compiled
    kernel on meta" note was a warning on every LSHAttention built."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lsh()


def test_lsh_backward_reaches_every_parameter():
    torch.manual_seed(0)
    m = _lsh(causal=True)
    x = torch.randn(3, 12, D_MODEL, requires_grad=True)
    m(x, seqlens_k=torch.tensor([12, 8, 8])).square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_lsh_refuses_what_it_cannot_do():
    cfg = AttentionConfig(d_model=D_MODEL, n_heads=HEADS, attention_type="lsh", causal=True)
    with pytest.raises(ValueError, match="no generation cache.*use_cache=False"):
        allocate_cache(cfg, 1, 8)
    lm = LanguageModel(LMConfig(vocab_size=11, block_size=16, d_model=D_MODEL, n_heads=HEADS, n_layers=1,
                                attention_type="lsh", lsh_buckets=2, lsh_chunk_size=4))
    with pytest.raises(ValueError, match="use_cache=False"):
        lm.generate(torch.zeros(1, 2, dtype=torch.long), 3)
    with pytest.raises(NotImplementedError, match=r"one \(B, T0\) tensor of equal lengths with use_cache=False"):
        lm.generate([torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long)], 3)
    m = _lsh()
    x = torch.randn(1, 8, D_MODEL)
    with pytest.raises(ValueError, match="no generation cache"):
        m(x, cache=object())
    with pytest.raises(ValueError, match="self-attention only"):
        m(x, x)
    with pytest.raises(ValueError, match="no attn_mask"):
        m(x, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="no cross-attention"):
        make_attention(cfg, cross=True)
    with pytest.raises(ValueError, match="n_kv_heads must equal n_heads"):
        _lsh(n_kv_heads=2)
    with pytest.raises(ValueError, match=r"lsh_buckets=3.*n_buckets must be 1 or an even"):
        _lsh(buckets=3)
    with pytest.raises(ValueError, match=r"lsh_chunk_size=0\).*chunk_size must be in \[1"):
        _lsh(chunk=0)
    with pytest.raises(ValueError, match="ALiBi"):
        _lsh(positional="alibi")


def test_lsh_decoder_cross_attends_with_softmax():
    cfg = AttentionConfig(d_model=D_MODEL, n_heads=HEADS, attention_type="lsh", causal=True)
    assert cross_config(cfg).attention_type == "softmax"
    blk = DecoderBlock(BlockConfig(attn=cfg, d_ff=64))
    assert isinstance(blk.self_attn, LSHAttention) and type(blk.cross_attn) is Attention


# ----------------------------------------------------------------------------------------------
# tiny models, a few training steps each


def _train(model, batch, steps=4):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        _, loss = model(*batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    return losses


@pytest.mark.parametrize("opts", [dict(attention_type="linformer", decoder_attention_type="softmax", linformer_k=4),
                                  dict(attention_type="linformer", decoder_attention_type="softmax",
                                       linformer_share="none", positional="rope"),
                                  dict(attention_type="lsh", lsh_buckets=2, lsh_chunk_size=4, lsh_hashes=2)],
                         ids=["linformer", "linformer-perhead-rope", "lsh"])
def test_tiny_transformer_trains(opts):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab_size=13, d_model=D_MODEL, n_heads=HEADS, n_encoder_layers=1,
                                          n_decoder_layers=1, d_ff=64, dropout=0.0, max_len=16, **opts))
    enc = model.encoder.layers[0].self_attn
    assert type(enc).__name__ == {"linformer": "LinformerAttention", "lsh": "LSHAttention"}[opts["attention_type"]]
    src, lengths = torch.randint(3, 13, (4, 10)), torch.tensor([10, 8, 6, 10])
    src[torch.arange(10) >= lengths[:, None]] = 0
    tgt = torch.randint(3, 13, (4, 9))
    _train(model, lambda: (src, tgt[:, :-1], lengths, tgt[:, 1:]))
    model.eval()
    out = model.greedy_decode(src, lengths, 1, 2, max_new_tokens=5, use_cache=opts["attention_type"] != "lsh")
    assert out.shape[0] == 4 and out.shape[1] <= 5


def test_tiny_lsh_lm_trains_and_generates():
    torch.manual_seed(0)
    lm = LanguageModel(LMConfig(vocab_size=17, block_size=16, n_layers=2, n_heads=HEADS, d_model=D_MODEL,
                                attention_type="lsh", lsh_buckets=2, lsh_chunk_size=4))
    x = torch.randint(0, 17, (4, 17))
    losses = _train(lm, lambda: (x[:, :-1], x[:, 1:]), steps=6)
    assert losses[-1] < losses[0]
    lm.eval()
    out = lm.generate(x[:1, :3], 5, greedy=True, use_cache=False)
    assert out.shape == (1, 8)
    torch.testing.assert_close(lm.generate(x[:1, :3], 5, greedy=True, use_cache=False), out)  # eval: fixed hash


@pytest.mark.parametrize("kind", ["linformer", "lsh"])
def test_compile(kind):
    torch.manual_seed(0)
    m = (_linformer() if kind == "linformer" else _lsh(causal=True)).eval()
    x = torch.randn(2, 12, D_MODEL)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), m(x))
