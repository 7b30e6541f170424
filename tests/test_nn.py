"""attention_ext.nn: the MultiheadAttention drop-in against torch's, the config-driven layers
against reference.py, the classic attentions against hand-computed cases, positions and blocks."""
import contextlib
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from attention_ext import reference
from attention_ext.nn import (AdditiveAttention, Attention, AttentionConfig, BlockConfig, DecoderBlock, EncoderBlock,
                              FeedForward, KVCache, LuongAttention, MultiheadAttention, RMSNorm, RotaryEmbedding,
                              SinusoidalPositionalEncoding, alibi_slopes, register_attention_type)
from attention_ext.nn.layers import ATTENTION_TYPES

ATOL = 2e-5
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")


def _pair(embed_dim=32, num_heads=4, seed=0, **kw):
    """A torch.nn.MultiheadAttention and ours with its state_dict loaded."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(embed_dim, num_heads, **kw)
    ours = MultiheadAttention(embed_dim, num_heads, **kw)
    missing = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return ref, ours


def _mask(kind, n, h, l, s, gen):
    """attn_mask / key_padding_mask in torch's convention, never masking a whole row."""
    if kind is None:
        return None
    if kind.startswith("kpm"):
        lengths = torch.randint(1, s + 1, (n,), generator=gen)
        lengths[0] = s
        pad = torch.arange(s).unsqueeze(0) >= lengths.unsqueeze(1)  # (N, S) True = ignore
        return pad if kind == "kpm_bool" else torch.zeros(n, s).masked_fill(pad, float("-inf"))
    shape = (l, s) if kind.endswith("2d") else (n * h, l, s)
    blocked = torch.rand(shape, generator=gen) < 0.4
    blocked[..., 0] = False  # key 0 always visible
    if kind.startswith("bool"):
        return blocked
    return torch.randn(shape, generator=gen).masked_fill(blocked, float("-inf"))


MASKS = [(None, None), ("bool2d", None), ("float2d", None), ("bool3d", None), ("float3d", None),
         (None, "kpm_bool"), (None, "kpm_float"), ("bool2d", "kpm_bool"), ("float2d", "kpm_bool"),
         ("float3d", "kpm_float"), ("bool3d", "kpm_float")]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("attn_kind,kpm_kind", MASKS)
def test_mha_parity_masks(batch_first, attn_kind, kpm_kind):
    n, h, l, s, e = 3, 4, 7, 9, 32
    ref, ours = _pair(e, h, batch_first=batch_first)
    gen = torch.Generator().manual_seed(1)
    shape_q = (n, l, e) if batch_first else (l, n, e)
    shape_k = (n, s, e) if batch_first else (s, n, e)
    q = torch.randn(shape_q, generator=gen)
    k, v = torch.randn(shape_k, generator=gen), torch.randn(shape_k, generator=gen)
    attn_mask = _mask(attn_kind, n, h, l, s, gen)
    kpm = _mask(kpm_kind, n, h, l, s, gen)
    for avg in (True, False):
        o_ref, w_ref = ref(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=avg)
        o, w = ours(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=avg)
        torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(w, w_ref, atol=ATOL, rtol=1e-4)
    o, w = ours(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
    assert w is None
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=1e-4)


def test_mha_parity_gradients():
    ref, ours = _pair(32, 4, batch_first=True)
    q = torch.randn(2, 6, 32, requires_grad=True)
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    o_ref, _ = ref(q, q, q, key_padding_mask=kpm)
    (o_ref ** 2).sum().backward()
    g_ref = q.grad.clone()
    q.grad = None
    o, _ = ours(q, q, q, key_padding_mask=kpm)
    (o ** 2).sum().backward()
    torch.testing.assert_close(q.grad, g_ref, atol=1e-4, rtol=1e-4)
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kw", [dict(kdim=12, vdim=20), dict(kdim=12, vdim=12), dict(add_bias_kv=True),
                                dict(add_zero_attn=True), dict(add_bias_kv=True, add_zero_attn=True, kdim=8),
                                dict(bias=False)])
