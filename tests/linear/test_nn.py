"""attention_type="linear": the LinearAttention layer, the Transformer stack built on it, and
generation with the recurrent state (equal to recomputing every prefix)."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.models import LanguageModel, LMConfig, Transformer, TransformerConfig
from attention_ext.nn import AttentionConfig, KVCache, LinearAttention, LinearCache, allocate_cache, make_attention
from tests.helpers import assert_compiled_backward_matches

pytestmark = pytest.mark.filterwarnings("ignore:attention_ext. no compiled linear:RuntimeWarning")


@pytest.mark.parametrize("causal", [True, False])
def test_layer_is_linear_attention_of_its_projections(causal):
    cfg = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, attention_type="linear", causal=causal)
    layer = make_attention(cfg)
    assert isinstance(layer, LinearAttention)
    x = torch.randn(2, 11, 32)
    q = layer.q_proj(x).view(2, 11, 4, 8)
    k, v = layer.k_proj(x).view(2, 11, 2, 8), layer.v_proj(x).view(2, 11, 2, 8)
    ref = ae.linear_attention(q, k, v, causal=causal, layout="bshd")
    torch.testing.assert_close(layer(x), layer.out_proj(ref.reshape(2, 11, 32)))


def test_padding_and_lengths():
    cfg = AttentionConfig(d_model=16, n_heads=2, attention_type="linear")
    layer = make_attention(cfg)
    x = torch.randn(2, 9, 16)
    lengths = torch.tensor([9, 5])
    out = layer(x, seqlens_k=lengths)
    torch.testing.assert_close(out[1, :5], layer(x[1:, :5])[0], rtol=1e-5, atol=1e-5)


def test_unsupported_options_raise():
    for kw in (dict(window=(4, 0)), dict(positional="alibi"), dict(sinks=True), dict(softcap=5.0)):
        with pytest.raises(ValueError, match="attention_type='linear' has no"):
            make_attention(AttentionConfig(d_model=16, n_heads=2, attention_type="linear", **kw))
    layer = make_attention(AttentionConfig(d_model=16, n_heads=2, attention_type="linear", causal=True))
    with pytest.raises(TypeError, match="LinearCache"):
        layer(torch.randn(1, 3, 16), cache=KVCache(1, 8, 2, 8))
    with pytest.raises(ValueError, match="attn_mask"):
        layer(torch.randn(1, 3, 16), attn_mask=torch.ones(3, 3, dtype=torch.bool))
    assert isinstance(allocate_cache(layer.config, 1, 8), LinearCache)


@pytest.mark.parametrize("fmap,gate", [("elu", False), ("favor", True), ("relu", True), ("elu", "feature")])
def test_lm_generate_with_state_equals_recompute(fmap, gate):
    lm = LanguageModel(LMConfig(vocab_size=40, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                                attention_type="linear", feature_map=fmap, decay_gate=gate)).eval()
    prompt = torch.randint(0, 40, (2, 5))
    a = lm.generate(prompt, 10, greedy=True)
    b = lm.generate(prompt, 10, greedy=True, use_cache=False)
    assert torch.equal(a, b)
    caches = lm.allocate_caches(2, 32)
    assert all(isinstance(c, LinearCache) for c in caches)
    full = lm(a)
    parts = [lm(a[:, :5], caches=caches), lm(a[:, 5:6], caches=caches, offset=5),
             lm(a[:, 6:15], caches=caches, offset=6)]  # prefill, one step, a long continuation
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)


def test_lm_trains_and_gate_gets_gradients():
    torch.manual_seed(0)
    lm = LanguageModel(LMConfig(vocab_size=20, d_model=32, n_heads=4, n_layers=2, attention_type="linear",
                                decay_gate=True, positional="rope"))
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    data = torch.arange(20).repeat(4, 3)[:, :48]  # a cyclic sequence: learnable from the previous token
    losses = []
    for _ in range(30):
        _, loss = lm(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(b.self_attn.gate.weight.grad is not None for b in lm.blocks)


def test_encoder_decoder_greedy_decode_with_state():
    cfg = TransformerConfig(src_vocab_size=30, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
                            dropout=0.0,
                            attention_type="linear")
    model = Transformer(cfg).eval()
    src = torch.randint(3, 30, (3, 7))
    lengths = torch.tensor([7, 4, 6])
    a = model.greedy_decode(src, lengths, bos_id=1, eos_id=2, max_new_tokens=8)
    b = model.greedy_decode(src, lengths, bos_id=1, eos_id=2, max_new_tokens=8, use_cache=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("causal,cross,gate", [(False, False, False), (True, False, True), (False, True, False),
                                               (True, False, "feature")])
def test_keep_weights_average_the_values(causal, cross, gate):
    """last_weights (keep_weights=True) are the weights the layer's output averages v with."""
    cfg = AttentionConfig(d_model=16, n_heads=4, n_kv_heads=2, attention_type="linear", causal=causal, decay_gate=gate)
    layer = LinearAttention(cfg, cross=cross)
    if gate:
        torch.nn.init.normal_(layer.gate.weight)
    x, ctx = torch.randn(2, 6, 16), torch.randn(2, 9, 16)
    mask = torch.ones(2, 9 if cross else 6, dtype=torch.bool)
    mask[1, -2:] = False
    layer.keep_weights = True
    y = layer(x, ctx if cross else None, key_mask=mask)
    w = layer.last_weights  # (B, H, S_q, S_k)
    assert w.shape == (2, 4, 6, 9 if cross else 6)
    src = ctx if cross else x
    v = layer.v_proj(src).view(2, src.shape[1], 2, 4).transpose(1, 2).repeat_interleave(2, 1)  # (B, H, S_k, D)
    ref = layer.out_proj((w @ v).transpose(1, 2).reshape(2, 6, 16))
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    assert (w[1, ..., -2:] == 0).all()


