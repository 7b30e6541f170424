"""linear_attention with GLA's gates, one per feature (decay (B, H, S, M)): S_t =
Diag(exp(decay_t)) S_{t-1} + phi(k_t) v'_t^T, on the delta-rule kernels' plain write. Against the
float64 recurrence (reference.linear_attention) under the project's rule (error <= 2x PyTorch's
same-dtype error), every gradient, gradcheck in float64, gates of -inf / -1e9, GQA, key padding,
states, varlen, layouts, opcheck of the op with `plain`, and the argument errors."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.linear import delta, ops, reference
from tests.helpers import assert_close_fa2, rel_err

pytestmark = pytest.mark.skipif(not delta.has_kernel(torch.device("cpu")), reason="no CPU delta kernel")
F64 = torch.float64
CODES = {"identity": 0, "elu": 1, "relu": 2}


def problem(b=2, h=4, hk=2, s=29, m=8, dv=6, seed=0, extreme=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, m, generator=g, dtype=F64)
    k = torch.randn(b, hk, s, m, generator=g, dtype=F64)
    v = torch.randn(b, hk, s, dv, generator=g, dtype=F64)
    decay = -torch.rand(b, h, s, m, generator=g, dtype=F64) * 0.5
    if extreme:  # a hard reset of some features, -1e9 on every feature of one row, -1e4 on one
        decay[0, 1, 5, : m // 2] = float("-inf")
        decay[-1, -1, s // 2] = -1e9
        decay[0, 0, s - 3, 1] = -1e4
    return q, k, v, decay


def run(dtype, q, k, v, decay, grad=True, **kw):
    """linear_attention in `dtype` (decay, states in float32 below float64): out (and the state)
    and the gradients of q, k, v, decay (and the initial state) for a fixed random loss."""
    side = F64 if dtype == F64 else torch.float32
    xs = [t.detach().to(dtype).requires_grad_(grad) for t in (q, k, v)] + [decay.detach().to(side).requires_grad_(grad)]
    st = kw.pop("initial_state", None)
    if st is not None:
        st = st.detach().to(side).requires_grad_(grad)
    res = ae.linear_attention(*xs[:3], causal=True, decay=xs[3], initial_state=st, return_state=True, **kw)
    out, state = res
    if not grad:
        return out, state.augmented(kw.get("normalize", True))
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)
    ws = torch.randn(state.augmented(kw.get("normalize", True)).shape, generator=g, dtype=F64)
    loss = (out.double() * w.double()).sum() + (state.augmented(kw.get("normalize", True)).double() * ws).sum()
    loss.backward()
    grads = [x.grad for x in xs] + ([st.grad] if st is not None else [])
    return out, state.augmented(kw.get("normalize", True)), grads


def torch_ref(dtype, q, k, v, decay, *, feature_map="elu", normalize=True, key_mask=None, initial_state=None,
              scale=1.0, cu_seqlens=None):
    """reference.linear_attention in `dtype` throughout (float64: the oracle), with autograd."""
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, decay)]
    st = initial_state.detach().to(dtype).requires_grad_() if initial_state is not None else None
    out, _, final = reference.linear_attention(*xs[:3], feature_map=CODES[feature_map], causal=True, normalize=normalize,
                                               scale=scale, decay=xs[3], initial_state=st, key_mask=key_mask,
                                               cu_seqlens=cu_seqlens)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out.shape, generator=g, dtype=F64).to(dtype)
    ws = torch.randn(final.shape, generator=g, dtype=F64).to(dtype)
    ((out * w).sum() + (final * ws).sum()).backward()
    return out, final, [x.grad for x in xs] + ([st.grad] if st is not None else [])


NAMES = ("dq", "dk", "dv", "ddecay", "dinitial_state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity"])
@pytest.mark.parametrize("normalize", [True, False])
def test_against_the_recurrence(dtype, feature_map, normalize):
    q, k, v, decay = problem(seed=CODES[feature_map] + 3 * normalize)
    s0 = torch.rand(2, 4, 8, 7 if normalize else 6, dtype=F64)
    kw = dict(feature_map=feature_map, normalize=normalize, scale=0.5)
    out, state, grads = run(dtype, q, k, v, decay, initial_state=s0, **kw)
    r_out, r_state, r_grads = torch_ref(F64, q, k, v, decay, initial_state=s0, **kw)
    t_out, t_state, t_grads = torch_ref(dtype, q, k, v, decay, initial_state=s0, **kw)
    assert_close_fa2(out, t_out, r_out, dtype, "out")
    assert_close_fa2(state, t_state, r_state, torch.float32, "final state")
    for name, a, t, r in zip(NAMES, grads, t_grads, r_grads):
        assert_close_fa2(a, t, r, dtype if name in ("dq", "dk", "dv") else torch.float32, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["short-masked", "long-state", "gqa"])
def test_16bit_identity_reads_its_inputs_as_widened(dtype, case):
    """Identity features without the normalizer hand 16-bit q, k, v to the kernel as they are (no
    float32 copies) where k and v have a head per query head: out and every gradient (the initial
    state's included) equal, bit for bit, the call on the float32-widened inputs rounded to the
    dtype (the kernel widens them exactly and rounds each result once). "long": 150 tokens, K 16
    (the forward's checkpoints read in place by the backward; its two-token passes meet the
    64-token chunks' edges). With GQA the gradients of the shared k and v sum over the group
    before they round: the widened path, the same equality."""
    s, m = (150, 16) if case == "long-state" else (29, 8)
    q, k, v, decay = problem(hk=2 if case == "gqa" else 4, s=s, m=m, extreme=True, seed=5)
    kw = dict(feature_map="identity", normalize=False, scale=0.5)
    if case == "short-masked":
        kw["key_mask"] = torch.rand(2, s, generator=torch.Generator().manual_seed(2)) > 0.3
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(2, 4, s, 6, generator=g).to(dtype)  # one upstream gradient, in dtype for both
    dstate = torch.randn(2, 4, m, 6, generator=g)
    s0 = torch.randn(2, 4, m, 6, generator=g) if case == "long-state" else None

    def call(t):
        xs = [x.detach().to(dtype).to(t).requires_grad_() for x in (q, k, v)]
        d = decay.detach().float().requires_grad_()
        st = s0.clone().requires_grad_() if s0 is not None else None
        out, state = ae.linear_attention(*xs, causal=True, decay=d, initial_state=st, return_state=True, **kw)
        state = state.augmented(False)
        torch.autograd.backward((out, state), (dout.to(t), dstate))
        return out, state, [x.grad for x in xs + [d]] + ([st.grad] if st is not None else [])

    out, state, grads = call(dtype)
    w_out, w_state, w_grads = call(torch.float32)
    assert out.dtype == dtype and torch.equal(out, w_out.to(dtype))
    assert torch.equal(state, w_state)
    for name, a, r in zip(NAMES, grads, w_grads):
        assert a.dtype == (dtype if name in ("dq", "dk", "dv") else torch.float32), name
        assert torch.equal(a, r.to(a.dtype)), name


def test_16bit_scale_zero_is_zero():
    """A scale of 0 gives 0 in fp16 too, where the unscaled out would round to inf (the call takes
    the float32 path: inf x 0 would be NaN)."""
    q, k, v, decay = problem(hk=4, seed=6)
    out = ae.linear_attention(q.half() * 100, k.half() * 100, v.half() * 100, causal=True, decay=decay.float(),
                              feature_map="identity", normalize=False, scale=0.0)
    assert out.dtype == torch.float16 and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("case", ["gqa-mask", "mha", "extreme", "identity-unnormalized"])
def test_float64_exact(case):
    """float64 runs the float64 kernel: the recurrence's answer to rounding, every gradient."""
    q, k, v, decay = problem(hk=4 if case == "mha" else 2, extreme=case == "extreme", seed=11)
    kw = dict(feature_map="identity" if case == "identity-unnormalized" else "elu",
              normalize=case != "identity-unnormalized")
    if case == "gqa-mask":
        kw["key_mask"] = torch.rand(2, 29, generator=torch.Generator().manual_seed(1)) > 0.3
    out, state, grads = run(F64, q, k, v, decay, **kw)
    r_out, r_state, r_grads = torch_ref(F64, q, k, v, decay, **kw)
    assert rel_err(out, r_out) < 1e-12 and rel_err(state, r_state) < 1e-12
    for name, a, r in zip(NAMES, grads, r_grads):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, r) < 1e-11, f"{name}: {rel_err(a, r):.3g}"


def test_hard_reset_forgets_the_past():
    """A row whose gates are all -inf empties the state: what follows equals a fresh start."""
    q, k, v, decay = problem(b=1, h=2, hk=2, s=20)
    decay[:, :, 9] = float("-inf")
    out = ae.linear_attention(q, k, v, causal=True, decay=decay)
    fresh = ae.linear_attention(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], causal=True, decay=decay[:, :, 9:])
    torch.testing.assert_close(out[:, :, 9:], fresh, rtol=1e-12, atol=1e-12)


