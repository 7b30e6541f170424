"""The CPU kernels' block-sparse walk and top-k path, beyond the float64 pattern tests of
test_functional.py: every dtype under the FA2 rule, every option of the fused op composed with a
layout (the sparse walk must equal the dense kernel given the layout as an element mask), the
tile-index cache, opcheck, gradcheck and bad input."""
from __future__ import annotations

import math

import pytest
import torch

import attention_ext as ae
from attention_ext.softmax import ops
from attention_ext.sparse import layouts as L
from attention_ext.sparse.functional import layout_to_mask
from attention_ext.sparse.reference import topk_attention_ref
from tests.helpers import assert_close_fa2, rand_qkv, reference_in

pytestmark = pytest.mark.skipif(not ops.has_kernel(torch.device("cpu")), reason="CPU kernels not built")


def rand_layout(h, sq, sk, bs, density=0.4, seed=0, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    lay = torch.rand(h, math.ceil(sq / bs), math.ceil(sk / bs), generator=g) < density
    if empty_row:
        lay[:, 1, :] = False  # a query block with nothing to attend
    return lay


def element_mask(lay, bs, sq, sk, causal=False):
    m = layout_to_mask(lay, bs, sq, sk).unsqueeze(0)  # (1, H or 1, Sq, Sk)
    if causal:
        m = m & torch.ones(sq, sk, dtype=torch.bool).tril()
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs,causal", [(32, False), (64, True), (48, False), (16, True)])
def test_block_sparse_dtypes_fa2_rule(dtype, bs, causal):
    """Forward and gradients against float64 with the equivalent element mask: error <= 2x
    PyTorch's own same-dtype error; GQA, per-head layout, odd lengths, an empty query block."""
    b, h, hk, s, d = 2, 4, 2, 157, 40
    q, k, v = rand_qkv(b, h, hk, s, s, d, dtype)
    lay = rand_layout(h, s, s, bs)
    out = ae.block_sparse_attention(q, k, v, lay, block_size=bs, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    mask = element_mask(lay, bs, s, s, causal)
    g = h // hk
    rep = lambda t: t.repeat_interleave(g, dim=1)  # noqa: E731
    r64, _, (q64, k64, v64, _, _) = reference_in(torch.float64, q, rep(k.detach()), rep(v.detach()), bias=mask)
    r64.backward(dout.double())
    rdt, _, (qd, kd, vd, _, _) = reference_in(dtype, q, rep(k.detach()), rep(v.detach()), bias=mask)
    rdt.backward(dout)
    fold = lambda t: t.unflatten(1, (hk, g)).sum(2)  # noqa: E731 (GQA: sum the group's grads)
    assert_close_fa2(out, rdt, r64, dtype, "out")
    assert_close_fa2(q.grad, qd.grad, q64.grad, dtype, "dq")
    assert_close_fa2(k.grad, fold(kd.grad), fold(k64.grad), dtype, "dk")
    assert_close_fa2(v.grad, fold(vd.grad), fold(v64.grad), dtype, "dv")
    assert torch.all(out[:, :, bs:2 * bs] == 0), "an empty query block gives 0"


OPTIONS = {
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64)),
    "window": dict(window=(40, 7)),
    "additive_mask": dict(attn_mask=torch.randn(1, 4, 130, 130, dtype=torch.float64)),
    "bool_mask": dict(attn_mask=torch.rand(2, 1, 130, 130) > 0.2),
    "padding": dict(key_mask=torch.arange(130)[None, :] < torch.tensor([[130], [77]])),
    "dropout": dict(dropout_p=0.3, seed=11),
    "bottom_right_causal": dict(causal=True, bottom_right=True),
}


