"""The delta rule (DeltaNet, Gated DeltaNet, KDA): delta_rule_attention / delta_rule_step and the
ops delta_fwd / delta_bwd against the float64 recurrence (reference.delta_rule), under the
project's rule (error <= 2x PyTorch's same-dtype error, tests/helpers.py); gradcheck, opcheck,
hard resets and extreme gates, varlen packs, layouts, the step, and input errors (the C++ check
and the fake agree)."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.linear import delta, reference
from tests.helpers import FLOOR, assert_close_fa2, rel_err

pytestmark = pytest.mark.skipif(not delta.has_kernel(torch.device("cpu")), reason="no CPU delta kernel")
F64 = torch.float64


def problem(b=2, hk=1, hv=2, s=23, kd=16, vd=24, gate=None, dtype=torch.float32, seed=0, h0=True, nseq=None):
    """q, k, v, beta, gate, initial_state in float64 (cast by the caller). gate: None, 'head' or
    'key'. k is L2-normalized and beta in (0, 1), as the layers produce them (an unnormalized k
    with beta near 1 makes the recurrence grow without bound)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hk, s, kd, generator=g, dtype=F64)
    k = reference._l2n(torch.randn(b, hk, s, kd, generator=g, dtype=F64))
    v = torch.randn(b, hv, s, vd, generator=g, dtype=F64)
    beta = torch.rand(b, hv, s, generator=g, dtype=F64)
    gt = None
    if gate == "head":
        gt = -torch.rand(b, hv, s, generator=g, dtype=F64) * 0.5
    elif gate == "key":
        gt = -torch.rand(b, hv, s, kd, generator=g, dtype=F64) * 0.5
    st = torch.randn(nseq or b, hv, kd, vd, generator=g, dtype=F64) * 0.3 if h0 else None
    return q, k, v, beta, gt, st


def torch_same_dtype(dtype, q, k, v, beta, gate, h0, scale=None, l2=False):
    """The recurrence in PyTorch at `dtype` throughout (what the kernel is held against)."""
    qq, kk = (reference._l2n(q), reference._l2n(k)) if l2 else (q, k)
    return reference.delta_rule(qq, kk, v, beta, gate, scale, h0, acc=dtype)