def test_gradcheck():
    q, k, v, decay = problem(b=1, h=2, hk=1, s=9, m=3, dv=2)
    s0 = torch.rand(1, 2, 3, 3, dtype=F64, requires_grad=True)
    q, k, v, decay = (t.requires_grad_() for t in (q, k, v, decay))

    def f(q, k, v, decay, s0):
        out, st = ae.linear_attention(q, k, v, causal=True, decay=decay, initial_state=s0, return_state=True)
        return out, st.augmented(True)
    assert torch.autograd.gradcheck(f, (q, k, v, decay, s0))


def test_varlen_and_bshd_match_the_padded_calls():
    """A varlen pack equals each sequence on its own; bshd equals bhsd."""
    q, k, v, decay = problem(b=1, h=2, hk=2, s=30)
    cu = torch.tensor([0, 11, 11, 26], dtype=torch.int32)
    s0 = torch.rand(3, 2, 8, 7, dtype=F64)
    out, st = ae.linear_attention(q, k, v, causal=True, decay=decay, cu_seqlens=cu, initial_state=s0, return_state=True)
    for n in range(3):
        a, e = int(cu[n]), int(cu[n + 1])
        o_n, st_n = ae.linear_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], causal=True, decay=decay[:, :, a:e],
                                        initial_state=s0[n:n + 1], return_state=True)
        torch.testing.assert_close(out[:, :, a:e], o_n, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(st.augmented(True)[n:n + 1], st_n.augmented(True), rtol=1e-12, atol=1e-12)
    assert (out[:, :, 26:] == 0).all()  # rows no sequence owns
    o_b = ae.linear_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, decay=decay, layout="bshd")
    torch.testing.assert_close(o_b.transpose(1, 2), ae.linear_attention(q, k, v, causal=True, decay=decay),
                               rtol=0, atol=0)


