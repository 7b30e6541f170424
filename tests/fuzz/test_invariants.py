"""Bit-level invariants of every family's main ops (README, Testing):

- layout: a strided input and its .contiguous() copy give bit-identical outputs, LSEs and
  gradients, and so does a non-contiguous grad_output; gradients come back in the layout the
  kernels allocate (csrc/torch/softmax_binding.cpp, empty_like_layout): (B, S, H, D) storage when
  the input keeps its heads inside its rows (stride(1) < stride(2)), else contiguous;
- NaN poisoning: NaN in every position an op must not read (past cu_seqlens, past seqlens_k /
  cache_seqlens, padded keys, pages no sequence uses, keys in blocks outside a sparse layout)
  leaves the output, LSE and gradients bit-identical to the clean run; NaN in a position that is
  read reaches the rows that read it;
- determinism: repeated calls, 1 vs 2 vs 3 (oversubscribed) intra-op threads, and 4 Python threads
  calling every family at once give bit-identical results."""
from __future__ import annotations

import threading

import pytest
import torch

import attention_ext as ae
from attention_ext import nn as aenn
from attention_ext.linear import reference as linear_reference
from attention_ext.softmax import ops

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")
NAN = float("nan")


def same(a, b, what):
    """Bit-identical, NaN at the same places included (torch.equal is False on any NaN)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    ok = torch.equal(a, b) or (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
    assert ok, f"{what}: not bit-identical (NaN {int(a.isnan().sum())} vs {int(b.isnan().sum())}, " \
               f"max diff {(a.double() - b.double()).nan_to_num(0.0).abs().max().item():.3g})"


def grads(outs, inputs, douts):
    outs = [o for o in outs if o is not None]
    return torch.autograd.grad(outs, inputs, douts[: len(outs)], allow_unused=True)


# ------------------------------------------------------------------ one call per family
def run_softmax(q, k, v, dout=None, **kw):
    out, lse = ae.attention(q, k, v, return_lse=True, **kw)
    g = grads([out], [q, k, v], [dout]) if dout is not None else ()
    return [out, lse, *g]


def run_sdpa(q, k, v, dout=None, **kw):
    """The torch SDPA drop-in (bhsd)."""
    out = ae.scaled_dot_product_attention(q, k, v, **kw)
    g = grads([out], [q, k, v], [dout]) if dout is not None else ()
    return [out, *g]


def run_flash(q, k, v, dout=None, **kw):
    """The flash-attn drop-in on (B, S, H, D) views of the bhsd inputs (and a bshd view of dout):
    results back in bhsd, so the checks below compare them as for the other calls."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse, _ = ae.flash_attn_func(t(q), t(k), t(v), return_attn_probs=True, **kw)
    g = grads([out], [q, k, v], [t(dout)]) if dout is not None else ()
    return [t(out), lse, *g]


def run_varlen(q, k, v, dout=None, cu_q=None, cu_k=None, **kw):
    mq, mk = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    out, lse = ae.softmax.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, **kw)
    end = int(cu_q[-1])
    g = grads([out], [q, k, v], [dout]) if dout is not None else ()
    return [out[:end], lse[:, :end], *g]


def run_linear(q, k, v, dout=None, **kw):
    out, st = ae.linear_attention(q, k, v, return_state=True, **kw)
    fin = st.augmented(kw.get("normalize", True))
    g = grads([out], [q, k, v], [dout]) if dout is not None else ()
    return [out, fin, *g]


def run_block_sparse(q, k, v, dout=None, layout=None, **kw):
    out, lse = ae.block_sparse_attention(q, k, v, layout, return_lse=True, **kw)
    g = grads([out], [q, k, v], [dout]) if dout is not None else ()
    return [out, lse, *g]


def run_topk(q, k, v, dout=None, k_top=5, **kw):
    out, lse = ae.topk_attention(q, k, v, k_top, return_lse=True, **kw)
    g = grads([out], [q, k, v], [dout]) if dout is not None else ()
    return [out, lse, *g]


def run_decode(q, kc, vc, dout=None, **kw):
    with torch.no_grad():
        out, lse = ae.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw)
    return [out, lse]


def bhsd(b, h, s, d, dtype=torch.float32, grad=True):
    return torch.randn(b, h, s, d, dtype=dtype).requires_grad_(grad)


# ------------------------------------------------------------------ layout invariance
def _strided_copy(t, kind):
    """A tensor equal to t (B, H, S, D) with other strides: heads inside rows (bshd storage),
    a slice of a wider last dim, or every other row of a longer tensor."""
    b, h, s, d = t.shape
    t = t.detach()
    if kind == "transposed":
        x = t.transpose(1, 2).contiguous().transpose(1, 2)
    elif kind == "sliced":
        x = torch.zeros(b, h, s, d + 5, dtype=t.dtype)
        x[..., 2:d + 2] = t
        x = x[..., 2:d + 2]
    else:  # every other row
        x = torch.zeros(b, h, 2 * s, d, dtype=t.dtype)
        x[:, :, ::2] = t
        x = x[:, :, ::2]
    assert torch.equal(x, t) and not x.is_contiguous()
    return x.requires_grad_()


FAMILY_CALLS = {
    "softmax": (run_softmax, dict(causal=True, window=(40, 0), softcap=5.0)),
    "softmax_gqa_mask": (run_softmax, dict(attn_mask=torch.rand(1, 1, 37, 45) > 0.2, bottom_right=True)),
    "linear": (run_linear, dict(causal=True)),
    "linear_noncausal": (run_linear, dict(causal=False, feature_map="relu")),
    "block_sparse": (run_block_sparse, dict(layout=torch.rand(1, 3, 3) < 0.6, block_size=16, causal=True)),
    "topk": (run_topk, dict(k_top=5)),
    "sdpa_gqa": (run_sdpa, dict(is_causal=True, enable_gqa=True)),
    "flash_attn_gqa": (run_flash, dict(causal=True, window_size=(20, 3), softcap=4.0)),
}


def _gqa(name):
    return 2 if "gqa" in name or name == "topk" else 1