def test_mha_parity_options(kw):
    ref, ours = _pair(32, 4, batch_first=True, **kw)
    assert set(ours.state_dict()) == set(ref.state_dict())
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, 32, generator=gen)
    k = torch.randn(2, 6, kw.get("kdim", 32), generator=gen)
    v = torch.randn(2, 6, kw.get("vdim", 32), generator=gen)
    kpm = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])
    attn_mask = _mask("bool2d", 2, 4, 5, 6, gen)
    o_ref, w_ref = ref(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask)
    o, w = ours(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(w, w_ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_is_causal_and_unbatched(batch_first):
    ref, ours = _pair(32, 4, batch_first=batch_first)
    x = torch.randn(5, 3, 32)  # (L, N, E) or (N, L, E)
    l = x.shape[1] if batch_first else x.shape[0]
    causal = torch.nn.Transformer.generate_square_subsequent_mask(l)
    o_ref, _ = ref(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    o, _ = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=1e-4)
    o2, w2 = ours(x, x, x, attn_mask=causal, is_causal=True)  # with the weights: the hint still holds
    torch.testing.assert_close(o2, o_ref, atol=ATOL, rtol=1e-4)
    assert torch.all(w2.triu(1) == 0)
    for mha in (ref, ours):  # the hint needs its mask, in torch's module and ours
        with pytest.raises(RuntimeError, match="attn_mask"):
            mha(x, x, x, is_causal=True)
    xu = torch.randn(6, 32)  # unbatched (L, E)
    o_ref, w_ref = ref(xu, xu, xu)
    o, w = ours(xu, xu, xu)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(w, w_ref, atol=ATOL, rtol=1e-4)


def test_mha_dropout_train_eval():
    _, ours = _pair(16, 2, batch_first=True, dropout=0.5)
    x = torch.randn(2, 8, 16)
    ours.eval()
    a, _ = ours(x, x, x)
    b, _ = ours(x, x, x)
    torch.testing.assert_close(a, b)
    ours.train()
    c, _ = ours(x, x, x, need_weights=False)
    assert c.shape == a.shape and not torch.allclose(a, c)


# ----------------------------------------------------------------------------------------------
# config-driven Attention layer against reference.attention


def _layer_reference(layer, x, context=None, bottom_right=True, **opts):
    """What Attention(config) must compute, from its own projections and reference.attention
    (positions bottom-right: a padded batch with seqlens_k wants top-left, bottom_right=False)."""
    c = layer.config
    b, s, _ = x.shape
    src = x if context is None else context
    q = layer.q_proj(x).view(b, s, c.n_heads, c.head_dim)
    k = layer.k_proj(src).view(b, src.shape[1], c.n_kv_heads, c.head_dim)
    v = layer.v_proj(src).view(b, src.shape[1], c.n_kv_heads, c.head_dim)
    if layer.rope is not None:
        q, k = layer.rope(q), layer.rope(k)
    window = (c.window[0], 0) if (c.causal and not layer.cross) else c.window
    out, _ = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=window,
                                 bottom_right=bottom_right, alibi_slopes=layer.alibi_slopes, sinks=layer.sinks,
                                 softcap=c.softcap, **opts)
    return layer.out_proj(out.transpose(1, 2).reshape(b, s, -1))


LAYER_CASES = [dict(), dict(n_kv_heads=2), dict(n_kv_heads=1, causal=True), dict(causal=True, window=(3, -1)),
               dict(window=(2, 2)), dict(positional="rope", causal=True), dict(positional="alibi", causal=True),
               dict(positional="alibi"), dict(sinks=True, causal=True), dict(softcap=5.0, n_kv_heads=2)]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "mha")