def test_a_prefill_then_more_tokens():
    """Generation: a prefill's state, then the next tokens from it, equals the whole sequence."""
    q, k, v, decay = problem(b=1, h=2, hk=2, s=16)
    whole = ae.linear_attention(q, k, v, causal=True, decay=decay)
    _, st = ae.linear_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], causal=True, decay=decay[:, :, :10],
                                return_state=True)
    rest = ae.linear_attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], causal=True, decay=decay[:, :, 10:],
                               initial_state=st)
    torch.testing.assert_close(rest, whole[:, :, 10:], rtol=1e-12, atol=1e-12)


def test_opcheck_plain():
    """delta_fwd / delta_bwd with plain=True (the GLA write) under torch.library.opcheck."""
    q, k, v, decay = problem(b=1, h=2, hk=2, s=7, m=4, dv=3)
    a = dict(q=q.float(), k=k.float(), v=v.float(), beta=torch.ones(1, 2, 7), gate=decay.float(),
             initial_state=torch.rand(1, 2, 4, 3), cu_seqlens=None, scale=0.5, qk_l2norm=False, plain=True,
             checkpoints=True)
    for n in ("q", "k", "v", "gate", "initial_state"):
        a[n] = a[n].requires_grad_()
    torch.library.opcheck(torch.ops.attention_ext.delta_fwd.default, tuple(a[n] for n in delta.FWD_ARGS))


def test_errors_name_the_argument():
    q, k, v, decay = problem(b=1, h=2, hk=2, s=5)
    with pytest.raises(ValueError, match="decay"):
        ae.linear_attention(q, k, v, causal=True, decay=decay[..., :3])  # not M wide
    with pytest.raises(ValueError, match="causal"):
        ae.linear_attention(q, k, v, causal=False, decay=decay)
    from attention_ext.linear.feature_maps import Favor
    fm = Favor(8, nb_features=6, stabilize=True, seed=0)
    with pytest.raises(ValueError, match="stabilize"):
        ae.linear_attention(q, k, v, causal=True, decay=decay[..., :6], feature_map=fm)