@pytest.mark.parametrize("kind", ["transposed", "sliced", "every_other_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FAMILY_CALLS))
def test_layout_invariance(name, dtype, kind):
    fn, kw = FAMILY_CALLS[name]
    torch.manual_seed(0)
    b, h, sq, sk, d = 2, 4, 37, 45, 40
    if name.startswith("linear"):
        sk = sq
    hk = h // _gqa(name)
    q, k, v = bhsd(b, h, sq, d, dtype), bhsd(b, hk, sk, d, dtype), bhsd(b, hk, sk, d, dtype)
    dout = torch.randn(b, h, sq, d, dtype=dtype)
    ref = fn(q, k, v, dout, **kw)
    qs, ks, vs = (_strided_copy(t, kind) for t in (q, k, v))
    got = fn(qs, ks, vs, dout, **kw)
    for i, (a, r) in enumerate(zip(got, ref)):
        same(a, r, f"{name} {kind} result {i}")
    # a non-contiguous grad_output (every other row of a longer tensor, and heads-inside-rows)
    for dnc in (_strided_copy(dout, "every_other_row").detach(), _strided_copy(dout, "transposed").detach()):
        got = fn(q, k, v, dnc, **kw)
        for i, (a, r) in enumerate(zip(got, ref)):
            same(a, r, f"{name} non-contiguous grad_output result {i}")
    # gradient layout: bshd storage where the input keeps its heads inside its rows, else contiguous
    got = fn(qs, ks, vs, dout, **kw)
    for t, g in zip((qs, ks, vs), got[-3:]):
        if t.stride(1) < t.stride(2):
            assert g.transpose(1, 2).is_contiguous(), (name, kind, t.stride(), g.stride())
        else:
            assert g.is_contiguous(), (name, kind, t.stride(), g.stride())


def test_layout_invariance_expanded_kv_heads():
    """k / v with one head expanded (stride 0) to H_k heads vs their contiguous copies; the
    gradient of an expanded input follows the same rule (stride(1) = 0 < stride(2): bshd)."""
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 33, 24
    for fn, kw in (FAMILY_CALLS["softmax"], FAMILY_CALLS["linear"], FAMILY_CALLS["block_sparse"]):
        q = bhsd(b, h, s, d)
        k1, v1 = bhsd(b, 1, s, d, grad=False), bhsd(b, 1, s, d, grad=False)
        ke, ve = k1.expand(b, 2, s, d).requires_grad_(), v1.expand(b, 2, s, d).requires_grad_()
        kc, vc = ke.detach().contiguous().requires_grad_(), ve.detach().contiguous().requires_grad_()
        dout = torch.randn(b, h, s, d)
        ref = fn(q, kc, vc, dout, **kw)
        got = fn(q, ke, ve, dout, **kw)
        for i, (a, r) in enumerate(zip(got, ref)):
            same(a, r, f"expanded result {i}")
        for g in got[-2:]:
            assert g.transpose(1, 2).is_contiguous()


def test_layout_invariance_varlen_and_decode():
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 5, 23, 40], dtype=torch.int32)
    q, k, v = (torch.randn(43, 4, 24, requires_grad=True) for _ in range(3))
    dout = torch.randn(43, 4, 24)
    ref = run_varlen(q, k, v, dout, cu_q=cu, cu_k=cu, causal=True)
    for kind in ("transposed", "sliced"):
        if kind == "transposed":
            qs, ks, vs = (t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for t in (q, k, v))
        else:
            qs, ks, vs = (torch.cat([torch.zeros(43, 4, 3), t.detach()], -1)[..., 3:].requires_grad_()
                          for t in (q, k, v))
        got = run_varlen(qs, ks, vs, dout, cu_q=cu, cu_k=cu, causal=True)
        for i, (a, r) in enumerate(zip(got, ref)):
            same(a, r, f"varlen {kind} result {i}")
    # decode: a q and cache that are slices of wider / longer tensors
    qd = torch.randn(3, 1, 4, 32)
    kc, vc = torch.randn(3, 100, 2, 32), torch.randn(3, 100, 2, 32)
    lens = torch.tensor([100, 17, 60], dtype=torch.int32)
    ref = run_decode(qd, kc, vc, cache_seqlens=lens)
    wide = lambda t: torch.cat([t, torch.randn(*t.shape[:-1], 5)], -1)[..., :32]  # noqa: E731
    got = run_decode(wide(qd), wide(kc), wide(vc), cache_seqlens=lens)
    for i, (a, r) in enumerate(zip(got, ref)):
        same(a, r, f"decode sliced result {i}")


# ------------------------------------------------------------------ NaN poisoning
def _clean_vs_poisoned(fn, clean, poisoned, what, dout=None, **kw):
    ref = fn(*clean, dout, **kw)
    got = fn(*poisoned, dout, **kw)
    for i, (a, r) in enumerate(zip(got, ref)):
        same(a, r, f"{what} result {i}")
        if i >= 2 and not r.isnan().any():
            assert not a.isnan().any(), f"{what}: NaN in gradient {i}"
    return ref