@pytest.mark.parametrize("opt", sorted(OPTIONS))
def test_sparse_walk_equals_dense_kernel_with_mask(opt):
    """Every option of the fused op composes with a layout: the block-sparse walk gives what the
    dense kernel gives with the layout as an element mask, forward and backward (float64)."""
    s, bs = 130, 32
    q, k, v = rand_qkv(2, 4, 2, s, s, 24, torch.float64)
    lay = rand_layout(4, s, s, bs, density=0.5, seed=3)
    kw = dict(OPTIONS[opt])
    out = ae.block_sparse_attention(q, k, v, lay, block_size=bs, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = element_mask(lay, bs, s, s)
    user = kw.pop("attn_mask", None)
    if user is None:
        full = mask
    elif user.dtype == torch.bool:
        full = mask & user
    else:
        full = user.masked_fill(~mask, float("-inf"))
    ref = ae.attention(q, k, v, attn_mask=full, **kw)
    rgrads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for a, r in zip(grads, rgrads):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k_top", [1, 7, 64])
@pytest.mark.parametrize("opt", ["plain", "causal", "alibi", "softcap", "window", "padding"])
def test_topk_options_match_reference_selection(k_top, opt):
    """Top-k ranks the final logits (after scale, softcap, ALiBi, masks): the kernel equals dense
    attention restricted to the float64 reference's selection (random data: no near ties)."""
    s, d = 150, 16
    q, k, v = rand_qkv(1, 4, 4, s, s, d, torch.float64)
    kw = {"plain": {}, "causal": dict(causal=True), "alibi": dict(alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.05],
                                                                                           dtype=torch.float64)),
          "softcap": dict(softcap=1.5), "window": dict(window=(20, 20)),
          "padding": dict(key_mask=torch.arange(s)[None, :] < 97)}[opt]
    out = ae.topk_attention(q, k, v, k_top, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # the reference selection from float64 logits computed by the reference probabilities' math
    lse = ae.attention(q, k, v, return_lse=True, **kw)[1]
    probs = ae.attention_weights(q, k, lse, **{n: x for n, x in kw.items()})
    logits = torch.where(probs > 0, probs.log() + lse[..., None], torch.full_like(probs, float("-inf")))
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k_top]
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, True) & (probs > 0)
    user = {n: x for n, x in kw.items()}
    kpm = user.pop("key_mask", None)
    ref = ae.attention(q, k, v, attn_mask=keep, key_mask=kpm, **user)
    rgrads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    for a, r in zip(grads, rgrads):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s,k_top", [(300, 64), (97, 5), (40, 100)])
def test_topk_dtypes(dtype, s, k_top):
    """Low-precision top-k against the float64 sort-based reference: error within 2x PyTorch's
    same-dtype error, on the rows whose selection is unambiguous in the dtype."""
    q, k, v = rand_qkv(1, 2, 2, s, s, 32, dtype)
    out = ae.topk_attention(q, k, v, k_top, causal=True)
    r64 = topk_attention_ref(q.double(), k.double(), v.double(), k_top, causal=True)[0]
    rdt = topk_attention_ref(q.float(), k.float(), v.float(), k_top, causal=True)[0].to(dtype)
    # rows where the dtype's rounding reorders the k-th and (k+1)-th logits pick another key;
    # compare the rows where float32 and float64 agree on the selection
    same = (rdt.double() - r64).abs().amax(-1) < 1e-2
    assert same.float().mean() > 0.9
    assert_close_fa2(out[same], rdt[same], r64[same], dtype, "out")