def test_attention_layer_matches_reference(case):
    torch.manual_seed(0)
    layer = Attention(AttentionConfig(d_model=48, n_heads=4, **case))
    if layer.sinks is not None:
        torch.nn.init.normal_(layer.sinks)
    x = torch.randn(2, 11, 48)
    lengths = torch.tensor([11, 6])
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _layer_reference(layer, x), atol=ATOL, rtol=1e-4)
        padded = layer(x, seqlens_k=lengths)
        torch.testing.assert_close(padded[:, :6], _layer_reference(layer, x, bottom_right=False,
                                                                   seqlens_k=lengths)[:, :6], atol=ATOL, rtol=1e-4)
        # a padded sequence computes what it computes alone (with causal, a window or ALiBi too:
        # bottom-right positions would follow seqlens_k and shift the diagonal by 11 - 6)
        torch.testing.assert_close(padded[1:, :6], layer(x[1:, :6]), atol=ATOL, rtol=1e-4)


def test_cross_attention_and_padding():
    torch.manual_seed(0)
    layer = Attention(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, kv_dim=24), cross=True)
    x, mem = torch.randn(2, 5, 32), torch.randn(2, 9, 24)
    lengths = torch.tensor([9, 4])
    kpm = torch.arange(9).unsqueeze(0) < lengths.unsqueeze(1)  # True = valid
    with torch.no_grad():
        a = layer(x, mem, seqlens_k=lengths)
        b = layer(x, mem, key_mask=kpm)
        ref = _layer_reference(layer, x, mem, seqlens_k=lengths)
        # padded memory rows must not matter
        mem2 = mem.clone()
        mem2[1, 4:] = 100.0
        c = layer(x, mem2, seqlens_k=lengths)
    torch.testing.assert_close(a, ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(b, ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(c, ref, atol=ATOL, rtol=1e-4)


def test_padding_by_lengths_and_by_mask_give_the_same_gradients():
    """Keys past seqlens_k are masked: they get exactly zero gradient, as with key_mask."""
    torch.manual_seed(0)
    layer = Attention(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2), cross=True)
    x = torch.randn(2, 5, 32)
    grads = []
    for kw in (dict(seqlens_k=torch.tensor([9, 4])),
               dict(key_mask=torch.arange(9).unsqueeze(0) < torch.tensor([[9], [4]]))):
        mem = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        layer(x, mem, **kw).square().sum().backward()
        assert torch.all(mem.grad[1, 4:] == 0)
        grads.append(mem.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", [dict(causal=True), dict(causal=True, positional="rope", n_kv_heads=2),
                                  dict(causal=True, positional="alibi", window=(4, -1)),
                                  dict(causal=True, sinks=True, n_kv_heads=1)])
def test_kv_cache_matches_full_sequence(case):
    torch.manual_seed(0)
    layer = Attention(AttentionConfig(d_model=32, n_heads=4, **case)).eval()
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        full = layer(x)
        cache = KVCache(2, 10, layer.n_kv_heads, layer.head_dim)
        steps = [layer(x[:, :4], cache=cache)]  # prefill 4, then one token at a time
        steps += [layer(x[:, t:t + 1], cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL, rtol=1e-4)
    with pytest.raises(ValueError, match="overflow"):
        cache.append(x.new_zeros(2, 1, layer.n_kv_heads, layer.head_dim), x.new_zeros(2, 1, layer.n_kv_heads, 8))


@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(causal=True, n_kv_heads=2, window=(3, -1)),
                                  dict(positional="alibi", causal=True)])
def test_sdpa_attention_type_matches_softmax(case):
    torch.manual_seed(0)
    ours = Attention(AttentionConfig(d_model=32, n_heads=4, **case))
    peer = Attention(AttentionConfig(d_model=32, n_heads=4, attention_type="sdpa", **case))
    peer.load_state_dict(ours.state_dict())
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(peer(x), ours(x), atol=ATOL, rtol=1e-4)
        lengths = torch.tensor([9, 5])
        torch.testing.assert_close(peer(x, seqlens_k=lengths)[1, :5], ours(x, seqlens_k=lengths)[1, :5],
                                   atol=ATOL, rtol=1e-4)


