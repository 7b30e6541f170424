"""The delta rule's CUDA forward (csrc/linear/cuda/delta_kernel.cuh) run on the CPU by the host
emulator (module attention_ext_emu_delta, built by emulator.load_delta()) against the float64
recurrence, with the project rule: error <= 2x PyTorch's own same-dtype error plus a floor.

torch.ops.attention_ext_emu_delta.delta_fwd / delta_step run the real binding's host steps
(csrc/torch/linear_delta_cuda_steps.h) with out and the final state starting as NaN, so an element
the kernel misses fails here. Covered: every lane split of a column (K from 5 to 600: KS = 1 to
32 lanes, 16 or 32 rows each), value widths that leave part of a CTA's columns empty, GVA, no /
per-head / per-key gates, the L2 norm, the plain write (GLA), float32 / float16 / bfloat16 inputs
with float32 or 16-bit beta and gates, blocks of staged tokens (long sequences, wide keys), varlen
packs with empty sequences, hard resets and extreme gates, the in-place step (prefill then steps
equal the whole sequence), and other warp interleavings (a missing barrier shows). The module
builds in ~10 s; the tests take seconds. Not covered: timing, real concurrency, register spills.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from attention_ext.linear import reference
from tests.cuda_emu import emulator as cuda_emu
from tests.fuzz.common import at_least
from tests.helpers import assert_close_fa2
from tests.linear.test_delta import problem  # float64 q, k (L2-normalized), v, beta, gates, state

F64 = torch.float64


@pytest.fixture(scope="module")
def emu():
    e = cuda_emu.load_delta()
    if e is None:
        pytest.skip(f"CUDA emulator unavailable: {cuda_emu.why}")
    return e


def launched(emu):
    """Which kernels the calls since the last look ran: 'recurrent' (delta_kernel.cuh), 'chunk'
    (delta_chunk_kernel.cuh)."""
    return {"chunk" if "delta_chunk" in n else "recurrent" for n in emu.launches() if "delta" in n}


def run(emu, q, k, v, beta, gate, h0, *, scale=None, l2=False, plain=False, cu=None, side_dtype=None,
        kernel="recurrent"):
    """The emulated op on inputs cast to q's dtype (beta and gate to side_dtype, default float32),
    checked to have run `kernel` (launched()) and no other."""
    side = side_dtype or torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    emu.launches()
    out, st, ck = emu.delta_fwd(q, k, v, beta.to(side).contiguous(),
                                gate.to(side).contiguous() if gate is not None else None,
                                h0.float().contiguous() if h0 is not None else None, cu, scale, l2, plain)
    assert ck.numel() == 0
    if q.shape[2] and q.numel() and v.numel():
        assert launched(emu) == {kernel}
    return out, st


def check(emu, dtype, q, k, v, beta, gate, h0, *, l2=False, plain=False, cu=None, side_dtype=None, what="",
          kernel="recurrent"):
    """ours vs float64 within 2x the same recurrence in PyTorch at `dtype` (its states in dtype)."""
    qd, kd, vd, bd = (t.to(dtype) for t in (q, k, v, beta))
    side = side_dtype or torch.float32
    gd = gate.to(side) if gate is not None else None
    out, st = run(emu, qd, kd, vd, bd, gd, h0, l2=l2, plain=plain, cu=cu, side_dtype=side, kernel=kernel)
    scale = q.shape[-1] ** -0.5
    ins64 = [t.to(F64) for t in (qd, kd, vd, bd.to(side))]
    g64 = gd.to(F64) if gd is not None else None
    h64 = h0.float().to(F64) if h0 is not None else None
    ref_out, ref_st = reference.delta_rule(*ins64, g64, scale, h64, cu, l2, plain=plain)
    t_out, t_st = reference.delta_rule(qd, kd, vd, bd.to(side).to(dtype), gd.to(dtype) if gd is not None else None,
                                       scale, h0.to(dtype) if h0 is not None else None, cu, l2, acc=dtype, plain=plain)
    assert out.dtype == dtype and st.dtype == torch.float32
    assert not out.isnan().any() and not st.isnan().any(), what
    assert_close_fa2(out, t_out, ref_out, dtype, f"{what} out")
    assert_close_fa2(st, t_st, ref_st, dtype, f"{what} final state")
    return out, st


CASES = [  # (hk, hv, s, kd, vd, gate, l2): K picks the lanes per column (1, 2, 4, 8, 16, 32) and rows (16 / 32)
    (1, 1, 1, 5, 8, None, False),
    (1, 2, 23, 16, 24, None, False),
    (2, 4, 37, 33, 17, "head", False),
    (1, 3, 40, 64, 64, "key", True),
    (2, 2, 9, 100, 5, "key", False),
    (1, 1, 45, 128, 40, "head", True),
    (1, 2, 12, 200, 33, "key", True),
    (1, 1, 11, 300, 9, "head", True),
    (1, 1, 7, 600, 6, "key", True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_matches_float64(emu, case, dtype):
    hk, hv, s, kd, vd, gate, l2 = case
    q, k, v, beta, g, h0 = problem(b=2, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate)
    check(emu, dtype, q, k, v, beta, g, h0, l2=l2, what=str(case))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_beta_and_gates(emu, dtype):
    """beta and gate in q's dtype (the binding reads either)."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=30, kd=64, vd=20, gate="key")
    check(emu, dtype, q, k, v, beta, g, h0, l2=True, side_dtype=dtype)