def test_topk_ties_lower_index_wins():
    """Identical keys tie exactly: the lower key index is kept, deterministically, in the forward
    and through the backward's mask."""
    s, d = 64, 8
    # small integers: every product is exact, so the reference's ties are exact too
    q = torch.randint(-3, 4, (1, 1, s, d)).double().requires_grad_()
    base = torch.randint(-3, 4, (1, 1, 8, d)).double()
    k = base.repeat(1, 1, s // 8, 1).requires_grad_()  # every key appears 8 times
    v = torch.randn(1, 1, s, d, dtype=torch.float64, requires_grad=True)
    for k_top in (1, 3, 9, 20):
        out = ae.topk_attention(q, k, v, k_top)
        ref = topk_attention_ref(q, k, v, k_top)[0]
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        dout = torch.randn_like(out)
        g = torch.autograd.grad(out, (q, k, v), dout)
        rg = torch.autograd.grad(ref, (q, k, v), dout)
        for a, r in zip(g, rg):
            torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


def test_topk_few_query_rows_and_k_past_length():
    """A decode-sized call (1 query row) and k_top >= Sk (dense attention)."""
    q, k, v = rand_qkv(2, 2, 1, 1, 300, 32, torch.float64, requires_grad=False)
    torch.testing.assert_close(ae.topk_attention(q, k, v, 17), topk_attention_ref(q, k, v, 17)[0])
    torch.testing.assert_close(ae.topk_attention(q, k, v, 300), ae.attention(q, k, v))
    torch.testing.assert_close(ae.topk_attention(q, k, v, 10**9), ae.attention(q, k, v))


def test_gradcheck_block_sparse_and_topk():
    q, k, v = rand_qkv(1, 2, 1, 37, 45, 8, torch.float64)
    lay = rand_layout(2, 37, 45, 16, density=0.6, seed=5, empty_row=False)
    torch.autograd.gradcheck(lambda q, k, v: ae.block_sparse_attention(q, k, v, lay, block_size=16, causal=True),
                             (q, k, v))
    torch.autograd.gradcheck(lambda q, k, v: ae.topk_attention(q, k, v, 6), (q, k, v))


def _opts(s, **kw):
    o = dict(bias=None, alibi_slopes=None, sinks=None, seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=s, max_seqlen_k=s, scale=0.25, softcap=0.0, window_left=-1, window_right=-1,
             bottom_right=False, dropout_p=0.0, seed=0, offset=0, rng_state=None, dropout_coords=None, block_layout=None,
             block_size=0, topk_thr=None, topk_jcut=None)
    o.update(kw)
    return o


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_sparse_options(dtype):
    s = 45
    q, k, v = rand_qkv(1, 2, 1, s, s, 16, dtype)
    lay = rand_layout(2, s, s, 16, seed=2, empty_row=False)
    o = _opts(s, block_layout=lay, block_size=16)
    args = (q, k, v, *[o[n] for n in ops.OPTION_NAMES])
    torch.library.opcheck(torch.ops.attention_ext.softmax_fwd.default, args)
    qd, kd = q.detach(), k.detach()
    thr_args = (qd, kd, *[_opts(s)[n] for n in ops.OPTION_NAMES], 5)
    torch.library.opcheck(torch.ops.attention_ext.topk_threshold.default, thr_args)
    thr, jcut = torch.ops.attention_ext.topk_threshold(*thr_args)
    o = _opts(s, topk_thr=thr, topk_jcut=jcut)
    torch.library.opcheck(torch.ops.attention_ext.softmax_fwd.default, (q, k, v, *[o[n] for n in ops.OPTION_NAMES]))
    out, lse = torch.ops.attention_ext.softmax_fwd(qd, kd, v.detach(), *[o[n] for n in ops.OPTION_NAMES])
    bargs = (torch.randn_like(out), qd, kd, v.detach(), out, lse, *[o[n] for n in ops.OPTION_NAMES], False, False)
    torch.library.opcheck(torch.ops.attention_ext.softmax_bwd.default, bargs)


def test_compile_block_sparse_and_topk():
    q, k, v = rand_qkv(1, 2, 2, 80, 80, 16, torch.float32, requires_grad=False)
    lay = rand_layout(2, 80, 80, 16, seed=4)
    f = torch.compile(lambda q, k, v: (ae.block_sparse_attention(q, k, v, lay, block_size=16),
                                       ae.topk_attention(q, k, v, 9)), fullgraph=True)
    a, b = f(q, k, v)
    torch.testing.assert_close(a, ae.block_sparse_attention(q, k, v, lay, block_size=16))
    torch.testing.assert_close(b, ae.topk_attention(q, k, v, 9))


def test_index_cache_follows_in_place_edits():
    """The tile index is cached per layout tensor and version: editing the layout in place must
    not serve the old index."""
    q, k, v = rand_qkv(1, 2, 2, 96, 96, 16, torch.float64, requires_grad=False)
    lay = rand_layout(2, 96, 96, 32, density=0.5, seed=6, empty_row=False)
    a = ae.block_sparse_attention(q, k, v, lay, block_size=32)
    lay[:, 0] = ~lay[:, 0]
    b = ae.block_sparse_attention(q, k, v, lay, block_size=32)
    fresh = ae.block_sparse_attention(q, k, v, lay.clone(), block_size=32)
    torch.testing.assert_close(b, fresh)
    assert not torch.equal(a, b)
    with torch.inference_mode():  # inference tensors have no version: never cached, still right
        lay_i = lay.clone()
        torch.testing.assert_close(ae.block_sparse_attention(q, k, v, lay_i, block_size=32), fresh)


BAD = [
    ("block not a multiple of 16", dict(block_size=24), ValueError, "multiple of 16"),
    ("layout shape", dict(block_layout=torch.ones(2, 3, 3, dtype=torch.bool)), ValueError, "block_layout must be"),
    ("layout heads", dict(block_layout=torch.ones(3, 2, 2, dtype=torch.bool)), ValueError, "block_layout must be"),
    ("layout dtype", dict(block_layout=torch.ones(2, 2, 2)), TypeError, "bool"),
]


@pytest.mark.parametrize("name,change,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_block_sparse_input(name, change, exc, msg):
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16, torch.float32, requires_grad=False)
    a = dict(block_layout=torch.ones(2, 2, 2, dtype=torch.bool), block_size=32)
    a.update(change)
    with pytest.raises(exc, match=msg):
        ae.block_sparse_attention(q, k, v, a.pop("block_layout"), **a)


def test_bad_topk_input():
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16, torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="k_top"):
        ae.topk_attention(q, k, v, 0)
    with pytest.raises(ValueError, match="k_top"):
        ae.topk_attention(q, k, v, 2.5)
    with pytest.raises(ValueError, match="do not combine"):
        ae.attention(q, k, v, topk=3, block_layout=torch.ones(1, 1, 1, dtype=torch.bool), block_size=64)
    with pytest.raises(ValueError, match="dropout"):
        ops.topk_threshold(q, k, 3, **_opts(64, dropout_p=0.1))


