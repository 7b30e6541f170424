"""nn.GatedDeltaNet (attention_type="gated_delta") and the LM on it: cached generation equals the
full forward, padded tokens change nothing, gradients reach every parameter, the LM trains and
generates, and the options the layer has no form for are refused."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.linear import delta
from attention_ext.models import LanguageModel, LMConfig
from attention_ext.nn import AttentionConfig, DeltaCache, GatedDeltaNet, allocate_cache, make_attention
from tests.helpers import assert_compiled_backward_matches

pytestmark = pytest.mark.skipif(not delta.has_kernel(torch.device("cpu")), reason="no CPU delta kernel")


def layer(n_heads=4, n_kv_heads=2, d_model=64, conv=4, seed=0):
    torch.manual_seed(seed)
    cfg = AttentionConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, attention_type="gated_delta",
                          causal=True, delta_conv=conv)
    return GatedDeltaNet(cfg).double()


@pytest.mark.parametrize("conv", [4, 0])
def test_cached_generation_equals_the_full_forward(conv):
    m = layer(conv=conv)
    x = torch.randn(2, 23, 64, dtype=torch.float64)
    full = m(x)
    cache = allocate_cache(m.config, 2, 23)
    assert isinstance(cache, DeltaCache)
    with torch.no_grad():
        parts = [m(x[:, :9], cache=cache)]  # prefill
        for t in range(9, 23, 2):  # steps of 2 and a last one of 1, in place on the state
            parts.append(m(x[:, t:t + 2], cache=cache))
    assert cache.pos == 23
    torch.testing.assert_close(torch.cat(parts, 1), full.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_tokens_change_nothing(side):
    m = layer()
    x = torch.randn(1, 15, 64, dtype=torch.float64)
    want = m(x)
    pad = torch.randn(1, 4, 64, dtype=torch.float64) * 100  # garbage
    xp = torch.cat([pad, x], 1) if side == "left" else torch.cat([x, pad], 1)
    mask = torch.ones(1, 19, dtype=torch.bool)
    if side == "left":
        mask[:, :4] = False
    else:
        mask[:, 15:] = False
    got = m(xp, key_mask=mask)
    real = got[:, 4:] if side == "left" else got[:, :15]
    torch.testing.assert_close(real, want, rtol=1e-10, atol=1e-10)
    # and the state after the padded prefill is the unpadded one's
    c1, c2 = DeltaCache(), DeltaCache()
    with torch.no_grad():
        m(x, cache=c1)
        m(xp, key_mask=mask, cache=c2)
    if side == "left":
        torch.testing.assert_close(c2.state, c1.state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("side", ["left", "right"])
def test_generation_after_a_padded_prefill(side):
    """Steps after a padded prefill continue from the real tokens: the convolutions' cache holds
    the last real inputs (not the padding), the state ignores the padding."""
    m = layer()
    x = torch.randn(1, 6, 64, dtype=torch.float64)
    pad = torch.randn(1, 3, 64, dtype=torch.float64)
    xp = torch.cat([pad, x[:, :4]], 1) if side == "left" else torch.cat([x[:, :4], pad], 1)
    mask = torch.ones(1, 7, dtype=torch.bool)
    mask[:, :3] = side != "left"
    mask[:, 4:] = side == "left"
    c1, c2 = DeltaCache(), DeltaCache()
    with torch.no_grad():
        m(x[:, :4], cache=c1)
        m(xp, key_mask=mask, cache=c2)
        want, got = m(x[:, 4:], cache=c1), m(x[:, 4:], cache=c2)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_gradients_reach_every_parameter():
    m = layer()
    m(torch.randn(2, 11, 64, dtype=torch.float64)).pow(2).sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("conv", [4, 0])
def test_compiled_backward_equals_eager(conv):
    """torch.compile(fullgraph=True) forward and backward with batch > 1 (the gates' gradients come
    back from the op (B, H_v, S); a gate computed in another layout broke the compiled backward)."""
    m = layer(conv=conv).float()
    x = torch.randn(3, 21, 64, requires_grad=True)
    mask = torch.ones(3, 21, dtype=torch.bool)
    mask[1, :5] = False  # left padding
    assert_compiled_backward_matches(m, x, (dict(), dict(key_mask=mask)))


def test_lm_trains_and_generates():
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64,
                   attention_type="gated_delta", positional="learned")
    lm = LanguageModel(cfg)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    data = torch.arange(64).remainder(8).repeat(4, 1)  # a period-8 pattern
    losses = []
    for _ in range(30):
        _, loss = lm(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    lm.eval()
    with torch.no_grad():
        cached = lm.generate(data[:, :16], 12, greedy=True)
        uncached = lm.generate(data[:, :16], 12, greedy=True, use_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("kw,msg", [
    (dict(causal=False), "causal"),
    (dict(causal=True, positional="rope"), "RoPE"),
    (dict(causal=True, window=(8, 0)), "window"),
    (dict(causal=True, delta_conv=1), "delta_conv"),
    (dict(causal=True, delta_conv=-2), "delta_conv"),
])
def test_refuses_what_it_has_no_form_for(kw, msg):
    with pytest.raises(ValueError, match=msg):
        GatedDeltaNet(AttentionConfig(d_model=32, n_heads=2, attention_type="gated_delta", **kw))
    with pytest.raises(ValueError, match="self-attention only"):
        GatedDeltaNet(AttentionConfig(d_model=32, n_heads=2, attention_type="gated_delta", causal=True), cross=True)


def test_audit_padding_masks_and_versions():
    """Found by an audit of the layer: (1) a padded row holding inf / NaN made the real tokens NaN
    (the mask was a product: inf x 0); (2) bad key_mask / seqlens_k failed in torch's words; (3) a
    gap inside the real tokens changed them (the convolutions read the gap's zeros): refused with
    the convolutions, exact without; (4) the in-place step wrote the state from C++ without
    bumping its version, so a graph that had saved it computed a stale gradient silently."""
    torch.manual_seed(0)
    m = make_attention(AttentionConfig(d_model=32, n_heads=4, attention_type="gated_delta", causal=True)).eval()
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        ref = m(x)
        pad = torch.cat([torch.full((1, 3, 32), float("inf")), x, torch.full((1, 2, 32), float("nan"))], 1)
        km = torch.tensor([[False] * 3 + [True] * 6 + [False] * 2])
        torch.testing.assert_close(m(pad, key_mask=km)[:, 3:9], ref)
    with torch.enable_grad():  # the padded rows' inf / NaN reach no weight's gradient either
        m(pad, key_mask=km)[:, 3:9].sum().backward()
    assert all(p.grad is None or p.grad.isfinite().all() for p in m.parameters())
    m.zero_grad(set_to_none=True)
    with torch.no_grad():
        with pytest.raises(TypeError, match="key_mask must be bool"):
            m(x, key_mask=torch.ones(1, 6, dtype=torch.long))
        with pytest.raises(ValueError, match=r"key_mask must be \(B, S\)"):
            m(x, key_mask=torch.ones(1, 5, dtype=torch.bool))
        with pytest.raises(TypeError, match="seqlens_k"):
            m(x, seqlens_k=[6])
        with pytest.raises(ValueError, match=r"seqlens_k must be >= 0"):
            m(x, seqlens_k=torch.tensor([-1]))
        torch.testing.assert_close(m(x, seqlens_k=torch.tensor([9])), ref)  # past S: every token (as attention())
        gap = torch.tensor([[True, True, True, False, False, True]])
        with pytest.raises(ValueError, match="gap"):
            m(x, key_mask=gap)
        m0 = make_attention(AttentionConfig(d_model=32, n_heads=4, attention_type="gated_delta", causal=True,
                                            delta_conv=0)).eval()
        torch.testing.assert_close(m0(x, key_mask=gap)[:, gap[0]], m0(x[:, gap[0]]))
    q, k = torch.randn(1, 1, 1, 3), torch.randn(1, 1, 1, 3)
    v, beta = torch.randn(1, 1, 1, 2), torch.rand(1, 1, 1)
    st = torch.randn(1, 1, 3, 2)
    w = torch.randn(3, 2, requires_grad=True)
    y = (st * w).sum()  # saves st
    with torch.no_grad():
        ae.delta_rule_step(q, k, v, beta, st, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    s = ae.LinearAttentionState(torch.randn(1, 1, 3, 2), torch.rand(1, 1, 3))
    y = (s.S * w).sum()
    with torch.no_grad():
        ae.linear_attention_step(q, k, v, s, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