def test_attention_type_registry_and_weights():
    calls = []

    @register_attention_type("test_counting")
    def counting(q, k, v, **kw):
        calls.append(q.shape)
        return ATTENTION_TYPES["softmax"](q, k, v, **kw)

    try:
        layer = Attention(AttentionConfig(d_model=16, n_heads=2, attention_type="test_counting", causal=True))
        layer.keep_weights = True
        layer(torch.randn(1, 5, 16))
        assert calls == [(1, 5, 2, 8)]
        w = layer.last_weights
        assert w.shape == (1, 2, 5, 5)
        torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 5))
        assert torch.all(w.triu(1) == 0)
    finally:
        del ATTENTION_TYPES["test_counting"]
    with pytest.raises(ValueError, match="unknown attention_type"):
        Attention(AttentionConfig(d_model=16, n_heads=2, attention_type="nope"))
    with pytest.raises(ValueError):
        AttentionConfig(d_model=16, n_heads=4, n_kv_heads=3)


# ----------------------------------------------------------------------------------------------
# Bahdanau / Luong against hand-computed cases


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def test_additive_attention_hand_computed():
    att = AdditiveAttention(2, 2, 2)
    with torch.no_grad():
        att.w_q.weight.copy_(torch.eye(2))
        att.w_k.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, -1.0]]))
        att.w_k.bias.copy_(torch.tensor([0.5, 0.0]))
        att.v.weight.copy_(torch.tensor([[1.0, 2.0]]))
    s = torch.tensor([[0.3, -0.2]])
    h = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 2.0]]])
    expected = []
    for hj in h[0].tolist():
        a = [math.tanh(0.3 + 2 * hj[0] + 0.5), math.tanh(-0.2 - hj[1])]
        expected.append(a[0] + 2 * a[1])
    w_exp = _softmax(expected)
    ctx, w = att(s, h)
    torch.testing.assert_close(w, torch.tensor([w_exp]))
    torch.testing.assert_close(ctx, torch.tensor([w_exp]) @ h[0])
    # padding: the third key is masked, the first two renormalize
    ctx, w = att(s, h, mask=torch.tensor([[True, True, False]]))
    w2 = _softmax(expected[:2])
    torch.testing.assert_close(w, torch.tensor([w2 + [0.0]]))


@pytest.mark.parametrize("score", ["dot", "general", "concat"])
def test_luong_attention_hand_computed(score):
    att = LuongAttention(2, 2, score=score, hidden_dim=2)
    s = torch.tensor([[1.0, 0.5]])
    h = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [2.0, -1.0]]])
    if score == "general":
        with torch.no_grad():
            att.w_a.weight.copy_(torch.tensor([[1.0, 1.0], [0.0, 3.0]]))  # s^T W h
        w_a = [[1.0, 1.0], [0.0, 3.0]]
        raw = [sum(s[0, i].item() * w_a[i][j] * hj[j] for i in range(2) for j in range(2)) for hj in h[0].tolist()]
    elif score == "concat":
        with torch.no_grad():
            att.w_a.weight.copy_(torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, -1.0, 0.0, 2.0]]))
            att.v.weight.copy_(torch.tensor([[1.0, -1.0]]))
        raw = [math.tanh(1.0 + hj[0]) - math.tanh(-0.5 + 2 * hj[1]) for hj in h[0].tolist()]
    else:
        raw = [1.0 * hj[0] + 0.5 * hj[1] for hj in h[0].tolist()]
    w_exp = torch.tensor([_softmax(raw)])
    values = torch.randn(1, 3, 5)
    ctx, w = att(s, h, values)
    torch.testing.assert_close(w, w_exp)
    torch.testing.assert_close(ctx, w_exp @ values[0])
    # a sequence of queries gives the per-step results stacked
    ctx_seq, w_seq = att(s.unsqueeze(1).expand(1, 4, 2), h, values)
    assert w_seq.shape == (1, 4, 3) and ctx_seq.shape == (1, 4, 5)
    torch.testing.assert_close(w_seq[:, 2], w_exp)


