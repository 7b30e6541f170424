"""The delta rule's chunk-parallel CUDA forward (csrc/linear/cuda/delta_chunk_kernel.cuh: three
tensor-core kernels over a scratch) run on the CPU by the host emulator against the float64
recurrence, under the project rule (error <= 2x PyTorch's own recurrence in the same dtype, bf16
or fp16, plus a floor).

The module's selection is set to chunked=1 (the chunk kernels for every call they take), so short
sequences reach them too; each test checks that they ran (or, for the calls they do not take, that
the recurrent kernel did). The scratch starts as 0xff bytes (bf16 NaN) and out and the state as NaN,
so a tile read before it is written, or an output left unwritten, fails. Covered: K 8-128 (both
kernel widths, K past 64 in the 128 one), V with partial value tiles, GVA, no gate, per-head gates
and per-key gates (KDA; with the plain write: GLA), the L2 norm, initial states, chunk boundaries
(1, 63, 64, 65, 130 rows), varlen packs with empty sequences and chunks that straddle sequences,
-1e4 / -1e9 / -inf gates at and across chunk boundaries (per head, and per key channel inside the
16-row blocks and across them), NaN past the pack, other warp interleavings, and a fuzz. Not
covered: timing, real concurrency, register spills (ptxas), bank conflicts.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from tests.cuda_emu import emulator as cuda_emu
from tests.cuda_emu.test_delta_emulated import check, launched
from tests.fuzz.common import at_least
from tests.linear.test_delta import problem

BF16, F16 = torch.bfloat16, torch.float16


@pytest.fixture(scope="module")
def emu():
    e = cuda_emu.load_delta()
    if e is None:
        pytest.skip(f"CUDA emulator unavailable: {cuda_emu.why}")
    old = e.set_chunked(1)
    yield e
    e.set_chunked(old)


def check_chunked(emu, *args, dtype=BF16, **kw):
    """check() at bf16 (or dtype) on the chunk kernels."""
    return check(emu, dtype, *args, kernel="chunk", **kw)


def run(emu, q, k, v, beta, gate, h0, *, l2=True, cu=None, plain=False):
    """The emulated op on bf16 inputs, beta rounded to bf16 as check() does, in float32 as the gates."""
    scale = q.shape[-1] ** -0.5
    out, st, _ = emu.delta_fwd(q.to(BF16), k.to(BF16), v.to(BF16), beta.to(BF16).float().contiguous(),
                               gate.float().contiguous() if gate is not None else None,
                               h0.float().contiguous() if h0 is not None else None, cu, scale, l2, plain)
    return out, st


CASES = [  # (hk, hv, s, kd, vd, gate, l2)
    (1, 1, 1, 8, 8, None, False),
    (1, 2, 63, 16, 24, None, False),
    (2, 4, 64, 64, 72, "head", True),
    (1, 1, 65, 128, 64, "head", True),
    (1, 3, 130, 72, 8, "head", False),
    (2, 2, 100, 120, 136, None, True),
    # per-key gates (KDA): the 16-row block split of the scores, the per-channel state decay
    (1, 1, 1, 8, 8, "key", False),
    (1, 2, 63, 16, 24, "key", True),
    (2, 4, 64, 64, 72, "key", True),
    (1, 1, 65, 128, 64, "key", True),
    (1, 3, 130, 72, 8, "key", False),
    (2, 2, 100, 120, 136, "key", True),
]


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_matches_float64(emu, case, dtype):
    hk, hv, s, kd, vd, gate, l2 = case
    q, k, v, beta, g, h0 = problem(b=2, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate)
    check_chunked(emu, q, k, v, beta, g, h0, l2=l2, what=str(case), dtype=dtype)


def test_no_initial_state_unnormalized(emu):
    """No initial state, q and k as given (k unit rows from problem(), q not)."""
    q, k, v, beta, g, _ = problem(b=1, hk=1, hv=2, s=150, kd=32, vd=40, gate="head", h0=False)
    check_chunked(emu, q, k, v, beta, g, None, l2=False)


def test_long_sequence(emu):
    """Many chunks: the state walk's double-buffered copies and the state carried through 9 chunks."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=560, kd=64, vd=64, gate="head")
    check_chunked(emu, q, k, v, beta, g, h0, l2=True)


