"""attention_ext.lsh_attention (Reformer's shared-QK LSH attention) against its float64 reference
(attention_ext.sparse.reference.lsh_attention_ref, a dense statement of the semantics): outputs,
LSEs and gradients in float32 / bfloat16 / float16 under the project's rule, odd sizes, causal,
several rounds, both layouts; the hash; gradcheck, opcheck, torch.compile; the special case of
one bucket; and the errors."""
from __future__ import annotations

import math

import pytest
import torch

import attention_ext as ae
from attention_ext.softmax import ops
from attention_ext.softmax import reference as softmax_ref
from attention_ext.sparse import lsh_buckets
from attention_ext.sparse.reference import lsh_attention_ref, lsh_buckets_ref
from tests.fuzz.common import check_grad, check_out

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")

f64 = torch.float64
LSH = torch.ops.attention_ext.lsh_attention if ops.HAS_EXT else None


def problem(b, h, s, d, n_buckets, n_hashes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(b, h, s, d, dtype=f64, generator=g).to(dtype)
    v = torch.randn(b, h, s, d, dtype=f64, generator=g).to(dtype)
    rot = torch.randn(n_hashes, d, n_buckets // 2, dtype=f64, generator=g)
    return qk, v, rot


# (B, H, S, D, n_buckets, n_hashes, chunk_size): odd lengths and dims, one chunk or many, a
# partial last chunk, chunks longer than the sequence, one bucket
SHAPES = [(2, 3, 100, 16, 8, 1, 16), (1, 2, 77, 24, 4, 3, 10), (1, 1, 33, 5, 1, 2, 40), (2, 2, 130, 64, 16, 2, 8),
          (1, 3, 1, 8, 4, 2, 4), (1, 2, 64, 33, 32, 1, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_float64_matches_reference(shape, causal):
    b, h, s, d, nb, nh, c = shape
    qk, v, rot = problem(b, h, s, d, nb, nh, f64)
    out, lse = ae.lsh_attention(qk, v, n_buckets=nb, n_hashes=nh, chunk_size=c, causal=causal, rotations=rot,
                                return_lse=True)
    ref, ref_lse = lsh_attention_ref(qk, v, rot, nb, c, causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_out_and_grads(dtype, layout, causal):
    """Out, LSE and the gradients of qk and v against float64, within the project's rule of
    PyTorch's own error doing the reference's math in `dtype`. The reference hashes with the
    op's buckets (a near-tie may round to the other bucket in float32: lsh_buckets is tested
    against float64 apart from near-ties below)."""
    b, h, s, d, nb, nh, c = 2, 3, 150, 40, 8, 2, 24
    qk, v, rot = problem(b, h, s, d, nb, nh, dtype, seed=1)
    buckets = lsh_buckets(qk, rot, nb)
    t = (lambda x: x.transpose(1, 2)) if layout == "bshd" else (lambda x: x)
    leaves = [t(qk).detach().clone().requires_grad_(), t(v).detach().clone().requires_grad_()]
    out, lse = ae.lsh_attention(leaves[0], leaves[1], n_buckets=nb, n_hashes=nh, chunk_size=c, causal=causal,
                                rotations=rot, layout=layout, return_lse=True)
    out = t(out)
    refs = {}
    for dt in (f64, dtype):
        lv = [qk.detach().to(dt).requires_grad_(), v.detach().to(dt).requires_grad_()]
        refs[dt] = (lsh_attention_ref(lv[0], lv[1], rot, nb, c, causal=causal, buckets=buckets), lv)
    (r64, r64_lse), l64 = refs[f64]
    (rlow, _), llow = refs[dtype]
    check_out(out, rlow, r64, dtype, "out")
    assert lse.dtype == torch.float32
    # relative: a query alone in every round has lse ~ -1e5, held in float32
    lse_tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert ((lse.double() - r64_lse).abs() / r64_lse.abs().clamp_min(1)).max().item() <= lse_tol
    dout = torch.randn(out.shape, dtype=f64).to(dtype)
    ours = torch.autograd.grad(out, leaves, dout)
    g64 = torch.autograd.grad(r64, l64, dout.double())
    glow = torch.autograd.grad(rlow, llow, dout)
    for name, o, r, lo in zip(("dqk", "dv"), ours, g64, glow):
        check_grad(t(o), lo, r, dtype, name)


def test_hash_matches_float64_apart_from_near_ties():
    qk, _, rot = problem(2, 3, 500, 24, 16, 3, torch.float32, seed=2)
    ours, ref = lsh_buckets(qk, rot, 16), lsh_buckets_ref(qk, rot, 16)
    assert ours.shape == (2, 3, 3, 500) and ours.dtype == torch.long
    x = torch.einsum("bhsd,rdn->bhrsn", qk.double(), rot)
    top2 = torch.cat([x, -x], -1).topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4
    assert clear.float().mean() > 0.99
    assert torch.equal(ours[clear], ref[clear])
    assert torch.equal(lsh_buckets(qk.double(), rot, 16), ref)  # float64 hashes exactly as the reference
    assert torch.equal(lsh_buckets(qk, rot[:, :, :0], 1), torch.zeros(2, 3, 3, 500, dtype=torch.long))


def test_ties_take_the_first_maximum():
    """argmax([xR; -xR])'s first-maximum rule: x R = (1, -1) ties +1 (bucket 0) and -(-1) (bucket
    2): bucket 0; x R = (0, 0): bucket 0."""
    rot = torch.eye(2, dtype=f64).unsqueeze(0)
    qk = torch.tensor([[1.0, -1.0], [0.0, 0.0], [-1.0, 0.5], [0.5, -2.0]], dtype=f64).view(1, 1, 4, 2)
    assert lsh_buckets(qk, rot, 4).flatten().tolist() == [0, 0, 2, 3]
    assert lsh_buckets_ref(qk, rot, 4).flatten().tolist() == [0, 0, 2, 3]


@pytest.mark.parametrize("causal", [False, True])
def test_one_bucket_one_chunk_is_full_attention_with_the_self_mask(causal):
    """n_buckets = 1 and chunk_size >= S: every query attends every other key (every earlier one
    when causal), at scale 1 / sqrt(D) over unit keys; a query with no other key (causal i = 0)
    returns its own value."""
    b, h, s, d = 2, 3, 45, 16
    qk, v, _ = problem(b, h, s, d, 2, 1, f64, seed=3)
    out = ae.lsh_attention(qk, v, n_buckets=1, chunk_size=64, causal=causal)
    keys = qk / qk.norm(dim=-1, keepdim=True)
    mask = ~torch.eye(s, dtype=torch.bool)
    if causal:
        mask &= torch.ones(s, s, dtype=torch.bool).tril()
    ref, _ = softmax_ref.attention(qk, keys, v, bias=mask, scale=1 / math.sqrt(d))
    if causal:
        ref[:, :, 0] = v[:, :, 0]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_alone_query_returns_its_value_and_self_logit():
    """A query alone in its bucket and chunks: out = v_i, lse = -1e5 (one round)."""
    qk = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.9, 0.1]], dtype=f64).view(1, 1, 3, 2)
    v = torch.randn(1, 1, 3, 2, dtype=f64)
    rot = torch.tensor([[[1.0], [0.0]]], dtype=f64)  # two buckets: the sign of x0
    out, lse = ae.lsh_attention(qk, v, n_buckets=2, chunk_size=4, rotations=rot, return_lse=True)
    assert lsh_buckets(qk, rot, 2).flatten().tolist() == [0, 1, 0]
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, 1])
    assert lse[0, 0, 1].item() == -1e5
    assert lse[0, 0, 0].item() > -10  # 0 and 2 share a bucket and see each other