CASES = [  # (hk, hv, s, kd, vd, gate, l2)
    (1, 1, 1, 8, 8, None, False),
    (1, 2, 23, 16, 24, None, False),
    (2, 4, 37, 33, 17, "head", False),
    (1, 3, 70, 64, 64, "key", True),
    (2, 2, 9, 5, 100, "key", False),
    (1, 1, 45, 128, 40, "head", True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, F64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_and_grads_match_reference(case, dtype):
    hk, hv, s, kd, vd, gate, l2 = case
    q, k, v, beta, g, h0 = problem(hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate)
    qd, kd_, vd_ = (t.to(dtype).requires_grad_() for t in (q, k, v))
    bd = beta.to(dtype).requires_grad_()
    gd = g.to(torch.float32 if dtype != F64 else F64).requires_grad_() if g is not None else None
    acc = F64 if dtype == F64 else torch.float32
    hd = h0.to(acc).requires_grad_()
    out, st = ae.delta_rule_attention(qd, kd_, vd_, bd, gate=gd, initial_state=hd, return_state=True, qk_l2norm=l2)
    assert out.dtype == dtype and out.shape == (2, hv, s, vd) and st.dtype == acc

    ins64 = [t.detach().to(F64).requires_grad_() for t in (qd, kd_, vd_, bd)]
    g64 = gd.detach().to(F64).requires_grad_() if gd is not None else None
    h64 = hd.detach().to(F64).requires_grad_()
    qq, kk = (reference._l2n(ins64[0]), reference._l2n(ins64[1])) if l2 else (ins64[0], ins64[1])
    ref_out, ref_st = reference.delta_rule(qq, kk, ins64[2], ins64[3], g64, None, h64)
    same = [t.detach().to(dtype).requires_grad_() for t in (qd, kd_, vd_, bd)]
    g_same = gd.detach().to(dtype).requires_grad_() if gd is not None else None
    h_same = hd.detach().to(dtype).requires_grad_()
    t_out, t_st = torch_same_dtype(dtype, *same, g_same, h_same, l2=l2)
    assert_close_fa2(out, t_out, ref_out, dtype, "out")
    assert_close_fa2(st, t_st, ref_st, dtype, "final state")

    gen = torch.Generator().manual_seed(1)
    do = torch.randn(out.shape, generator=gen, dtype=F64)
    dst = torch.randn(st.shape, generator=gen, dtype=F64)
    ours = torch.autograd.grad((out.to(F64) * do).sum() + (st.to(F64) * dst).sum(),
                               [qd, kd_, vd_, bd, hd] + ([gd] if gd is not None else []))
    refs = torch.autograd.grad((ref_out * do).sum() + (ref_st * dst).sum(), ins64 + [h64] + ([g64] if g64 is not None else []))
    tg = torch.autograd.grad((t_out.to(F64) * do).sum() + (t_st.to(F64) * dst).sum(),
                             same + [h_same] + ([g_same] if g_same is not None else []))
    for name, a, t, r in zip(("dq", "dk", "dv", "dbeta", "dinitial_state", "dgate"), ours, tg, refs):
        assert a.dtype == (hd.dtype if name == "dinitial_state" else gd.dtype if name == "dgate" else dtype), name
        assert_close_fa2(a, t, r, dtype, name)


@pytest.mark.parametrize("gate,l2,hv", [(None, False, 1), ("head", True, 2), ("key", False, 2), ("key", True, 4)])
def test_gradcheck(gate, l2, hv):
    """float64 gradcheck of every input; S = 70 crosses the backward's replay chunk (64)."""
    q, k, v, beta, g, h0 = problem(b=1, hk=min(hv, 2), hv=hv, s=70, kd=6, vd=5, gate=gate)
    ins = [t.requires_grad_() for t in (q, k, v, beta, h0)] + ([g.requires_grad_()] if g is not None else [])

    def fn(q, k, v, beta, h0, *g):
        return ae.delta_rule_attention(q, k, v, beta, gate=g[0] if g else None, initial_state=h0, return_state=True,
                                       qk_l2norm=l2)

    assert torch.autograd.gradcheck(fn, ins, atol=1e-8)


@pytest.mark.parametrize("checkpoints", [False, True])
@pytest.mark.parametrize("gate", [None, "head", "key"])
def test_opcheck(gate, checkpoints):
    """S = 70 crosses a checkpoint (64 tokens); with checkpoints=True the backward reads them."""
    q, k, v, beta, g, h0 = problem(b=2, hk=1, hv=2, s=70, kd=7, vd=9, gate=gate)
    args = [t.float().requires_grad_() for t in (q, k, v, beta)]
    a = dict(q=args[0], k=args[1], v=args[2], beta=args[3], gate=g.float() if g is not None else None,
             initial_state=h0.float(), cu_seqlens=None, scale=0.3, qk_l2norm=True, plain=False,
             checkpoints=checkpoints)
    torch.library.opcheck(torch.ops.attention_ext.delta_fwd.default, tuple(a[n] for n in delta.FWD_ARGS))
    ck = torch.ops.attention_ext.delta_fwd(*(a[n] for n in delta.FWD_ARGS))[2].detach() if checkpoints else None
    assert ck is None or ck.shape == (2 * 2, 2, 9, 7)
    dout = torch.randn(2, 2, 70, 9)
    b = dict(a, dout=dout, dfinal_state=torch.randn(2, 2, 7, 9), checkpoints=ck)
    torch.library.opcheck(torch.ops.attention_ext.delta_bwd.default,
                          tuple(b[n].detach() if isinstance(b[n], torch.Tensor) else b[n] for n in delta.BWD_ARGS))


@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("length", ["long", "short"])
@pytest.mark.parametrize("gate", [None, "head", "key"])
@pytest.mark.parametrize("varlen", [False, True])
def test_backward_from_the_forward_checkpoints(gate, varlen, length, plain):
    """The backward reading the forward's checkpoints (what autograd does) equals the backward
    that recomputes them, to rounding (the two forward passes sum in different orders); varlen
    packs place each sequence's checkpoints by its position in the pack. The forward itself is the
    same with checkpoints or without, bit for bit; "short": a step-sized call (10 tokens, V = 128)
    that without checkpoints runs on the state's rows, a pack's empty sequence keeping its state.
    plain: the plain write, whose forward pairs tokens in a pass except where a pass ends at a
    checkpoint (so with and without them it pairs differently: still the same bits). The delta
    rule's pairs (AVX-512: p_{t+1} from the pass before, rounded differently) skip the checkpoint
    positions with and without checkpoints alike, which the bit-for-bit check holds them to."""
    if length == "long":
        cu = torch.tensor([0, 70, 70, 100, 230], dtype=torch.int32) if varlen else None
        s, vd = (235 if varlen else 150), 9
    else:
        cu = torch.tensor([0, 4, 4, 10], dtype=torch.int32) if varlen else None
        s, vd = 10, 128
    q, k, v, beta, g, h0 = problem(b=1 if varlen else 2, hk=1, hv=2, s=s, kd=12, vd=vd, gate=gate,
                                   nseq=(len(cu) - 1) if varlen else None)
    a = dict(q=q.float(), k=k.float(), v=v.float(), beta=beta.float(), gate=g.float() if g is not None else None,
             initial_state=h0.float(), cu_seqlens=cu, scale=0.3, qk_l2norm=True, plain=plain, checkpoints=True)
    out, st, ck = torch.ops.attention_ext.delta_fwd(*(a[n] for n in delta.FWD_ARGS))
    out0, st0, ck0 = torch.ops.attention_ext.delta_fwd(*(dict(a, checkpoints=False)[n] for n in delta.FWD_ARGS))
    assert torch.equal(out, out0) and torch.equal(st, st0) and ck0.numel() == 0
    if varlen:  # the empty sequence
        assert torch.equal(st0[1], h0[1].float())
    gen = torch.Generator().manual_seed(2)
    b = dict(a, dout=torch.randn(out.shape, generator=gen), dfinal_state=torch.randn(st.shape, generator=gen))
    with_ck = torch.ops.attention_ext.delta_bwd(*(dict(b, checkpoints=ck)[n] for n in delta.BWD_ARGS))
    without = torch.ops.attention_ext.delta_bwd(*(dict(b, checkpoints=None)[n] for n in delta.BWD_ARGS))
    for x, y in zip(with_ck, without):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="checkpoints must be"):
        torch.ops.attention_ext.delta_bwd(*(dict(b, checkpoints=ck[1:])[n] for n in delta.BWD_ARGS))


@pytest.mark.parametrize("gate", ["head", "key"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_hard_reset_is_exact(gate, dtype):
    """A log-gate of -inf at token r empties the state: rows from r on equal a fresh run of the
    tail from zeros, bit for bit up to the summation order, with finite gradients; the chunked
    (WY) form, which subtracts cumulative gates, gives NaN there."""
    q, k, v, beta, g, _ = problem(b=1, hk=1, hv=1, s=40, kd=8, vd=8, gate=gate, h0=False)
    r = 17
    g[:, :, r] = float("-inf")
    args = [t.to(dtype).requires_grad_() for t in (q, k, v, beta, g)]
    out = ae.delta_rule_attention(*args[:4], gate=args[4])
    tail = ae.delta_rule_attention(*(t[:, :, r:].detach() for t in args[:4]), gate=_tail_gate(args[4].detach(), r))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :, r:].detach(), tail, rtol=1e-6 if dtype != F64 else 1e-13, atol=1e-6)
    out.sum().backward()
    for t in args:
        assert torch.isfinite(t.grad).all()
    if gate == "head":
        chunked, _ = reference.delta_rule_chunked(*(t.detach().to(F64) for t in args[:4]), args[4].detach().to(F64),
                                                  chunk=64)
        assert torch.isnan(chunked[:, :, r:]).any()


def _tail_gate(g, r):
    t = g[:, :, r:].clone()
    t[:, :, 0] = 0.0  # the reset's own token starts from zeros: its gate no longer matters
    return t


@pytest.mark.parametrize("big", [1e4, 1e9])
def test_extreme_gates_match_float64(big):
    """log-gates of -1e4 and -1e9 (an underflowing decay) give the float64 recurrence's answer."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=30, kd=8, vd=8, gate="head")
    g[:, :, 5] = -big
    g[:, 1, 20] = -big
    out, st = ae.delta_rule_attention(q.float(), k.float(), v.float(), beta.float(), gate=g.float(),
                                      initial_state=h0.float(), return_state=True)
    ref, ref_st = reference.delta_rule(q, k, v, beta, g, None, h0)
    assert rel_err(out, ref) < 1e-5 and rel_err(st, ref_st) < 1e-5


@pytest.mark.parametrize("gate", [None, "key"])
def test_varlen_equals_separate_sequences(gate):
    lens = [5, 0, 31, 1, 12]
    s = sum(lens) + 3  # a tail no sequence owns
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=s, kd=9, vd=10, gate=gate, nseq=len(lens))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    ins = [t.float().requires_grad_() for t in (q, k, v, beta)]
    gf = g.float().requires_grad_() if g is not None else None
    hf = h0.float().requires_grad_()
    out, st = ae.delta_rule_attention(*ins, gate=gf, initial_state=hf, cu_seqlens=cu, return_state=True)
    assert st.shape == (len(lens), 2, 9, 10)
    assert torch.equal(out[:, :, s - 3:], torch.zeros_like(out[:, :, s - 3:]))
    (out.sum() + st.sum()).backward()
    for n, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = [t.detach()[:, :, a:e].clone().requires_grad_() for t in ins]
        gs = gf.detach()[:, :, a:e].clone().requires_grad_() if gf is not None else None
        hs = hf.detach()[n:n + 1].clone().requires_grad_()
        o, sn = ae.delta_rule_attention(*sl, gate=gs, initial_state=hs, return_state=True)
        torch.testing.assert_close(out[:, :, a:e], o)
        torch.testing.assert_close(st[n:n + 1], sn)
        (o.sum() + sn.sum()).backward()
        for full, part in zip(ins + ([gf] if gf is not None else []), sl + ([gs] if gs is not None else [])):
            torch.testing.assert_close(full.grad[:, :, a:e], part.grad)
        torch.testing.assert_close(hf.grad[n:n + 1], hs.grad)
    for t in ins:
        assert torch.equal(t.grad[:, :, s - 3:], torch.zeros_like(t.grad[:, :, s - 3:]))


def test_bshd_layout_equals_bhsd():
    q, k, v, beta, g, h0 = problem(b=2, hk=2, hv=4, s=13, kd=8, vd=6, gate="key")
    a = ae.delta_rule_attention(q, k, v, beta, gate=g, initial_state=h0)
    b = ae.delta_rule_attention(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                                v.transpose(1, 2).contiguous(), beta, gate=g, initial_state=h0, layout="bshd")
    assert b.shape == (2, 13, 4, 6) and b.is_contiguous()
    torch.testing.assert_close(b.transpose(1, 2), a, rtol=0, atol=0)


@pytest.mark.parametrize("gate", ["head", "key"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_steps_equal_the_sequence(dtype, gate):
    """A prefill, then steps of a few tokens, equals the whole sequence to rounding: the long
    calls keep the gates out of the state (fwd_group's factors) while steps run the recurrence
    itself, so each meets the error rule against float64 and they differ by no more than it
    allows. 150 tokens: the factors fold back at chunk edges and where they leave their range."""
    s, pre = 150, 120
    q, k, v, beta, g, _ = problem(b=2, hk=1, hv=2, s=s, kd=16, vd=16, gate=gate, h0=False)
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    g = g.float()
    g[:, :, 40:45] -= 8.0  # strong gates: the factors leave [2^-40, 2^40] and fold back
    whole, final = ae.delta_rule_attention(q, k, v, beta, gate=g, return_state=True)
    outs, state = [], None
    o, state = ae.delta_rule_step(q[:, :, :pre], k[:, :, :pre], v[:, :, :pre], beta[:, :, :pre], None,
                                  gate=g[:, :, :pre])
    outs.append(o)
    for t in range(pre, s, 3):
        e = min(t + 3, s)
        before = state.clone()
        o, new = ae.delta_rule_step(q[:, :, t:e], k[:, :, t:e], v[:, :, t:e], beta[:, :, t:e], state, gate=g[:, :, t:e])
        assert torch.equal(state, before)  # not modified in place
        outs.append(o)
        state = new
    scale = q.shape[-1] ** -0.5
    ref = reference.delta_rule(q.double(), k.double(), v.double(), beta.double(), g.double(), scale)
    low = reference.delta_rule(q, k, v, beta, g.to(dtype), scale, acc=dtype)
    for i, (split, one) in enumerate(((torch.cat(outs, 2), whole), (state, final))):
        what = ("out", "state")[i]
        assert_close_fa2(split, low[i], ref[i], dtype, f"prefill + steps, {what}")
        assert_close_fa2(one, low[i], ref[i], dtype, f"whole sequence, {what}")
        bound = 2.0 * rel_err(low[i], ref[i]) + FLOOR[dtype]
        assert rel_err(split, one) <= bound, f"{what}: prefill + steps vs whole differ by {rel_err(split, one):.3g}"


def test_reference_fallback_equals_kernel(monkeypatch):
    """Devices with no kernel run the PyTorch recurrence after the op's own check: the same
    answer and gradients."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=9, kd=5, vd=7, gate="key")
    ins = [t.requires_grad_() for t in (q, k, v, beta, g, h0)]
    a, sa = ae.delta_rule_attention(*ins[:4], gate=ins[4], initial_state=ins[5], return_state=True, qk_l2norm=True)
    ga = torch.autograd.grad(a.sum() + sa.sum(), ins)
    monkeypatch.setitem(delta._KERNELS, "cpu", False)
    monkeypatch.setitem(delta._BWD_KERNELS, "cpu", False)
    b, sb = ae.delta_rule_attention(*ins[:4], gate=ins[4], initial_state=ins[5], return_state=True, qk_l2norm=True)
    gb = torch.autograd.grad(b.sum() + sb.sum(), ins)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(sa, sb)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y)
    with pytest.raises(ValueError, match="beta must have shape"):
        ae.delta_rule_attention(*[t.detach() for t in ins[:3]], beta[:, :1].detach())


def test_forward_kernel_without_backward_kernel(monkeypatch):
    """A device with a forward kernel and no backward kernel (CUDA today): calls that need
    gradients run the PyTorch recurrence, calls that do not (inference, no_grad) the kernel."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=9, kd=5, vd=7, gate="head")
    q, k, v, beta, g, h0 = (t.float() for t in (q, k, v, beta, g, h0))
    monkeypatch.setitem(delta._BWD_KERNELS, "cpu", False)
    calls = []
    real, real_fwd = delta._call, delta._fwd
    monkeypatch.setattr(delta, "_call", lambda op, names, a: calls.append(op) or real(op, names, a))
    monkeypatch.setattr(delta, "_fwd", lambda a, grad: calls.append("delta_fwd") or real_fwd(a, grad))
    kernel = ae.delta_rule_attention(q, k, v, beta, gate=g, initial_state=h0)
    assert calls == ["delta_fwd"]
    calls.clear()
    qg = q.clone().requires_grad_()
    rec = ae.delta_rule_attention(qg, k, v, beta, gate=g, initial_state=h0)
    assert "delta_fwd" not in calls and rec.requires_grad
    torch.testing.assert_close(rec.detach(), kernel, rtol=1e-5, atol=1e-6)
    calls.clear()
    with torch.no_grad():
        ae.delta_rule_attention(qg, k, v, beta, gate=g, initial_state=h0)
    assert calls == ["delta_fwd"]


WY_CASES = [  # (b, hk, hv, s, kd, vd, gate, chunk): S below, at and past the chunk; GVA
    (2, 1, 2, 23, 8, 5, "head", 8),
    (1, 2, 4, 70, 16, 9, None, 16),
    (2, 1, 1, 64, 8, 8, "head", 64),
    (1, 1, 1, 3, 4, 4, "head", 64),
    (1, 1, 3, 130, 32, 20, "head", 64),
    (2, 1, 2, 23, 8, 5, "key", 8),
    (1, 2, 2, 45, 16, 9, "key", 32),
]


@pytest.mark.parametrize("case", WY_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_wy_form_matches_float64(case, dtype):
    """The chunked WY form (the fallback where no kernel serves a call) against the float64
    recurrence: 2x the recurrence's own error at float32, and to rounding at float64; gradients
    too."""
    b, hk, hv, s, kd, vd, gate, chunk = case
    q, k, v, beta, g, h0 = problem(b=b, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate)
    ins = [t.to(dtype).requires_grad_() for t in (q, k, v, beta, h0)] + ([g.to(dtype).requires_grad_()] if g is not None else [])
    out, st = reference.delta_rule_wy(*ins[:4], ins[5] if g is not None else None, 0.4, ins[4], None, True, chunk=chunk)
    ins64 = [t.detach().to(F64).requires_grad_() for t in ins]
    ref, ref_st = reference.delta_rule(*ins64[:4], ins64[5] if g is not None else None, 0.4, ins64[4], None, True)
    same = [t.detach().requires_grad_() for t in ins]
    t_out, t_st = reference.delta_rule(*same[:4], same[5] if g is not None else None, 0.4, same[4], None, True)
    assert_close_fa2(out, t_out, ref, dtype, "out")
    assert_close_fa2(st, t_st, ref_st, dtype, "state")
    gen = torch.Generator().manual_seed(3)
    do, dst = torch.randn(out.shape, generator=gen, dtype=F64), torch.randn(st.shape, generator=gen, dtype=F64)
    ga = torch.autograd.grad((out.to(F64) * do).sum() + (st.to(F64) * dst).sum(), ins)
    gr = torch.autograd.grad((ref * do).sum() + (ref_st * dst).sum(), ins64)
    gt = torch.autograd.grad((t_out.to(F64) * do).sum() + (t_st.to(F64) * dst).sum(), same)
    for name, x, t, r in zip(("dq", "dk", "dv", "dbeta", "dh0", "dgate"), ga, gt, gr):
        assert_close_fa2(x, t, r, dtype, name)


@pytest.mark.parametrize("gate,plain", [("head", False), ("key", False), ("key", True)])
def test_wy_gradcheck(gate, plain):
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=13, kd=4, vd=3, gate=gate)
    ins = [t.requires_grad_() for t in (q, k, v, beta, g, h0)]
    if plain:
        beta.requires_grad_(False)  # unread by the plain write
        ins = [t for t in ins if t is not beta]

    def fn(*x):
        a = list(x)
        if plain:
            a.insert(3, beta)
        return reference.delta_rule_wy(*a[:5], 0.5, a[5], None, True, chunk=4, plain=plain)
    assert torch.autograd.gradcheck(fn, ins)


@pytest.mark.parametrize("gate,plain", [("head", False), ("key", False), ("key", True)])
@pytest.mark.parametrize("big", [1e4, 1e9, float("inf")])
def test_wy_extreme_gates_are_exact(big, gate, plain):
    """Gates of -1e4, -1e9 and -inf (hard resets; per key: on some channels) inside chunks: the
    WY form sums gates between two tokens, never subtracts cumulative ones, so values and
    gradients equal the recurrence's (the plain write too: GLA)."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=40, kd=8, vd=8, gate=gate)
    g[:, :, 17, ...] = -big
    if gate == "key":
        g[:, :, 30, :3] = -big
    else:
        g[:, :, 30] = -big
    ins = [t.clone().requires_grad_() for t in (q, k, v, beta, g, h0)]
    out, st = reference.delta_rule_wy(*ins[:5], 0.4, ins[5], chunk=16, plain=plain)
    ins2 = [t.detach().clone().requires_grad_() for t in ins]
    ref, ref_st = reference.delta_rule(*ins2[:5], 0.4, ins2[5], plain=plain)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st, ref_st, rtol=1e-12, atol=1e-12)
    ga = torch.autograd.grad(out.sum() + st.sum(), ins, allow_unused=True)
    gr = torch.autograd.grad(ref.sum() + ref_st.sum(), ins2, allow_unused=True)
    for x, r in zip(ga, gr):
        if x is None or r is None:  # beta with the plain write
            assert plain and x is None and r is None
            continue
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, r, rtol=1e-10, atol=1e-10)


