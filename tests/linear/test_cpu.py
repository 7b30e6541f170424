"""The linear attention op on the CPU: forward and every gradient against the float64 reference
(FA2's rule: error <= 2x PyTorch's own same-dtype error), gradcheck in float64, opcheck, the fake
kernels' checks against the op's, and stability. Skips while the op is not registered
(ATTENTION_EXT_LINEAR_STANDIN=1 runs it on a Python stand-in built from reference.py)."""
from __future__ import annotations

import os

import pytest
import torch

import attention_ext as ae
from attention_ext.linear import feature_maps, ops, reference
from tests.helpers import assert_close_fa2

pytestmark = pytest.mark.skipif(not ops.has_kernel(torch.device("cpu")),
                                reason="torch.ops.attention_ext.linear_fwd has no CPU kernel (op not built)")
STANDIN = os.environ.get("ATTENTION_EXT_LINEAR_STANDIN") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
f64 = torch.float64


def run_case(s, dtype, *, causal, fmap="elu", b=1, h=2, hk=1, m=16, dv=24, layout="bhsd", decay=False,
             init=False, mask=False, normalize=True):
    """ae.linear_attention through the op in `dtype` against reference.linear_attention in float64
    and in `dtype`: out, the final state, and the gradients of q, k, v, decay and initial_state."""
    shape = (lambda heads, d: (b, heads, s, d)) if layout == "bhsd" else (lambda heads, d: (b, s, heads, d))
    q = (0.5 * torch.randn(shape(h, m))).to(dtype).requires_grad_()
    k = (0.5 * torch.randn(shape(hk, m))).to(dtype).requires_grad_()
    v = torch.randn(shape(hk, dv)).to(dtype).requires_grad_()
    acc = ops.acc_dtype(dtype)
    g = (-0.2 * torch.rand(b, h, s, dtype=acc)).requires_grad_() if decay else None
    s0 = torch.rand(b, h, m, dv + normalize, dtype=acc).requires_grad_() if init else None
    kpm = (torch.rand(b, s) > 0.25) if mask else None
    fm = {"favor": feature_maps.Favor(m, 32, stabilize=False, seed=0),
          "rfa": feature_maps.RFA(m, 16, seed=0)}.get(fmap, fmap)
    out, st = ae.linear_attention(q, k, v, feature_map=fm, causal=causal, decay=g, initial_state=s0,
                                  key_mask=kpm, layout=layout, normalize=normalize, scale=0.5,
                                  return_state=True)
    assert out.dtype == dtype and out.shape == (*q.shape[:3], dv) if layout == "bhsd" else True
    final = st.augmented(normalize)

    def ref_in(rdt):
        leaves = [t.detach().to(rdt).requires_grad_() for t in (q, k, v)]
        side = [None if t is None else t.detach().to(rdt).requires_grad_() for t in (g, s0)]
        bq, bk, bv = (x.transpose(1, 2) if layout == "bshd" else x for x in leaves)
        if fmap in ("favor", "rfa"):
            bq, bk, code = fm(bq, is_query=True), fm(bk), 0
        else:
            code = {"identity": 0, "elu": 1, "relu": 2}[fmap]
        o, _, f = reference.linear_attention(bq, bk, bv, feature_map=code, causal=causal, normalize=normalize,
                                             scale=0.5, decay=side[0], initial_state=side[1], key_mask=kpm)
        return (o.transpose(1, 2) if layout == "bshd" else o), f, leaves + side

    ref, ref_final, ref_leaves = ref_in(f64)
    low, low_final, low_leaves = ref_in(dtype)
    assert_close_fa2(out, low, ref, dtype, "out")
    assert_close_fa2(final, low_final, ref_final, dtype if dtype != torch.float16 else torch.float32, "final_state")
    dout = torch.randn_like(out)
    dfin = torch.randn_like(final)
    torch.autograd.backward([out, final], [dout, dfin])
    torch.autograd.backward([ref, ref_final], [dout.to(f64), dfin.to(f64)])
    torch.autograd.backward([low, low_final], [dout.to(dtype), dfin.to(dtype)])
    for name, t, r, lo in zip(("dq", "dk", "dv", "ddecay", "dinitial_state"), (q, k, v, g, s0), ref_leaves,
                              low_leaves):
        if t is not None:
            assert_close_fa2(t.grad, lo.grad, r.grad, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s", [1, 7, 47, 48, 49, 63, 64, 65, 1000])  # kChunk = 48
def test_sizes(s, causal, dtype):
    run_case(s, dtype, causal=causal, m=8, dv=12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fmap,normalize", [("relu", True), ("identity", False), ("favor", True), ("rfa", False)])
def test_feature_maps(fmap, normalize, causal, dtype):
    run_case(65, dtype, causal=causal, fmap=fmap, normalize=normalize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,dv", [(16, 40), (40, 16), (64, 64), (128, 96)])
def test_head_dims(m, dv, dtype):
    run_case(129, dtype, causal=True, m=m, dv=dv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opt", ["decay", "init", "mask", "gqa_bshd", "all"])
def test_options(opt, dtype):
    kw = dict(decay=dict(decay=True), init=dict(init=True), mask=dict(mask=True),
              gqa_bshd=dict(b=2, h=6, hk=2, layout="bshd"), all=dict(decay=True, init=True, mask=True, b=2, h=4,
                                                                       hk=2))[opt]
    run_case(97, dtype, causal=True, **kw)
    if "decay" not in kw:
        run_case(97, dtype, causal=False, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, f64], ids=str)
def test_varlen(dtype):
    cu = torch.tensor([0, 7, 7, 70, 71], dtype=torch.int32)
    h, m, dv = 4, 16, 8
    q, k = torch.randn(1, h, 71, m).to(dtype), torch.randn(1, 2, 71, m).to(dtype)
    v = torch.randn(1, 2, 71, dv).to(dtype)
    acc = ops.acc_dtype(dtype)
    s0 = torch.rand(4, h, m, dv + 1, dtype=acc)
    g = -0.1 * torch.rand(1, h, 71, dtype=acc)
    out, den, final = ops.fwd(q, k, v, decay=g, initial_state=s0, key_mask=None, cu_seqlens=cu, max_seqlen=63,
                              feature_map=1, causal=True, normalize=True, eps=1e-6, scale=1.0)
    r = reference.linear_attention(q.to(f64), k.to(f64), v.to(f64), causal=True, decay=g.to(f64),
                                   initial_state=s0.to(f64), cu_seqlens=cu)
    lo = reference.linear_attention(q, k, v, causal=True, decay=g.to(dtype), initial_state=s0.to(dtype), cu_seqlens=cu)
    assert_close_fa2(out, lo[0], r[0], dtype, "out")
    assert_close_fa2(final, lo[2], r[2], dtype, "final_state")
    assert den.shape == (1, h, 71) and den.dtype == acc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gradients(causal, dtype):
    """A varlen pack's gradients (q, k, v, decay, initial state) through the op against the
    float64 reference, per FA2's rule (gradcheck covers float64)."""
    cu = torch.tensor([0, 7, 7, 70, 71], dtype=torch.int32)
    h, m, dv, total = 4, 16, 8, 71
    acc = ops.acc_dtype(dtype)
    leaves = [(0.5 * torch.randn(1, h, total, m)).to(dtype), (0.5 * torch.randn(1, 2, total, m)).to(dtype),
              torch.randn(1, 2, total, dv).to(dtype), torch.rand(4, h, m, dv + 1, dtype=acc)]
    leaves.append(-0.1 * torch.rand(1, h, total, dtype=acc) if causal else None)

    def run(rdt, fwd):
        xs = [None if x is None else x.detach().to(rdt if i < 3 else (acc if fwd else rdt)).requires_grad_()
              for i, x in enumerate(leaves)]
        if fwd:
            out, _, final = ops.fwd(*xs[:3], decay=xs[4], initial_state=xs[3], key_mask=None, cu_seqlens=cu,
                                    max_seqlen=63, feature_map=1, causal=causal, normalize=True, eps=1e-6, scale=1.0)
        else:
            out, _, final = reference.linear_attention(*xs[:3], causal=causal, decay=xs[4], initial_state=xs[3],
                                                       cu_seqlens=cu)
        return out, final, xs

    out, final, ours = run(dtype, True)
    dout, dfin = torch.randn_like(out), torch.randn_like(final)
    torch.autograd.backward([out, final], [dout, dfin])
    ref, low = [], []
    for rdt, into in ((f64, ref), (dtype, low)):
        o, f, xs = run(rdt, False)
        torch.autograd.backward([o, f], [dout.to(rdt), dfin.to(rdt)])
        into.extend(xs)
    for name, a, r, lo in zip(("dq", "dk", "dv", "dinitial_state", "ddecay"), ours, ref, low):
        if a is not None:
            assert_close_fa2(a.grad, lo.grad, r.grad, dtype, name)


def test_den_and_shapes():
    q, k, v = torch.randn(2, 4, 33, 8), torch.randn(2, 2, 33, 8), torch.randn(2, 2, 33, 5)
    for normalize in (True, False):
        out, den, final = ops.fwd(q, k, v, decay=None, initial_state=None, key_mask=None, cu_seqlens=None,
                                  max_seqlen=33, feature_map=1, causal=True, normalize=normalize, eps=1e-6, scale=1.0)
        r = reference.linear_attention(q.double(), k.double(), v.double(), causal=True, normalize=normalize)
        assert out.shape == (2, 4, 33, 5) and final.shape == (2, 4, 8, 5 + normalize)
        torch.testing.assert_close(den.double(), r[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final.double(), r[2], rtol=1e-4, atol=1e-4)
    qb = torch.randn(2, 33, 4, 8).transpose(1, 2)  # (B, S, H, D) storage: out keeps it
    out = ops.fwd(qb, k, v, decay=None, initial_state=None, key_mask=None, cu_seqlens=None, max_seqlen=33,
                  feature_map=1, causal=False, normalize=True, eps=1e-6, scale=1.0)[0]
    assert out.stride(1) < out.stride(2)


def test_no_nan_with_large_activations_and_long_sequences():
    s = 4096 if STANDIN else 65536  # the stand-in is quadratic
    for dtype in (torch.bfloat16, torch.float16):
        q, k = (8 * torch.randn(1, 1, s, 16)).to(dtype), (8 * torch.randn(1, 1, s, 16)).to(dtype)
        v = (8 * torch.randn(1, 1, s, 16)).to(dtype)
        for causal in (True, False):
            out, den, final = ops.fwd(q, k, v, decay=None, initial_state=None, key_mask=None, cu_seqlens=None,
                                      max_seqlen=s, feature_map=1, causal=causal, normalize=True, eps=1e-6, scale=1.0)
            assert torch.isfinite(out).all() and torch.isfinite(den).all() and torch.isfinite(final).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("stabilize", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_favor_projection_gradient(causal, stabilize, dtype):
    """A learnable FAVOR+ projection (a Parameter) gets the float64 reference's gradient within
    FA2's rule, through the op, stabilized (the offsets are constants that cancel at eps = 0) or
    not."""
    import copy

    m, s = 16, 40
    fm = feature_maps.Favor(m, 24, stabilize=stabilize, seed=0, learnable=True)
    g = torch.Generator().manual_seed(0)
    q, k = (0.5 * torch.randn(1, 2, s, m, generator=g)).to(dtype), (0.5 * torch.randn(1, 1, s, m, generator=g)).to(dtype)
    v = torch.randn(1, 1, s, 8, generator=g).to(dtype)
    out = ae.linear_attention(q, k, v, feature_map=fm, causal=causal, eps=0.0)
    dout = torch.randn_like(out)
    out.backward(dout)

    def ref(rdt):
        f = copy.deepcopy(fm)
        f.projection.grad = None
        f.stabilize = False
        x = [t.to(rdt) for t in (q, k, v)]
        o = reference.linear_attention(f(x[0], is_query=True), f(x[1]), x[2], feature_map=0, causal=causal, eps=0.0)[0]
        o.backward(dout.to(rdt))
        return o, f.projection.grad

    r_out, r_grad = ref(f64)
    lo_out, lo_grad = ref(dtype)
    assert_close_fa2(out, lo_out, r_out, dtype, "out")
    assert fm.projection.grad.abs().sum() > 0
    assert_close_fa2(fm.projection.grad, lo_grad, r_grad, dtype, "dprojection")


def test_no_nan_random_features_long_and_large():
    """FAVOR+ (stabilized: key features <= 1) and RFA at S = 65536 with large activations in bf16
    and fp16: a finite, positive (FAVOR+) normalizer and a finite output."""
    s = 4096 if STANDIN else 65536
    x = 8 * torch.randn(1, 1, s, 16)
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = x.to(dtype), x.flip(2).to(dtype), x.to(dtype)
        for fmap in (feature_maps.Favor(16, 16, seed=0), feature_maps.RFA(16, 8, seed=0)):
            for causal in (True, False):
                out, st = ae.linear_attention(q, k, v, feature_map=fmap, causal=causal, return_state=True)
                assert torch.isfinite(out).all() and torch.isfinite(st.z).all() and torch.isfinite(st.S).all()
                if isinstance(fmap, feature_maps.Favor):
                    assert (st.z > 0).any()


# ---------------------------------------------------------------------------------- gradcheck, opcheck
def _args(causal=True, decay=True, init=True, mask=True, varlen=False, normalize=True, dtype=f64, s=6, rg=True):
    b = 1 if varlen else 2
    q = torch.randn(b, 2, s, 3, dtype=dtype, requires_grad=rg)
    k = torch.randn(b, 1, s, 3, dtype=dtype, requires_grad=rg)
    v = torch.randn(b, 1, s, 2, dtype=dtype, requires_grad=rg)
    acc = ops.acc_dtype(dtype)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32) if varlen else None
    nb = 2
    g = (-torch.rand(b, 2, s, dtype=acc)).requires_grad_(rg) if decay else None
    s0 = torch.rand(nb, 2, 3, 2 + normalize, dtype=acc).requires_grad_(rg) if init else None
    km = (torch.rand(b, s) > 0.3) if mask else None
    return dict(q=q, k=k, v=v, decay=g, initial_state=s0, key_mask=km, cu_seqlens=cu, max_seqlen=s,
                feature_map=1, causal=causal, normalize=normalize, eps=1e-6, scale=0.7, keep_residual=True)


GRAD_CASES = [dict(), dict(causal=False, decay=False), dict(normalize=False), dict(varlen=True),
              dict(varlen=True, causal=False, decay=False, mask=False), dict(init=False, mask=False)]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "all")
def test_gradcheck(case):
    a = _args(**case)
    names = [n for n in ("q", "k", "v", "decay", "initial_state") if a[n] is not None]

    def fn(*xs):
        kw = dict(a, **dict(zip(names, xs)))
        out, _, final = ops.fwd(**kw)
        return out, final

    assert torch.autograd.gradcheck(fn, tuple(a[n] for n in names))


def _gradcheck(a):
    """gradcheck's fast mode (the Jacobian against random projections u^T J v, one numerical
    directional derivative instead of one per input element): these problems span several
    chunks, and the full Jacobian took 15-32 s each; GRAD_CASES above check it whole."""
    names = [n for n in ("q", "k", "v", "decay", "initial_state") if a[n] is not None]

    def fn(*xs):
        out, _, final = ops.fwd(**dict(a, **dict(zip(names, xs))))
        return out, final

    assert torch.autograd.gradcheck(fn, tuple(a[n] for n in names), fast_mode=True)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_across_chunks(causal):
    """Three chunks (kChunk = 48) with a short last one: the stored chunk states, the descending sweep's
    reverse state and the running ddecay sum cross chunk boundaries (s = 6 above stays in one)."""
    _gradcheck(_args(s=130, causal=causal, decay=causal))


@pytest.mark.parametrize("feature_map", [1, 2])
@pytest.mark.parametrize("scale", [-0.7, 0.7])
def test_gradcheck_feature_sign(feature_map, scale):
    """The feature derivative is taken from the featurized rows alone; a negative scale flips
    which side of the comparison x > 0 lands on."""
    _gradcheck(dict(_args(s=70, mask=False), feature_map=feature_map, scale=scale))


def test_recycled_outputs_do_not_alias():
    """Outputs of 2 MB and up come from a cache of freed blocks: a kept output must survive the
    next calls, and a recycled block must be fully rewritten."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 1024, 64) for _ in range(3))  # out: 2 MB
    opts = dict(decay=None, initial_state=None, key_mask=None, cu_seqlens=None, max_seqlen=1024, feature_map=1,
                causal=True, normalize=True, eps=1e-6, scale=1.0)
    first = ops.fwd(q, k, v, **opts)[0]
    keep = first.clone()
    for _ in range(3):
        ops.fwd(2 * q, k, v, **opts)  # freed at once: its block goes back to the cache
    again = ops.fwd(q, k, v, **opts)[0]
    assert torch.equal(first, keep) and torch.equal(again, keep)
    assert again.data_ptr() != first.data_ptr()


def test_empty_cpu_cache():
    """attention_ext.empty_cpu_cache() hands the kept output blocks back and reports their bytes;
    outputs alive at the time are untouched."""
    if STANDIN:
        pytest.skip("the stand-in allocates with torch, no block cache")
    if getattr(ae._ext._C, "sanitize", 0):
        pytest.skip("sanitized build: exact-size output blocks freed with their tensor, no cache (csrc/cpu/memory.h)")
    import attention_ext

    q, k, v = (torch.randn(1, 8, 1024, 64) for _ in range(3))  # out: 2 MB, den 32 KB
    opts = dict(decay=None, initial_state=None, key_mask=None, cu_seqlens=None, max_seqlen=1024, feature_map=1,
                causal=True, normalize=True, eps=1e-6, scale=1.0)
    live = ops.fwd(q, k, v, **opts)[0]
    keep = live.clone()
    attention_ext.empty_cpu_cache()
    ops.fwd(q, k, v, **opts)  # its 2 MB output is kept when it dies
    assert attention_ext.empty_cpu_cache() >= q.numel() * 4
    assert attention_ext.empty_cpu_cache() == 0
    assert torch.equal(live, keep)


@pytest.mark.parametrize("case", GRAD_CASES[:4], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "all")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_fwd(case, dtype):
    a = _args(dtype=dtype, **case)  # keep_residual=True: bf16 normalized calls return the residual
    torch.library.opcheck(torch.ops.attention_ext.linear_fwd.default, tuple(a[n] for n in ops.FWD_ARGS))


@pytest.mark.parametrize("dtype", [torch.float32, f64, torch.bfloat16], ids=str)
def test_opcheck_bwd(dtype):
    if STANDIN:
        pytest.skip("the stand-in's backward runs autograd inside the kernel, which opcheck's schema check rejects")
    a = _args(dtype=dtype, rg=False)
    out, den, final, res = torch.ops.attention_ext.linear_fwd(*[a[n] for n in ops.FWD_ARGS])
    assert res.shape == (out.shape if dtype == torch.bfloat16 else (0,))
    b = dict(a, dout=torch.randn_like(out), dfinal_state=torch.randn_like(final), out=out, den=den,
             out_residual=res if res.numel() else None)
    torch.library.opcheck(torch.ops.attention_ext.linear_bwd.default, tuple(b[n] for n in ops.BWD_ARGS))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 5e-3)], ids=str)
@pytest.mark.parametrize("s,vscale", [(1, 1.0), (3, 1.0), (1, 1e-3)])
def test_normalized_grad_one_key_rows(dtype, tol, s, vscale):
    """Normalized, 16-bit: a row that sees one key (row 0 of a causal sequence) has out_0 =
    v_0 (1 - eps / den_0), and d k_0 is the small eps / den_0 part of dout . (v_0 - out_0) / den_0,
    which out's 16-bit rounding swamps where den_0 is within ~1e3 of eps (small relu features).
    The op keeps out's rounding residual for its backward (ops.fwd, keep_residual), so the
    gradient keeps ~2^-17 of out. Found by the long fuzz profile (grad k 0 against 0.088); without
    the residual this measured 2.3 (bf16) and 0.31 (fp16) relative error, PyTorch's own
    same-dtype autograd 8.2 and inf, so the bound here is absolute, not PyTorch's. vscale: small
    outputs, whose fp16 residual would be subnormal unscaled (0.23 at 1e-4; it is stored times
    2^11), found by a review."""
    worst = 0.0
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        q, k = ((0.03 * torch.rand(2, 2, s, 2, dtype=f64, generator=g)).to(dtype).requires_grad_() for _ in range(2))
        v = (vscale * torch.randn(2, 2, s, 4, dtype=f64, generator=g)).to(dtype).requires_grad_()
        out = ae.linear_attention(q, k, v, feature_map="relu", causal=True, normalize=True)
        dout = torch.randn(out.shape, dtype=f64, generator=g).to(dtype)
        ours = torch.autograd.grad(out, (q, k, v), dout)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = reference.linear_attention(*leaves, feature_map=2, causal=True, normalize=True)[0]
        exact = torch.autograd.grad(ref, leaves, dout.double())
        for a, r in zip(ours, exact):
            worst = max(worst, ((a.double() - r).abs().max() / r.abs().max()).item())
    assert worst <= tol, worst


def test_residual_kept_only_where_read():
    """ops.fwd keeps out's rounding residual (linear_fwd's 4th output, saved for the backward) for
    normalized 16-bit calls whose backward reads d den: q, k, decay or the initial state needs a
    gradient (dv never reads it), under grad mode."""
    q, k, v = (torch.randn(1, 2, 5, 4).bfloat16() for _ in range(3))

    from attention_ext.linear.ops import _keep_residual
    assert _keep_residual(q.requires_grad_(), k, {}) and _keep_residual(q.detach(), k.requires_grad_(), {})
    assert not _keep_residual(q.detach(), k.detach(), {})  # v alone: dv never reads d den
    with torch.no_grad():
        assert not _keep_residual(q.requires_grad_(), k, {})
    g = torch.zeros(1, 2, 5, requires_grad=True)
    assert _keep_residual(q.detach(), k.detach(), {"decay": g})
    # on CUDA only the SIMT kernels (M > 128) keep one, and the op refuses it below: decided from
    # the tensor's device, which the op's Meta kernel (fake tensors, torch.compile) never sees
    # (a review found the fake kernel's residual shaped like out where the CUDA kernels kept none)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        for m, want in ((64, False), (128, False), (136, True)):
            qc = torch.empty(1, 2, 5, m, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            assert _keep_residual(qc, qc, {}) == want
    a = dict(decay=None, initial_state=None, key_mask=None, cu_seqlens=None, max_seqlen=5, feature_map=1,
             causal=True, normalize=True, eps=1e-6, scale=1.0)
    for normalize, dt, want in ((True, torch.bfloat16, True), (False, torch.bfloat16, False),
                                (True, torch.float32, False)):
        args = dict(a, q=q.detach().to(dt), k=k.detach().to(dt), v=v.to(dt), normalize=normalize, keep_residual=True)
        res = torch.ops.attention_ext.linear_fwd(*[args[n] for n in ops.FWD_ARGS])[3]
        assert (res.shape == (1, 2, 5, 4)) == want and (res.numel() == 0) != want


def test_only_final_state_reaches_the_loss():
    a = _args()
    out, _, final = ops.fwd(**a)
    final.sum().backward()
    ref = reference.linear_attention(*(a[n].detach().requires_grad_() for n in ("q", "k", "v")), causal=True,
                                     decay=a["decay"].detach(), initial_state=a["initial_state"].detach(),
                                     key_mask=a["key_mask"], scale=0.7)[2]
    torch.testing.assert_close(final, ref)
    assert a["q"].grad.abs().sum() == 0 and a["k"].grad.abs().sum() > 0


BAD = [
    ("q 3-D", lambda a: a.update(q=a["q"][0]), ValueError),
    ("dtype mix", lambda a: a.update(k=a["k"].float()), TypeError),
    ("int dtype", lambda a: a.update(q=a["q"].long(), k=a["k"].long(), v=a["v"].long()), TypeError),
    ("heads", lambda a: a.update(q=a["q"][:, :1].repeat(1, 3, 1, 1), k=a["k"].repeat(1, 2, 1, 1),
                                 v=a["v"].repeat(1, 2, 1, 1), decay=None, initial_state=None), ValueError),
    ("feature dim", lambda a: a.update(k=a["k"][..., :2]), ValueError),
    ("length", lambda a: a.update(k=a["k"][:, :, :4]), ValueError),
    ("decay non-causal", lambda a: a.update(causal=False), ValueError),
    ("decay dtype", lambda a: a.update(decay=a["decay"].float()), TypeError),
    ("decay shape", lambda a: a.update(decay=a["decay"][..., :3]), ValueError),
    ("state shape", lambda a: a.update(initial_state=a["initial_state"][..., :2]), ValueError),
    ("mask dtype", lambda a: a.update(key_mask=a["key_mask"].float()), TypeError),
    ("feature_map", lambda a: a.update(feature_map=7), ValueError),
    ("eps", lambda a: a.update(eps=-1.0), ValueError),
    ("last stride", lambda a: a.update(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError),
]


@pytest.mark.parametrize("name,mutate,exc", BAD, ids=[c[0] for c in BAD])
def test_fake_checks_match_cpp(name, mutate, exc):
    """The op on CPU tensors and on fake tensors (its Meta kernel: torch.compile's path) rejects
    the same inputs with the same type and message: both run the one C++ check."""
    a = _args(rg=False)
    mutate(a)
    args = tuple(a[n] for n in ops.FWD_ARGS)
    with pytest.raises(exc) as real:
        torch.ops.attention_ext.linear_fwd(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args)
        with pytest.raises(exc) as faked:
            torch.ops.attention_ext.linear_fwd(*fake)
    assert str(faked.value).splitlines()[0] == str(real.value).splitlines()[0]


def test_linear_check_op():
    """linear_check, the reference fallback's check: linear_fwd's own C++ rules on any device (meta
    tensors here), the same errors as the op, and opcheck."""
    a = _args(rg=False, dtype=torch.float32)
    args = tuple(a[n] for n in ("q", "k", "v", *ops.OPTION_NAMES))
    torch.library.opcheck(torch.ops.attention_ext.linear_check.default, args)
    torch.ops.attention_ext.linear_check(*[x.to("meta") if isinstance(x, torch.Tensor) else x for x in args])
    bad = dict(a, k=a["k"][..., :2])
    bad_args = tuple(bad[n] for n in ("q", "k", "v", *ops.OPTION_NAMES))
    with pytest.raises(ValueError) as op:
        torch.ops.attention_ext.linear_fwd(*bad_args)
    with pytest.raises(ValueError) as check:
        torch.ops.attention_ext.linear_check(*[x.to("meta") if isinstance(x, torch.Tensor) else x for x in bad_args])
    assert str(check.value).splitlines()[0] == str(op.value).splitlines()[0]


def test_set_cuda_kernels_selection():
    """linear.set_cuda_kernels returns the previous selection (so **old restores it) and names a
    bad segment_chunks; on the CPU it changes nothing."""
    old = ae.linear.set_cuda_kernels(chunk_parallel=True, segment_chunks=3, chunk_states=True, delta_chunked=True)
    want = dict(chunk_parallel=True, segment_chunks=3, chunk_states=True, delta_chunked=True)
    try:
        assert ae.linear.cuda_kernels() == want
        if ops.HAS_OP:
            with pytest.raises(ValueError, match="segment_chunks"):
                ae.linear.set_cuda_kernels(chunk_parallel=True, segment_chunks=-1)
            with pytest.raises(ValueError, match="delta_chunked"):
                torch.ops.attention_ext.delta_set_cuda_kernels(2)
        q = torch.randn(1, 2, 9, 8)
        torch.testing.assert_close(ae.linear_attention(q, q, q, causal=True),
                                   reference.linear_attention(q, q, q, causal=True)[0])
    finally:
        assert ae.linear.set_cuda_kernels(**old) == want
    assert ae.linear.cuda_kernels() == old


@pytest.mark.parametrize("big", [1e4, 1e9, float("inf")])
@pytest.mark.parametrize("normalize", [True, False])
def test_extreme_gates_give_the_recurrence(big, normalize):
    """decay of -1e4, -1e9 and -inf (a hard reset) inside a chunk and at a chunk's first row: the
    chunked kernel's out, final state and gradients equal the recurrent form's (reference.linear_step
    in float64), finite everywhere. The weights are sums of the gates between two rows, never a
    difference of running sums, which loses the small gates after a large one and gives NaN
    after -inf."""
    import attention_ext as ae
    from attention_ext.linear import reference as ref

    torch.manual_seed(0)
    b, h, s, m, dv = 1, 2, 150, 8, 5
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for d in (m, m, dv))
    decay = -0.1 * torch.rand(b, h, s, dtype=torch.float64)
    decay[:, 0, 30] = -big   # inside the first chunk
    decay[:, 1, 64] = -big   # a chunk's first row
    decay[:, :, 100] = -big
    leaves = [t.clone().requires_grad_() for t in (q, k, v, decay)]
    out, st = ae.linear_attention(*leaves[:3], causal=True, decay=leaves[3], normalize=normalize, return_state=True)
    fin = st.augmented(normalize)
    assert torch.isfinite(out).all() and torch.isfinite(fin).all()
    # the recurrence, position by position, in float64
    r_leaves = [t.clone().requires_grad_() for t in (q, k, v, decay)]
    state = torch.zeros(b, h, m, dv, dtype=torch.float64)
    z = torch.zeros(b, h, m, dtype=torch.float64) if normalize else None
    r_out, state, z = ref.linear_step(*r_leaves[:3], state, z, r_leaves[3], feature_map=1, inplace=False)
    torch.testing.assert_close(out, r_out, rtol=1e-9, atol=1e-9)
    r_fin = torch.cat([state, z.unsqueeze(-1)], -1) if normalize else state
    torch.testing.assert_close(fin, r_fin, rtol=1e-9, atol=1e-9)
    g = torch.randn_like(out)
    ours = torch.autograd.grad((out * g).sum() + fin.sum(), leaves)
    want = torch.autograd.grad((r_out * g).sum() + r_fin.sum(), r_leaves)
    for name, a, w in zip(("dq", "dk", "dv", "ddecay"), ours, want):
        assert torch.isfinite(a).all(), name
        fin_w = torch.isfinite(w)
        torch.testing.assert_close(a[fin_w], w[fin_w], rtol=1e-7, atol=1e-7, msg=name)
