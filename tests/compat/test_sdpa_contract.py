"""attention_ext.scaled_dot_product_attention against the contract of torch's own
torch.nn.functional.scaled_dot_product_attention: torch's causal mask objects
(torch.nn.attention.bias), masks of every broadcastable shape, size-1 and empty dims, GQA / MQA,
scale, 3-D and 5-D inputs, torch.compile and torch.export, and the error types of bad inputs.
Numbers are judged against torch's math path in float64, by the FA2 rule (tests/helpers.py):
the drop-in's error at most 2x the error of torch's own SDPA in the same dtype."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right, causal_upper_left

import attention_ext as ae
from attention_ext.compat import sdpa as sdpa_mod
from attention_ext.softmax import ops
from tests.helpers import assert_close_fa2

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")

DTYPES = [torch.float32, torch.bfloat16]
VARIANTS = {"upper_left": causal_upper_left, "lower_right": causal_lower_right}


def _bias(variant: str, sq: int, sk: int) -> CausalBias:
    with warnings.catch_warnings():  # torch warns that lower-right with Sq > Sk has rows with no key
        warnings.simplefilter("ignore", UserWarning)
        return VARIANTS[variant](sq, sk)


def _bias_as_mask(variant: str, sq: int, sk: int) -> Tensor:
    """What the object stands for, as a bool (Sq, Sk) mask (True = attend)."""
    return torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq if variant == "lower_right" else 0)


def _math64(q, k, v, **kw) -> Tensor:
    """The oracle: torch's math path in float64 (a float mask promoted with the inputs)."""
    kw = {n: (x.double() if isinstance(x, Tensor) and x.is_floating_point() else x) for n, x in kw.items()}
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), **kw)


def _leaves(ts):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]


def _compare(q, k, v, dtype, *, grad=True, ref_kw=None, **kw):
    """ours(q, k, v, **kw) and torch's same-dtype SDPA against the float64 math path, output and
    (grad=True) the gradients of q, k, v and a float mask. ref_kw: the oracle's arguments where
    they differ (a causal bias object stood for by its mask)."""
    ref_kw = kw if ref_kw is None else ref_kw
    mask = kw.get("attn_mask")
    grad_mask = grad and isinstance(mask, Tensor) and not isinstance(mask, CausalBias) and mask.is_floating_point()
    runs = {}
    for name, fn, kws in (("ours", ae.scaled_dot_product_attention, kw),
                          ("torch", F.scaled_dot_product_attention, kw), ("ref", _math64, ref_kw)):
        leaves = _leaves((q, k, v))
        kws = dict(kws)
        if grad_mask:
            kws["attn_mask"] = kws["attn_mask"].detach().clone().requires_grad_()
        runs[name] = (fn(*leaves, **kws), leaves, kws.get("attn_mask"))
    assert_close_fa2(runs["ours"][0], runs["torch"][0], runs["ref"][0], dtype, "out")
    if not grad:
        return runs
    dout = torch.randn(runs["ref"][0].shape, dtype=torch.float64)
    for out, _, _ in runs.values():
        out.backward(dout.to(out.dtype))
    for i, what in enumerate(("dq", "dk", "dv")):
        assert_close_fa2(runs["ours"][1][i].grad, runs["torch"][1][i].grad, runs["ref"][1][i].grad, dtype, what)
    if grad_mask:
        assert_close_fa2(runs["ours"][2].grad, runs["torch"][2].grad, runs["ref"][2].grad, dtype, "dmask")
    return runs


def _rand(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype).requires_grad_()