def _poison(ts, fill):
    """Copies of ts (leaves requiring grad as the originals) with fill(copy) applied under no_grad."""
    out = []
    for t in ts:
        c = t.detach().clone()
        with torch.no_grad():
            fill(c)
        out.append(c.requires_grad_(t.requires_grad))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nan_softmax_padding(dtype):
    torch.manual_seed(1)
    b, h, sq, sk, d = 3, 4, 29, 50, 40
    q, k, v = bhsd(b, h, sq, d, dtype), bhsd(b, 2, sk, d, dtype), bhsd(b, 2, sk, d, dtype)
    dout = torch.randn(b, h, sq, d, dtype=dtype)
    lens = torch.tensor([50, 13, 0], dtype=torch.int32)

    def past_len(t):
        for i, n in enumerate(lens.tolist()):
            t[i, :, n:] = NAN

    for kw in (dict(), dict(causal=True, bottom_right=True), dict(window=(5, 5), softcap=3.0),
               dict(alibi_slopes=torch.rand(h), sinks=torch.randn(h))):
        ps = _poison([q, k, v], lambda t: None)
        ps[1], ps[2] = _poison([k, v], past_len)
        _clean_vs_poisoned(run_softmax, (q, k, v), ps, f"seqlens_k {kw}", dout, seqlens_k=lens, **kw)
    kpm = torch.rand(b, sk) > 0.4
    kpm[2] = False  # a batch with every key padded

    def padded(t):
        t.masked_fill_(~kpm.view(b, 1, sk, 1), NAN)

    # padded keys and values, forward and backward
    ps = [q] + _poison([k, v], padded)
    _clean_vs_poisoned(run_softmax, (q, k, v), ps, "key_mask", dout, key_mask=kpm)
    # a bool attn_mask that hides keys from every query hides them as padding does
    am = kpm.view(b, 1, 1, sk).expand(b, 1, sq, sk)
    _clean_vs_poisoned(run_softmax, (q, k, v), ps, "attn_mask", dout, attn_mask=am)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_dropins_hidden_keys(dtype):
    """The drop-ins keep the NaN policy of the ops under them: keys a bool attn_mask hides from
    every query (SDPA), keys past cu_seqlens_k[-1] in a flash-attn varlen pack, and keys
    nn.MultiheadAttention's key_padding_mask pads may hold NaN without changing a bit."""
    torch.manual_seed(3)
    b, h, sq, sk, d = 2, 4, 21, 33, 24
    q, k, v = bhsd(b, h, sq, d, dtype), bhsd(b, 2, sk, d, dtype), bhsd(b, 2, sk, d, dtype)
    dout = torch.randn(b, h, sq, d, dtype=dtype)
    keep = torch.rand(b, sk) > 0.3
    ps = [q] + _poison([k, v], lambda t: t.masked_fill_(~keep.view(b, 1, sk, 1), NAN))
    am = keep.view(b, 1, 1, sk).expand(b, h, sq, sk)
    _clean_vs_poisoned(run_sdpa, (q, k, v), ps, "sdpa attn_mask", dout, attn_mask=am, enable_gqa=True)

    # a varlen pack whose storage runs past cu_seqlens_k[-1]
    cu_q, cu_k = torch.tensor([0, 9, 21], dtype=torch.int32), torch.tensor([0, 14, 25], dtype=torch.int32)
    qp, kp, vp = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))  # (S, H, D)
    dp = dout[0].transpose(0, 1).contiguous()

    def varlen(q, k, v, dout):
        out = ae.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 14, causal=True)
        return [out, *grads([out], [q, k, v], [dout])]

    def tail(t):
        t[25:] = NAN

    kp2, vp2 = _poison([kp, vp], tail)
    _clean_vs_poisoned(varlen, (qp, kp, vp), (qp, kp2, vp2), "flash_attn_varlen_func past cu_seqlens_k", dp)

    # nn.MultiheadAttention, NaN in the padded positions of key and value: the output, the query's
    # gradient and every parameter's but in_proj_weight's are unchanged. The input projection
    # reads every position (dW_k = sum over rows of dK_row^T kv_row: 0 x NaN at a padded row), as
    # torch's own module does; the attention under it reads none.
    torch.manual_seed(4)
    mha = aenn.MultiheadAttention(32, 4, batch_first=True, dtype=dtype)
    params = [p for n, p in mha.named_parameters() if n != "in_proj_weight"]
    assert len(params) == len(list(mha.parameters())) - 1
    x = torch.randn(b, sq, 32, dtype=dtype)
    kv = torch.randn(b, sk, 32, dtype=dtype)
    kpm = ~keep  # True = padded
    kv_nan = kv.masked_fill(kpm.view(b, sk, 1), NAN)
    outs = []
    for kk in (kv, kv_nan):
        xq = x.clone().requires_grad_()
        out, _ = mha(xq, kk, kk, key_padding_mask=kpm, need_weights=False)
        outs.append((out, *torch.autograd.grad(out, [xq, *params], torch.ones_like(out))))
    for i, (a, r) in enumerate(zip(outs[1], outs[0])):
        same(a, r, f"nn.MultiheadAttention key_padding_mask result {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 61])
def test_nan_softmax_padding_tiles(rows, dtype):
    """Padded keys poisoned (NaN in k, inf in v) across several key tiles of 128, with the
    packed kernels (61 query rows) and the few-row direct path (3 rows, no grad). bf16 with 61
    rows takes the bf16 dot products where the CPU has them (csrc/cpu/bf16dot.h): the redo of a
    NaN P V must then give the instruction's bits exactly."""
    torch.manual_seed(3)
    b, h, sk, d = 2, 3, 300, 24
    grad = rows > 8
    q, k, v = (bhsd(b, h, s, d, dtype, grad=grad) for s in (rows, sk, sk))
    kpm = torch.rand(b, sk) > 0.3
    kpm[1, 128:256] = False  # a whole tile padded
    ps = [q] + _poison([k], lambda t: t.masked_fill_(~kpm.view(b, 1, sk, 1), NAN)) \
        + _poison([v], lambda t: t.masked_fill_(~kpm.view(b, 1, sk, 1), float("inf")))
    dout = torch.randn(b, h, rows, d, dtype=dtype) if grad else None
    _clean_vs_poisoned(run_softmax, (q, k, v), ps, "key_mask", dout, key_mask=kpm)
    _clean_vs_poisoned(run_softmax, (q, k, v), ps, "key_mask + causal", dout, key_mask=kpm,
                       causal=True, bottom_right=True)


def test_nan_softmax_causal_reaches_reading_rows():
    """Causal (S_q = S_k = 200, two key tiles): a NaN in v[150] reaches rows 150.. of the output
    and no row before; rows 0..149 are bit-identical to the clean run."""
    torch.manual_seed(4)
    q, k, v = (bhsd(1, 2, 200, 16, grad=False) for _ in range(3))
    clean = ae.attention(q, k, v, causal=True)
    vp = v.clone()
    vp[0, 1, 150, 5] = NAN
    got = ae.attention(q, k, vp, causal=True)
    same(got[0, 0], clean[0, 0], "head 0")
    same(got[0, 1, :150], clean[0, 1, :150], "rows before the NaN key")
    assert got[0, 1, 150:].isnan().any(-1).all()


@pytest.mark.parametrize("what", ["value", "key"])
@pytest.mark.parametrize("how", ["key_mask", "bool_attn_mask", "block_sparse_key_mask", "causal"])
def test_nan_softmax_padded(how, what):
    """Found by test_nan_softmax_padding: B = H = 1, S_q = 4, S_k = 6, D = 8, key 2 padded, NaN in
    v[0, 0, 2] (expected: out bit-identical to the clean run; got: NaN in every row: the tile's
    P V product multiplied the hidden key's P = 0 by its row), or in k[0, 0, 2] (forward clean;
    dq NaN in every row, dS K likewise). "causal": key 5 is hidden from rows 0-3 by causal=True
    (top-left), same result. Fixed by redoing such products without the hidden keys (tile.h)."""
    torch.manual_seed(8)
    b, h, sq, sk, d = 1, 1, 4, 6, 8
    q, k, v = bhsd(b, h, sq, d), bhsd(b, h, sk, d), bhsd(b, h, sk, d)
    kpm = torch.ones(b, sk, dtype=torch.bool)
    key = 5 if how == "causal" else 2
    kpm[0, key] = False
    poisoned = _poison([v if what == "value" else k], lambda t: t[0, 0, key].fill_(NAN))[0]
    args = (q, k, poisoned) if what == "value" else (q, poisoned, v)
    dout = torch.randn(b, h, sq, d)
    if how == "block_sparse_key_mask":
        lay = torch.ones(1, 1, 1, dtype=torch.bool)
        _clean_vs_poisoned(run_block_sparse, (q, k, v), args, how, dout, layout=lay, block_size=16,
                           key_mask=kpm)
    else:
        kw = {"key_mask": dict(key_mask=kpm), "bool_attn_mask": dict(attn_mask=kpm.view(1, 1, 1, sk)),
              "causal": dict(causal=True)}[how]
        _clean_vs_poisoned(run_softmax, (q, k, v), args, how, dout, **kw)


@pytest.mark.parametrize("row", [100, 130])
@pytest.mark.parametrize("heads", [(2, 2), (2, 1)], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", ["causal", "bool"])
@pytest.mark.parametrize("what", ["q", "dout", "q_inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nan_query_row_reaches_its_keys_only(dtype, what, mask, heads, row):
    """A NaN in query row 100 or 130 of head 1 (q, or the gradient dout; or an inf in q) reaches
    that row's out / dq and the dK / dV of the keys the row sees (with inf in q: of those whose
    logit is not -inf), and changes no other bit: not the keys hidden from it by a causal edge or a
    bool mask in the same tiles. Found by this test: with NaN in q, causal, the row's LSE is NaN and
    exp(-inf - NaN) gave the hidden keys P = NaN (dK and dV NaN at keys 101..127 of its tile); with
    NaN in dout, P^T dO gave 0 x NaN there. Row 130 is row 34 of its 48-row block: the AMX
    backward's mask of such rows was once 32 bits wide (found by review)."""
    torch.manual_seed(10)
    (h, hk), s, d = heads, 150, 40  # rows 100 and 130: 4 and 34 into their 48-row block
    q, dout = torch.randn(1, h, s, d, dtype=dtype), torch.randn(1, h, s, d, dtype=dtype)
    k, v = (torch.randn(1, hk, s, d, dtype=dtype) for _ in range(2))
    if mask == "causal":
        kw, seen = dict(causal=True), torch.arange(s) <= row
    else:
        allowed = torch.rand(s, s) > 0.3
        seen = allowed[row]
        kw = dict(attn_mask=allowed.view(1, 1, s, s))
    qp, dp = q.clone(), dout.clone()
    (dp if what == "dout" else qp)[0, 1, row, 7] = float("inf") if what == "q_inf" else NAN
    ins = [t.requires_grad_() for t in (q, k, v)]
    clean = run_softmax(*ins, dout, **kw)
    got = run_softmax(qp.requires_grad_(), *ins[1:], dp, **kw)
    # NaN expected: out / lse / dq at (head 1, row) (out and lse only from q); dk / dv at the seen keys
    rows = torch.zeros(1, h, s, dtype=torch.bool)
    rows[0, 1, row] = True
    keys = torch.zeros(1, hk, s, dtype=torch.bool)
    keys[0, hk - 1] = seen
    from_q = what != "dout"
    expect = [rows if from_q else None, rows if from_q else None, rows, keys, keys]
    for name, g, c, e in zip(("out", "lse", "dq", "dk", "dv"), got, clean, expect):
        bad = g.isnan() | g.isinf()
        if e is None:
            same(g, c, name)
            continue
        e = e.view(*e.shape, *([1] if g.dim() == 4 else [])).expand_as(g)
        # an inf in q makes some of the row's logits -inf: those keys get P = 0, as if hidden
        if not (what == "q_inf" and name in ("dk", "dv")):
            assert bad[e].view(-1, *g.shape[3:]).any(-1).all() if g.dim() == 4 else bad[e].all(), \
                f"{name}: a value the bad element reaches is finite"
        assert torch.equal(g[~e], c[~e]), f"{name}: a value the bad element does not reach changed"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_inf_under_softcap_has_zero_derivative(dtype, where, causal):
    """An inf in q[100, 7] (k[40, 7]) under softcap: the logits it makes are +-cap, and softcap's
    derivative there is 0, so its terms of dK (dQ) are 0 x inf. They are left out, in every tile:
    out, lse and every gradient stay finite. Before, a tile that could hide keys left them out and
    a full tile gave NaN (dq column 7 of every row reading k[40] without causal, none with it)."""
    torch.manual_seed(13)
    s, d = 150, 40
    q, k, v, dout = (torch.randn(1, 2, s, d, dtype=dtype) for _ in range(4))
    qp, kp = q.clone(), k.clone()
    if where == "q":
        qp[0, 1, 100, 7] = float("inf")
    else:
        kp[0, 1, 40, 7] = float("inf")
    ins = [t.requires_grad_() for t in (qp, kp, v)]
    got = run_softmax(*ins, dout, softcap=30.0, causal=causal)
    for name, g in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert torch.isfinite(g).all(), f"{name}: not finite"
    clean = run_softmax(*[t.detach().clone().requires_grad_() for t in (q, k, v)], dout, softcap=30.0, causal=causal)
    same(got[0][0, 0], clean[0][0, 0], "head 0's out")
    if causal and where == "k":
        same(got[2][0, 1, :40], clean[2][0, 1, :40], "dq of the rows before the key")


@pytest.mark.parametrize("what", ["v", "dout"])
def test_nan_mask_grad_stays_off_hidden_pairs(what):
    """The gradient of a float attn_mask under causal, with NaN in v[40] (dout row 10): it is NaN
    where a row reads the NaN (rows >= 40 at the keys they see; row 10 at its keys) and keeps its
    clean bits elsewhere, 0 at the pairs causal hides. Found by a review: the CPU added the bias
    gradient before selecting dS = 0 where P = 0, so a hidden pair got 0 x NaN (rows < 40 at key
    40; row 10 at keys 11..63)."""
    torch.manual_seed(14)
    s, d = 64, 16
    q, k, v, dout = (torch.randn(1, 1, s, d) for _ in range(4))
    seen = torch.ones(s, s, dtype=torch.bool).tril()
    grads_of = []
    for bad in (False, True):
        vv, dd = v.clone(), dout.clone()
        if bad:
            if what == "v":
                vv[0, 0, 40, 3] = NAN
            else:
                dd[0, 0, 10] = NAN
        mask = torch.zeros(1, 1, s, s, requires_grad=True)
        out = ae.attention(q, k, vv, attn_mask=mask, causal=True)
        out.backward(dd)
        grads_of.append(mask.grad[0, 0])
    clean, got = grads_of
    reach = torch.zeros(s, s, dtype=torch.bool)
    if what == "v":
        reach[40:] = seen[40:]  # those rows' O is NaN, so is their D_i, so is dS at every key they see
    else:
        reach[10] = seen[10]
    assert got[reach].isnan().all(), "a pair that reads the NaN is not NaN"
    same(got[~reach], clean[~reach], "the pairs that do not read it")
    assert (clean[~seen] == 0).all()


def test_nan_float_mask_is_added():
    """A float attn_mask is added to the logits, so its -inf does not hide a NaN key (IEEE:
    NaN + -inf = NaN): the row reads the key and shows it. Hide unread keys with a bool mask,
    key_mask or seqlens_k."""
    torch.manual_seed(9)
    q, k, v = bhsd(1, 1, 4, 8, grad=False), bhsd(1, 1, 6, 8, grad=False), bhsd(1, 1, 6, 8, grad=False)
    k[0, 0, 2] = NAN
    fm = torch.zeros(1, 1, 1, 6)
    fm[..., 2] = float("-inf")
    assert ae.attention(q, k, v, attn_mask=fm).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_softmax_varlen_tail(dtype):
    torch.manual_seed(2)
    cq = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
    ck = torch.tensor([0, 11, 20, 20], dtype=torch.int32)
    q, k, v = (torch.randn(n, 4, 24, dtype=dtype, requires_grad=True) for n in (36, 27, 27))
    dout = torch.randn(36, 4, 24, dtype=dtype)

    def tail(n):
        return lambda t: t[n:].fill_(NAN)

    ps = _poison([q], tail(30)) + _poison([k, v], tail(20))
    for kw in (dict(), dict(causal=True), dict(window=(3, 2), alibi_slopes=torch.rand(4))):
        ref = _clean_vs_poisoned(run_varlen, (q, k, v), ps, f"varlen tail {kw}", dout, cu_q=cq, cu_k=ck, **kw)
        assert not ref[2][:30].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_linear_padding_and_tail(dtype):
    torch.manual_seed(3)
    b, h, s, d = 2, 2, 41, 16
    q, k, v = (0.5 * bhsd(b, h, s, d, dtype)).detach().requires_grad_(), bhsd(b, h, s, d, dtype), \
        bhsd(b, h, s, d, dtype)
    dout = torch.randn(b, h, s, d, dtype=dtype)
    # varlen pack: rows past cu_seqlens[-1]
    cu = torch.tensor([0, 9, 30], dtype=torch.int32)
    q1, k1, v1 = (t.detach()[:1].requires_grad_() for t in (q, k, v))
    ps = _poison([q1, k1, v1], lambda t: t[:, :, 30:].fill_(NAN))

    def run_cut(q_, k_, v_, dout_, **kw):
        res = run_linear(q_, k_, v_, dout_, **kw)
        return [res[0][:, :, :30]] + res[1:]

    _clean_vs_poisoned(run_cut, (q1, k1, v1), ps, "linear varlen tail", dout[:1], cu_seqlens=cu, causal=True)


@pytest.mark.parametrize("causal", [True, False])
def test_nan_linear_padded_keys(causal):
    """Found by test_nan_linear_padding_and_tail: B = 2, H = 2, S = 41, D = 16, key_mask
    with ~30% padded, NaN in the padded keys' k and v rows: expected out / state / gradients
    bit-identical to the clean run, got NaN outputs (csrc/linear/cpu/linear.cpp load_chunk loaded a
    padded key's rows and scaled its features by 0; it now fills them with zeros)."""
    torch.manual_seed(3)
    b, h, s, d = 2, 2, 41, 16
    q, k, v = (0.5 * bhsd(b, h, s, d)).detach().requires_grad_(), bhsd(b, h, s, d), bhsd(b, h, s, d)
    kpm = torch.rand(b, s) > 0.3
    ps = [q] + _poison([k, v], lambda t: t.masked_fill_(~kpm.view(b, 1, s, 1), NAN))
    _clean_vs_poisoned(run_linear, (q, k, v), ps, "linear key_mask", torch.randn(b, h, s, d),
                       key_mask=kpm, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_block_sparse_off_blocks(dtype):
    torch.manual_seed(4)
    b, h, sq, sk, d, bs = 2, 2, 70, 75, 32, 16
    lay = torch.rand(h, 5, 5) < 0.6
    lay[:, :, 2] = False  # key block 2 is read by no query block of any head
    lay[:, 3, :] = False  # query block 3 reads nothing
    q, k, v = bhsd(b, h, sq, d, dtype), bhsd(b, h, sk, d, dtype), bhsd(b, h, sk, d, dtype)
    dout = torch.randn(b, h, sq, d, dtype=dtype)
    ps = _poison([q], lambda t: t[:, :, 48:64].fill_(NAN)) + _poison([k, v], lambda t: t[:, :, 32:48].fill_(NAN))
    for kw in (dict(), dict(causal=True), dict(sinks=torch.randn(h))):
        _clean_vs_poisoned(run_block_sparse, (q, k, v), ps, f"block sparse off blocks {kw}", dout, layout=lay,
                           block_size=bs, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k_top", [1, 4, 60])
def test_nan_topk_padding(dtype, k_top):
    """Top-k ranks the logits in a pass of its own before the fused kernel: NaN in padded keys
    (key_mask, past seqlens_k, a batch with every key padded) must reach neither the
    ranking nor the kernel. k_top 60 > S_k: every allowed key kept."""
    torch.manual_seed(6)
    b, h, sq, sk, d = 3, 4, 23, 41, 24
    q, k, v = bhsd(b, h, sq, d, dtype), bhsd(b, 2, sk, d, dtype), bhsd(b, 2, sk, d, dtype)
    dout = torch.randn(b, h, sq, d, dtype=dtype)
    kpm = torch.rand(b, sk) > 0.4
    kpm[2] = False
    lens = torch.tensor([41, 9, 0], dtype=torch.int32)

    def padded(t):
        t.masked_fill_(~kpm.view(b, 1, sk, 1), NAN)

    def past_len(t):
        for i, n in enumerate(lens.tolist()):
            t[i, :, n:] = NAN

    for fill, kw in ((padded, dict(key_mask=kpm)), (padded, dict(key_mask=kpm, causal=True)),
                     (past_len, dict(seqlens_k=lens, window=(6, 6), softcap=4.0)),
                     (past_len, dict(seqlens_k=lens, alibi_slopes=torch.rand(h), sinks=torch.randn(h)))):
        ps = [q] + _poison([k, v], fill)
        _clean_vs_poisoned(run_topk, (q, k, v), ps, f"topk {k_top} {kw}", dout, k_top=k_top, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nan_decode_cache(dtype):
    torch.manual_seed(5)
    b, h, hk, d = 3, 4, 2, 40
    q = torch.randn(b, 2, h, d, dtype=dtype)
    lens = torch.tensor([70, 1, 33], dtype=torch.int32)
    # contiguous cache: rows past cache_seqlens, rows before cache_leftpad
    kc, vc = torch.randn(b, 80, hk, d, dtype=dtype), torch.randn(b, 80, hk, d, dtype=dtype)
    pad = torch.tensor([3, 0, 10], dtype=torch.int32)

    def dead(t):
        for i in range(b):
            t[i, int(lens[i]):] = NAN
            t[i, : int(pad[i])] = NAN

    for kw in (dict(), dict(causal=True), dict(window_size=(9, 0), softcap=4.0), dict(num_splits=3)):
        _clean_vs_poisoned(run_decode, (q, kc, vc), [q] + _poison([kc, vc], dead), f"decode {kw}",
                           cache_seqlens=lens, cache_leftpad=pad, **kw)
    # paged: pages no sequence uses, rows of the last page past the length, and table entries past
    # the pages a sequence uses (pointing at a NaN page)
    page = 16
    pool_k, pool_v = torch.randn(20, page, hk, d, dtype=dtype), torch.randn(20, page, hk, d, dtype=dtype)
    bt = torch.tensor([[3, 7, 1, 12, 19], [5, 17, 17, 17, 17], [9, 2, 18, 17, 17]], dtype=torch.int32)
    used = {int(bt[i, j]) for i in range(b) for j in range((int(lens[i]) + page - 1) // page)}
    assert 17 not in used  # the entries past a sequence's pages point at a poisoned page

    def dead_pages(t):
        for pg in range(20):
            if pg not in used:
                t[pg] = NAN
        for i in range(b):
            n = int(lens[i])
            last = int(bt[i, (n - 1) // page])
            t[last, (n - 1) % page + 1:] = NAN

    for kw in (dict(), dict(causal=True), dict(num_splits=2)):
        _clean_vs_poisoned(run_decode, (q, pool_k, pool_v), [q] + _poison([pool_k, pool_v], dead_pages),
                           f"paged {kw}", cache_seqlens=lens, block_table=bt, **kw)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_decode_query_row_lse(dtype, num_splits):
    """A NaN query row reads NaN logits: its out and LSE are NaN with and without key splits, the
    other rows keep their bits. With splits the merge (common/split_merge.h) took the max of the
    partial LSEs, which skips NaN, and returned -inf for the row (found in review)."""
    from attention_ext.decode import decode_fwd

    torch.manual_seed(8)
    b, h, hk, d, sk = 2, 4, 2, 64, 5000
    q = torch.randn(b, 1, h, d, dtype=dtype)
    kc, vc = torch.randn(b, sk, hk, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype)
    lens = torch.tensor([sk, 3001], dtype=torch.int32)
    run = lambda qq: decode_fwd(qq, kc, vc, cache_seqlens=lens, scale=d ** -0.5, num_splits=num_splits)
    out0, lse0 = run(q)
    qp = q.clone()
    qp[1, 0, 3] = float("nan")
    out, lse = run(qp)
    assert torch.isnan(out[1, 0, 3]).all() and torch.isnan(lse[1, 3]).all()
    keep = torch.ones(b, h, dtype=torch.bool)
    keep[1, 3] = False
    assert torch.equal(lse[keep], lse0[keep])
    assert torch.equal(out[:, 0][keep], out0[:, 0][keep])


@pytest.mark.parametrize("d", [64, 80, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_decode_key_hidden_from_some_rows(dtype, d):
    """Found while extending the decode kernel (flash_attn_func, S_q = 2, S_k = 10, causal
    bottom-right, NaN in v[9]: row 0, which does not see key 9, came out NaN): the kernel's P V ran
    every key of a chunk for every query row, so a key hidden from one row by the causal diagonal
    or the window still cost 0 x its value there. Edge chunks now run row by row over each row's
    own keys (csrc/decode/cpu/decode.cpp). For each poisoned key (value, then key), the rows that
    see it are NaN and the others bit-identical to the clean run; the keys sit at the causal edge
    (bottom-right) and at the window's left end, in one chunk and across chunks (300 keys), on a
    contiguous and a paged cache, and through attention()'s few-query routing (flash_attn_func),
    at every ISA level this machine runs (avx512bf16: P V on bf16 dot products, in key pairs)."""
    if not ae._ext.HAS_EXT:  # --reference-only: the fallback
        _decode_hidden_keys(dtype, d)
        return
    old = ae.cpu_isa()
    try:
        for level in ae.cpu_isas():
            ae.set_cpu_isa(level)
            _decode_hidden_keys(dtype, d)
    finally:
        ae.set_cpu_isa(old)


def _decode_hidden_keys(dtype, d):
    torch.manual_seed(9)
    b, sq, h, hk, sk = 2, 5, 4, 2, 300
    q = torch.randn(b, sq, h, d, dtype=dtype)
    kc, vc = torch.randn(b, sk, hk, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype)
    lens = torch.tensor([sk, 41], dtype=torch.int32)
    page = 16
    bt = torch.randperm(2 * (sk // page + 1)).view(2, -1).int()[:, : (sk + page - 1) // page]

    def to_pages(t):  # (B, S, H_k, D) -> a page pool in the order of bt
        pool = torch.zeros(bt.numel() + 1, page, hk, d, dtype=dtype)
        for i in range(b):
            for j in range(bt.shape[1]):
                chunk = t[i, j * page:(j + 1) * page]
                pool[int(bt[i, j]), : chunk.shape[0]] = chunk
        return pool

    for window in ((-1, 0), (6, 0), (3, 2)):
        for i in range(b):
            n = int(lens[i])
            # keys by the diagonal (seen by the last rows only) and by the window's left end
            # (seen by the first rows only; window (3, 2) also reaches right of the diagonal)
            for key in {n - 1, n - 3, n - sq - window[0] if window[0] >= 0 else 0}:
                if not 0 <= key < n:
                    continue
                for which in ("v", "k"):
                    kp, vp = kc.clone(), vc.clone()
                    (vp if which == "v" else kp)[i, key, 1] = NAN
                    sees = [(window[0] < 0 or key >= r + n - sq - window[0]) and key <= r + n - sq + window[1]
                            for r in range(sq)]
                    calls = {
                        "contiguous": lambda k_, v_: run_decode(q, k_, v_, cache_seqlens=lens, window_size=window),
                        "paged": lambda k_, v_: run_decode(q, to_pages(k_), to_pages(v_), cache_seqlens=lens,
                                                           block_table=bt, window_size=window),
                    }
                    if window == (-1, 0):  # attention() sends this one to the decode kernel
                        calls["flash_attn_func"] = lambda k_, v_: [ae.flash_attn_func(
                            q[i:i + 1], k_[i:i + 1, :n], v_[i:i + 1, :n], causal=True)]
                    for name, fn in calls.items():
                        clean, got = fn(kc, vc), fn(kp, vp)
                        out, ref = got[0], clean[0]
                        bi = 0 if name == "flash_attn_func" else i
                        for r in range(sq):
                            what = f"{name} window {window} batch {i} key {key} ({which}) row {r}"
                            same(out[bi, r, :2], ref[bi, r, :2], what + ", kv head 0's query heads")
                            if sees[r]:  # query heads 2, 3 read kv head 1
                                assert out[bi, r, 2:].isnan().all(), what
                            else:
                                same(out[bi, r, 2:], ref[bi, r, 2:], what)
                        if name != "flash_attn_func":
                            same(out[1 - bi], ref[1 - bi], f"{name}: the other sequence")


def test_nan_that_is_read_propagates():
    """A NaN in a position an op reads reaches every row that reads it, and only those."""
    torch.manual_seed(6)
    b, h, s, d = 1, 2, 40, 16
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    # softmax: q row 5 -> out row 5; key 7 under causal -> rows >= 7
    qn = q.clone()
    qn[0, 0, 5, 3] = NAN
    out = ae.attention(qn, k, v, causal=True)
    assert out[0, 0, 5].isnan().all() and not out[0, 0, :5].isnan().any() and not out[0, 0, 6:].isnan().any()
    kn = k.clone()
    kn[0, 1, 7, 0] = NAN
    out = ae.attention(q, kn, v, causal=True)
    assert out[0, 1, 7:].isnan().all() and not out[0, 1, :7].isnan().any() and not out[0, 0].isnan().any()
    vn = v.clone()
    vn[0, 0, 7, 2] = NAN
    out = ae.attention(q, k, vn, causal=True)
    # rows >= 7 read key 7, the rows before it do not
    assert out[0, 0, 7:, 2].isnan().all() and not out[0, 0, :7].isnan().any() and not out[0, 1].isnan().any()
    # varlen: a NaN in sequence 1 stays in sequence 1
    cu = torch.tensor([0, 10, 25, 40], dtype=torch.int32)
    qp, kp, vp = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    kp[12, 0, 0] = NAN
    out = ae.softmax.attention_varlen(qp, kp, vp, cu, cu, 15, 15)
    assert out[10:25, 0].isnan().all() and not out[:10].isnan().any() and not out[25:].isnan().any()
    # linear, causal: key 7 -> rows >= 7
    out = ae.linear_attention(q, kn, v, causal=True)
    assert out[0, 1, 7:].isnan().all() and not out[0, 1, :7].isnan().any()
    # block-sparse: a NaN key in an on block reaches the query blocks that read it
    lay = torch.zeros(1, 3, 3, dtype=torch.bool)
    lay[0, 0, 0] = lay[0, 2, 0] = lay[0, 1, 1] = lay[0, 2, 2] = True
    out = ae.block_sparse_attention(q, kn, v, lay, block_size=16)  # key 7 in key block 0
    assert out[0, 1, :16].isnan().all() and out[0, 1, 32:].isnan().all() and not out[0, 1, 16:32].isnan().any()
    # top-k: a NaN logit is not silently dropped from the ranking
    out = ae.topk_attention(q, kn, v, 3)
    assert out[0, 1].isnan().any(axis=-1).all()
    # decode: a NaN in a live cache row reaches every query of that sequence
    kc = k.transpose(1, 2).contiguous()
    kc[0, 30, 1, 0] = NAN
    with torch.no_grad():
        out = ae.flash_attn_with_kvcache(q.transpose(1, 2)[:, -1:].contiguous(), kc, v.transpose(1, 2).contiguous(),
                                         cache_seqlens=torch.tensor([35], dtype=torch.int32))
    assert out[0, 0, 1].isnan().all() and not out[0, 0, 0].isnan().any()


# ------------------------------------------------------------------ determinism and threads
def _problems():
    """Problems large enough that the CPU kernels split their work across threads."""
    torch.manual_seed(7)
    b, h, s, d = 2, 4, 300, 64
    q, k, v = bhsd(b, h, s, d), bhsd(b, 2, s, d), bhsd(b, 2, s, d)
    dout = torch.randn(b, h, s, d)
    cu = torch.tensor([0, 100, 130, 600], dtype=torch.int32)
    qp, kp, vp = (t.detach().transpose(1, 2).reshape(-1, t.shape[1], d).requires_grad_() for t in (q, k, v))
    dp = dout.transpose(1, 2).reshape(-1, h, d)
    lay = torch.rand(h, 19, 19) < 0.5
    kc, vc = torch.randn(2, 4096, 2, d), torch.randn(2, 4096, 2, d)
    pool = torch.randn(70, 128, 2, d)
    bt = torch.randperm(70)[:64].view(2, 32).to(torch.int32)
    lens = torch.tensor([4000, 2500], dtype=torch.int32)
    qd = torch.randn(2, 1, h, d)
    return {
        "softmax": lambda: run_softmax(q, k, v, dout, causal=True, alibi_slopes=torch.linspace(0.1, 0.5, h)),
        "softmax_dropout": lambda: run_softmax(q, k, v, dout, dropout_p=0.3, seed=11, deterministic=True),
        "varlen": lambda: run_varlen(qp, kp, vp, dp, cu_q=cu, cu_k=cu, causal=True),
        "linear": lambda: run_linear(q, k, v, dout, causal=True),
        "linear_noncausal": lambda: run_linear(q, k, v, dout, causal=False),
        "block_sparse": lambda: run_block_sparse(q, k, v, dout, layout=lay, block_size=16),
        "topk": lambda: run_topk(q, k, v, dout, k_top=20),
        "sdpa": lambda: run_sdpa(q, k, v, dout, is_causal=True, enable_gqa=True),
        "flash_attn": lambda: run_flash(q, k, v, dout, window_size=(64, 0), alibi_slopes=torch.linspace(0.1, 0.5, h)),
        # the num_splits=0 heuristic (3 splits here) and a given count
        "decode": lambda: run_decode(qd, kc, vc, cache_seqlens=lens, num_splits=0),
        "decode_paged": lambda: run_decode(qd, pool, pool, cache_seqlens=lens, block_table=bt, num_splits=3),
    }


N_FWD = {"softmax": 2, "softmax_dropout": 2, "varlen": 2, "linear": 2, "linear_noncausal": 2, "block_sparse": 2,
         "topk": 2, "decode": 2, "decode_paged": 2, "sdpa": 1, "flash_attn": 2}  # results before the gradients


@pytest.fixture
def threads():
    n0 = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(n0)


def test_repeated_runs_bit_identical():
    probs = _problems()
    for name, fn in probs.items():
        a, b = fn(), fn()
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{name} repeated result {i}")


@pytest.mark.parametrize("n", [2, 3])
def test_threads_bit_identical(threads, n):
    """1 vs n intra-op threads (3 oversubscribes a 2-core machine): forward and backward."""
    probs = _problems()
    threads(1)
    one = {name: fn() for name, fn in probs.items()}
    threads(n)
    for name, fn in probs.items():
        got = fn()
        for i, (x, y) in enumerate(zip(got, one[name])):
            same(x, y, f"{name} {'forward' if i < N_FWD[name] else 'backward'} result {i}, 1 vs {n} threads")


@pytest.mark.parametrize("via", ["flash_attn_with_kvcache", "attention"])
def test_decode_split_heuristic_threads(threads, via):
    """Found by test_threads_bit_identical: B = 2, H = 4, H_k = 2, D = 64, one query row over 4000
    and 2500 cached keys, fp32: 1 vs 2 threads differed by 2.2e-7 (1 vs 3: 2.6e-7) while the
    decode kernel's num_splits=0 heuristic (flash_attn_with_kvcache's default, and what attention()
    uses when it routes a no-grad call of <= 8 query rows to the decode kernel) chose the split
    count from the thread count: the split merge then summed in another order. The count now
    follows the problem only (csrc/decode/cpu/decode.cpp decode_num_splits)."""
    torch.manual_seed(7)
    qd, kc, vc = torch.randn(2, 1, 4, 64), torch.randn(2, 4096, 2, 64), torch.randn(2, 4096, 2, 64)
    lens = torch.tensor([4000, 2500], dtype=torch.int32)
    if via == "attention":
        fn = lambda: [ae.attention(qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2))]  # noqa: E731
    else:
        fn = lambda: run_decode(qd, kc, vc, cache_seqlens=lens)  # noqa: E731
    threads(1)
    one = fn()
    threads(2)
    for x, y in zip(fn(), one):
        same(x, y, f"{via}: 1 vs 2 threads")


def test_python_threads_concurrent():
    """4 Python threads calling every family's ops at once give what serial calls give."""
    probs = _problems()
    serial = {name: fn() for name, fn in probs.items()}
    results, errors = {}, []
    names = list(probs)

    def worker(w):
        try:
            for rep in range(2):
                for name in names[w:] + names[:w]:  # each thread starts at another family
                    results[(w, rep, name)] = probs[name]()
        except Exception as e:  # reported below: an exception in a thread is otherwise lost
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    for (w, rep, name), got in results.items():
        for i, (x, y) in enumerate(zip(got, serial[name])):
            same(x, y, f"{name} in thread {w} (pass {rep}) result {i}")


@pytest.mark.parametrize("fmap", ["elu", "relu", "identity"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_linear_feature_maps_propagate(fmap, where):
    """Found by test_nan_that_is_read_propagates: the fused elu + 1 and relu maps took a NaN
    input for a positive / negative one (their compares are false on NaN): elu(NaN) + 1 came out
    1 and relu(NaN) 0, so a NaN key vanished from every row that read it (fixed in
    csrc/linear/cpu/feature_map.h). Causal: a NaN at position 7 reaches rows >= 7 only (q: row 7
    only). "v" found that it also reached row 6: the intra-chunk product multiplied the masked
    (zero) upper triangle of phi(Q) phi(K)^T by V, and 0 * NaN = NaN (cpu/simd.h gemm now never
    reads a masked triangle, Tri)."""
    torch.manual_seed(10)
    q, k, v = (0.5 * torch.randn(1, 2, 30, 16) for _ in range(3))
    t = {"q": q, "k": k, "v": v}[where]
    t[0, 1, 7, 3] = NAN
    out = ae.linear_attention(q, k, v, causal=True, feature_map=fmap, normalize=fmap != "identity")
    hit = out[0, 1].isnan().any(-1)
    want = torch.zeros(30, dtype=torch.bool)
    if where == "q":
        want[7] = True
    else:
        want[7:] = True
    assert torch.equal(hit, want), hit.int().tolist()
    assert not out[0, 0].isnan().any()


@pytest.mark.parametrize("t", [7, 50])
@pytest.mark.parametrize("where", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("fmap,decay", [("elu", False), ("elu", True), ("identity", True)])
def test_nan_linear_backward_reaches_dependents(fmap, decay, where, t):
    """Causal backward: a NaN at element (t, 3) of q, k, v or dout reaches exactly the gradient
    rows of q, k and v that depend on that element, those whose float64 reference gradient
    changes when the element does (the reference's masked weights are exact zeros, so a row that
    does not depend on it comes out bit-identical). S = 60 over the CPU's 48-row chunks: t = 7
    spreads inside chunk 0 and into chunk 1, t = 50 only inside chunk 1. The products that
    multiply a masked (C, C) factor (dQ~ = P K~, dK~ = P^T Q~, dV' = A^T dO') must not read its
    zero triangle against a NaN row of the other operand.
    d decay is checked one way (NaN wherever it depends on the element): the kernel forms it as
    the reverse running sum of Q~_i . dQ~_i - K~_i . dK~_i, whose terms cancel exactly in the
    math but not when one is NaN, so it can be NaN at rows before t that do not depend on t."""
    torch.manual_seed(11)
    b, h, s, d = 1, 2, 60, 16
    normalize = fmap != "identity"
    x64 = {n: 0.5 * torch.randn(b, h, s, d, dtype=torch.float64) for n in ("q", "k", "v")}
    dout64 = torch.randn(b, h, s, d, dtype=torch.float64)
    g64 = -0.2 * torch.rand(b, h, s, dtype=torch.float64) if decay else None
    code = {"identity": 0, "elu": 1}[fmap]

    def ref_grads(bump):
        leaves = {n: x.clone() for n, x in x64.items()}
        dout = dout64.clone()
        (dout if where == "dout" else leaves[where])[0, 1, t, 3] += bump
        leaves = {n: x.requires_grad_() for n, x in leaves.items()}
        g = g64.clone().requires_grad_() if decay else None
        out = linear_reference.linear_attention(leaves["q"], leaves["k"], leaves["v"], feature_map=code, causal=True,
                                         normalize=normalize, decay=g)[0]
        return torch.autograd.grad(out, [leaves[n] for n in "qkv"] + ([g] if decay else []), dout)

    # (B, H, S): the rows (of d decay: the entries) that change with the element
    dep = [(a - b_).abs().amax(-1) > 0 if a.dim() == 4 else (a - b_).abs() > 0
           for a, b_ in zip(ref_grads(1.0), ref_grads(0.0))]

    leaves = {n: x.float() for n, x in x64.items()}
    dout = dout64.float()
    (dout if where == "dout" else leaves[where])[0, 1, t, 3] = NAN
    leaves = {n: x.requires_grad_() for n, x in leaves.items()}
    g = g64.float().requires_grad_() if decay else None
    out = ae.linear_attention(leaves["q"], leaves["k"], leaves["v"], causal=True, feature_map=fmap,
                              normalize=normalize, scale=1.0, decay=g)
    got = torch.autograd.grad(out, [leaves[n] for n in "qkv"] + ([g] if decay else []), dout)
    for name, gr, want in zip("qkv", got, dep):
        hit = gr.isnan().any(-1)
        assert torch.equal(hit, want), f"d{name}: NaN rows {hit[0].nonzero().tolist()} vs dependent " \
                                       f"{want[0].nonzero().tolist()}"
    if decay:
        hit = got[3].isnan()
        assert bool(hit[dep[3]].all()), "d decay: not NaN where it depends on the NaN"