def test_rotations_drawn_from_the_generator():
    qk, v, _ = problem(1, 2, 70, 16, 8, 2, torch.float32, seed=4)
    a = ae.lsh_attention(qk, v, n_buckets=8, n_hashes=2, chunk_size=8, generator=torch.Generator().manual_seed(5))
    b = ae.lsh_attention(qk, v, n_buckets=8, n_hashes=2, chunk_size=8, generator=torch.Generator().manual_seed(5))
    rot = torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(5))
    c = ae.lsh_attention(qk, v, n_buckets=8, n_hashes=2, chunk_size=8, rotations=rot)
    assert torch.equal(a, b) and torch.equal(a, c)
    torch.manual_seed(6)
    d = ae.lsh_attention(qk, v, n_buckets=8, n_hashes=2, chunk_size=8)
    torch.manual_seed(6)
    assert torch.equal(d, ae.lsh_attention(qk, v, n_buckets=8, n_hashes=2, chunk_size=8))


def test_gradcheck_float64():
    qk, v, rot = problem(1, 2, 30, 6, 4, 2, f64, seed=7)
    qk.requires_grad_(), v.requires_grad_()
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda a, b: ae.lsh_attention(a, b, n_buckets=4, n_hashes=2, chunk_size=5, causal=causal, rotations=rot),
            (qk, v))


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck(causal):
    qk, v, rot = problem(2, 2, 37, 8, 4, 2, torch.float32, seed=8)
    qk.requires_grad_(), v.requires_grad_()
    torch.library.opcheck(LSH, (qk, v, rot, 4, 2, 6, causal))
    torch.library.opcheck(torch.ops.attention_ext.lsh_buckets, (qk, rot, 4))