def test_varlen_with_empty_sequences(emu):
    """A pack whose sequences start mid-chunk (slots by position), an empty one included: each
    equals its run alone, the rows past the pack are untouched (0) and NaN there changes nothing,
    and the empty sequence passes its initial state through."""
    cu = torch.tensor([0, 70, 70, 135, 200], dtype=torch.int32)
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=205, kd=64, vd=24, gate="head", nseq=4)
    out, st = check_chunked(emu, q, k, v, beta, g, h0, l2=True, cu=cu)
    assert (out[:, :, 200:] == 0).all()
    torch.testing.assert_close(st[1], h0[1].float(), rtol=0, atol=0)
    bad = [t.clone() for t in (q, k, v, beta, g)]
    for t in bad:
        t[:, :, 200:] = float("nan")
    out_n, st_n = run(emu, *bad, h0, cu=cu)
    assert torch.equal(out_n, out) and torch.equal(st_n, st)
    for n in range(4):
        a, e = int(cu[n]), int(cu[n + 1])
        sl = (slice(None), slice(None), slice(a, e))
        o1, s1 = run(emu, *(t[sl] for t in (q, k, v, beta)), g[sl], h0[n:n + 1])
        # a different chunk alignment: the same math, rounded at other points
        torch.testing.assert_close(out[sl].float(), o1.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(st[n:n + 1], s1, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("r", [17, 64, 100])
@pytest.mark.parametrize("big", [1e4, 1e9, float("inf")])
def test_extreme_gates(emu, big, r):
    """A log-gate of -1e4, -1e9 or -inf at row r (mid-chunk, a chunk's first row, the second
    chunk's middle) empties the state there: the chunk sums run from the last reset, so the rows
    from r on equal a fresh run of the tail (never NaN from -inf - -inf), and the whole call
    passes the float64 check."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=150, kd=32, vd=16, gate="head")
    g[:, :, r] = -big
    out, st = check_chunked(emu, q, k, v, beta, g, h0, l2=True)
    tail_g = g[:, :, r:].clone()
    tail_g[:, :, 0] = 0.0
    tail, tail_st = run(emu, *(t[:, :, r:] for t in (q, k, v, beta)), tail_g, None)
    torch.testing.assert_close(out[:, :, r:].float(), tail.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(st, tail_st, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("r", [5, 17, 64, 100])
@pytest.mark.parametrize("big", [1e4, 1e9, float("inf")])
def test_extreme_per_key_gates(emu, big, r):
    """Per-key log-gates of -1e4, -1e9 or -inf in some channels at row r (inside a 16-row block,
    at a block's first row, at a chunk's first row, mid second chunk), others in a later row of
    the same block and of the next one: each is a zero factor in every decay through it, so the
    whole call passes the float64 check with no NaN; with every channel reset at row r, the rows
    from r on equal a fresh run of the tail."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=150, kd=32, vd=16, gate="key")
    g[:, 0, r, ::3] = -big
    g[:, 1, r, 1::2] = -big
    g[:, :, r + 3, 5:9] = -big
    g[:, :, r + 20, :4] = -big
    check_chunked(emu, q, k, v, beta, g, h0, l2=True, what=f"{big} at {r}")
    g = problem(b=1, hk=1, hv=2, s=150, kd=32, vd=16, gate="key")[4]
    g[:, :, r] = -big
    out, st = check_chunked(emu, q, k, v, beta, g, h0, l2=True)
    tail_g = g[:, :, r:].clone()
    tail_g[:, :, 0] = 0.0
    tail, tail_st = run(emu, *(t[:, :, r:] for t in (q, k, v, beta)), tail_g, None)
    torch.testing.assert_close(out[:, :, r:].float(), tail.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(st, tail_st, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("s", [40, 130])
def test_plain_write_per_key_gates(emu, s):
    """GLA's recurrence (the plain write u = v, per-key gates): A = 0 and W = 0 in the prep."""
    q, k, v, beta, g, h0 = problem(b=2, hk=1, hv=2, s=s, kd=64, vd=40, gate="key")
    check_chunked(emu, q, k, v * 0.3, beta, g, h0, l2=False, plain=True)


def test_varlen_per_key_gates(emu):
    """A varlen pack with per-key gates: sequences starting mid-chunk, an empty one."""
    cu = torch.tensor([0, 70, 70, 135, 200], dtype=torch.int32)
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=205, kd=64, vd=24, gate="key", nseq=4)
    out, st = check_chunked(emu, q, k, v, beta, g, h0, l2=True, cu=cu)
    torch.testing.assert_close(st[1], h0[1].float(), rtol=0, atol=0)


def test_calls_the_chunk_kernels_do_not_take(emu):
    """float32, K > 128 or K not a multiple of 8 run on the recurrent kernel whatever the
    selection says (and stay right)."""
    for dtype, kd, gate in ((torch.float32, 64, "head"), (torch.float32, 64, "key"), (F16, 136, None),
                            (BF16, 136, None), (BF16, 20, "head"), (BF16, 136, "key")):
        q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=70, kd=kd, vd=16, gate=gate)
        check(emu, dtype, q, k, v, beta, g, h0, l2=True, what=f"{dtype} {kd} {gate}", kernel="recurrent")


def test_auto_selection_by_length(emu):
    """chunked=-1 (the default): the recurrent kernel below 256 rows, the chunk kernels from 256."""
    old = emu.set_chunked(-1)
    try:
        for s, want in ((255, False), (256, True)):
            q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=s, kd=16, vd=8, gate="head")
            launched(emu)
            run(emu, q, k, v, beta, g, h0)
            assert launched(emu) == {"chunk" if want else "recurrent"}
    finally:
        emu.set_chunked(old)


@pytest.mark.parametrize("warp_serial,reverse", [(False, False), (True, True)], ids=["lockstep", "last_warp_first"])
def test_other_warp_interleavings(emu, warp_serial, reverse):
    """Every product reads tiles other warps wrote (T, h, u): a missing barrier shows."""
    emu.set_schedule(warp_serial, reverse)
    try:
        for gate in ("head", "key"):
            q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=140, kd=64, vd=72, gate=gate)
            check_chunked(emu, q, k, v, beta, g, h0, l2=True, what=gate)
    finally:
        emu.set_schedule(True, False)