# ------------------------------------------------------------------ torch.nn.attention.bias objects
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("sq,sk", [(16, 16), (7, 29), (29, 7), (1, 9)])
def test_causal_bias(variant, sq, sk, dtype):
    """causal_upper_left / causal_lower_right run as causal aligned top-left / bottom-right (the
    object's storage is never read: it is uninitialized), forward and gradients, the same on
    every call."""
    q, k, v = _rand(2, 3, sq, 40, dtype=dtype), _rand(2, 3, sk, 40, dtype=dtype), _rand(2, 3, sk, 40, dtype=dtype)
    mask = _bias(variant, sq, sk)
    runs = _compare(q, k, v, dtype, attn_mask=mask, ref_kw=dict(attn_mask=_bias_as_mask(variant, sq, sk)))
    again = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(again, runs["ours"][0].detach())
    if variant == "lower_right" and sq > sk:  # the first Sq - Sk rows see no key: 0, as torch gives
        assert torch.all(again[:, :, :sq - sk] == 0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_bias_runs_the_kernel_option(variant, monkeypatch):
    """On the fused path the object becomes attention()'s causal / bottom_right option: bit-equal
    to that call, and torch's own SDPA is not called."""
    monkeypatch.setattr(sdpa_mod, "_torch_sdpa", None)  # a call to it would fail
    q, k, v = torch.randn(2, 4, 9, 32), torch.randn(2, 2, 21, 32), torch.randn(2, 2, 21, 32)
    out = ae.scaled_dot_product_attention(q, k, v, attn_mask=_bias(variant, 9, 21), enable_gqa=True)
    ref = ae.attention(q, k, v, causal=True, bottom_right=variant == "lower_right")
    assert torch.equal(out, ref)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shapes", [
    ((3, 7, 16), (3, 12, 16), (3, 12, 16)),          # 3-D inputs: torch's own path
    ((2, 2, 7, 16), (2, 2, 12, 16), (2, 2, 12, 24)),  # Ev != E: torch's own path
    ((2, 2, 7, 16), (2, 2, 12, 16), (2, 2, 12, 16)),  # the fused path
], ids=["3d", "dv", "fused"])
def test_causal_bias_with_sdpa_patched(variant, shapes, monkeypatch):
    """With F.scaled_dot_product_attention replaced by the drop-in (as when running torch's own
    tests on it), a causal bias reaches the drop-in directly, and the shapes it hands to torch's
    own SDPA do not come back to it."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", ae.scaled_dot_product_attention)
    q, k, v = (torch.randn(s, dtype=torch.float64) for s in shapes)
    sq, sk = shapes[0][-2], shapes[1][-2]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_bias(variant, sq, sk))
    monkeypatch.undo()
    ref = _math64(q, k, v, attn_mask=_bias_as_mask(variant, sq, sk))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


def test_causal_bias_errors():
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 9, 8)
    for fn in (F.scaled_dot_product_attention, ae.scaled_dot_product_attention):  # torch's type, ours
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            fn(q, k, k, attn_mask=causal_lower_right(6, 9), is_causal=True)
    with pytest.raises(RuntimeError, match=r"attn_mask is a causal bias for 6 queries and 10 keys, but query has 6 "
                                           r"and key 9: build it with causal_upper_left\(6, 9\)"):
        ae.scaled_dot_product_attention(q, k, k, attn_mask=causal_upper_left(6, 10))
    with pytest.raises(RuntimeError):  # torch's own fails on the lengths too (a broadcast of the mask)
        F.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(5, 9))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_bias_compiled(variant):
    """Under torch.compile(fullgraph=True) the object, an input of the compiled function, is read
    as its variant and lengths (no view of its storage), forward and backward."""
    q, k, v = _rand(2, 4, 7, 32), _rand(2, 4, 12, 32), _rand(2, 4, 12, 32)
    mask = _bias(variant, 7, 12)
    f = torch.compile(lambda q, k, v, m: ae.scaled_dot_product_attention(q, k, v, attn_mask=m), fullgraph=True,
                      backend="aot_eager")
    leaves = _leaves((q, k, v))
    out = f(*leaves, mask)
    out.sum().backward()
    ref_leaves = _leaves((q, k, v))
    ref = ae.scaled_dot_product_attention(*ref_leaves, attn_mask=mask)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, _math64(q, k, v, attn_mask=_bias_as_mask(variant, 7, 12)).float(), atol=1e-5,
                               rtol=1e-4)


# ------------------------------------------------------------------ masks, broadcasting, empty shapes
MASK_SHAPES = [(7, 29), (1, 29), (4, 7, 29), (1, 7, 29), (2, 4, 7, 29), (2, 1, 7, 29), (1, 4, 1, 29), (2, 1, 1, 29),
               (1, 1, 1, 1), (7, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mask_broadcast_shapes(shape, kind, dtype):
    """A bool (True = attend) or float (added) mask of every shape that broadcasts to
    (B, H, Sq, Sk) = (2, 4, 7, 29), with GQA; the gradient of a float mask is reduced over its
    broadcast dims."""
    q, k, v = _rand(2, 4, 7, 40, dtype=dtype), _rand(2, 2, 29, 40, dtype=dtype), _rand(2, 2, 29, 40, dtype=dtype)
    if kind == "bool":
        mask = torch.rand(shape) > 0.4
        mask[..., 0] = True  # no row without a key: the fully masked row has its own test
    else:
        mask = torch.randn(shape, dtype=dtype)
    _compare(q, k, v, dtype, grad=dtype == torch.float32, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero(kind):
    """A query row whose mask allows no key gives 0, as torch's SDPA (its math path included)."""
    q, k, v = torch.randn(2, 3, 6, 16), torch.randn(2, 3, 10, 16), torch.randn(2, 3, 10, 16)
    mask = torch.rand(6, 10) > 0.3
    mask[:, 0], mask[2] = True, False
    if kind == "float":
        mask = torch.zeros(6, 10).masked_fill(~mask, float("-inf"))
    ours = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = _math64(q, k, v, attn_mask=mask)
    assert torch.all(ours[:, :, 2] == 0) and torch.all(ref[:, :, 2] == 0)
    assert torch.all(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:, :, 2] == 0)
    torch.testing.assert_close(ours, ref.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["plain", "causal", "mask"])