def test_torch_compile_matches_eager_across_lengths():
    rot = torch.randn(2, 16, 4)
    f = lambda a, b: ae.lsh_attention(a, b, n_buckets=8, n_hashes=2, chunk_size=16, rotations=rot,  # noqa: E731
                                      causal=True)
    g = torch.compile(f, fullgraph=True)
    for s in (100, 130):  # the second length recompiles with a symbolic S
        qk, v, _ = problem(2, 3, s, 16, 8, 2, torch.float32, seed=s)
        qk.requires_grad_()
        out = g(qk, v)
        torch.testing.assert_close(out, f(qk, v), rtol=1e-5, atol=1e-6)
        (dq,) = torch.autograd.grad(out.sum(), qk)
        (dq_eager,) = torch.autograd.grad(f(qk, v).sum(), qk)
        torch.testing.assert_close(dq, dq_eager, rtol=1e-4, atol=1e-5)


def test_memory_is_chunked_not_quadratic():
    """No S x S tensor: every tensor the op makes (forward and backward) is O(S * chunk_size),
    the largest being the (S / C, C, 2C) mask of the chunk pairs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    s, c = 4096, 32
    qk, v, rot = problem(1, 1, s, 16, 128, 1, torch.float32, seed=9)
    qk.requires_grad_()
    with Largest():
        ae.lsh_attention(qk, v, n_buckets=128, chunk_size=c, rotations=rot).sum().backward()
    assert Largest.numel <= 2 * s * c, Largest.numel
    assert Largest.numel < s * s // 32


@pytest.mark.parametrize("kw, match", [
    (dict(n_buckets=3), "n_buckets must be 1 or an even number"),
    (dict(n_buckets=0), "n_buckets must be 1 or an even number"),
    (dict(chunk_size=0), r"chunk_size must be in \[1, 2\^30\)"),
    (dict(n_hashes=0), "n_hashes must be >= 1"),
    (dict(rotations=torch.randn(1, 5, 4)), r"rotations must be \(n_hashes, D, n_buckets // 2\) = \(1, 8, 4\)"),
    (dict(rotations=torch.randn(2, 8, 4)), r"rotations must be \(n_hashes, D, n_buckets // 2\) = \(1, 8, 4\)"),
    (dict(v=torch.randn(1, 2, 10, 9)), "v must have qk's shape"),
    (dict(v=torch.randn(1, 2, 10, 8, dtype=f64)), "qk and v must have one dtype"),
    (dict(qk=torch.randn(2, 10, 8)), "qk must be 4-D"),
    (dict(layout="bsdh"), "layout must be 'bhsd' or 'bshd'"),
])
def test_errors_name_the_argument(kw, match):
    args = dict(qk=torch.randn(1, 2, 10, 8), v=torch.randn(1, 2, 10, 8), n_buckets=8, chunk_size=4)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        ae.lsh_attention(args.pop("qk"), args.pop("v"), **args)


def test_edge_sizes():
    """No positions: empty outputs. A chunk far longer than the sequence: one chunk (the mask is
    sized by the sequence, not by chunk_size), equal to chunk_size = S."""
    out, lse = ae.lsh_attention(torch.randn(2, 3, 0, 8), torch.randn(2, 3, 0, 8), n_buckets=4, return_lse=True)
    assert out.shape == (2, 3, 0, 8) and lse.shape == (2, 3, 0)
    qk, v, rot = problem(1, 2, 50, 8, 4, 2, f64, seed=10)
    big = ae.lsh_attention(qk, v, n_buckets=4, n_hashes=2, chunk_size=10 ** 8, rotations=rot)
    torch.testing.assert_close(big, ae.lsh_attention(qk, v, n_buckets=4, n_hashes=2, chunk_size=50, rotations=rot))
    torch.testing.assert_close(big, lsh_attention_ref(qk, v, rot, 4, 10 ** 8)[0], rtol=1e-10, atol=1e-10)


def test_alone_in_one_round_of_two():
    """A query alone in one round and not the other: that round's weight is about exp(-1e5) = 0, so
    the output is the other round's; the LSE combines both as the reference does."""
    qk = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.9, 0.1], [-0.8, 0.3]], dtype=f64).view(1, 1, 4, 2)
    v = torch.randn(1, 1, 4, 2, dtype=f64)
    rot = torch.tensor([[[1.0], [0.0]], [[0.0], [1.0]]], dtype=f64)  # round 0: sign of x0, round 1: of x1
    out, lse = ae.lsh_attention(qk, v, n_buckets=2, n_hashes=2, chunk_size=4, rotations=rot, return_lse=True)
    ref, ref_lse = lsh_attention_ref(qk, v, rot, 2, 4)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(rotations=torch.randn(1, 8, 4, device="meta")), ValueError, "rotations must be on qk's device"),
    (dict(rotations=torch.ones(1, 8, 4, dtype=torch.long)), TypeError, "rotations must be floating point"),
    (dict(chunk_size=2 ** 40), ValueError, r"chunk_size must be in \[1, 2\^30\)"),
    (dict(qk=torch.randn(1, 2, 10, 300), v=torch.randn(1, 2, 10, 300), rotations=torch.randn(1, 300, 4)),
     ValueError, "(?s)head dim.*in attention_ext.lsh_attention"),
])
def test_more_errors(kw, exc, match):
    args = dict(qk=torch.randn(1, 2, 10, 8), v=torch.randn(1, 2, 10, 8), n_buckets=8, chunk_size=4)
    args.update(kw)
    with pytest.raises(exc, match=match):
        ae.lsh_attention(args.pop("qk"), args.pop("v"), **args)


def test_inputs_that_are_not_tensors_are_named():
    """A numpy qk or a float n_buckets is a TypeError naming it (the op's schema error before)."""
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match=r"lsh_attention: qk must be a torch\.Tensor, got numpy\.ndarray: convert it "
                                        r"with torch\.from_numpy\(qk\)"):
        ae.lsh_attention(q.numpy(), q, n_buckets=2)
    with pytest.raises(TypeError, match="lsh_attention: n_buckets must be an int, got 4.0"):
        ae.lsh_attention(q, q, n_buckets=4.0)
    rot = torch.randn(1, 4, 1)
    torch.testing.assert_close(ae.lsh_attention(q, q, n_buckets=torch.tensor(2), rotations=rot),  # an integer
                               ae.lsh_attention(q, q, n_buckets=2, rotations=rot), rtol=0, atol=0)
