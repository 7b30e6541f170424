"""The plain call: attention() / the SDPA drop-in with no tensor option go through
torch.ops.attention_ext.softmax_fwd_plain (a composite of fwd that also takes few-row CPU calls to the
decode kernel), called from Python by attention_ext._C.softmax_fwd_plain. Each route against the float64
reference, the op under opcheck and gradcheck, the entry's own argument handling, and the ways
back to torch.ops' full path (torch function modes, functorch, torch.compile)."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import attention_ext as ae
from attention_ext import _ext
from attention_ext.softmax import ops
from tests.helpers import assert_close_fa2, rand_qkv, reference_in

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")

PLAIN = torch.ops.attention_ext.softmax_fwd_plain.default


def _ops_run(fn):
    """fn()'s result and the kernel ops it ran, as the profiler records them: the composites that
    route a call (softmax_fwd_plain, softmax_fwd_routed) left out."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        res = fn()
    names = [e.name for e in prof.events() if e.name.startswith("attention_ext::")]
    return res, [n for n in names if n not in ("attention_ext::softmax_fwd_plain", "attention_ext::softmax_fwd_routed")]


def _reference(q, k, v, layout, window, bottom_right, scale, dtype):
    to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    kw = dict(window=window, bottom_right=bottom_right, scale=scale)
    qb, kb, vb = (to_bhsd(t.detach()) for t in (q, k, v))
    ref, ref_lse, _ = reference_in(torch.float64, qb, kb, vb, **kw)
    low, _, _ = reference_in(dtype, qb, kb, vb, **kw)
    return to_bhsd(ref), to_bhsd(low), ref_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 37), (5, 9), (8, 8), (9, 9), (16, 16), (20, 5), (33, 150)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("window,bottom_right", [((-1, -1), False), ((-1, 0), False), ((-1, 0), True),
                                                 ((3, 2), True), ((2, 5), False)])
