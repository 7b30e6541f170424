"""The linear family's definitions agree: the quadratic reference against a naive recurrent loop
(float64), the chunked peer against the reference, and the feature maps (FAVOR+ unbiasedness,
RFA's kernel, the registry). Pure PyTorch: runs with or without the compiled extension."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attention_ext.linear import feature_maps, reference
from attention_ext.softmax import reference as softmax_reference

f64 = torch.float64


def recurrent(q, k, v, *, feature_map=1, causal=True, normalize=True, eps=1e-6, scale=1.0, decay=None,
              initial_state=None, key_mask=None):
    """The recurrence, one position and one (batch, head) at a time: S_t = exp(decay_t) S_{t-1} +
    phi(k_t) v'_t^T, O'_t = scale phi(q_t)^T S_t (causal); non-causal reads the final S."""
    b, h, s, m = q.shape
    g = h // k.shape[1]
    dv = v.shape[-1]
    width = dv + 1 if normalize else dv
    out = torch.zeros(b, h, s, dv, dtype=q.dtype)
    den = torch.ones(b, h, s, dtype=q.dtype)
    final = torch.zeros(b, h, m, width, dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            st = initial_state[bi, hi].clone() if initial_state is not None else torch.zeros(m, width, dtype=q.dtype)
            rows = []
            for t in range(s):
                if decay is not None:
                    st = st * math.exp(decay[bi, hi, t])
                fk = reference.phi(k[bi, hi // g, t], feature_map)
                if key_mask is not None and not key_mask[bi, t]:
                    fk = torch.zeros_like(fk)
                vt = v[bi, hi // g, t]
                if normalize:
                    vt = torch.cat([vt, vt.new_ones(1)])
                st = st + torch.outer(fk, vt)
                rows.append(st.clone())
            final[bi, hi] = st
            for t in range(s):
                o = scale * reference.phi(q[bi, hi, t], feature_map) @ (rows[t] if causal else st)
                if normalize:
                    den[bi, hi, t] = o[-1] + eps
                    out[bi, hi, t] = o[:-1] / den[bi, hi, t]
                else:
                    out[bi, hi, t] = o
    return out, den, final


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("code", [0, 1, 2])
@pytest.mark.parametrize("normalize", [True, False])
def test_reference_equals_recurrence(causal, code, normalize):
    b, h, hk, s, m, dv = 2, 4, 2, 9, 5, 3
    q, k = torch.randn(b, h, s, m, dtype=f64), torch.randn(b, hk, s, m, dtype=f64)
    v = torch.randn(b, hk, s, dv, dtype=f64)
    kw = dict(feature_map=code, causal=causal, normalize=normalize, scale=0.7)
    kw["initial_state"] = torch.rand(b, h, m, dv + normalize, dtype=f64)
    kw["key_mask"] = torch.rand(b, s) > 0.3
    if causal:
        kw["decay"] = -torch.rand(b, h, s, dtype=f64)
    ref = reference.linear_attention(q, k, v, **kw)
    rec = recurrent(q, k, v, **kw)
    for name, x, y in zip(("out", "den", "final"), ref, rec):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=name)


def test_reference_varlen_is_per_sequence():
    h, m, dv = 2, 4, 3
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q, k = torch.randn(1, h, 12, m, dtype=f64), torch.randn(1, h, 12, m, dtype=f64)
    v = torch.randn(1, h, 12, dv, dtype=f64)
    s0 = torch.rand(3, h, m, dv + 1, dtype=f64)
    decay = -torch.rand(1, h, 12, dtype=f64)
    out, den, final = reference.linear_attention(q, k, v, causal=True, decay=decay, initial_state=s0, cu_seqlens=cu)
    for n, (a, e) in enumerate([(0, 5), (5, 5), (5, 12)]):
        o, d, f = reference.linear_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], causal=True,
                                             decay=decay[:, :, a:e], initial_state=s0[n: n + 1])
        torch.testing.assert_close(out[:, :, a:e], o)
        torch.testing.assert_close(final[n: n + 1], f)
    torch.testing.assert_close(final[1], s0[1])  # an empty sequence keeps its initial state


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s", [1, 63, 64, 65, 130])
def test_chunked_peer_equals_reference(causal, s):
    q, k = torch.randn(1, 4, s, 8, dtype=f64), torch.randn(1, 2, s, 8, dtype=f64)
    v = torch.randn(1, 2, s, 6, dtype=f64)
    for normalize in (True, False):
        ref = reference.linear_attention(q, k, v, causal=causal, normalize=normalize, scale=0.5)[0]
        got = reference.chunked(q, k, v, causal=causal, normalize=normalize, scale=0.5)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_reference_gradients_finite_with_decay():
    """The masked exp(G_i - G_j) above the diagonal must give no NaN gradient."""
    q, k, v = (torch.randn(1, 2, 6, 3, dtype=f64, requires_grad=True) for _ in range(3))
    decay = (-3 * torch.rand(1, 2, 6, dtype=f64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: reference.linear_attention(*a[:3], causal=True, decay=a[3])[0],
                                    (q, k, v, decay))


# ---------------------------------------------------------------------------------- feature maps
def test_favor_kernel_unbiased():
    """E over redraws of phi(q) . phi(k) = exp(q . k / sqrt(d)) (the unstabilized map)."""
    d, reps = 8, 300
    q, k = 0.4 * torch.randn(5, d, dtype=f64), 0.4 * torch.randn(6, d, dtype=f64)
    fm = feature_maps.Favor(d, 64, stabilize=False, seed=1)
    acc = torch.zeros(5, 6, dtype=f64)
    for r in range(reps):
        fm.redraw()
        acc += fm(q, is_query=True) @ fm(k).T
    exact = torch.exp(q @ k.T / math.sqrt(d))
    err = (acc / reps - exact).abs() / exact
    assert err.mean() < 0.02 and err.max() < 0.15


def test_favor_stabilization_cancels():
    """Stabilized FAVOR+ (query row maxima, the keys' common offset carried in the state) gives
    the plain formula's normalized attention, and stays finite where the plain one underflows,
    with the definition's answer there: every feature ~exp(-1000), so eps dominates and out ~ 0
    (linear.functional.normalize_offset)."""
    import attention_ext as ae

    d = 16
    fm = feature_maps.Favor(d, 64, seed=3)
    plain = feature_maps.Favor(d, 64, stabilize=False, seed=3)
    q, k = torch.randn(1, 2, 10, d, dtype=f64), torch.randn(1, 2, 10, d, dtype=f64)
    v = torch.randn(1, 2, 10, 4, dtype=f64)
    for causal in (True, False):
        a, sa = ae.linear_attention(q, k, v, feature_map=fm, causal=causal, eps=0.0, return_state=True)
        b, sb = ae.linear_attention(q, k, v, feature_map=plain, causal=causal, eps=0.0, return_state=True)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(sa.S * sa.log_scale.exp()[..., None, None], sb.S)
    big = 30 * torch.randn(1, 2, 10, d)
    out = ae.linear_attention(big, big, v.float(), feature_map=fm, causal=True)
    assert torch.isfinite(out).all() and out.abs().amax() < 1e-20
    assert (plain(big) == 0).all()  # the plain formula underflows: every feature is 0 there
    # with eps = 0 nothing dominates: the stabilized ratio, softmax-like, finite and nonzero
    out0 = ae.linear_attention(big, big, v.float(), feature_map=fm, causal=True, eps=0.0)
    assert torch.isfinite(out0).all() and out0.abs().amax() > 0


def _favor_error(m, q, k, v, seed):
    fm = feature_maps.Favor(q.shape[-1], m, seed=seed)
    out = reference.linear_attention(fm(q, is_query=True), fm(k), v, feature_map=0)[0]
    exact = softmax_reference.attention(q, k, v)[0]
    return out, (out - exact).abs().mean().item()


def test_favor_approaches_softmax():
    """The mean over redraws approaches softmax attention, and the error falls as nb_features
    grows."""
    d = 16
    q, k, v = (0.7 * torch.randn(1, 2, 24, d, dtype=f64) for _ in range(3))
    exact = softmax_reference.attention(q, k, v)[0]
    err = {m: sum(_favor_error(m, q, k, v, s)[1] for s in range(6)) / 6 for m in (8, 64, 512)}
    assert err[512] < 0.75 * err[64] and err[64] < 0.75 * err[8]
    outs = [_favor_error(32, q, k, v, 100 + s)[0] for s in range(60)]
    mean_err = (torch.stack(outs).mean(0) - exact).abs().mean().item()
    single = sum((o - exact).abs().mean().item() for o in outs) / len(outs)
    assert mean_err < 0.3 * single


def test_rfa_kernel():
    """E over redraws of phi(q) . phi(k) = exp(-|q - k|^2 / (2 sigma^2)) for unit q, k."""
    d, reps = 8, 300
    q, k = F.normalize(torch.randn(4, d, dtype=f64), dim=-1), F.normalize(torch.randn(5, d, dtype=f64), dim=-1)
    fm = feature_maps.RFA(d, 64, sigma=1.5, seed=0)
    assert fm(q).shape == (4, 128)
    acc = torch.zeros(4, 5, dtype=f64)
    for _ in range(reps):
        fm.redraw()
        acc += fm(q) @ fm(k).T
    exact = torch.exp(-torch.cdist(q, k) ** 2 / (2 * 1.5 ** 2))
    assert (acc / reps - exact).abs().max() < 0.02


def test_random_maps_seed_redraw_and_interval():
    a, b = feature_maps.Favor(8, seed=5), feature_maps.Favor(8, seed=5)
    assert a.nb_features == math.ceil(8 * math.log(8))
    torch.testing.assert_close(a.projection, b.projection)
    a.redraw()
    assert not torch.equal(a.projection, b.projection)
    a.redraw(seed=9)
    b.redraw(seed=9)
    torch.testing.assert_close(a.projection, b.projection)
    w = a.projection[:8] / a.projection[:8].norm(dim=1, keepdim=True)  # one orthogonal block
    torch.testing.assert_close(w @ w.T, torch.eye(8), atol=1e-5, rtol=0)
    fm = feature_maps.RFA(8, redraw_interval=2, seed=0)
    seen = []
    for _ in range(5):
        fm.prepare()
        seen.append(fm.projection.clone())
    assert torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2]) and torch.equal(seen[2], seen[3])
    fm.eval()
    fm.prepare()
    assert torch.equal(fm.projection, seen[4])  # no redraw in eval mode


def test_registry():
    assert {"elu", "relu", "identity", "favor", "rfa"} <= set(feature_maps.FEATURE_MAPS)
    assert [feature_maps.get_feature_map(n).fused_code for n in ("identity", "elu", "relu")] == [0, 1, 2]
    assert feature_maps.resolve("favor", 16) is feature_maps.resolve("favor", 16)  # one projection per name
    with pytest.raises(ValueError, match="unknown feature_map"):
        feature_maps.get_feature_map("nope")
    with pytest.raises(TypeError, match="feature_map must be"):
        feature_maps.resolve(3, 16)