@pytest.mark.parametrize("gate", [True, "feature"])
def test_right_padded_prefill_then_step_with_a_gate(gate):
    """A decay-gated layer prefilled with right padding (key_mask) then stepped equals the run
    without the padding: the layer sets the padded tokens' gates to 0, so they write nothing and
    decay nothing (they decayed the state before: 0.28 off)."""
    torch.manual_seed(0)
    cfg = AttentionConfig(d_model=16, n_heads=2, attention_type="linear", causal=True, decay_gate=gate)
    m = LinearAttention(cfg).double().eval()
    torch.nn.init.normal_(m.gate.weight)  # a trained gate, far from its zero start
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    km = torch.ones(1, 7, dtype=torch.bool)
    km[0, 5:] = False  # 5 real tokens, right-padded to 7
    with torch.no_grad():
        cache = allocate_cache(cfg, 1, 8)
        m(x[:, :7], key_mask=km, cache=cache)
        step = m(x[:, 7:8], cache=cache)
        ref = m(torch.cat([x[:, :5], x[:, 7:8]], 1))[:, -1:]
    torch.testing.assert_close(step, ref)
    km2 = torch.ones(1, 8, dtype=torch.bool)
    km2[0, [2, 5]] = False  # holes: the real tokens' outputs equal the run without them
    with torch.no_grad():
        full = m(x, key_mask=km2)
        holes = m(x[:, km2[0]])
    torch.testing.assert_close(full[:, km2[0]], holes)
    with pytest.raises(ValueError, match=r"key_mask must be \(B, S\)"):  # a bad mask still meets the named check
        m(x, key_mask=km2[0])
    with pytest.raises(TypeError, match="key_mask must be bool"):
        m(x, key_mask=km2.long())


def test_feature_gates_are_per_feature_and_checked():
    """decay_gate="feature": a (H * head_dim)-wide gate projection, whose per-feature gates reach
    the kernel (a layer whose features see different gates differs from one whose gates are
    their mean per head); other values and the random feature maps are refused by name."""
    torch.manual_seed(0)
    cfg = AttentionConfig(d_model=16, n_heads=2, attention_type="linear", causal=True, decay_gate="feature")
    m = LinearAttention(cfg).double()
    assert m.gate.out_features == 16
    torch.nn.init.normal_(m.gate.weight, std=2.0)
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    y = m(x)
    g = torch.nn.functional.logsigmoid(m.gate(x)).view(1, 6, 2, 8).permute(0, 2, 1, 3)  # (B, H, S, M)
    q, k, v = (p(x).view(1, 6, 2, 8) for p in (m.q_proj, m.k_proj, m.v_proj))
    assert m.rope is None  # AttentionConfig's default positional: none
    ref = ae.linear_attention(q, k, v, causal=True, decay=g, layout="bshd")
    torch.testing.assert_close(y, m.out_proj(ref.reshape(1, 6, 16)))
    mean = ae.linear_attention(q, k, v, causal=True, decay=g.mean(-1), layout="bshd")
    assert (ref - mean).abs().max() > 1e-3
    with pytest.raises(ValueError, match="decay_gate"):
        AttentionConfig(d_model=16, n_heads=2, attention_type="linear", causal=True, decay_gate="channel")
    with pytest.raises(ValueError, match="decay_gate='feature'"):
        LinearAttention(AttentionConfig(d_model=16, n_heads=2, attention_type="linear", causal=True,
                                        decay_gate="feature", feature_map="favor"))