@at_least(60)
@given(data=st.data())
def test_fuzz_chunked_delta_forward(emu, data):
    """Hypothesis over the chunk kernels: GVA groups, K and V (multiples of 8, partial tiles),
    no / per-head / per-key gates with the odd hard reset (per key: in some channels), the plain
    write with per-key gates, the L2 norm, initial states, varlen packs with
    empty sequences and a tail; out and the final state against float64 under the 2x rule."""
    draw = data.draw
    varlen = draw(st.booleans())
    b = 1 if varlen else draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    hv = hk * draw(st.integers(1, 2))
    kd = 8 * draw(st.integers(1, 16))
    vd = 8 * draw(st.integers(1, 18))
    gate = draw(st.sampled_from([None, "head", "key"]))
    dtype = draw(st.sampled_from([BF16, F16]))
    plain = gate == "key" and draw(st.booleans())
    l2, init = draw(st.booleans()), draw(st.booleans())
    if varlen:
        lens = draw(st.lists(st.integers(0, 140), min_size=1, max_size=3))
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        s, nseq = int(cu[-1]) + draw(st.integers(0, 2)), len(lens)
    else:
        s, cu, nseq = draw(st.integers(1, 200)), None, b
    seed = draw(st.integers(0, 2 ** 16))
    note(dict(dtype=dtype, b=b, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate, plain=plain, l2=l2, init=init, cu=cu,
              seed=seed))
    q, k, v, beta, g, h0 = problem(b=b, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate, seed=seed, h0=init, nseq=nseq)
    if g is not None and s > 3 and draw(st.booleans()):
        row = draw(st.integers(0, s - 1))
        if gate == "key":
            g[:, :, row, draw(st.integers(0, kd - 1)):] = float("-inf")
        else:
            g[:, :, row] = float("-inf")
    if plain:
        v = v * 0.3  # the plain write adds every token: keep the state's size moderate
    if s == 0 or (cu is not None and int(cu[-1]) == 0):
        return
    check_chunked(emu, q, k, v, beta, g, h0, l2=l2, cu=cu, plain=plain, what="fuzz", dtype=dtype)