def test_classic_padding_batch():
    torch.manual_seed(0)
    for att in (AdditiveAttention(6, 4, 8), LuongAttention(6, 4, score="general")):
        keys = torch.randn(3, 5, 4)
        mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
        ctx, w = att(torch.randn(3, 6), keys, mask=mask)
        assert ctx.shape == (3, 4) and w.shape == (3, 5)
        assert torch.all(w[~mask] == 0)
        torch.testing.assert_close(w.sum(-1), torch.ones(3))
        torch.testing.assert_close(ctx[2], keys[2, 0])
    with pytest.raises(ValueError):
        LuongAttention(4, 6, score="dot")


# ----------------------------------------------------------------------------------------------
# positions, FFN, norms, blocks


def test_sinusoidal_values():
    pe = SinusoidalPositionalEncoding(8, max_len=16)
    x = torch.zeros(1, 3, 8)
    y = pe(x)
    torch.testing.assert_close(y[0, 0], torch.tensor([0.0, 1.0] * 4))
    for i in range(4):
        f = 1.0 / 10000 ** (2 * i / 8)
        torch.testing.assert_close(y[0, 2, 2 * i], torch.tensor(math.sin(2 * f)))
        torch.testing.assert_close(y[0, 2, 2 * i + 1], torch.tensor(math.cos(2 * f)))
    torch.testing.assert_close(pe(x, offset=2)[0, 0], y[0, 2])


def test_rope_is_relative():
    rope = RotaryEmbedding(16, max_len=8)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def dot(m, n):
        return (rope(q, offset=m) * rope(k, offset=n)).sum()

    torch.testing.assert_close(dot(3, 1), dot(10, 8), atol=1e-5, rtol=1e-5)  # also past the initial table
    torch.testing.assert_close(rope(q, offset=0), q)
    torch.testing.assert_close(rope(q, offset=5).norm(), q.norm())


def test_rope_keeps_float32_tables_through_a_dtype_cast():
    """model.to(torch.bfloat16) casts every buffer: RoPE's tables are rebuilt in float32 instead,
    and a table grown past its initial 4096 rows later comes from the exact frequencies (rebuilt
    from bf16-rounded ones, the angle at position 5000 was off by radians: a rotation error of 2.2)."""
    torch.manual_seed(0)
    exact = RotaryEmbedding(64)
    cast = RotaryEmbedding(64).to(torch.bfloat16)
    assert cast.cos.dtype == torch.float32 and cast.sin.dtype == torch.float32
    x = torch.randn(1, 1, 2, 64)
    for pos in (100, 5000, 3000):  # 5000 grows the table; 3000 reads the grown one
        want = exact(x, offset=pos).bfloat16()
        torch.testing.assert_close(cast(x.bfloat16(), offset=pos), want, atol=0.05, rtol=0.02)
    assert not any("cos" in n or "sin" in n or "freq" in n for n in cast.state_dict())


def test_alibi_slopes():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s6 = alibi_slopes(6)
    assert s6.shape == (6,) and torch.all(s6 > 0)
    torch.testing.assert_close(s6[:4], alibi_slopes(4))


@pytest.mark.parametrize("act", ["relu", "gelu", "swiglu"])
def test_feedforward(act):
    ffn = FeedForward(16, 40, act)
    x = torch.randn(2, 3, 16)
    y = ffn(x)
    assert y.shape == x.shape
    h = ffn.w1(x)
    h = {"relu": F.relu(h), "gelu": F.gelu(h), "swiglu": F.silu(h) * (ffn.w3(x) if ffn.w3 is not None else 0)}[act]
    torch.testing.assert_close(y, ffn.w2(h))


