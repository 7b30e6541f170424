"""attention_ext.linear_attention / linear_attention_step / LinearAttentionState: the recurrent
and parallel forms agree, states carry across calls, GQA, padding, varlen, decay, initial state,
layouts, feature maps and input errors. Runs on the compiled op when it is registered, on the
reference otherwise (float64 where exactness is checked)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attention_ext as ae
from attention_ext.linear import LinearAttentionState, feature_maps, reference

pytestmark = pytest.mark.filterwarnings("ignore:attention_ext. no compiled linear:RuntimeWarning")
f64 = torch.float64


def qkv(b=2, h=4, hk=2, s=13, m=6, dv=5, dtype=f64, layout="bhsd"):
    def mk(heads, d):
        return torch.randn((b, heads, s, d) if layout == "bhsd" else (b, s, heads, d), dtype=dtype)
    return mk(h, m), mk(hk, m), mk(hk, dv)


MAPS = ["elu", "relu", "favor", "rfa"]


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("decay", [False, True])
def test_prefill_then_steps_equals_parallel(fmap, decay):
    q, k, v = qkv()
    g = -torch.rand(2, 4, 13, dtype=f64) if decay else None
    # FAVOR+'s key offset differs between the calls, and eps acts on the offset normalizer: exact without it
    eps = 0.0 if fmap == "favor" else 1e-6
    full = ae.linear_attention(q, k, v, feature_map=fmap, causal=True, decay=g, scale=0.8, eps=eps)
    out, state = ae.linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], feature_map=fmap, causal=True,
                                     decay=g[..., :6] if decay else None, scale=0.8, eps=eps, return_state=True)
    outs = [out]
    for t in (6, 7, 10):  # one token, three tokens, three tokens
        e = {6: 7, 7: 10, 10: 13}[t]
        o, state = ae.linear_attention_step(q[:, :, t:e], k[:, :, t:e], v[:, :, t:e], state, feature_map=fmap,
                                            decay_t=g[..., t:e] if decay else None, scale=0.8, eps=eps,
                                            inplace=t == 7)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 2), full)


def test_steps_from_nothing_and_bshd():
    q, k, v = qkv(layout="bshd")
    full = ae.linear_attention(q, k, v, causal=True, layout="bshd")
    state, outs = None, []
    for t in range(13):
        o, state = ae.linear_attention_step(q[:, t: t + 1], k[:, t: t + 1], v[:, t: t + 1], state, layout="bshd")
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full)
    assert state.S.dtype == torch.float32 or state.S.dtype == f64


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fmap", ["elu", "favor"])
def test_state_across_two_calls_equals_one(causal, fmap):
    q, k, v = qkv()
    g = -torch.rand(2, 4, 13, dtype=f64) if causal else None
    s0 = LinearAttentionState(torch.randn(2, 4, 6, 5, dtype=f64), torch.rand(2, 4, 6, dtype=f64) + 1)
    if fmap == "favor":  # 6 features, the state's width
        s0 = LinearAttentionState(s0.S, s0.z, torch.randn(2, 4, dtype=f64))
        fmap = feature_maps.Favor(6, 6, seed=0)
    full, sf = ae.linear_attention(q, k, v, causal=causal, decay=g, feature_map=fmap, initial_state=s0,
                                   return_state=True, eps=0.0)
    if causal:
        o1, s1 = ae.linear_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], causal=True, decay=g[..., :5],
                                     feature_map=fmap, initial_state=s0, return_state=True, eps=0.0)
        o2, s2 = ae.linear_attention(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], causal=True, decay=g[..., 5:],
                                     feature_map=fmap, initial_state=s1, return_state=True, eps=0.0)
        torch.testing.assert_close(torch.cat([o1, o2], 2), full)
    else:  # the non-causal state is a sum: keys in two calls, then the queries read it
        _, s1 = ae.linear_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], feature_map=fmap, initial_state=s0,
                                    return_state=True)
        _, s2 = ae.linear_attention(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], feature_map=fmap, initial_state=s1,
                                    return_state=True)
    for a, b in ((s2, sf),):  # compare the states' absolute values: S exp(log_scale)
        f = (lambda s: s.log_scale.exp()) if s0.log_scale is not None else (lambda s: torch.ones(2, 4, dtype=f64))
        torch.testing.assert_close(a.S * f(a)[..., None, None], b.S * f(b)[..., None, None])
        torch.testing.assert_close(a.z * f(a)[..., None], b.z * f(b)[..., None])


def test_state_conversions():
    st = LinearAttentionState.zeros(2, 3, 4, 5)
    assert st.S.shape == (2, 3, 4, 5) and st.z.shape == (2, 3, 4) and st.S.dtype == torch.float32
    aug = torch.randn(2, 3, 4, 6)
    st = LinearAttentionState.from_augmented(aug, normalize=True)
    torch.testing.assert_close(st.augmented(), aug)
    assert LinearAttentionState.from_augmented(aug, normalize=False).z is None
    with pytest.raises(ValueError, match="normalizer"):
        LinearAttentionState.from_augmented(aug, normalize=False).augmented(normalize=True)


@pytest.mark.parametrize("causal", [True, False])
def test_gqa_equals_repeated_kv(causal):
    q, k, v = qkv(h=6, hk=2)
    ref = ae.linear_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), causal=causal)
    torch.testing.assert_close(ae.linear_attention(q, k, v, causal=causal), ref)


@pytest.mark.parametrize("causal", [True, False])
def test_padded_keys_contribute_nothing(causal):
    q, k, v = qkv()
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, 9:] = False
    mask[1, [2, 5]] = False
    out, st = ae.linear_attention(q, k, v, causal=causal, key_mask=mask, return_state=True)
    # the same as keys whose features are 0: identity map on elu features with the padded rows zeroed
    fk = reference.phi(k, 1) * mask.view(2, 1, 13, 1)
    ref, st_ref = ae.linear_attention(reference.phi(q, 1), fk, v, causal=causal, feature_map="identity",
                                      return_state=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(st.S, st_ref.S)
    # and changing a padded key or value changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 10] += 5
    v2[1, :, 5] -= 3
    torch.testing.assert_close(ae.linear_attention(q, k2, v2, causal=causal, key_mask=mask), out)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_sequences_are_independent(causal):
    lens = [5, 1, 0, 9]
    cu = torch.tensor([0, 5, 6, 6, 15], dtype=torch.int32)
    total, h, m, dv = 15, 4, 6, 5
    q, k = torch.randn(total, h, m, dtype=f64), torch.randn(total, 2, m, dtype=f64)
    v = torch.randn(total, 2, dv, dtype=f64)
    s0 = LinearAttentionState(torch.randn(4, h, m, dv, dtype=f64), torch.rand(4, h, m, dtype=f64) + 1)
    g = -torch.rand(1, h, total, dtype=f64) if causal else None
    out, st = ae.linear_attention(q, k, v, cu_seqlens=cu, causal=causal, decay=g, initial_state=s0, return_state=True)
    assert out.shape == (total, h, dv) and st.S.shape == (4, h, m, dv)
    for n, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        init = LinearAttentionState(s0.S[n: n + 1], s0.z[n: n + 1])
        o, sn = ae.linear_attention(q[a:e].unsqueeze(0), k[a:e].unsqueeze(0), v[a:e].unsqueeze(0), layout="bshd",
                                    causal=causal, decay=g[..., a:e] if causal else None, initial_state=init,
                                    return_state=True)
        torch.testing.assert_close(out[a:e], o[0])
        torch.testing.assert_close(st.S[n: n + 1], sn.S)
    # a neighbour's state or inputs never leak into a sequence
    s1 = LinearAttentionState(s0.S.clone(), s0.z.clone())
    s1.S[0] += 100
    k2 = k.clone()
    k2[:5] += 3
    out2 = ae.linear_attention(q, k2, v, cu_seqlens=cu, causal=causal, decay=g, initial_state=s1)
    torch.testing.assert_close(out2[5:], out[5:])


def test_decay_and_initial_state_match_reference():
    q, k, v = qkv()
    g = -2 * torch.rand(2, 4, 13, dtype=f64)
    s0 = torch.randn(2, 4, 6, 6, dtype=f64)
    out = ae.linear_attention(q, k, v, causal=True, decay=g, initial_state=s0, scale=0.3, eps=1e-3)
    ref = reference.linear_attention(q, k, v, causal=True, decay=g, initial_state=s0, scale=0.3, eps=1e-3)[0]
    torch.testing.assert_close(out, ref)


def test_layouts_agree():
    q, k, v = qkv()
    for causal in (True, False):
        a = ae.linear_attention(q, k, v, causal=causal)
        b = ae.linear_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal, layout="bshd")
        torch.testing.assert_close(b.transpose(1, 2), a)


def test_custom_feature_maps():
    q, k, v = qkv()
    ref = ae.linear_attention(F.softplus(q), F.softplus(k), v, feature_map="identity", causal=True)
    torch.testing.assert_close(ae.linear_attention(q, k, v, feature_map=F.softplus, causal=True), ref)
    torch.testing.assert_close(ae.linear_attention(q, k, v, feature_map=torch.nn.Softplus(), causal=True), ref)
    feature_maps.register_feature_map("softplus_test", lambda head_dim: torch.nn.Softplus())
    try:
        torch.testing.assert_close(ae.linear_attention(q, k, v, feature_map="softplus_test", causal=True), ref)
    finally:
        del feature_maps.FEATURE_MAPS["softplus_test"]
    wide = ae.linear_attention(q, k, v, feature_map=lambda x: torch.cat([F.relu(x), F.relu(-x)], -1))
    assert wide.shape == (2, 4, 13, 5)


def test_gradients_reach_every_input():
    q, k, v = (t.requires_grad_() for t in qkv())
    g = (-torch.rand(2, 4, 13, dtype=f64)).requires_grad_()
    s0 = LinearAttentionState(torch.randn(2, 4, 16, 5, dtype=f64, requires_grad=True),
                              (torch.rand(2, 4, 16, dtype=f64) + 1).requires_grad_())
    fm = feature_maps.Favor(6, 16, learnable=True, seed=0).double()
    out, st = ae.linear_attention(q, k, v, causal=True, decay=g, initial_state=s0, feature_map=fm, return_state=True)
    (out.sum() + st.S.sum()).backward()
    for t in (q, k, v, g, s0.S, s0.z, fm.projection):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_step_gradients_match_parallel():
    q, k, v = (t.requires_grad_() for t in qkv(s=4))
    full = ae.linear_attention(q, k, v, causal=True)
    gfull = torch.autograd.grad(full.sum(), (q, k, v))
    out, _ = ae.linear_attention_step(q, k, v, None)
    gstep = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(out, full)
    for a, b in zip(gstep, gfull):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(layout="sbhd"), ValueError, "layout"),
    (dict(decay=torch.zeros(2, 4, 13)), ValueError, "decay needs causal"),
    (dict(key_mask=torch.ones(2, 13)), TypeError, "key_mask must be bool"),
    (dict(key_mask=torch.ones(2, 12, dtype=torch.bool)), ValueError, "key_mask must be"),
    (dict(feature_map="nope"), ValueError, "unknown feature_map"),
    (dict(feature_map=3), TypeError, "feature_map must be"),
    (dict(initial_state=torch.zeros(2, 4, 6, 5)), ValueError, "initial_state"),
    (dict(initial_state=LinearAttentionState(torch.zeros(2, 4, 6, 5))), ValueError, "normalizer"),
    (dict(cu_seqlens=torch.tensor([0, 20])), ValueError, "varlen|cu_seqlens"),
])
def test_bad_input(kwargs, exc, msg):
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(exc, match=msg):
        ae.linear_attention(q, k, v, **kwargs)


def test_bad_shapes():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ae.linear_attention(q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1))
    with pytest.raises(TypeError, match="share a dtype"):
        ae.linear_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="one sequence length"):
        ae.linear_attention(q, k[:, :, :5], v[:, :, :5])


def test_a_varlen_pack_is_one_kind():
    """With cu_seqlens, a 3-D q and 4-D k / v is refused by name (it reported a 5-D k before)."""
    with pytest.raises(ValueError, match=r"so k must be \(total, H_k, D\) too"):
        ae.linear_attention(torch.randn(7, 4, 5), torch.randn(1, 7, 2, 5), torch.randn(1, 7, 2, 3),
                            cu_seqlens=torch.tensor([0, 3, 7]))