def test_wy_varlen_equals_the_recurrence():
    cu = torch.tensor([0, 9, 9, 30, 41], dtype=torch.int32)
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=45, kd=6, vd=5, gate="head", nseq=4)
    out, st = reference.delta_rule_wy(q, k, v, beta, g, 0.4, h0, cu, True, chunk=8)
    ref, ref_st = reference.delta_rule(q, k, v, beta, g, 0.4, h0, cu, True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st, ref_st, rtol=1e-12, atol=1e-12)
    gk = -torch.rand(1, 2, 45, 6, dtype=F64)
    gk[:, :, 20, :2] = float("-inf")
    out, st = reference.delta_rule_wy(q, k, v, beta, gk, 0.4, h0, cu, True, chunk=8)
    ref, ref_st = reference.delta_rule(q, k, v, beta, gk, 0.4, h0, cu, True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st, ref_st, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="per-key gates"):
        reference.delta_rule_wy(q, k, v, beta, g, 0.4, h0, cu, plain=True)


@pytest.mark.parametrize("gate,form", [(None, "wy"), ("head", "wy"), ("key", "wy")])
def test_fallback_form(monkeypatch, gate, form):
    """Where no kernel serves a call, the chunked WY form runs, never the token loop."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=9, kd=5, vd=7, gate=gate)
    monkeypatch.setitem(delta._KERNELS, "cpu", False)
    monkeypatch.setitem(delta._BWD_KERNELS, "cpu", False)
    calls = []
    for name in ("delta_rule_wy", "delta_rule"):
        real = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
    ae.delta_rule_attention(q, k, v, beta, gate=g, initial_state=h0)
    assert calls == ["delta_rule_wy" if form == "wy" else "delta_rule"]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "wy_fallback"])
@pytest.mark.parametrize("gate", [None, "head", "key"])
def test_nan_past_the_pack_changes_nothing(monkeypatch, gate, kernel):
    """NaN in every input's rows past cu_seqlens[-1]: out, the final states and every gradient are
    bit for bit the clean pack's (the tail's gradients 0), on the kernels and on the fallback."""
    if not kernel:
        monkeypatch.setitem(delta._KERNELS, "cpu", False)
        monkeypatch.setitem(delta._BWD_KERNELS, "cpu", False)
    cu = torch.tensor([0, 9, 9, 30], dtype=torch.int32)
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=35, kd=6, vd=5, gate=gate, nseq=3)
    res = []
    for poison in (False, True):
        ins = [t.float().clone() for t in (q, k, v, beta)] + [g.float().clone() if g is not None else None]
        if poison:
            for t in ins:
                if t is not None:
                    t[:, :, 30:] = float("nan")
        ins = [t.requires_grad_() if t is not None else None for t in ins]
        h = h0.float().clone().requires_grad_()
        out, st = ae.delta_rule_attention(*ins[:4], gate=ins[4], initial_state=h, return_state=True, cu_seqlens=cu,
                                          qk_l2norm=True)
        grads = torch.autograd.grad(out.sum() + st.sum(), [t for t in ins + [h] if t is not None])
        res.append((out, st, grads))
    (o1, s1, g1), (o2, s2, g2) = res
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_empty_sequence_passes_the_state_through():
    q, k, v, beta, g, h0 = problem(b=2, hk=1, hv=1, s=0, kd=4, vd=3, gate="head")
    h0.requires_grad_()
    out, st = ae.delta_rule_attention(q, k, v, beta, gate=g, initial_state=h0, return_state=True)
    assert out.shape == (2, 1, 0, 3)
    torch.testing.assert_close(st, h0.detach())
    st.sum().backward()
    torch.testing.assert_close(h0.grad, torch.ones_like(h0))


def _base_args():
    q, k, v, beta, g, h0 = problem(b=2, hk=1, hv=2, s=6, kd=4, vd=5, gate="head")
    return dict(q=q.float(), k=k.float(), v=v.float(), beta=beta.float(), gate=g.float(), initial_state=h0.float(),
                cu_seqlens=None, scale=0.5, qk_l2norm=False, plain=False)


BAD = [
    ("q dims", lambda a: a.update(q=a["q"][0]), ValueError, "4-D"),
    ("k shape", lambda a: a.update(k=a["k"][..., :3]), ValueError, "k must have q's shape"),
    ("v heads", lambda a: a.update(q=torch.randn(2, 3, 6, 4), k=torch.randn(2, 3, 6, 4)), ValueError, "multiple"),
    ("v length", lambda a: a.update(v=a["v"][:, :, :4]), ValueError, "v must be"),
    ("dtype mix", lambda a: a.update(k=a["k"].double()), TypeError, "share a dtype"),
    ("beta shape", lambda a: a.update(beta=a["beta"][:, :1]), ValueError, "beta must have shape"),
    ("beta dtype", lambda a: a.update(beta=a["beta"].half()), TypeError, "beta must be"),
    ("gate shape", lambda a: a.update(gate=a["gate"][..., :3]), ValueError, "gate must have shape"),
    ("gate per key width", lambda a: a.update(gate=torch.zeros(2, 2, 6, 3)), ValueError, "gate must have shape"),
    ("state shape", lambda a: a.update(initial_state=a["initial_state"][..., :2]), ValueError, "initial_state must"),
    ("state dtype", lambda a: a.update(initial_state=a["initial_state"].double()), TypeError, "initial_state must"),
    ("scale", lambda a: a.update(scale=float("nan")), ValueError, "scale"),
    ("last stride", lambda a: a.update(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
     "contiguous"),  # the op's rule; delta_rule_attention copies such rows (test_strided_rows_are_copied)
    ("cu batch", lambda a: a.update(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)), ValueError, "pack"),
]


@pytest.mark.parametrize("name,mutate,exc,msg", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_fake_matches_cpp(name, mutate, exc, msg):
    a = dict(_base_args(), checkpoints=False)
    mutate(a)
    args = tuple(a[n] for n in delta.FWD_ARGS)
    with pytest.raises(exc, match=msg) as real:
        torch.ops.attention_ext.delta_fwd(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args)
        with pytest.raises(exc) as faked:
            torch.ops.attention_ext.delta_fwd(*fake)
    assert str(faked.value).splitlines()[0] == str(real.value).splitlines()[0]


def test_functional_bad_inputs():
    a = _base_args()
    with pytest.raises(TypeError, match="beta"):
        ae.delta_rule_attention(a["q"], a["k"], a["v"], [0.5])
    with pytest.raises(ValueError, match="layout"):
        ae.delta_rule_attention(a["q"], a["k"], a["v"], a["beta"], layout="bsd")
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        ae.delta_rule_attention(a["q"][:1], a["k"][:1], a["v"][:1], a["beta"][:1],
                                cu_seqlens=torch.tensor([1, 6], dtype=torch.int32))


def test_compile_traces_the_op():
    q, k, v, beta, g, _ = problem(b=1, hk=1, hv=1, s=8, kd=4, vd=4, gate="head", h0=False)
    args = [t.float() for t in (q, k, v, beta, g)]
    f = torch.compile(lambda q, k, v, b, g: ae.delta_rule_attention(q, k, v, b, gate=g), fullgraph=True,
                      backend="eager")
    torch.testing.assert_close(f(*args), ae.delta_rule_attention(*args[:4], gate=args[4]))


@pytest.mark.parametrize("gate", [None, "head", "key"])
def test_chunked_peer_equals_the_recurrence(gate):
    """The benchmark's peer (reference.delta_rule_chunked) computes the same function (moderate
    gates; chunks of 16 over 40 tokens, a partial last one)."""
    q, k, v, beta, g, _ = problem(b=2, hk=2, hv=2, s=40, kd=8, vd=6, gate=gate, h0=False)
    out, st = reference.delta_rule_chunked(q, k, v, beta, g, chunk=16)
    ref, ref_st = reference.delta_rule(q, k, v, beta, g)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st, ref_st, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
@pytest.mark.parametrize("gate", [None, "head", "key"])
def test_inplace_step_equals_the_functional_step(gate, dtype):
    q, k, v, beta, g, h0 = problem(b=3, hk=1, hv=2, s=3, kd=16, vd=40, gate=gate)
    acc = F64 if dtype == F64 else torch.float32
    args = [t.to(dtype) for t in (q, k, v, beta)]
    gg = g.to(acc) if g is not None else None
    state = h0.to(acc)
    want_out, want_state = ae.delta_rule_step(*args, state, gate=gg, qk_l2norm=True)
    s2 = state.clone()
    with torch.no_grad():
        out, new = ae.delta_rule_step(*args, s2, gate=gg, qk_l2norm=True, inplace=True)
    assert new is s2
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(s2, want_state, rtol=0, atol=0)


def test_inplace_step_opcheck_and_errors():
    q, k, v, beta, g, h0 = problem(b=2, hk=1, hv=2, s=1, kd=8, vd=8, gate="head")
    a = dict(q=q.float(), k=k.float(), v=v.float(), beta=beta.float(), state=h0.float(), gate=g.float(), scale=0.5,
             qk_l2norm=False)
    torch.library.opcheck(torch.ops.attention_ext.delta_step.default, tuple(a[n] for n in delta.STEP_ARGS))
    with pytest.raises(ValueError, match="state is updated in place and must be contiguous"):
        torch.ops.attention_ext.delta_step(*[dict(a, state=torch.zeros(8, 8).expand(2, 2, 8, 8))[n]
                                             for n in delta.STEP_ARGS])
    with pytest.raises(ValueError, match="no autograd"):
        ae.delta_rule_step(a["q"].requires_grad_(), a["k"], a["v"], a["beta"], a["state"], inplace=True)


def test_strided_rows_are_copied():
    """q, k, v whose last dim is strided (the op reads rows whole) are copied by the function."""
    q, k, v, beta, g, _ = problem(b=1, hk=1, hv=1, s=7, kd=6, vd=5, gate="head", h0=False)
    qs = q.transpose(2, 3).contiguous().transpose(2, 3)
    torch.testing.assert_close(ae.delta_rule_attention(qs, k, v, beta, gate=g), ae.delta_rule_attention(q, k, v, beta, gate=g))


@pytest.mark.skipif(not delta.HAS_EXT, reason="no compiled extension")
def test_cuda_chunk_rule():
    """The one C++ rule (common/delta_params.h delta_chunk_takes) that picks the CUDA chunk
    kernels, as Python's routing of CUDA calls needing gradients reads it: every gate (per-key
    ones: KDA) both ways, GLA's plain write with per-key gates; bf16 and fp16; K <= 128,
    K and V multiples of 8; the automatic selection from 256 rows on."""
    from attention_ext._ext import delta_chunk_takes as takes
    bf, f16 = torch.bfloat16, torch.float16
    for bwd in (False, True):
        assert takes(1, bf, 128, 128, False, False, 64, bwd)           # DeltaNet / Gated DeltaNet
        assert takes(1, bf, 128, 128, True, False, 64, bwd)             # KDA
        assert takes(1, bf, 64, 40, True, True, 64, bwd)                # GLA's plain write
        assert not takes(1, bf, 64, 64, False, True, 64, bwd)          # a plain write without per-key gates
        assert takes(1, f16, 64, 64, False, False, 64, bwd) and takes(1, f16, 64, 64, True, False, 64, bwd)
        assert not takes(1, torch.float32, 64, 64, True, False, 64, bwd)
        assert not takes(1, bf, 136, 64, False, False, 64, bwd) and not takes(1, bf, 20, 64, False, False, 64, bwd)
        assert not takes(1, bf, 64, 20, False, False, 64, bwd)
        assert not takes(0, bf, 64, 64, False, False, 4096, bwd)
        assert not takes(-1, bf, 64, 64, False, False, 255, bwd) and takes(-1, bf, 64, 64, False, False, 256, bwd)


def test_bshd_tensors_without_layout_name_it():
    """(B, S, H, D) tensors passed with the default layout: the error names layout='bshd' (a
    LayoutMismatch, a ValueError), with grouped values too and with beta already right; before,
    it asked to reshape beta (which would have run the wrong math)."""
    q = k = torch.randn(1, 7, 2, 5)
    for hv in (2, 4):
        v, beta = torch.randn(1, 7, hv, 3), torch.rand(1, hv, 7)
        with pytest.raises(ValueError, match="pass layout='bshd'"):
            ae.delta_rule_attention(q, k, v, beta)
        assert ae.delta_rule_attention(q, k, v, beta, layout="bshd").shape == (1, 7, hv, 3)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_transposed_beta_is_named_beside_the_layout(layout):
    """q, k, v right for `layout` and beta given as (B, S, H_v): the shapes also fit the other
    layout, so the error names both fixes (before, it named only the layout, and following it ran
    the wrong math); the transposed beta then gives the right result."""
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))          # (B, H, S, D)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    beta_shs = torch.rand(1, 64, 2)                                  # (B, S, H_v): a mistake
    with pytest.raises(ValueError, match=r"beta must be \(B, H_v, S\) = \(1, 2, 64\) in every layout, got "
                                         r"\(1, 64, 2\): pass beta\.transpose\(1, 2\)"):
        ae.delta_rule_attention(q, k, v, beta_shs, layout=layout, qk_l2norm=True)
    out = ae.delta_rule_attention(q, k, v, beta_shs.transpose(1, 2), layout=layout, qk_l2norm=True)
    assert out.shape == q.shape


@pytest.mark.parametrize("family", ["linear", "delta"])
def test_double_backward_raises(family):
    """The linear and delta backward ops have no derivative of their own: a second backward
    through the gradients (create_graph=True, a gradient penalty) raises, where it returned zeros
    with torch's warning; the first-order gradient is unchanged."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    if family == "linear":
        call = lambda: ae.linear_attention(q, k, v, causal=True)  # noqa: E731
    else:
        beta = torch.rand(1, 2, 9)
        call = lambda: ae.delta_rule_attention(q, torch.nn.functional.normalize(k, dim=-1), v, beta)  # noqa: E731
    dq, = torch.autograd.grad(call().square().sum(), q, create_graph=True)
    first, = torch.autograd.grad(call().square().sum(), q)
    torch.testing.assert_close(dq, first)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(dq.sum(), v)