def test_one_kv_head_broadcasts(case, dtype, monkeypatch):
    """One key / value head without enable_gqa broadcasts over the query heads, as in torch: it
    runs on the kernel as multi-query attention (torch's own SDPA is not called, k and v are not
    repeated), dk and dv summed over the query heads."""
    q, k, v = _rand(2, 8, 16, 32, dtype=dtype), _rand(2, 1, 32, 32, dtype=dtype), _rand(2, 1, 32, 32, dtype=dtype)
    kw = {"causal": dict(is_causal=True), "mask": dict(attn_mask=torch.rand(16, 32) > 0.5)}.get(case, {})
    if case == "mask":
        kw["attn_mask"][:, 0] = True
    runs = _compare(q, k, v, dtype, **kw)
    monkeypatch.setattr(sdpa_mod, "_torch_sdpa", None)  # a call to it would fail
    assert torch.equal(ae.scaled_dot_product_attention(q, k, v, **kw), runs["ours"][0].detach())


@pytest.mark.parametrize("shapes", [
    ((2, 1, 16, 32), (2, 8, 32, 32), (2, 8, 32, 32)),  # one query head over 8 kv heads
    ((2, 8, 16, 32), (2, 1, 32, 32), (2, 8, 32, 32)),  # k with one head, v with 8
    ((2, 8, 16, 32), (1, 8, 32, 32), (1, 8, 32, 32)),  # one batch of keys for two of queries
    ((2, 8, 16, 32), (1, 1, 32, 32), (1, 1, 32, 32)),
    ((8, 16, 32), (2, 1, 32, 32), (2, 1, 32, 32)),     # 3-D queries over 4-D keys
    ((2, 8, 16, 32), (1, 32, 32), (1, 32, 32)),
    ((2, 3, 4, 9, 16), (2, 3, 4, 11, 16), (2, 3, 4, 11, 16)),  # 5-D
    ((12, 9, 16), (12, 11, 16), (12, 11, 16)),         # 3-D
    ((9, 16), (11, 16), (11, 24)),                     # 2-D, Ev != E
    ((2, 4, 9, 300), (2, 4, 11, 300), (2, 4, 11, 300)),  # head dim past the kernel's 256
], ids=["q1", "k1v8", "kb1", "kb1h1", "q3d", "k3d", "5d", "3d", "2d", "d300"])
def test_other_broadcasts_as_torch(shapes):
    """The shapes torch's SDPA broadcasts or takes and the kernel does not run on: torch's own."""
    q, k, v = (_rand(*s) for s in shapes)
    _compare(q, k, v, torch.float32)


@pytest.mark.parametrize("shapes,kw", [
    (((2, 0, 10, 64),) * 3, {}),                                        # zero heads
    (((2, 0, 10, 64), (2, 0, 12, 64), (2, 0, 12, 64)), dict(enable_gqa=True, is_causal=True)),
    (((0, 4, 10, 64),) * 3, {}),                                        # zero batch
    (((2, 4, 0, 64), (2, 4, 5, 64), (2, 4, 5, 64)), dict(is_causal=True)),  # no queries
    (((2, 4, 3, 64), (2, 4, 0, 64), (2, 4, 0, 64)), {}),                # no keys: 0, as torch gives
    (((2, 4, 3, 0), (2, 4, 5, 0), (2, 4, 5, 8)), {}),                   # head dim 0
    (((0, 10, 64),) * 3, {}),                                           # 3-D, zero batch
], ids=["heads", "heads_gqa", "batch", "sq", "sk", "d", "3d"])
def test_empty_shapes(shapes, kw):
    """Zero-size dims give torch's output shape and values, forward and backward."""
    q, k, v = (_rand(*s) for s in shapes)
    ours = ae.scaled_dot_product_attention(q, k, v, **kw)
    theirs = F.scaled_dot_product_attention(q, k, v, **kw)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs)
    ours.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [dict(scale=0.3), dict(scale=2.0, is_causal=True), dict(scale=0.0),
                                dict(dropout_p=0.0, enable_gqa=True), dict(is_causal=True, enable_gqa=True)],
                         ids=["scale", "scale_causal", "scale0", "dropout0", "causal_gqa"])