def test_rmsnorm():
    n = RMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8)
    torch.testing.assert_close(n(x), x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_blocks_shapes_and_residual_order(norm_first, norm):
    torch.manual_seed(0)
    cfg = BlockConfig(attn=AttentionConfig(d_model=32, n_heads=4, causal=True), d_ff=64, norm=norm,
                      norm_first=norm_first, dropout=0.0)
    enc, dec = EncoderBlock(cfg).eval(), DecoderBlock(cfg).eval()
    x, mem = torch.randn(2, 7, 32), torch.randn(2, 5, 32)
    y = enc(x)
    z = dec(x, mem, memory_seqlens=torch.tensor([5, 3]))
    assert y.shape == x.shape and z.shape == x.shape
    sa = enc.self_attn
    if norm_first:
        h = x + sa(enc.norm1(x))
        expected = h + enc.ffn(enc.norm2(h))
    else:
        h = enc.norm1(x + sa(x))
        expected = enc.norm2(h + enc.ffn(h))
    torch.testing.assert_close(y, expected)
    # causal: changing the last token leaves earlier outputs alone
    x2 = x.clone()
    x2[:, -1] += 1.0
    torch.testing.assert_close(dec(x2, mem)[:, :-1], dec(x, mem)[:, :-1])


# ----------------------------------------------------------------------------------------------
# MultiheadAttention inside torch's own Transformer layers


class _OpSpy(TorchDispatchMode):
    """Records the name of every op that runs (below autograd): our kernel is attention_ext::softmax_fwd
    (or the composite softmax_fwd_plain over it, which is what a dispatch mode sees under inference_mode);
    torch's own attention shows as aten::_transformer_encoder_layer_fwd, _native_multi_head_attention
    or a _scaled_dot_product_* kernel."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name)
        return func(*args, **(kwargs or {}))

    def torch_attention(self):
        return sorted(n for n in self.ops if any(
            w in n for w in ("transformer_encoder_layer", "multi_head_attention", "scaled_dot_product")))


def _with_our_attention(module):
    """A deep copy of `module` with each torch.nn.MultiheadAttention replaced by ours, same weights."""
    ours = copy.deepcopy(module)
    for parent in list(ours.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.MultiheadAttention):
                mha = MultiheadAttention(child.embed_dim, child.num_heads, dropout=child.dropout,
                                         bias=child.in_proj_bias is not None, batch_first=child.batch_first)
                mha.load_state_dict(child.state_dict(), strict=True)
                setattr(parent, name, mha)
    return ours


def _transformer_pair(kind, batch_first):
    """(torch's, ours): the same torch layer / encoder, ours with attention_ext's MultiheadAttention."""
    e, h, ff = 32, 4, 48
    torch.manual_seed(0)
    if kind == "decoder_layer":
        ref = torch.nn.TransformerDecoderLayer(e, h, ff, dropout=0.0, batch_first=batch_first)
        return ref, _with_our_attention(ref)
    layer = torch.nn.TransformerEncoderLayer(e, h, ff, dropout=0.0, batch_first=batch_first)
    if kind == "encoder_layer":
        return layer, _with_our_attention(layer)
    with warnings.catch_warnings():  # batch_first=False: "enable_nested_tensor is True, but ..."
        warnings.simplefilter("ignore", UserWarning)
        ref = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
        ours = torch.nn.TransformerEncoder(_with_our_attention(layer), num_layers=2, enable_nested_tensor=True)
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert ours.use_nested_tensor == ref.use_nested_tensor == batch_first  # nested tensors reach our module
    return ref, ours


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("mode", ["train", "eval_no_grad", "eval_inference_mode"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", ["encoder_layer", "decoder_layer", "encoder"])
def test_mha_inside_torch_transformer_layers(kind, batch_first, mode):
    """Our MultiheadAttention where torch's layers put theirs: TransformerEncoderLayer (whose eval
    fast path would run torch's fused kernel on our weights), TransformerDecoderLayer and
    TransformerEncoder with nested tensors (eval + padding mask nests the batch). Train and eval;
    the output matches the torch layer with torch's attention, and attention_ext's kernel ran
    (torch's attention did not)."""
    ref, ours = _transformer_pair(kind, batch_first)
    n, l, s, e = 3, 7, 6, 32
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n, l, e, generator=gen)
    mem = torch.randn(n, s, e, generator=gen)
    pad = torch.arange(l).unsqueeze(0) >= torch.tensor([l, 5, 3]).unsqueeze(1)  # (N, L) True = padding
    mem_pad = torch.arange(s).unsqueeze(0) >= torch.tensor([s, 2, 4]).unsqueeze(1)
    if not batch_first:
        x, mem = x.transpose(0, 1), mem.transpose(0, 1)
    if kind == "decoder_layer":
        causal = torch.nn.Transformer.generate_square_subsequent_mask(l)
        kw = dict(tgt_mask=causal, tgt_is_causal=True, tgt_key_padding_mask=pad, memory_key_padding_mask=mem_pad)
        args = (x, mem)
    else:
        kw = dict(src_key_padding_mask=pad)
        args = (x,)
    for m in (ref, ours):
        m.train(mode == "train")
    grad_ctx = {"train": contextlib.nullcontext, "eval_no_grad": torch.no_grad,
                "eval_inference_mode": torch.inference_mode}[mode]
    with grad_ctx():
        want = ref(*args, **kw)
        spy = _OpSpy()
        with spy:
            got = ours(*args, **kw)
    # under inference_mode (autograd keys excluded) a dispatch mode sees the composite softmax_fwd_plain,
    # which runs fwd below it
    assert {"attention_ext::softmax_fwd", "attention_ext::softmax_fwd_plain"} & spy.ops, "our kernel did not run"
    assert not spy.torch_attention(), f"torch's attention ran instead: {spy.torch_attention()}"
    assert not got.is_nested and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    if mode == "train":
        (got * want.detach()).sum().backward()
        assert all(p.grad is not None for p in ours.parameters() if p.requires_grad)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_mha_nested_input():
    """Nested (N, *, E) inputs (what TransformerEncoder hands its layers in eval): out is nested,
    each sequence equal to torch's on the padded batch with its key padding mask."""
    ref, ours = _pair(32, 4, batch_first=True)
    lengths = [7, 4, 1]
    seqs = [torch.randn(n, 32) for n in lengths]
    nested = torch.nested.nested_tensor(seqs)
    padded = torch.nested.to_padded_tensor(nested, 0.0)
    pad = torch.arange(7).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
    with torch.no_grad():
        want, _ = ref(padded, padded, padded, key_padding_mask=pad, need_weights=False)
        got, _ = ours(nested, nested, nested, need_weights=False)
    assert got.is_nested
    for i, t in enumerate(got.unbind()):
        torch.testing.assert_close(t, want[i, :lengths[i]], atol=ATOL, rtol=1e-4)
    with pytest.raises(ValueError, match="nested"):
        ours(nested, nested, nested, key_padding_mask=pad)


def test_layer_input_errors_name_the_argument():
    """Shapes the layer cannot take are named, not raw unpack / attribute / broadcast errors."""
    self_attn = Attention(AttentionConfig(d_model=32, n_heads=4))
    cross = Attention(AttentionConfig(d_model=32, n_heads=4), cross=True)
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"x must be \(B, S, d_model\) with d_model = 32"):
        self_attn(x[0])
    with pytest.raises(ValueError, match="x must be"):
        self_attn(torch.randn(2, 5, 16))
    with pytest.raises(TypeError, match="x"):
        self_attn([1, 2])
    with pytest.raises(ValueError, match="needs `context`"):
        cross(x)
    with pytest.raises(ValueError, match="build it with cross=True"):
        self_attn(x, torch.randn(2, 7, 32))  # a memory handed to a self-attention layer is not ignored
    cache = KVCache(3, 16, 4, 8)  # batch 3, not 2
    with pytest.raises(ValueError, match=r"KVCache.append: k must be \(B, T, H_k, D\) with "
                                         r"\(B, H_k, D\) = \(3, 4, 8\)"):
        self_attn(x, cache=cache)


def test_multihead_autocast_bias_kv_and_weight_dtype():
    """Found by an audit: add_bias_kv under autocast failed (the float32 bias promoted the 16-bit
    keys: 'q, k, v must share a dtype'); the weights of a 16-bit module came back float32, where
    torch's are in the module's dtype. A query with every key padded gives 0 (documented)."""
    from attention_ext.nn import MultiheadAttention
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(16, 4, add_bias_kv=True, batch_first=True)
    m = MultiheadAttention(16, 4, add_bias_kv=True, batch_first=True)
    m.load_state_dict(t.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, wa = t(x, x, x)
        b, wb = m(x, x, x)
    assert b.dtype == a.dtype == torch.bfloat16 and wb.dtype == wa.dtype
    torch.testing.assert_close(b.float(), a.float(), rtol=0.05, atol=0.05)
    tb, mb = t.bfloat16(), m.bfloat16()
    xb = x.bfloat16()
    assert mb(xb, xb, xb)[1].dtype == tb(xb, xb, xb)[1].dtype == torch.bfloat16
    m2 = MultiheadAttention(16, 4, batch_first=True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1] = True  # the second sequence: every key padded
    out, w = m2(x, x, x, key_padding_mask=kpm)
    assert (out[1] == m2.out_proj.bias).all() and (w[1] == 0).all()


def test_lsh_and_linformer_masks_and_context_checked():
    """Found by an audit: the LSH layer took a seqlens_k shorter than the batch and zeroed the rows
    past it; the Linformer layer ignored a context given to a self-attention layer, dropped
    key_mask when seqlens_k came too, and failed in torch's words on cross=True without context.
    All refused (or combined) by name now."""
    from attention_ext.nn import AttentionConfig, make_attention
    lsh = make_attention(AttentionConfig(d_model=32, n_heads=4, attention_type="lsh", lsh_buckets=4,
                                         lsh_chunk_size=8)).eval()
    x = torch.randn(3, 40, 32)
    with pytest.raises(ValueError, match=r"seqlens_k must be \(3,\)"):
        lsh(x, seqlens_k=torch.tensor([40, 23]))
    with pytest.raises(TypeError, match="seqlens_k"):
        lsh(x, seqlens_k=torch.tensor([40.0, 23.0, 7.0]))
    lf = make_attention(AttentionConfig(d_model=32, n_heads=4, attention_type="linformer")).eval()
    x = torch.randn(2, 12, 32)
    with pytest.raises(ValueError, match="takes no context"):
        lf(x, torch.randn(2, 12, 32))
    km = torch.ones(2, 12, dtype=torch.bool)
    km[1, 8:] = False
    with torch.no_grad():
        both = lf(x, key_mask=km, seqlens_k=torch.tensor([12, 10]))
        torch.testing.assert_close(both, lf(x, key_mask=km))  # the stricter of the two: 8 real keys


def test_sparse_layer_options_fail_at_build():
    """Found by an audit: a float n_global built and failed mid-forward, a negative one meant no
    global blocks, topk='3' failed in a comparison, sparse_kwargs were ignored under 'topk', and
    'random' without density named no sparse_kwargs. All refused when the layer is built."""
    from attention_ext.nn import AttentionConfig, make_attention
    base = dict(d_model=32, n_heads=2, attention_type="sparse", sparse_block_size=16)
    for kw, exc, match in ((dict(sparse_kwargs=dict(n_global=1.5)), TypeError, "n_global"),
                           (dict(sparse_kwargs=dict(n_global=-1)), ValueError, "n_global"),
                           (dict(sparse_pattern="topk", topk="3"), ValueError, "topk"),
                           (dict(sparse_pattern="topk", topk=3, sparse_kwargs=dict(n_global=1)), ValueError,
                            "no sparse_kwargs"),
                           (dict(sparse_pattern="random"), TypeError, "sparse_kwargs")):
        with pytest.raises(exc, match=match):
            make_attention(AttentionConfig(**base, **kw))