def test_block_sparse_few_query_rows():
    """A decode-sized call (the forward reads K / V in place for <= 8 query rows) walks the
    layout too, with its gradients."""
    q, k, v = rand_qkv(2, 2, 2, 5, 200, 24, torch.float64)
    lay = torch.rand(2, 1, 7, generator=torch.Generator().manual_seed(9)) < 0.5
    out = ae.block_sparse_attention(q, k, v, lay, block_size=32)
    ref = ae.attention(q, k, v, attn_mask=element_mask(lay, 32, 5, 200))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    dout = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_topk_with_dropout_and_a_bias_that_requires_grad():
    """Found by an audit: top-k with dropout_p > 0 always raised (the threshold pass was handed
    the dropout options, which it refuses), so a top-k layer could not train with dropout; and a
    bias requiring grad reached the threshold op, which has no autograd (torch's warning). Now the
    selection ranks the scores before dropout and the fused op drops among the kept keys: the
    output equals dense attention restricted to the top-k selection with the same keep-mask."""
    import warnings
    s, d, p, k_top = 40, 16, 0.3, 5
    q, k, v = rand_qkv(1, 2, 2, s, s, d, torch.float64)
    bias = torch.randn(1, 2, s, s, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "autograd kernel was not registered" warning
        out = ae.topk_attention(q, k, v, k_top, attn_mask=bias, dropout_p=p, seed=11)
        out.sum().backward()
    logits = (q @ k.transpose(-1, -2)) * d ** -0.5 + bias.detach()
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k_top]
    sel = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, True)
    ref = ae.attention(q, k, v, attn_mask=bias.detach().masked_fill(~sel, float("-inf")), dropout_p=p, seed=11)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert bias.grad is not None and bias.grad.abs().sum() > 0


def test_sparse_mask_of_another_length_names_block_layout():
    """Found by an audit: a SparseMask built for 45 positions used on 40 failed with 'attn_mask of
    shape (1, 1, 45, 45) does not broadcast', an argument the caller never passed."""
    sm = L.from_mask(lambda a, b: b <= a, 16, seq_len=45)
    q = torch.randn(1, 2, 40, 16)
    with pytest.raises(ValueError, match=r"block_layout: the SparseMask was built for .*seq_len=40"):
        ae.block_sparse_attention(q, q, q, sm)