@pytest.mark.parametrize("family", ["delta", "linear"])
def test_eager_autograd_is_the_registered_layer(family, monkeypatch):
    """A differentiable eager call of delta_fwd / linear_fwd runs the family's _EagerFwd
    (_ext.eager_autograd: torch's generated layer costs 30-45 us a call in fill_defaults): the same
    outputs and gradients, bit for bit, as the op called through its registered autograd, with
    an unused final state (materialize_grads off) and every differentiable input."""
    from attention_ext.linear import ops as lops
    mod = delta if family == "delta" else lops
    if not (delta.HAS_OP if family == "delta" else lops.HAS_OP):
        pytest.skip("compiled extension not built")
    q, k, v, beta, g, h0 = (t.float() for t in problem(b=2, hk=1, hv=2, s=19, kd=8, vd=6, gate="head"))
    runs, seen = [], []
    for eager in (True, False):
        ins = [t.clone().requires_grad_() for t in (q, k, v, beta, g, h0)]
        qq, kk, vv, bb, gg, hh = ins
        if family == "delta":
            a = dict(q=qq, k=kk, v=vv, beta=bb, gate=gg, initial_state=hh, cu_seqlens=None, scale=0.4,
                     qk_l2norm=True, plain=False, checkpoints=True)
            args = delta._args("delta_fwd", delta.FWD_ARGS, a)
            op = torch.ops.attention_ext.delta_fwd.default
        else:  # GLA-free linear attention with a per-head decay; q, k of the value heads
            qq2, kk2 = qq.repeat(1, 2, 1, 1), kk.repeat(1, 2, 1, 1)
            a = dict(q=qq2, k=kk2, v=vv, decay=gg, initial_state=None, key_mask=None, cu_seqlens=None, max_seqlen=0,
                     feature_map=1, causal=True, normalize=True, eps=1e-6, scale=0.4, keep_residual=False)
            args = [a[n] for n in lops.FWD_ARGS]
            op = torch.ops.attention_ext.linear_fwd.default
        if eager:
            real = mod._EagerFwd.apply
            monkeypatch.setattr(mod._EagerFwd, "apply", lambda *x: seen.append(x[0]) or real(*x))
            res = delta.call_autograd(op, args, mod._EagerFwd, True)
            monkeypatch.undo()
        else:
            res = op(*args)
        (res[0] * torch.linspace(-1, 1, res[0].shape[-1])).sum().backward()  # the final state unused
        used = [t for t in ins if t.grad is not None]
        runs.append((res[0], res[1], *(t.grad for t in used)))
    assert seen == [op] and len(runs[0]) == len(runs[1]) >= 5
    for x, y in zip(*runs):
        assert torch.equal(x, y)