def test_options_as_torch(kw, dtype):
    q, k, v = _rand(2, 6, 13, 80, dtype=dtype), _rand(2, 3, 13, 80, dtype=dtype), _rand(2, 3, 13, 80, dtype=dtype)
    if not kw.get("enable_gqa"):
        k, v = _rand(2, 6, 13, 80, dtype=dtype), _rand(2, 6, 13, 80, dtype=dtype)
    _compare(q, k, v, dtype, grad=dtype == torch.float32, **kw)


def test_dropout_keeps_the_expectation():
    """dropout_p > 0 draws another mask than torch's (no two implementations share one), so the
    contract is the distribution: each probability kept with 1 - p and scaled by 1 / (1 - p), the
    output unbiased. With v = 1 on one key and 0 elsewhere the output is that key's probability
    after dropout."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 64, 16), torch.randn(1, 1, 48, 16)
    v = torch.zeros(1, 1, 48, 16)
    v[..., 5, :] = 1.0
    p = ae.scaled_dot_product_attention(q, k, v)[..., 0]  # the probability of key 5, no dropout
    draws = torch.stack([ae.scaled_dot_product_attention(q, k, v, dropout_p=0.3)[..., 0] for _ in range(400)])
    kept = draws != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.02
    torch.testing.assert_close(draws[kept], (p / 0.7).expand_as(draws)[kept], atol=1e-6, rtol=1e-5)


def test_dropout_one_drops_everything_as_torch():
    """dropout_p = 1.0 (which attention() refuses) is torch's zero output with zero gradients, on
    the fused path, with a mask and with GQA; torch's own SDPA agrees."""
    torch.manual_seed(1)
    for hk, mask in ((4, None), (2, torch.rand(7, 9) > 0.3)):
        q = torch.randn(2, 4, 7, 16, requires_grad=True)
        k, v = (torch.randn(2, hk, 9, 16, requires_grad=True) for _ in range(2))
        outs = [f(q, k, v, attn_mask=mask, dropout_p=1.0, enable_gqa=True)
                for f in (F.scaled_dot_product_attention, ae.scaled_dot_product_attention)]
        for out in outs:
            assert out.shape == (2, 4, 7, 16) and torch.equal(out, torch.zeros_like(out))
        grads = torch.autograd.grad(outs[1].sum(), (q, k, v))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


# ------------------------------------------------------------------ torch.compile and torch.export
def test_compile_dynamic_batch_with_mask():
    """torch.compile(fullgraph=True, dynamic=True) with a per-batch mask: one graph for two batch
    sizes, the eager result."""
    f = torch.compile(lambda q, k, v, m: ae.scaled_dot_product_attention(q, k, v, attn_mask=m), fullgraph=True,
                      dynamic=True, backend="aot_eager")
    for b in (3, 5):
        q, k, v = torch.randn(b, 2, 9, 16), torch.randn(b, 2, 11, 16), torch.randn(b, 2, 11, 16)
        m = torch.rand(b, 1, 9, 11) > 0.3
        m[..., 0] = True
        torch.testing.assert_close(f(q, k, v, m), ae.scaled_dot_product_attention(q, k, v, attn_mask=m), atol=0,
                                   rtol=0)


class _Attend(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v, m):
        return self.fn(q, k, v, attn_mask=m)