def test_widest_values_and_zero_scale():
    """What the per-head path takes, the per-feature one takes too: Dv = 1024 normalized (the
    normalizer runs as a column of its own) and scale = 0 (every output 0)."""
    q, k = torch.rand(1, 2, 10, 8, dtype=F64), torch.rand(1, 2, 10, 8, dtype=F64)
    v = torch.randn(1, 2, 10, 1024, dtype=F64)
    g = -torch.rand(1, 2, 10, 8, dtype=F64)
    out, st = ae.linear_attention(q, k, v, causal=True, decay=g, return_state=True)
    r_out, _, r_fin = reference.linear_attention(q, k, v, causal=True, decay=g)
    assert rel_err(out, r_out) < 1e-12 and rel_err(st.augmented(True), r_fin) < 1e-12
    z = ae.linear_attention(q, k, v[..., :6], causal=True, decay=g, scale=0.0)
    assert (z == 0).all()
    with pytest.raises(ValueError, match="decay"):
        ae.linear_attention(q, k, v, causal=True, decay=g[..., None])  # 5-D


def test_fallback_without_kernels_equals_the_kernels(monkeypatch):
    """Where no delta kernel serves the call (CUDA training), GLA's gates run PyTorch's chunked WY
    form with the plain write: the kernels' answer and gradients, extreme gates included."""
    q, k, v, decay = problem(b=1, h=2, hk=1, s=45, m=6, dv=5, extreme=True)
    st = torch.randn(1, 2, 6, 6, dtype=F64) * 0.3
    a_out, a_st, a_g = run(torch.float32, q, k, v, decay, initial_state=st)
    monkeypatch.setitem(delta._KERNELS, "cpu", False)
    monkeypatch.setitem(delta._BWD_KERNELS, "cpu", False)
    b_out, b_st, b_g = run(torch.float32, q, k, v, decay, initial_state=st)
    torch.testing.assert_close(b_out, a_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b_st, a_st, rtol=1e-5, atol=1e-5)
    for x, y in zip(b_g, a_g):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64], ids=str)
@pytest.mark.parametrize("feature_map,normalize", [("elu", True), ("identity", False), ("relu", True)])
@pytest.mark.parametrize("inplace", [False, True])
def test_steps_continue_a_prefill(dtype, feature_map, normalize, inplace):
    """Generation with GLA's gates: linear_attention's prefill state, then linear_attention_step
    with decay_t (B, H, T, M) one token at a time (and three at once), GQA and extreme gates
    (a -inf hard reset inside the steps), equals the whole sequence against float64 under the
    error rule; with inplace=True the state's own tensors advance."""
    q, k, v, decay = problem(b=2, h=4, hk=2, s=29, m=8, dv=6, seed=11, extreme=True)
    decay[1, 2, 22, 3:] = float("-inf")  # inside the stepped tokens
    kw = dict(feature_map=feature_map, normalize=normalize, scale=0.5)
    side = F64 if dtype == F64 else torch.float32
    x = [t.to(dtype) for t in (q, k, v)]
    g = decay.to(side)
    out0, st = ae.linear_attention(x[0][:, :, :20], x[1][:, :, :20], x[2][:, :, :20], causal=True,
                                   decay=g[:, :, :20], return_state=True, **kw)
    outs, S0 = [out0], st.S
    for lo, hi in ((20, 21), (21, 22), (22, 25), (25, 29)):
        before = st.S.clone()
        o, new = ae.linear_attention_step(*(t[:, :, lo:hi] for t in x), st, decay_t=g[:, :, lo:hi], inplace=inplace,
                                          **kw)
        assert (new is st) == inplace and (new.S is S0) == inplace
        assert torch.equal(st.S, before) != inplace  # inplace=False leaves the given state as it was
        st = new
        outs.append(o)
    out = torch.cat(outs, 2)
    r_out, r_state, _ = torch_ref(F64, q, k, v, decay, **kw)
    t_out, t_state, _ = torch_ref(dtype, q, k, v, decay, **kw)
    assert_close_fa2(out, t_out, r_out, dtype, "out")
    assert_close_fa2(st.augmented(normalize), t_state, r_state, side if dtype != F64 else F64, "final state")
    whole = ae.linear_attention(*x, causal=True, decay=g, **kw)
    if dtype == F64:
        torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-12)