@pytest.mark.parametrize("gate", [None, "head", "key"])
def test_plain_write(emu, gate):
    """u = v, beta unread (linear attention with GLA's per-key gates)."""
    q, k, v, beta, g, h0 = problem(b=1, hk=2, hv=2, s=50, kd=48, vd=24, gate=gate)
    check(emu, torch.float32, q, k, v, beta, g, h0, plain=True)


def test_no_initial_state(emu):
    q, k, v, beta, g, _ = problem(b=2, hk=1, hv=1, s=33, kd=32, vd=40, gate="head", h0=False)
    check(emu, torch.float32, q, k, v, beta, g, None, l2=True)


@pytest.mark.parametrize("kd,s", [(128, 100), (600, 13)])
def test_token_blocks(emu, kd, s):
    """Sequences longer than one staged block of tokens (32 at K = 128; 2 or 3 at K = 600 with
    per-key gates): the block loop's barriers and the state carried across blocks."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=s, kd=kd, vd=12, gate="key")
    check(emu, torch.float32, q, k, v, beta, g, h0, l2=True)


@pytest.mark.parametrize("gate", ["head", "key"])
def test_varlen_with_empty_sequences(emu, gate):
    """A pack of sequences (an empty one included) equals each run alone; the tail rows that no
    sequence owns are 0, and an empty sequence passes its initial state through."""
    cu = torch.tensor([0, 9, 9, 30, 41], dtype=torch.int32)
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=45, kd=24, vd=10, gate=gate, nseq=4)
    out, st = check(emu, torch.float32, q, k, v, beta, g, h0, l2=True, cu=cu)
    assert (out[:, :, 41:] == 0).all()
    torch.testing.assert_close(st[1], h0[1].float(), rtol=0, atol=0)
    # NaN in the rows past the last sequence changes no bit
    bad = [t.float().clone() for t in (q, k, v, beta, g)]
    for t in bad:
        t[:, :, 41:] = float("nan")
    out_n, st_n = run(emu, *bad, h0, l2=True, cu=cu)
    assert torch.equal(out_n, out) and torch.equal(st_n, st)
    for n in range(4):
        a, e = int(cu[n]), int(cu[n + 1])
        sl = (slice(None), slice(None), slice(a, e))
        o1, s1 = run(emu, *(t.float()[sl] for t in (q, k, v, beta)), g.float()[sl], h0[n:n + 1], l2=True)
        torch.testing.assert_close(out[sl], o1, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(st[n:n + 1], s1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gate", ["head", "key"])
@pytest.mark.parametrize("big", [1e4, 1e9, float("inf")])
def test_extreme_gates(emu, gate, big):
    """A log-gate of -1e4, -1e9 or -inf at one token empties the state there: the recurrence stays
    exact (the rows after it equal a fresh run of the tail), where a chunked form's cumulative
    gates lose it."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=40, kd=16, vd=8, gate=gate)
    r = 17
    g[:, :, r] = -big
    out, st = check(emu, torch.float32, q, k, v, beta, g, h0, l2=True)
    tail_g = g[:, :, r:].clone()
    tail_g[:, :, 0] = 0.0
    tail, tail_st = run(emu, *(t.float()[:, :, r:] for t in (q, k, v, beta)), tail_g.float(), None, l2=True)
    torch.testing.assert_close(out[:, :, r:], tail, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(st, tail_st, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_steps_equal_the_sequence(emu, dtype):
    """delta_step advances the state in place: a prefill's final state followed by steps of 1 and 3
    tokens gives the whole sequence's outputs and final state."""
    q, k, v, beta, g, h0 = problem(b=2, hk=1, hv=2, s=20, kd=32, vd=16, gate="key")
    q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
    g, h0 = g.float(), h0.float()
    whole, final = run(emu, q, k, v, beta, g, h0, l2=True)
    sl = lambda a, e: (slice(None), slice(None), slice(a, e))  # noqa: E731
    out0, state = run(emu, *(t[sl(0, 12)] for t in (q, k, v, beta)), g[sl(0, 12)], h0, l2=True)
    outs = [out0]
    scale = q.shape[-1] ** -0.5
    for a, e in ((12, 13), (13, 16), (16, 20)):
        ptr = state.data_ptr()
        outs.append(emu.delta_step(*(t[sl(a, e)] for t in (q, k, v)), beta.float()[sl(a, e)].contiguous(), state,
                                   g[sl(a, e)].contiguous(), scale, True))
        assert state.data_ptr() == ptr
    torch.testing.assert_close(torch.cat(outs, 2), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("warp_serial,reverse", [(False, False), (True, True)], ids=["lockstep", "last_warp_first"])
def test_other_warp_interleavings(emu, warp_serial, reverse):
    """The staged rows are written by one warp and read by all; o is left by the slice-0 lanes and
    written out by others: a missing barrier reads stale or unwritten shared memory."""
    emu.set_schedule(warp_serial, reverse)
    try:
        q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=70, kd=64, vd=40, gate="key")
        check(emu, torch.float32, q, k, v, beta, g, h0, l2=True)
    finally:
        emu.set_schedule(True, False)


def test_errors_name_the_argument(emu):
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=5, kd=8, vd=8, gate="head")
    q, k, v, beta = (t.float() for t in (q, k, v, beta))
    with pytest.raises(ValueError, match="beta must have shape"):
        emu.delta_fwd(q, k, v, beta[:, :1], None, None, None, 0.3, False, False)
    with pytest.raises(ValueError, match="checkpoints=True is for the CPU"):
        emu.delta_fwd(q, k, v, beta, None, None, None, 0.3, False, False, True)
    with pytest.raises(TypeError, match="float64"):
        emu.delta_fwd(q.double(), k.double(), v.double(), beta.double(), None, None, None, 0.3, False, False)
    with pytest.raises(ValueError, match="state must be contiguous|contiguous"):
        emu.delta_step(q, k, v, beta, h0.float().transpose(-1, -2).contiguous().transpose(-1, -2), None, 0.3, False)


@at_least(150)
@given(data=st.data())
def test_fuzz_cuda_delta_forward(emu, data):
    """Hypothesis over the emulated kernel: dtypes, GVA groups, K (every lane split) and V (partial
    column blocks), gates (with the odd -inf reset), the L2 norm, initial states, varlen packs with
    empty sequences and a tail, the plain write, 16-bit beta / gates; out and the final state
    against float64 under the 2x rule."""
    draw = data.draw
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    varlen = draw(st.booleans())
    b = 1 if varlen else draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    hv = hk * draw(st.integers(1, 3))
    kd = draw(st.sampled_from([1, 3, 16, 17, 33, 64, 100, 128, 200, 513]))
    vd = draw(st.sampled_from([1, 5, 16, 31, 33, 64, 100]))
    gate = draw(st.sampled_from([None, "head", "key"]))
    plain = draw(st.booleans()) and gate == "key"
    l2, init = draw(st.booleans()), draw(st.booleans())
    side = draw(st.sampled_from([torch.float32, dtype]))
    if varlen:
        lens = draw(st.lists(st.integers(0, 25), min_size=1, max_size=4))
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        s, nseq = int(cu[-1]) + draw(st.integers(0, 2)), len(lens)
    else:
        s, cu, nseq = draw(st.integers(0, 80)), None, b
    seed = draw(st.integers(0, 2 ** 16))
    note(dict(dtype=dtype, b=b, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate, plain=plain, l2=l2, init=init,
              side=side, cu=cu, seed=seed))
    q, k, v, beta, g, h0 = problem(b=b, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate, seed=seed, h0=init, nseq=nseq)
    if g is not None and s > 3 and draw(st.booleans()):
        g[:, :, s // 2] = float("-inf")  # a hard reset mid-sequence
    if plain:
        v = v * 0.3  # the plain write adds every token: keep the state's size moderate
    check(emu, dtype, q, k, v, beta, g, h0, l2=l2, plain=plain, cu=cu, side_dtype=side, what="fuzz")