def test_routes_match_reference(dtype, sq, sk, layout, window, bottom_right):
    """No gradient: a CPU call of <= decode_max_q rows whose positions the decode op expresses
    (no window, bottom-right, or Sq = Sk) runs the decode kernel, any other the fused one; both against
    the float64 reference, rows that see nothing included (out 0, lse -inf)."""
    torch.manual_seed(sq * 1000 + sk)
    q, k, v = rand_qkv(2, 6, 2, sq, sk, 40, dtype, layout=layout, requires_grad=False)
    (out, lse), names = _ops_run(lambda: ae.attention(q, k, v, layout=layout, window=window,
                                                        bottom_right=bottom_right, return_lse=True))
    decode = sq <= _ext._C.decode_max_q and (window == (-1, -1) or bottom_right or sq == sk)
    assert names == ["attention_ext::decode_fwd" if decode else "attention_ext::softmax_fwd"]
    qb, kb, vb = ((t.transpose(1, 2) if layout == "bshd" else t) for t in (q, k, v))
    wl, wr = window
    route = ops.fwd_route(qb, kb, vb, window_left=wl, window_right=wr, bottom_right=bottom_right)
    assert route.startswith("decode: " if decode else "fused: "), route
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 6, sq)
    ref, low, ref_lse = _reference(q, k, v, layout, window, bottom_right, None, dtype)
    assert_close_fa2(out, low, ref, dtype, "out")
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert bool((out.transpose(1, 2) if layout == "bshd" else out)[~fin].eq(0).all())
    if fin.any():
        assert (lse[fin].double() - ref_lse[fin]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("sq", [4, 24])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gradients_take_the_fused_op(sq, layout):
    """Inputs that need a gradient keep the fused op (it has the backward), decode-sized or not;
    the gradients match the float64 reference within 2x PyTorch's float32 error."""
    torch.manual_seed(sq)
    q, k, v = rand_qkv(1, 4, 2, sq, 30, 32, torch.float32, layout=layout)
    out, names = _ops_run(lambda: ae.attention(q, k, v, layout=layout, causal=True, bottom_right=True))
    assert "attention_ext::softmax_fwd" in names and "attention_ext::decode_fwd" not in names
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, low, _ = _reference(q, k, v, layout, (-1, 0), True, None, torch.float32)
    qs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qs32 = [t.detach().requires_grad_() for t in (q, k, v)]
    to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    r = ae.reference.attention(*(to_bhsd(t) for t in qs), window=(-1, 0), bottom_right=True)[0]
    r.backward(to_bhsd(dout).double())
    r32 = ae.reference.attention(*(to_bhsd(t) for t in qs32), window=(-1, 0), bottom_right=True)[0]
    r32.backward(to_bhsd(dout))
    for name, ours, r64, r32_ in zip("qkv", (q, k, v), qs, qs32):
        assert_close_fa2(ours.grad, r32_.grad, r64.grad, torch.float32, "d" + name)


@pytest.mark.parametrize("options", [{}, {"alibi": True}, {"sinks": True}, {"mask": True}])
def test_eager_autograd_is_the_registered_layer(options):
    """A differentiable eager call runs ops._EagerFwd (torch's generated layer costs ~100 us a
    call in fill_defaults): the same outputs and gradients, bit for bit, as the op called through
    its registered autograd, every differentiable input included."""
    torch.manual_seed(1)
    b, h, s, d = 2, 3, 21, 24
    base = [torch.randn(b, h, s, d) for _ in range(3)]
    alibi = torch.rand(h) * 0.5 + 0.1 if options.get("alibi") else None
    sinks = torch.randn(h) if options.get("sinks") else None
    mask = torch.randn(b, 1, s, s) if options.get("mask") else None
    seen = []
    orig = ops._EagerFwd.apply

    def spy(*a):
        seen.append(a[0])
        return orig(*a)

    runs = []
    for eager in (True, False):
        q, k, v = (t.clone().requires_grad_() for t in base)
        sk = sinks.clone().requires_grad_() if sinks is not None else None
        bias = mask.clone().requires_grad_() if mask is not None else None
        opts = dict(bias=bias, alibi_slopes=alibi, sinks=sk, scale=0.3, window_right=0)
        if eager:
            ops._EagerFwd.apply = spy
            try:
                out, lse = ops.fwd(q, k, v, **{**ops._NEUTRAL_OPTIONS, **opts})
            finally:
                ops._EagerFwd.apply = orig
        else:  # the op itself: torch's registered layer
            a = {**ops._NEUTRAL_OPTIONS, **ops._OPTION_DEFAULTS, **opts, "num_splits": 1, "deterministic": False}
            out, lse = ops._FWD_OP(q, k, v, *[a[n] for n in ops.FWD_ARGS[3:]])
        (out * torch.linspace(-1, 1, d)).sum().backward()
        runs.append((out, lse, *(t.grad for t in (q, k, v, sk, bias) if t is not None)))
    assert seen == [ops._FWD_OP]
    for x, y in zip(*runs):
        assert torch.equal(x, y)


def test_gradcheck_fwd_plain():
    q, k, v = rand_qkv(1, 2, 1, 6, 9, 8, torch.float64, layout="bshd")
    torch.autograd.gradcheck(lambda q, k, v: PLAIN(q, k, v, 0.4, 3, 0, True, "bshd", 0, False)[0], (q, k, v))
    q, k, v = rand_qkv(1, 2, 2, 11, 7, 8, torch.float64)
    torch.autograd.gradcheck(lambda q, k, v: PLAIN(q, k, v, None, -1, -1, False, "bhsd", 0, False)[0], (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", ["decode", "fused", "bshd_window", "grad"])
def test_opcheck_fwd_plain(dtype, case):
    sq = 5 if case in ("decode", "grad") else 19
    layout = "bshd" if case == "bshd_window" else "bhsd"
    q, k, v = rand_qkv(2, 4, 2, sq, 23, 16, dtype, layout=layout, requires_grad=case == "grad")
    window = (6, 0) if case == "bshd_window" else (-1, -1)
    torch.library.opcheck(PLAIN, (q, k, v, None, *window, case == "bshd_window", layout, 0, False))
    torch.library.opcheck(PLAIN, (q, k, v, 0.3, -1, -1, False, layout, 1, True))


def test_entry_is_the_op():
    """_C.softmax_fwd_plain gives what torch.ops gives, bit for bit, and shows in the profiler as the op."""
    q, k, v = rand_qkv(1, 8, 8, 16, 16, 64, torch.float32, requires_grad=False)
    args = (q, k, v, None, -1, 0, False, "bhsd", 0, False)
    a, b = _ext._C.softmax_fwd_plain(*args), PLAIN(*args)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with torch.profiler.profile() as prof:
        ae.attention(q, k, v)
    assert "attention_ext::softmax_fwd_plain" in {e.name for e in prof.events()}


class _Sub(torch.Tensor):
    pass


def test_entry_argument_errors():
    q, k, v = rand_qkv(1, 2, 2, 16, 16, 8, torch.float32, requires_grad=False)
    good = [q, k, v, None, -1, -1, False, "bhsd", 0, False]
    with pytest.raises(TypeError, match="10 or 11 positional"):
        _ext._C.softmax_fwd_plain(q, k, v)
    with pytest.raises(TypeError, match="plain tensors"):
        _ext._C.softmax_fwd_plain(q.numpy(), *good[1:])
    with pytest.raises(TypeError, match="plain tensors"):
        _ext._C.softmax_fwd_plain(q.as_subclass(_Sub), *good[1:])
    # a Parameter is a plain tensor
    torch.testing.assert_close(_ext._C.softmax_fwd_plain(torch.nn.Parameter(q), *good[1:])[0].detach(),
                               _ext._C.softmax_fwd_plain(*good)[0], rtol=0, atol=0)
    with pytest.raises(TypeError):
        _ext._C.softmax_fwd_plain(*good[:3], "0.5", *good[4:])
    with pytest.raises(TypeError):
        _ext._C.softmax_fwd_plain(*good[:4], 1.5, *good[5:])
    with pytest.raises(ValueError, match="layout must be 'bhsd' or 'bshd'"):
        _ext._C.softmax_fwd_plain(*good[:7], "bsdh", *good[8:])
    with pytest.raises(ValueError, match="head dim mismatch"):
        _ext._C.softmax_fwd_plain(q, k[..., :4], v[..., :4], *good[3:])
    # a failing conversion keeps its own error (one made with it pending would be a SystemError)
    class Fails:
        def __bool__(self):
            raise RuntimeError("bool failed")

    with pytest.raises(RuntimeError, match="bool failed"):
        _ext._C.softmax_fwd_plain(*good[:6], Fails(), *good[7:9], Fails())
    with pytest.raises(OverflowError):
        _ext._C.softmax_fwd_plain(*good[:4], 2**70, *good[5:])
    # through attention(): the general path words the same errors for its own arguments
    with pytest.raises(ValueError, match="layout"):
        ae.attention(q, k, v, layout="bsdh")
    with pytest.raises(RuntimeError, match="window_left"):  # as the general path raises it
        ae.attention(q, k, v, window=(2**70, 0))


def test_fallbacks_keep_their_meaning():
    """What the entry refuses takes torch.ops' path with the same result: a torch function mode
    (which sees the call), a Parameter, a strided head dim, an int window, 3-D inputs (SDPA)."""
    torch.manual_seed(0)
    q, k, v = rand_qkv(1, 4, 4, 12, 12, 16, torch.float32, requires_grad=False)
    want = ae.attention(q, k, v, causal=True)

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        got = ae.attention(q, k, v, causal=True)
    assert mode.calls > 0 and torch.equal(got, want)
    assert torch.equal(ae.attention(torch.nn.Parameter(q), k, v, causal=True).detach(), want)
    wide = torch.randn(1, 4, 12, 32)
    strided = wide[..., ::2]
    assert strided.stride(-1) == 2
    torch.testing.assert_close(ae.attention(strided, k, v), ae.attention(strided.contiguous(), k, v), rtol=0, atol=0)
    x = torch.randn(12, 16)
    torch.testing.assert_close(ae.scaled_dot_product_attention(x[None], x[None], x[None]),
                               torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None]),
                               rtol=1e-5, atol=1e-6)


def test_vmap_and_compile():
    """vmap (no gradient: torch.func's grad transforms do not take the ops' autograd, see
    docs/known-gaps.md) and torch.compile with dynamic shapes, against eager calls."""
    torch.manual_seed(1)
    q, k, v = rand_qkv(3, 2, 2, 6, 10, 16, torch.float32, requires_grad=False)
    want = torch.stack([ae.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=True, bottom_right=True)[0]
                        for i in range(3)])
    with torch.no_grad():
        got = torch.vmap(lambda a, b, c: ae.attention(a[None], b[None], c[None], causal=True, bottom_right=True)[0])(
            q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    f = torch.compile(lambda a, b, c: ae.attention(a, b, c, causal=True, bottom_right=True), backend="aot_eager",
                      fullgraph=True, dynamic=True)
    for s in (6, 13):
        a, b, c = rand_qkv(1, 2, 2, s, s + 3, 16, torch.float32, requires_grad=False)
        torch.testing.assert_close(f(a, b, c), ae.attention(a, b, c, causal=True, bottom_right=True),
                                   rtol=1e-5, atol=1e-6)


def _general(q, k, v, **kw):
    """attention()'s general path (functional._attention) with attention()'s defaults."""
    from attention_ext.softmax import functional as fn

    a = dict(layout="bhsd", scale=None, causal=False, bottom_right=False, window=(-1, -1), attn_mask=None,
             key_mask=None, seqlens_k=None, alibi_slopes=None, softcap=0.0, sinks=None, dropout_p=0.0, generator=None,
             seed=None, dropout_coords=None, return_lse=True, deterministic=False, num_splits=0, block_layout=None,
             block_size=64, topk=0, key_padding_mask=None)
    a.update(kw)
    return fn._attention(q, k, v, *a.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mask", ["bool", "bool_rows", "float", "float_heads", "key"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("sq,sk", [(1, 9), (5, 5), (16, 16), (20, 37)])
def test_masked_plain_call_is_the_general_path(dtype, mask, layout, sq, sk):
    """A 4-D attn_mask or a key mask takes the plain call (softmax_fwd_plain with softmax_fwd's bias), which gives
    the general path's result bit for bit, out and lse, and the float64 reference's within 2x
    PyTorch's error; the op never routes a masked call to the decode kernel."""
    torch.manual_seed(sq * 100 + sk)
    b, h = 2, 4
    q, k, v = rand_qkv(b, h, 2, sq, sk, 24, dtype, layout=layout, requires_grad=False)
    acc = ops.acc_dtype(dtype)
    kw = {}
    if mask == "bool":
        kw["attn_mask"] = torch.rand(b, 1, sq, sk) > 0.3
    elif mask == "bool_rows":
        kw["attn_mask"] = torch.rand(1, h, 1, sk) > 0.5
    elif mask == "float":
        kw["attn_mask"] = torch.randn(b, 1, sq, sk, dtype=acc)
    elif mask == "float_heads":
        kw["attn_mask"] = torch.randn(1, h, sq, sk, dtype=acc)
    else:
        keep = torch.rand(b, sk) > 0.3
        keep[:, 0] = True
        kw["key_mask"] = keep
    (out, lse), names = _ops_run(lambda: ae.attention(q, k, v, layout=layout, causal=sq > 1, bottom_right=True,
                                                        return_lse=True, **kw))
    assert names == ["attention_ext::softmax_fwd"]
    want, want_lse = _general(q, k, v, layout=layout, causal=sq > 1, bottom_right=True, **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    bias = kw.get("attn_mask")
    if "key_mask" in kw:
        bias = kw["key_mask"][:, None, None, :]
    rkw = dict(window=(-1, 0) if sq > 1 else (-1, -1), bottom_right=True, bias=bias)
    qb, kb, vb = (to_bhsd(t) for t in (q, k, v))
    ref, _, _ = reference_in(torch.float64, qb, kb, vb, **rkw)
    low, _, _ = reference_in(dtype, qb, kb, vb, **rkw)
    assert_close_fa2(to_bhsd(out), low, ref, dtype, "out")


def test_masked_plain_call_gradients_and_fallbacks():
    """A float mask that requires grad gets fwd's bias gradient, as on the general path; what the
    plain call does not take (a mask of another float dtype, a 2-D mask, both masks, a key mask of
    the wrong shape) takes the general path with its result or its error."""
    torch.manual_seed(3)
    q, k, v = rand_qkv(1, 2, 2, 12, 12, 16, torch.float32)
    m = torch.randn(1, 2, 12, 12, requires_grad=True)
    ae.attention(q, k, v, attn_mask=m).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v, m)]
    for t in (q, k, v, m):
        t.grad = None
    _general(q, k, v, attn_mask=m)[0].square().sum().backward()
    for g, t in zip(grads, (q, k, v, m)):
        torch.testing.assert_close(g, t.grad, rtol=0, atol=0)

    qd, kd, vd = (t.detach() for t in (q, k, v))
    half = torch.randn(1, 1, 12, 12, dtype=torch.float16)
    torch.testing.assert_close(ae.attention(qd, kd, vd, attn_mask=half),
                               ae.attention(qd, kd, vd, attn_mask=half.float()), rtol=0, atol=0)
    two_d = torch.rand(12, 12) > 0.4
    torch.testing.assert_close(ae.attention(qd, kd, vd, attn_mask=two_d),
                               ae.attention(qd, kd, vd, attn_mask=two_d[None, None]), rtol=0, atol=0)
    keep = torch.ones(1, 12, dtype=torch.bool)
    keep[0, 5] = False
    both = ae.attention(qd, kd, vd, attn_mask=two_d[None, None], key_mask=keep)
    torch.testing.assert_close(both, ae.attention(qd, kd, vd, attn_mask=two_d[None, None] & keep[:, None, None]),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"key_mask must be \(B, Sk\)"):
        ae.attention(qd, kd, vd, key_mask=torch.ones(1, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        ae.attention(qd, kd, vd, attn_mask=torch.ones(1, 3, 12, 12, dtype=torch.bool))


@pytest.mark.parametrize("kind", ["bool", "float_grad"])
def test_opcheck_fwd_plain_with_bias(kind):
    q, k, v = rand_qkv(2, 4, 2, 7, 11, 16, torch.float32, requires_grad=kind == "float_grad")
    bias = (torch.rand(2, 1, 7, 11) > 0.3 if kind == "bool"
            else torch.randn(1, 4, 7, 11, requires_grad=True))
    torch.library.opcheck(PLAIN, (q, k, v, None, -1, -1, False, "bhsd", 0, False, bias))


@pytest.mark.parametrize("case,want", [
    ("plain", "decode: "), ("nine_rows", "fused: more query rows"), ("no_keys", "fused: no keys"),
    ("mask", "fused: a mask"), ("dropout", "fused: dropout"), ("layout", "fused: a block layout"),
    ("varlen", "fused: a varlen pack"), ("top_left_window", "fused: positions aligned top-left"),
    ("square_window", "decode: "), ("grad", "fused: an input that requires grad"),
    ("lengths_alibi_sinks", "decode: ")])
def test_fwd_route_says_why(case, want):
    """The one statement of the CPU route (route_fwd, csrc/torch/softmax_route.cpp): ops.fwd_route names the condition that
    decided, and a call runs the kernel it names."""
    sq = {"nine_rows": 9, "square_window": 6}.get(case, 3)
    sk = {"no_keys": 0, "square_window": 6}.get(case, 40)
    q, k, v = rand_qkv(2, 4, 2, sq, sk, 16, torch.float32, requires_grad=case == "grad")
    opts = {}
    if case == "mask":
        opts["bias"] = torch.ones(1, 1, sq, sk, dtype=torch.bool)
    elif case == "dropout":
        opts["dropout_p"] = 0.1
    elif case == "layout":
        opts.update(block_layout=torch.ones(1, 1, 1, dtype=torch.bool), block_size=64)
    elif case == "varlen":
        q, k, v = (t[:1] for t in (q, k, v))
        opts.update(cu_seqlens_q=torch.tensor([0, sq], dtype=torch.int32),
                    cu_seqlens_k=torch.tensor([0, sk], dtype=torch.int32), max_seqlen_q=sq, max_seqlen_k=sk)
    elif case in ("top_left_window", "square_window"):
        opts.update(window_left=2, window_right=0)
    elif case == "lengths_alibi_sinks":
        opts.update(seqlens_k=torch.tensor([40, 7], dtype=torch.int32), alibi_slopes=torch.rand(4),
                    sinks=torch.randn(4), bottom_right=True)
    assert ops.fwd_route(q, k, v, **opts).startswith(want)
    if case in ("plain", "square_window", "lengths_alibi_sinks", "top_left_window", "nine_rows"):
        kw = dict(window=(opts.get("window_left", -1), opts.get("window_right", -1)),
                  bottom_right=opts.get("bottom_right", False), seqlens_k=opts.get("seqlens_k"),
                  alibi_slopes=opts.get("alibi_slopes"), sinks=opts.get("sinks"))
        out, names = _ops_run(lambda: ae.attention(q, k, v, **kw))
        assert ("attention_ext::decode_fwd" in names) == want.startswith("decode")
        ref = ae.reference.attention(q.double(), k.double(), v.double(), **kw)[0]
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_fwd_route_checks_its_inputs():
    q, k, v = rand_qkv(1, 4, 2, 3, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="head dim mismatch"):
        ops.fwd_route(q, k[..., :8], v[..., :8])
    with pytest.raises(TypeError, match="unknown option"):
        ops.fwd_route(q, k, v, causal=True)


def _route_args(q, k, v, **over):
    a = {n: None for n in ops._OPTION_TENSORS}
    a.update(max_seqlen_q=0, max_seqlen_k=0, scale=0.25, softcap=0.0, window_left=-1, window_right=-1,
             bottom_right=False, dropout_p=0.0, seed=0, offset=0, block_size=0, **over)
    return (q, k, v, *[a[n] for n in ops.OPTION_NAMES])


@pytest.mark.parametrize("sq", [3, 12])
@pytest.mark.parametrize("grad", [False, True])
def test_opcheck_routed(sq, grad):
    """softmax_fwd_routed (the decode route at sq = 3 without grad, softmax_fwd otherwise) and
    softmax_fwd_route pass opcheck; the route op returns a str, which opcheck's AOT comparison
    cannot compare, so it runs the other checks."""
    q, k, v = rand_qkv(2, 4, 2, sq, 40, 16, torch.float32, requires_grad=grad)
    args = _route_args(q, k, v, seqlens_k=torch.tensor([40, 9], dtype=torch.int32))
    torch.library.opcheck(torch.ops.attention_ext.softmax_fwd_routed.default, (*args, 1, False))
    torch.library.opcheck(torch.ops.attention_ext.softmax_fwd_route.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    want = "decode: " if sq <= _ext._C.decode_max_q and not grad else "fused: "
    assert torch.ops.attention_ext.softmax_fwd_route(*args).startswith(want)


def test_softmax_fwd_stays_fused():
    """softmax_fwd runs the fused kernels whatever the call (context parallelism pairs its (out,
    lse) with softmax_bwd); only the routed op takes the decode kernel."""
    q, k, v = rand_qkv(1, 4, 2, 2, 40, 16, torch.float32, requires_grad=False)
    args = _route_args(q, k, v)
    (out, lse), names = _ops_run(lambda: torch.ops.attention_ext.softmax_fwd(*args))
    assert names == ["attention_ext::softmax_fwd"]
    (out2, lse2), names = _ops_run(lambda: torch.ops.attention_ext.softmax_fwd_routed(*args))
    assert names == ["attention_ext::decode_fwd"]
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse2, lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "general"])
def test_compiled_decode_route_keeps_a_dynamic_batch(plain):
    """A compiled decode step (one query row, no grad) with a dynamic batch: the route runs the
    fused op's checks only on concrete sizes, so nothing specializes the batch (a
    ConstraintViolationError under mark_dynamic), and one graph serves every batch."""
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    kw = {} if plain else dict(alibi_slopes=torch.rand(4), bottom_right=True)
    f = torch.compile(lambda q, k, v: ae.attention(q, k, v, **kw), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for b in (2, 3, 5):
            q, k, v = rand_qkv(b, 4, 2, 1, 17, 32, torch.float32, requires_grad=False)
            for t in (q, k, v):
                torch._dynamo.mark_dynamic(t, 0)
            torch.testing.assert_close(f(q, k, v), ae.attention(q, k, v, **kw), atol=1e-6, rtol=1e-6)
    assert counts["stats"]["unique_graphs"] == 1


def test_bshd_shape_errors_show_the_shapes_as_passed():
    # the op checks its (B, H, S, D) views; a bshd caller also reads the shapes it passed
    q, k, v = torch.randn(2, 16, 4, 32), torch.randn(2, 16, 2, 32), torch.randn(2, 16, 3, 32)
    for call in (lambda: ae.attention(q, k, v, layout="bshd"), lambda: ae.flash_attn_func(q, k, v)):
        with pytest.raises(ValueError, match=r"k and v must have the same shape.*as passed, \(B, S, H, D\): "
                                             r"q \(2, 16, 4, 32\), k \(2, 16, 2, 32\), v \(2, 16, 3, 32\)"):
            call()
    with pytest.raises(ValueError) as e:  # bhsd: the op's own message, nothing added
        ae.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert "as passed" not in str(e.value)