def test_step_bshd_and_a_per_head_prefill():
    """decay_t per feature after a prefill with per-head gates (its state is the same kind), in
    the bshd layout: the reference with the per-head gates broadcast over the features."""
    q, k, v, decay = problem(b=1, h=2, hk=1, s=12, m=5, dv=3, seed=4)
    head = decay[..., 0]  # (B, H, S)
    _, st = ae.linear_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], causal=True, decay=head[:, :, :9],
                                return_state=True)
    o, st = ae.linear_attention_step(*(t[:, :, 9:].transpose(1, 2) for t in (q, k, v)), st,
                                     decay_t=decay[:, :, 9:], layout="bshd")
    full = torch.cat([head[:, :, :9, None].expand(-1, -1, -1, 5), decay[:, :, 9:]], 2)
    r_out, _, r_fin = reference.linear_attention(q, k, v, feature_map=1, causal=True, decay=full)
    assert o.shape == (1, 3, 2, 3)
    torch.testing.assert_close(o.transpose(1, 2), r_out[:, :, 9:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.augmented(True), r_fin, rtol=1e-12, atol=1e-12)


def test_step_gradcheck():
    """Two steps with per-feature gates from a given state, differentiable in every input
    (inplace=False under autograd), float64 gradcheck."""
    q, k, v, decay = problem(b=1, h=2, hk=1, s=3, m=3, dv=2, seed=5)
    s0, z0 = torch.rand(1, 2, 3, 2, dtype=F64), torch.rand(1, 2, 3, dtype=F64)
    xs = [t.clone().requires_grad_() for t in (q, k, v, decay, s0, z0)]

    def f(q, k, v, g, s, z):
        st = ae.LinearAttentionState(s, z)
        o1, st = ae.linear_attention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], st, decay_t=g[:, :, :1])
        o2, st = ae.linear_attention_step(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], st, decay_t=g[:, :, 1:])
        return o1, o2, st.S, st.z

    assert torch.autograd.gradcheck(f, xs)


def test_step_errors_name_the_argument():
    q, k, v, decay = problem(b=1, h=2, hk=2, s=2, m=8, dv=3)
    with pytest.raises(ValueError, match="decay_t"):
        ae.linear_attention_step(q, k, v, None, decay_t=decay[..., :5])  # not M wide
    from attention_ext.linear.feature_maps import Favor
    fm = Favor(8, nb_features=6, stabilize=True, seed=0)
    with pytest.raises(ValueError, match="stabilize"):
        ae.linear_attention_step(q, k, v, None, decay_t=decay[..., :6], feature_map=fm)
    # one token taken by an index (x[:, :, -1], 3-D): the error shows the slice that keeps the axis
    with pytest.raises(ValueError, match=r"q_t must be a 4-D .*x\[:, :, -1:\]"):
        ae.linear_attention_step(q[:, :, -1], k[:, :, -1:], v[:, :, -1:], None)


def test_step_without_the_step_kernel(monkeypatch):
    """Where no compiled step serves the device (reference.linear_step in place, the PyTorch
    recurrence), the in-place per-feature step gives the kernel's answer and advances the same
    tensors."""
    q, k, v, decay = problem(b=1, h=2, hk=1, s=3, m=6, dv=5, seed=8)
    decay[0, 1, 1, :3] = float("-inf")  # a hard reset of half the features
    x = [t.float() for t in (q, k, v)] + [decay.float()]
    st0 = ae.LinearAttentionState(torch.randn(1, 2, 6, 5), torch.rand(1, 2, 6))
    a_out, a_st = ae.linear_attention_step(*x[:3], st0.clone(), decay_t=x[3], inplace=True)
    monkeypatch.setitem(ops._STEP_KERNELS, "cpu", False)
    assert not ops.has_step_kernel(torch.device("cpu"), torch.float32)
    st = st0.clone()
    S, z = st.S, st.z
    b_out, b_st = ae.linear_attention_step(*x[:3], st, decay_t=x[3], inplace=True)
    assert b_st.S is S and b_st.z is z
    torch.testing.assert_close(b_out, a_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b_st.augmented(), a_st.augmented(), rtol=1e-5, atol=1e-5)
