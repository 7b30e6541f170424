"""The recurrent step: torch.ops.attention_ext.linear_step (the fused CPU kernel, state updated in
place) against reference.linear_step in float64 (FA2's rule: error <= 2x PyTorch's own same-dtype
error), prefill + steps == the parallel causal form through linear_attention_step, in-place
semantics, the autograd fallback, opcheck, and input errors (the C++ check and the fake agree)."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.linear import LinearAttentionState, feature_maps, ops, reference
from tests.helpers import assert_close_fa2

pytestmark = pytest.mark.filterwarnings("ignore:attention_ext. no compiled linear:RuntimeWarning")
HAS_STEP = ops.has_step_kernel(torch.device("cpu"))
needs_op = pytest.mark.skipif(not HAS_STEP, reason="torch.ops.attention_ext.linear_step has no CPU kernel")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
f64 = torch.float64


def step_problem(b=2, h=4, hk=2, t=1, m=7, dv=9, dtype=torch.float32, decay=True, normalize=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, m, generator=g).to(dtype)
    k = torch.randn(b, hk, t, m, generator=g).to(dtype)
    v = torch.randn(b, hk, t, dv, generator=g).to(dtype)
    acc = ops.acc_dtype(dtype)
    state = torch.randn(b, h, m, dv, generator=g).to(acc)
    z = (torch.rand(b, h, m, generator=g) + 1).to(acc) if normalize else None
    gate = (-torch.rand(b, h, t, *((m,) if decay == "feature" else ()), generator=g)).to(acc) if decay else None
    if decay == "feature" and t > 0:  # GLA's gate per feature, a reset (-inf) of two rows of one head
        gate[0, 1, -1, :2] = float("-inf")
    return q, k, v, state, z, gate


# ---------------------------------------------------------------------------------- the op
@needs_op
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("code", [0, 1, 2])
@pytest.mark.parametrize("t,decay,normalize,hk", [(1, False, True, 4), (1, True, True, 2), (3, True, True, 1),
                                                   (4, False, False, 2), (1, "feature", True, 2),
                                                   (3, "feature", False, 1)])
@pytest.mark.parametrize("m,dv", [(7, 9), (64, 64), (16, 40), (33, 1)])
def test_op_matches_reference(m, dv, t, decay, normalize, hk, code, dtype):
    q, k, v, s0, z0, gate = step_problem(hk=hk, t=t, m=m, dv=dv, dtype=dtype, decay=decay, normalize=normalize)
    s, z = s0.clone(), None if z0 is None else z0.clone()
    kw = dict(feature_map=code, eps=1e-6, scale=0.7)
    out = ops.step(q, k, v, s, z, gate, **kw)
    assert out.dtype == dtype and out.shape == (2, 4, t, dv)

    def ref(rdt):
        sdt = f64 if rdt == f64 else ops.acc_dtype(dtype)
        return reference.linear_step(*(x.to(rdt) for x in (q, k, v)), s0.to(sdt).clone(),
                                     None if z0 is None else z0.to(sdt).clone(),
                                     None if gate is None else gate.to(sdt), inplace=True, **kw)

    r_out, r_s, r_z = ref(f64)
    lo_out, lo_s, lo_z = ref(dtype)
    assert_close_fa2(out, lo_out, r_out, dtype, "out")
    assert_close_fa2(s, lo_s, r_s, torch.float32 if dtype != f64 else f64, "state")
    if normalize:
        assert_close_fa2(z, lo_z, r_z, torch.float32 if dtype != f64 else f64, "normalizer")


@needs_op
def test_op_updates_in_place_with_strides():
    """The state may be any view with a contiguous last dim (here every other head of a larger
    tensor); the op writes through it and leaves the rest untouched."""
    q, k, v, s0, z0, gate = step_problem(t=2)
    big, zbig = torch.randn(2, 8, 7, 9), torch.rand(2, 8, 7) + 1
    big[:, ::2], zbig[:, ::2] = s0, z0
    keep, zkeep = big[:, 1::2].clone(), zbig[:, 1::2].clone()
    s, z = big[:, ::2], zbig[:, ::2]
    ptr = s.data_ptr()
    out = ops.step(q, k, v, s, z, gate, feature_map=1, eps=1e-6, scale=1.0)
    r_out, r_s, r_z = reference.linear_step(q, k, v, s0.clone(), z0.clone(), gate, feature_map=1)
    torch.testing.assert_close(out, r_out)
    torch.testing.assert_close(big[:, ::2], r_s)
    torch.testing.assert_close(zbig[:, ::2], r_z)
    assert s.data_ptr() == ptr and torch.equal(big[:, 1::2], keep) and torch.equal(zbig[:, 1::2], zkeep)


@needs_op
def test_op_empty_and_no_positions():
    q, k, v, s0, z0, _ = step_problem(t=0)
    s = s0.clone()
    out = ops.step(q, k, v, s, z0.clone(), None, feature_map=1, eps=1e-6, scale=1.0)
    assert out.shape == (2, 4, 0, 9) and torch.equal(s, s0)


@needs_op
@pytest.mark.parametrize("case", ["mha", "gqa_decay", "no_normalizer", "T3_bf16", "f64", "per_feature"])
def test_opcheck(case):
    kw = dict(mha=dict(hk=4), gqa_decay=dict(hk=2), no_normalizer=dict(normalize=False, decay=False),
              T3_bf16=dict(t=3, dtype=torch.bfloat16), f64=dict(t=2, dtype=f64),
              per_feature=dict(t=2, decay="feature"))[case]
    q, k, v, s, z, gate = step_problem(**kw)
    torch.library.opcheck(torch.ops.attention_ext.linear_step.default, (q, k, v, s, z, gate, 1, 1e-6, 0.5))


BAD = [
    ("q 3-D", lambda a: a.update(q=a["q"][0]), ValueError),
    ("dtype mix", lambda a: a.update(k=a["k"].double()), TypeError),
    ("int dtype", lambda a: a.update(q=a["q"].long(), k=a["k"].long(), v=a["v"].long()), TypeError),
    ("heads", lambda a: a.update(k=a["k"][:, :1].repeat(1, 3, 1, 1), v=a["v"][:, :1].repeat(1, 3, 1, 1)), ValueError),
    ("kv length", lambda a: a.update(k=a["k"].repeat(1, 1, 2, 1)), ValueError),
    ("feature width", lambda a: a.update(k=a["k"][..., :3]), ValueError),
    ("state shape", lambda a: a.update(state=a["state"][..., :4]), ValueError),
    ("state dtype", lambda a: a.update(state=a["state"].double()), TypeError),
    ("state last stride", lambda a: a.update(state=a["state"].transpose(2, 3).contiguous().transpose(2, 3)),
     ValueError),
    ("normalizer shape", lambda a: a.update(normalizer=a["normalizer"][..., :3]), ValueError),
    ("normalizer dtype", lambda a: a.update(normalizer=a["normalizer"].half()), TypeError),
    ("decay shape", lambda a: a.update(decay=a["decay"][:, :2]), ValueError),
    ("decay per feature, not M wide", lambda a: a.update(decay=a["decay"][..., None].expand(-1, -1, -1, 3).contiguous()),
     ValueError),
    ("feature_map", lambda a: a.update(feature_map=3), ValueError),
    ("eps", lambda a: a.update(eps=float("nan")), ValueError),
    ("last stride", lambda a: a.update(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError),
]


@needs_op
@pytest.mark.parametrize("name,mutate,exc", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_fake_matches_cpp(name, mutate, exc):
    """The op on CPU tensors and on fake tensors (its Meta kernel) rejects the same inputs with the
    same type and message (one C++ check), and a rejected call leaves the state unchanged."""
    q, k, v, s, z, gate = step_problem(t=2)
    a = dict(q=q, k=k, v=v, state=s, normalizer=z, decay=gate, feature_map=1, eps=1e-6, scale=1.0)
    mutate(a)
    args = tuple(a[n] for n in ops.STEP_ARGS)
    before = a["state"].clone()
    with pytest.raises(exc) as real:
        torch.ops.attention_ext.linear_step(*args)
    assert torch.equal(a["state"], before)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args)
        with pytest.raises(exc) as faked:
            torch.ops.attention_ext.linear_step(*fake)
    assert str(faked.value).splitlines()[0] == str(real.value).splitlines()[0]


# ---------------------------------------------------------------------------------- linear_attention_step
MAPS = ["identity", "elu", "relu", "favor", "rfa"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("decay", [False, True])
def test_prefill_then_steps_equals_parallel(fmap, decay, dtype):
    """Prefill (return_state=True) then steps of 1 and 3 tokens (no grad: the op where built)
    equal the parallel causal form, within 2x PyTorch's same-dtype error of the float64 result;
    GQA, odd M = 7 and Dv = 5."""
    g = torch.Generator().manual_seed(1)
    b, h, hk, s, m, dv = 2, 4, 2, 11, 7, 5
    q, k = (0.5 * torch.randn(b, h, s, m, generator=g)), 0.5 * torch.randn(b, hk, s, m, generator=g)
    v = torch.randn(b, hk, s, dv, generator=g)
    gate = -torch.rand(b, h, s, generator=g, dtype=f64) if decay else None
    eps = 0.0 if fmap == "favor" else 1e-6  # FAVOR+'s key offset moves between calls; exact without eps
    fm = {"favor": feature_maps.Favor(m, 16, seed=0), "rfa": feature_maps.RFA(m, 8, seed=0)}.get(fmap, fmap)
    if fmap == "rfa":
        eps = 0.0  # RFA's features can be negative: no eps near a vanishing normalizer

    def run(dt):
        x = [t.to(dt) for t in (q, k, v)]
        gg = None if gate is None else gate.to(ops.acc_dtype(dt))
        full = ae.linear_attention(*x, feature_map=fm, causal=True, decay=gg, eps=eps, scale=0.8)
        out, st = ae.linear_attention(*(t[:, :, :5] for t in x), feature_map=fm, causal=True, eps=eps, scale=0.8,
                                      decay=None if gg is None else gg[..., :5], return_state=True)
        outs = [out]
        for a, e in ((5, 6), (6, 9), (9, 10), (10, 11)):
            o, st = ae.linear_attention_step(*(t[:, :, a:e] for t in x), st, feature_map=fm, eps=eps, scale=0.8,
                                             decay_t=None if gg is None else gg[..., a:e], inplace=a % 2 == 0)
            outs.append(o)
        return torch.cat(outs, 2), full

    with torch.no_grad():
        steps, full = run(dtype)
        ref = run(f64)[1]
    assert steps.dtype == dtype
    assert_close_fa2(steps, full, ref, dtype, "steps")
    if dtype == f64:
        torch.testing.assert_close(steps, full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmap", ["elu", "favor"])
def test_op_path_equals_pytorch_path(fmap, dtype):
    """linear_attention_step without grad (the op where built) and with autograd recording (the
    PyTorch form, reference.linear_step) give the same outputs and states."""
    q, k, v, s0, z0, gate = step_problem(t=3, m=16, dv=12, dtype=dtype)
    fm = feature_maps.Favor(16, 16, seed=0) if fmap == "favor" else fmap
    st = LinearAttentionState(s0, z0, torch.zeros(2, 4) if fmap == "favor" else None)
    with torch.no_grad():
        a, sa = ae.linear_attention_step(q, k, v, st, feature_map=fm, decay_t=gate)
    leaf = st.S.clone().requires_grad_()
    b, sb = ae.linear_attention_step(q, k, v, LinearAttentionState(leaf, st.z, st.log_scale), feature_map=fm,
                                     decay_t=gate)
    assert b.grad_fn is not None
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(a, b.detach(), **tol)
    torch.testing.assert_close(sa.S, sb.S.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sa.z, sb.z.detach(), rtol=1e-5, atol=1e-5)


def test_inplace_semantics():
    q, k, v, s0, z0, gate = step_problem(t=2)
    st = LinearAttentionState(s0.clone(), z0.clone())
    with torch.no_grad():
        _, new = ae.linear_attention_step(q, k, v, st, decay_t=gate)  # a new state; st kept
        assert torch.equal(st.S, s0) and torch.equal(st.z, z0) and new is not st
        s_ptr = st.S.data_ptr()
        _, same = ae.linear_attention_step(q, k, v, st, decay_t=gate, inplace=True)
    assert same is st and st.S.data_ptr() == s_ptr  # the decode loop's tensors, advanced in place
    torch.testing.assert_close(st.S, new.S)
    torch.testing.assert_close(st.z, new.z)
    # normalize=False: no normalizer in the result, as linear_attention's state
    _, nz = ae.linear_attention_step(q, k, v, LinearAttentionState(s0.clone(), z0.clone()), normalize=False)
    assert nz.z is None


def test_step_gradcheck_every_input():
    """The autograd path (the PyTorch form) differentiates q, k, v, decay and the state, in float64."""
    q, k, v, s0, z0, gate = step_problem(b=1, h=2, hk=1, t=2, m=3, dv=2, dtype=f64)
    leaves = [x.requires_grad_() for x in (q, k, v, s0, z0, gate)]

    def fn(q, k, v, s, z, g):
        out, st = ae.linear_attention_step(q, k, v, LinearAttentionState(s, z), decay_t=g, scale=0.6)
        return out, st.S, st.z

    assert torch.autograd.gradcheck(fn, tuple(leaves))


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(state=LinearAttentionState(torch.zeros(2, 4, 7, 8), torch.zeros(2, 4, 7))), ValueError, "state.S must be"),
    (dict(state=LinearAttentionState(torch.zeros(2, 4, 7, 9))), ValueError, "normalizer z"),
    (dict(decay_t=torch.zeros(2, 4, 3)), ValueError, "decay_t must be"),
    (dict(layout="sbhd"), ValueError, "layout"),
    (dict(state=torch.zeros(2, 4, 7, 9)), TypeError, "LinearAttentionState"),
])
def test_functional_bad_inputs(kwargs, exc, msg):
    q, k, v, s, z, _ = step_problem(t=2)
    kw = dict(dict(state=LinearAttentionState(s, z)), **kwargs)
    with pytest.raises(exc, match=msg):
        ae.linear_attention_step(q, k, v, kw.pop("state"), **kw)
    with pytest.raises(ValueError, match="do not match"):
        ae.linear_attention_step(q, k[..., :3], v, None)


@needs_op
def test_compiled_step_mutates_the_state():
    """Under torch.compile the mutating op is functionalized and the state still advances in place."""
    q, k, v, s0, z0, gate = step_problem(t=1)
    s1, z1, s2, z2 = s0.clone(), z0.clone(), s0.clone(), z0.clone()

    def f(q, k, v, s, z, g):
        return ops.step(q, k, v, s, z, g, feature_map=1, eps=1e-6, scale=1.0)

    with torch.no_grad():
        a = torch.compile(f, fullgraph=True)(q, k, v, s1, z1, gate)
        b = f(q, k, v, s2, z2, gate)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(s1, s2)
    torch.testing.assert_close(z1, z2)
    assert not torch.equal(s1, s0)


@needs_op
def test_op_refuses_overlapping_state():
    """state and normalizer are written in place: an expanded state, or a normalizer sharing the
    state's memory, would be updated twice; the op names the argument instead."""
    q, k, v, s0, z0, gate = step_problem(b=2, h=4, hk=2, m=7, dv=9)
    expanded = s0[:1].expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match="state is updated in place"):
        ops.step(q, k, v, expanded, z0.clone(), gate)
    with pytest.raises(ValueError, match="normalizer is updated in place"):
        ops.step(q, k, v, s0.clone(), z0[:1].expand(2, -1, -1), gate)
    s = s0.clone()
    with pytest.raises(ValueError, match="share memory"):
        ops.step(q, k, v, s, s.view(2, 4, 7 * 9)[:, :, :7], gate)  # z over the first state row


def test_inplace_step_advances_a_strided_state():
    """inplace=True on a state whose S is a transposed view (not stride 1) advances that very tensor
    (the kernel runs on a contiguous copy and the result goes back), equal to the functional step."""
    torch.manual_seed(3)
    q = k = torch.randn(1, 2, 1, 4)
    v = torch.randn(1, 2, 1, 3)
    buf = torch.rand(1, 2, 3, 4)
    st = ae.LinearAttentionState(buf.transpose(-1, -2), torch.rand(1, 2, 4))
    ref_out, ref = ae.linear_attention_step(q, k, v, ae.LinearAttentionState(st.S.clone(), st.z.clone()))
    out, got = ae.linear_attention_step(q, k, v, st, inplace=True)
    assert got is st and st.S.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(buf.transpose(-1, -2), ref.S)
    torch.testing.assert_close(st.z, ref.z)