class _AttendKept(torch.nn.Module):
    """A data-dependent batch: the rows of x that `keep` selects (torch.nonzero), with their
    masks, as a model that drops finished sequences from a batch does."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, keep, m):
        idx = keep.nonzero().squeeze(-1)
        q = x[idx]  # (u0, H, S, D), u0 unknown until run time
        return self.fn(q, q, q, attn_mask=m[idx])


def _ref_kept(x, keep, m):
    idx = keep.nonzero().squeeze(-1)
    return _math64(x[idx], x[idx], x[idx], attn_mask=m[idx])


@pytest.mark.parametrize("fn", [F.scaled_dot_product_attention, ae.scaled_dot_product_attention],
                         ids=["torch", "ours"])
def test_export_data_dependent_batch(fn):
    """torch.export of a model whose batch is data-dependent (an unbacked size) and whose mask
    follows it: the mask's broadcast check is a runtime assert, not a guard the export cannot
    take. The exported program runs on other selections. torch's own, exported the same way, is
    the control."""
    x, m = torch.randn(4, 2, 8, 16), torch.rand(4, 1, 8, 8) > 0.3
    m[..., 0] = True
    ep = torch.export.export(_AttendKept(fn), (x, torch.tensor([1, 0, 1, 1]), m))
    for keep in ([0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]):
        keep = torch.tensor(keep)
        torch.testing.assert_close(ep.module()(x, keep, m), _ref_kept(x, keep, m).float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mask_shape", [(3, 1, 9, 11), (1, 1, 9, 11), (9, 11)], ids=["per_batch", "b1", "2d"])
def test_export_dynamic_batch(mask_shape):
    """torch.export with a dynamic (Dim.AUTO) batch and a mask, then the exported program on
    another batch size."""
    auto = torch.export.Dim.AUTO
    q, k, v = torch.randn(3, 2, 9, 16), torch.randn(3, 2, 11, 16), torch.randn(3, 2, 11, 16)
    m = torch.rand(mask_shape) > 0.3
    m[..., 0] = True
    dyn_m = {0: auto} if mask_shape[0] == 3 else None
    ep = torch.export.export(_Attend(ae.scaled_dot_product_attention), (q, k, v, m),
                             dynamic_shapes=({0: auto}, {0: auto}, {0: auto}, dyn_m))
    b = 5
    q, k, v = torch.randn(b, 2, 9, 16), torch.randn(b, 2, 11, 16), torch.randn(b, 2, 11, 16)
    if mask_shape[0] == 3:
        m = torch.rand(b, 1, 9, 11) > 0.3
        m[..., 0] = True
    torch.testing.assert_close(ep.module()(q, k, v, m), _math64(q, k, v, attn_mask=m).float(), atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------ errors: torch's types
def _err_cases():
    r = torch.randn
    q, k, v = r(2, 4, 8, 16), r(2, 4, 9, 16), r(2, 4, 9, 16)
    return {
        "mask_and_causal": ((q, k, v), dict(attn_mask=torch.ones(8, 9, dtype=torch.bool), is_causal=True)),
        "gqa_without_flag": ((q, r(2, 2, 9, 16), r(2, 2, 9, 16)), {}),
        "gqa_not_dividing": ((q, r(2, 3, 9, 16), r(2, 3, 9, 16)), dict(enable_gqa=True)),
        "head_dim": ((q, r(2, 4, 9, 8), v), {}),
        "batch": ((q, r(3, 4, 9, 16), r(3, 4, 9, 16)), {}),
        "mixed_dtype": ((q, k.double(), v), {}),
        "int_inputs": ((q.long(), k.long(), v.long()), {}),
        "device": ((q, k.to("meta"), v), {}),
        "one_dim": ((r(16), r(16), r(16)), {}),
        "mask_dtype": ((q, k, v), dict(attn_mask=torch.ones(8, 9, dtype=torch.long))),
        "mask_shape": ((q, k, v), dict(attn_mask=torch.ones(3, 9, dtype=torch.bool))),
        "mask_5d": ((q, k, v), dict(attn_mask=torch.ones(1, 2, 4, 8, 9, dtype=torch.bool))),
        "dropout_above_1": ((q, k, v), dict(dropout_p=1.5)),
    }


@pytest.mark.parametrize("case", list(_err_cases()))
def test_errors_are_torchs_type(case):
    """A bad input raises RuntimeError, as torch's SDPA does for it (ours names the argument)."""
    args, kw = _err_cases()[case]
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(*args, **kw)
    with pytest.raises(RuntimeError):
        ae.scaled_dot_product_attention(*args, **kw)


def test_error_messages_name_the_fix():
    q = torch.randn(2, 4, 8, 16)
    with pytest.raises(TypeError, match=r"key must be a torch.Tensor, got numpy.ndarray: convert it with "
                                        r"torch.from_numpy\(key\)"):
        ae.scaled_dot_product_attention(q, q.numpy(), q)
    with pytest.raises(RuntimeError, match=r"pass enable_gqa=True"):
        ae.scaled_dot_product_attention(q, q[:, :2], q[:, :2])
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 8\) does not broadcast"):  # also a ValueError
        ae.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"attn_mask must be bool or floating point"):  # also a TypeError
        ae.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"key and value must have one length \(dim -2\)"):  # torch's own reads
        ae.scaled_dot_product_attention(q, q, q[:, :, :5])                                   # past v's end
    with pytest.raises(RuntimeError, match=r"the leading dims of query \(2, 4, 8, 16\), key \(3, 4, 8, 16\) and "
                                           r"value \(3, 4, 8, 16\) do not broadcast"):
        ae.scaled_dot_product_attention(q, torch.randn(3, 4, 8, 16), torch.randn(3, 4, 8, 16))
