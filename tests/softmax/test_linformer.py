"""attention_ext.linformer_attention against its float64 reference (softmax.reference.linformer_attention):
out and the gradients of q, k, v and both projections in float32 / bfloat16 / float16 under the
project's rule; shared and per-head projections, proj_v defaulted, GQA, Sq != Sk, odd sizes, both
layouts; gradcheck, opcheck, torch.compile; the errors."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.softmax import ops
from attention_ext.softmax import reference
from tests.fuzz.common import check_grad, check_out

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")

f64 = torch.float64
OP = torch.ops.attention_ext.linformer_attention if ops.HAS_EXT else None


def problem(b, h, hk, sq, sk, d, r, per_head, own_v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, dtype=f64, generator=g).to(dtype)  # noqa: E731
    q, k, v = mk(b, h, sq, d), mk(b, hk, sk, d), mk(b, hk, sk, d)
    pshape = (hk, r, sk) if per_head else (r, sk)
    proj_k = mk(*pshape) / sk ** 0.5
    proj_v = mk(*pshape) / sk ** 0.5 if own_v else None
    return q, k, v, proj_k, proj_v


# (B, H, H_k, Sq, Sk, D, r)
SHAPES = [(2, 4, 4, 50, 70, 16, 12), (1, 6, 2, 33, 129, 24, 7), (2, 3, 1, 1, 40, 40, 40), (1, 2, 2, 65, 65, 64, 100)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("own_v", [False, True])
def test_float64_matches_reference(shape, per_head, own_v):
    b, h, hk, sq, sk, d, r = shape
    q, k, v, pk, pv = problem(b, h, hk, sq, sk, d, r, per_head, own_v, f64)
    out = ae.linformer_attention(q, k, v, pk, pv, scale=0.3)
    torch.testing.assert_close(out, reference.linformer_attention(q, k, v, pk, pv, scale=0.3), rtol=1e-10,
                               atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("per_head", [False, True])
def test_low_precision_out_and_grads(dtype, layout, per_head):
    b, h, hk, sq, sk, d, r = 2, 4, 2, 77, 150, 40, 33
    base = problem(b, h, hk, sq, sk, d, r, per_head, True, dtype, seed=1)
    t = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
    leaves = [t(x).detach().clone().requires_grad_() for x in base[:3]] + [x.detach().clone().requires_grad_()
                                                                          for x in base[3:]]
    out = t(ae.linformer_attention(*leaves, layout=layout))
    refs = {}
    for dt in (f64, dtype):
        lv = [x.detach().to(dt).requires_grad_() for x in base]
        refs[dt] = (reference.linformer_attention(*lv), lv)
    (r64, l64), (rlow, llow) = refs[f64], refs[dtype]
    check_out(out, rlow, r64, dtype, "out")
    dout = torch.randn(out.shape, dtype=f64).to(dtype)
    ours = torch.autograd.grad(out, leaves, dout)
    g64 = torch.autograd.grad(r64, l64, dout.double())
    glow = torch.autograd.grad(rlow, llow, dout)
    for i, (name, o, r_, lo) in enumerate(zip(("dq", "dk", "dv", "dproj_k", "dproj_v"), ours, g64, glow)):
        check_grad(t(o) if i < 3 else o, lo, r_, dtype, name)


def test_gradcheck_float64():
    q, k, v, pk, pv = problem(1, 4, 2, 9, 13, 6, 5, True, True, f64, seed=2)
    leaves = [x.requires_grad_() for x in (q, k, v, pk, pv)]
    assert torch.autograd.gradcheck(lambda *a: ae.linformer_attention(*a), leaves)
    assert torch.autograd.gradcheck(lambda a, b_, c, p: ae.linformer_attention(a, b_, c, p[0]), leaves[:4])


@pytest.mark.parametrize("per_head", [False, True])
def test_opcheck(per_head):
    q, k, v, pk, pv = problem(2, 4, 2, 11, 23, 8, 6, per_head, True, torch.float32, seed=3)
    for x in (q, k, v, pk, pv):
        x.requires_grad_()
    torch.library.opcheck(OP, (q, k, v, pk, pv, None))
    torch.library.opcheck(OP, (q, k, v, pk, None, 0.25))


def test_torch_compile_matches_eager():
    f = lambda q, k, v, p: ae.linformer_attention(q, k, v, p)  # noqa: E731
    g = torch.compile(f, fullgraph=True)
    for s in (100, 120):
        q, k, v, pk, _ = problem(2, 3, 3, s, s, 16, 32, False, False, torch.float32, seed=s)
        pk.requires_grad_()
        out = g(q, k, v, pk)
        torch.testing.assert_close(out, f(q, k, v, pk), rtol=1e-5, atol=1e-6)
        (dp,) = torch.autograd.grad(out.sum(), pk)
        (dp_eager,) = torch.autograd.grad(f(q, k, v, pk).sum(), pk)
        torch.testing.assert_close(dp, dp_eager, rtol=1e-4, atol=1e-5)


def test_full_rank_identity_projection_is_attention():
    """proj = I (r = S): Linformer is plain softmax attention."""
    q, k, v, _, _ = problem(2, 4, 2, 30, 30, 16, 30, False, False, f64, seed=4)
    eye = torch.eye(30, dtype=f64)
    torch.testing.assert_close(ae.linformer_attention(q, k, v, eye), ae.attention(q, k, v), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw, match", [
    (dict(proj_k=torch.randn(8, 19)), "proj_k's last dim must be k's length S = 20"),
    (dict(proj_k=torch.randn(20)), r"proj_k must be \(r, S\)"),
    (dict(proj_k=torch.randn(3, 8, 20)), r"proj_k per head must be \(H_k, r, S\) with H_k = 2"),
    (dict(proj_k=torch.randn(0, 20)), "r >= 1"),
    (dict(proj_k=torch.randn(8, 20, dtype=f64)), "proj_k must have k's dtype"),
    (dict(proj_v=torch.randn(9, 20)), "proj_k and proj_v must project to the same r"),
    (dict(proj_v=torch.randn(8, 21)), "proj_v's last dim must be v's length"),
    (dict(q=torch.randn(2, 4, 16)), "q must be 4-D"),
    (dict(layout="bsdh"), "layout must be 'bhsd' or 'bshd'"),
])
def test_errors_name_the_argument(kw, match):
    args = dict(q=torch.randn(1, 4, 10, 16), k=torch.randn(1, 2, 20, 16), v=torch.randn(1, 2, 20, 16),
                proj_k=torch.randn(8, 20))
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        ae.linformer_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("proj_k"), **args)


def test_fused_rules_name_the_call():
    """A rule of the fused kernel (the head dim, GQA's head counts) names linformer_attention."""
    with pytest.raises(ValueError, match="(?s)head dim.*in attention_ext.linformer_attention"):
        ae.linformer_attention(torch.randn(1, 2, 5, 300), torch.randn(1, 2, 9, 300), torch.randn(1, 2, 9, 300),
                               torch.randn(4, 9))
    with pytest.raises(ValueError, match="(?s)multiple.*in attention_ext.linformer_attention"):
        ae.linformer_attention(torch.randn(1, 3, 5, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8),
                               torch.randn(4, 9))


def test_inputs_that_are_not_tensors_are_named():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match=r"linformer_attention: q must be a torch\.Tensor, got numpy\.ndarray"):
        ae.linformer_attention(q.numpy(), q, q, torch.randn(3, 8))
    with pytest.raises(TypeError, match=r"linformer_attention: proj_k must be a torch\.Tensor, got list"):
        ae.linformer_attention(q, q, q, [[0.0] * 8] * 3)