@pytest.mark.parametrize("gate", [True, "feature"])
def test_low_rank_gate_with_temperature_is_glas(gate):
    """decay_gate_rank=r factors the gate projection through rank r (GLA's x -> 16 -> gates) and
    decay_gate_temperature=tau divides the log-gates (GLA's 16): the kernel gets
    logsigmoid(W2 W1 x + b) / tau; both factors learn; a generation step equals the whole run."""
    torch.manual_seed(0)
    cfg = AttentionConfig(d_model=16, n_heads=2, attention_type="linear", causal=True, decay_gate=gate,
                          decay_gate_rank=3, decay_gate_temperature=16)
    m = LinearAttention(cfg).double()
    w1, w2 = m.gate[0], m.gate[1]
    width = 16 if gate == "feature" else 2
    assert (w1.in_features, w1.out_features, w1.bias, w2.out_features) == (16, 3, None, width)
    torch.nn.init.normal_(w2.weight, std=2.0)  # a trained gate, far from its zero start
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    y = m(x)
    g = torch.nn.functional.logsigmoid(w2(w1(x))) / 16  # (B, S, H * M) or (B, S, H)
    g = g.view(1, 6, 2, 8).permute(0, 2, 1, 3) if gate == "feature" else g.transpose(1, 2)
    q, k, v = (p(x).view(1, 6, 2, 8) for p in (m.q_proj, m.k_proj, m.v_proj))
    ref = ae.linear_attention(q, k, v, causal=True, decay=g.contiguous(), layout="bshd")
    torch.testing.assert_close(y, m.out_proj(ref.reshape(1, 6, 16)))
    untempered = ae.linear_attention(q, k, v, causal=True, decay=(16 * g).contiguous(), layout="bshd")
    assert (ref - untempered).abs().max() > 1e-3
    y.square().sum().backward()
    assert w1.weight.grad.abs().max() > 0 and w2.weight.grad.abs().max() > 0
    lm = LanguageModel(LMConfig(vocab_size=11, n_layers=1, n_heads=2, d_model=16, block_size=32,
                                attention_type="linear", decay_gate=gate, decay_gate_rank=4,
                                decay_gate_temperature=8.0)).double().eval()
    torch.nn.init.normal_(lm.blocks[0].self_attn.gate[1].weight)
    ids = torch.randint(0, 11, (2, 9))
    full = lm(ids)
    caches = lm.allocate_caches(2, 16, dtype=torch.float64)
    steps = torch.cat([lm(ids[:, :5], caches=caches)]
                      + [lm(ids[:, t:t + 1], caches=caches, offset=t) for t in range(5, 9)], 1)
    torch.testing.assert_close(steps, full)
    for kw, match in ((dict(decay_gate_rank=-1), "decay_gate_rank"), (dict(decay_gate_rank=2.0), "decay_gate_rank"),
                      (dict(decay_gate_temperature=0.0), "decay_gate_temperature"),
                      (dict(decay_gate_temperature=float("inf")), "decay_gate_temperature"),
                      (dict(decay_gate_temperature="16"), "decay_gate_temperature"),
                      (dict(decay_gate=False, decay_gate_rank=16), "pass decay_gate=True or 'feature'")):
        with pytest.raises(ValueError, match=match):
            AttentionConfig(**dict(dict(d_model=16, n_heads=2, attention_type="linear", causal=True,
                                        decay_gate="feature"), **kw))


@pytest.mark.parametrize("gate", [True, "feature"])
def test_compiled_backward_equals_eager(gate):
    """torch.compile(fullgraph=True) forward and backward with batch > 1: the fused maps of the
    gated path ran on (B, H, S, D) views of the bshd projections, and their backward's strides
    under fake tensors (the input's) differed from eager's (the gradient's), which broke the
    compiled backward's view of them."""
    torch.manual_seed(0)
    m = make_attention(AttentionConfig(d_model=32, n_heads=4, attention_type="linear", causal=True,
                                       decay_gate=gate))
    x = torch.randn(3, 21, 32, requires_grad=True)
    mask = torch.ones(3, 21, dtype=torch.bool)
    mask[0, 15:] = False
    assert_compiled_backward_matches(m, x, (dict(), dict(key_mask=mask)))


def test_audit_config_and_decay_dtypes():
    """Found by an audit: n_heads / n_kv_heads of 0 raised ZeroDivisionError; a bool or integer
    decay was taken as log-gates of 1 (a state growing each step). Both refused by name."""
    for kw in (dict(n_kv_heads=0), dict(n_heads=0), dict(n_kv_heads=True), dict(n_heads=2.0)):
        with pytest.raises(ValueError, match="n_kv_heads|n_heads"):
            AttentionConfig(**dict(dict(d_model=16, n_heads=2, attention_type="linear"), **kw))
    import numpy as np
    c = AttentionConfig(d_model=np.int64(16), n_heads=np.int64(2), n_kv_heads=np.int32(1))  # numpy ints: as ints
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == (16, 2, 1, 8) and type(c.n_heads) is int
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
    with pytest.raises(TypeError, match="decay must be floating"):
        ae.linear_attention(q, k, v, causal=True, decay=torch.ones(1, 2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="decay_t must be floating"):
        ae.linear_attention_step(q, k, v, None, decay_t=torch.ones(1, 2, 5, 4, dtype=torch.long))
