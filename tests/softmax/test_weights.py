"""attention_weights: the probabilities of an attention() call with the same options, never rows
that do not sum to 1. A given LSE is checked against the options (ValueError naming lse); without
one it is computed from the scores. The probabilities are checked against the call itself: P @ v
is attention()'s output, and each row sums to 1 (minus the sinks' share)."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae

F64 = torch.float64


def _qkv(b, h, hk, sq, sk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, s, d, generator=g, dtype=F64).to(dtype) for n, s in ((h, sq), (hk, sk), (hk, sk)))


def test_lse_of_other_options_raises():
    """The trap an example once set: the LSE of a window=(256, 0) call read with causal=True gave
    rows summing to up to 4.7. It raises, naming lse and the options to match; read with its own
    options it gives rows that sum to 1."""
    q, k, v = _qkv(1, 2, 2, 600, 600, 32, torch.float32)
    _, lse = ae.attention(q, k, v, window=(256, 0), return_lse=True)
    with pytest.raises(ValueError, match=r"lse does not belong to these options: .* sums to .*causal, bottom_right, "
                                         r"window.*or lse=None"):
        ae.attention_weights(q, k, lse, causal=True)
    p = ae.attention_weights(q, k, lse, window=(256, 0))
    torch.testing.assert_close(p.sum(-1), torch.ones(1, 2, 600), atol=1e-5, rtol=0)
    _, lse_causal = ae.attention(q, k, v, causal=True, return_lse=True)
    with pytest.raises(ValueError, match="lse does not belong"):  # the other way round: rows sum below 1
        ae.attention_weights(q, k, lse_causal, window=(256, 0))


_OPTS = {
    "plain": {},
    "causal": dict(causal=True),
    "causal_bottom_right": dict(causal=True, bottom_right=True),
    "window": dict(window=(7, 3)),
    "key_mask": dict(key_mask=torch.arange(53)[None, :] < torch.tensor([[53], [20]])),
    "seqlens_k": dict(seqlens_k=torch.tensor([53, 11])),
    "bool_mask": dict(attn_mask=torch.rand(37, 53, generator=torch.Generator().manual_seed(3)) > 0.3),
    "float_mask": dict(attn_mask=torch.randn(2, 1, 37, 53, generator=torch.Generator().manual_seed(4))),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "softcap": dict(softcap=2.0, scale=0.7),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    "block_layout": dict(block_layout=torch.rand(1, 3, 4, generator=torch.Generator().manual_seed(5)) > 0.4,
                         block_size=16),
    "topk": dict(topk=5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", list(_OPTS))
def test_weights_are_the_calls_probabilities(name, dtype):
    """Odd sizes, GQA: with the call's LSE and without one, the weights are the same, P @ v is
    the call's output, and every row with a visible key sums to 1 (with sinks: 1 minus the sink's
    share); a row with none is 0."""
    opts = {n: (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and dtype == F64 else t)
            for n, t in _OPTS[name].items()}
    q, k, v = _qkv(2, 4, 2, 37, 53, 24, dtype)
    out, lse = ae.attention(q, k, v, return_lse=True, **opts)
    p = ae.attention_weights(q, k, lse, **opts)
    p_own = ae.attention_weights(q, k, **opts)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == F64 else dict(atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(p, p_own, **tol)
    acc = p.dtype
    v_rep = v.to(acc).repeat_interleave(2, dim=1)  # (B, H, Sk, D)
    out_tol = dict(atol=1e-10, rtol=1e-9) if dtype == F64 else dict(atol=2e-2, rtol=2e-2) \
        if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close((p @ v_rep).to(dtype), out, **out_tol)
    seen = torch.isfinite(lse)
    total = p.sum(-1)
    if "sinks" in opts:
        total = total + torch.exp(opts["sinks"].to(acc).view(1, -1, 1) - lse)
    torch.testing.assert_close(total[seen], torch.ones_like(total[seen]), atol=1e-5 if dtype != F64 else 1e-12, rtol=0)
    assert bool((p[~seen] == 0).all())


def test_rows_with_no_key_are_exempt_and_zero():
    """A row with nothing to attend has lse -inf: given or computed, its weights are 0, no error."""
    q, k, v = _qkv(2, 2, 2, 5, 6, 8, torch.float32)
    km = torch.ones(2, 6, dtype=torch.bool)
    km[1] = False
    _, lse = ae.attention(q, k, v, key_mask=km, return_lse=True)
    assert bool(torch.isinf(lse[1]).all())
    for given in (lse, None):
        p = ae.attention_weights(q, k, given, key_mask=km)
        assert bool((p[1] == 0).all())
        torch.testing.assert_close(p[0].sum(-1), torch.ones(2, 5))


@pytest.mark.parametrize("wrong", ["scale", "sinks", "key_mask_inverted", "finite_for_an_empty_row", "nan"])
def test_every_mismatch_names_lse(wrong):
    q, k, v = _qkv(2, 2, 2, 5, 6, 8, torch.float32)
    km = torch.ones(2, 6, dtype=torch.bool)
    km[1, 4:] = False
    sinks = torch.tensor([1.0, 2.0])
    kw = {}
    if wrong == "scale":
        lse = ae.attention(q, k, v, scale=1.0, return_lse=True)[1]
    elif wrong == "sinks":  # the LSE holds the sinks: read without them the rows sum below 1
        lse = ae.attention(q, k, v, sinks=sinks, return_lse=True)[1]
    elif wrong == "key_mask_inverted":
        lse = ae.attention(q, k, v, key_mask=km, return_lse=True)[1]
        kw = dict(key_mask=~km)
    elif wrong == "finite_for_an_empty_row":  # -inf says "no key": a finite one there does not belong
        lse = ae.attention(q, k, v, return_lse=True)[1]
        kw = dict(key_mask=torch.zeros(2, 6, dtype=torch.bool))
    else:
        lse = ae.attention(q, k, v, return_lse=True)[1]
        lse[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="lse does not belong to these options"):
        ae.attention_weights(q, k, lse, **kw)


def test_nan_inputs_stay_the_inputs_to_report():
    """A NaN in q makes its row's scores and LSE NaN: the weights show it (NaN row) and the
    check does not blame lse for it."""
    q, k, v = _qkv(1, 2, 2, 4, 6, 8, torch.float32)
    q[0, 1, 2, 3] = float("nan")
    _, lse = ae.attention(q, k, v, return_lse=True)
    p = ae.attention_weights(q, k, lse)
    assert bool(torch.isnan(p[0, 1, 2]).all())
    torch.testing.assert_close(p[0, 0].sum(-1), torch.ones(4))


def test_lse_shape_and_layout_errors():
    q, k, v = _qkv(2, 4, 2, 8, 9, 16, torch.float32)
    lse = ae.attention(q, k, v, return_lse=True)[1]
    with pytest.raises(ValueError, match=r"lse must be \(B, H, Sq\) = \(2, 4, 8\)"):
        ae.attention_weights(q, k, lse[:, :2])
    # (B, S, H, D) tensors read as (B, H, S, D): the shapes prove the mix-up, the error names layout
    with pytest.raises(ValueError, match=r"fit layout='bshd' \(B, S, H, D\): pass layout='bshd'"):
        ae.attention_weights(q.transpose(1, 2), k.transpose(1, 2), lse)
    torch.testing.assert_close(ae.attention_weights(q.transpose(1, 2), k.transpose(1, 2), lse, layout="bshd"),
                               ae.attention_weights(q, k, lse))
