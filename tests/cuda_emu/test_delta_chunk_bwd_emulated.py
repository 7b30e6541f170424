"""The delta rule's chunk-parallel CUDA backward (csrc/linear/cuda/delta_chunk_bwd_kernel.cuh: the
forward's prep and walk recomputed, then four kernels; with per-key gates
delta_chunk_key_bwd_kernel.cuh's) run on the CPU by the host emulator: every gradient (q, k, v,
beta, the per-head or per-key gate, the initial state) against autograd of the float64
recurrence, within 2x PyTorch's same-dtype error plus a floor (bf16, and fp16 in the cases marked
so), PyTorch's being the larger of two same-dtype computations of the same gradients: autograd through the recurrence, and the chunked form
(delta_chunk_torch.py, bf16 intermediates where the kernels have them, as flash-linear-attention's
kernels do). The second matters where the first is lucky: at one token its few roundings can
make a one-element gradient (dgate) 10x more accurate than any chunked bf16 form.

The op's host steps (csrc/torch/linear_delta_cuda_steps.h) start the scratch as 0xff bytes (bf16
NaN) and dv / dbeta / dgate / dinit_state as NaN, so a tile read before it is written or a
gradient left unwritten fails. Covered: both kernel widths (K 8-128), partial value tiles, GVA
(dq / dk summed over a group), no gate, per-head and per-key gates (KDA), the L2 norm, with and without initial
states and final-state gradients, chunk boundaries, varlen packs whose sequences start mid-chunk
(an empty one included), -1e4 / -1e9 / -inf gates (per key: in some channels), other warp
interleavings, the calls it does not
take (a ValueError), and a fuzz. Not covered: timing, real concurrency, spills, atomics' order.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from attention_ext.linear import reference
from tests.cuda_emu import emulator as cuda_emu
from tests.cuda_emu.delta_chunk_torch import grads as chunked_grads
from tests.fuzz.common import at_least
from tests.helpers import assert_close_fa2, rel_err
from tests.linear.test_delta import problem

BF16, F16, F64 = torch.bfloat16, torch.float16, torch.float64


@pytest.fixture(scope="module")
def emu():
    e = cuda_emu.load_delta()
    if e is None:
        pytest.skip(f"CUDA emulator unavailable: {cuda_emu.why}")
    return e


def autograd(dtype, q, k, v, beta, gate, h0, dout, dh, l2, cu, plain=False):
    """Gradients of <out, dout> + <final state, dh> through reference.delta_rule computed in
    `dtype` (NaN of a -inf gate's own derivative as 0, the kernels' value; plain: GLA's write)."""
    ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, beta)]
    gi = gate.detach().to(dtype).requires_grad_() if gate is not None else None
    hi = h0.detach().to(dtype).requires_grad_() if h0 is not None else None
    out, fin = reference.delta_rule(*ins, gi, q.shape[-1] ** -0.5, hi, cu, l2, acc=dtype, plain=plain)
    leaves = ins + [x for x in (gi, hi) if x is not None]
    loss = (out.to(dtype) * dout.to(dtype)).sum() + (fin.to(dtype) * dh.to(dtype)).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else torch.nan_to_num(g, nan=0.0) for g, x in zip(grads, leaves)]


def check_bwd(emu, q, k, v, beta, gate, h0, *, l2=False, cu=None, seed=0, dfinal=True, what="", dtype=BF16,
              plain=False):
    """The emulated delta_bwd on `dtype` (bf16 or fp16) q / k / v / dout (beta, gate float32, beta
    as rounded to dtype) against float64 autograd, each gradient within 2x PyTorch's error in
    dtype."""
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    bd = beta.to(dtype).float()
    gd = gate.float() if gate is not None else None
    hh = h0.float() if h0 is not None else None
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(v.shape, generator=gen, dtype=F64).to(dtype)
    nst = h0.shape[0] if h0 is not None else (cu.numel() - 1 if cu is not None else q.shape[0])
    dh = torch.randn(nst, v.shape[1], q.shape[-1], v.shape[-1], generator=gen, dtype=F64).float() if dfinal else None
    res = emu.delta_bwd(dout, dh, qd, kd, vd, bd, gd, hh, cu, q.shape[-1] ** -0.5, l2, plain)
    dh_ = dh if dh is not None else torch.zeros(nst, v.shape[1], q.shape[-1], v.shape[-1])
    ins = (qd, kd, vd, bd, gd, hh)
    r64 = autograd(F64, *(t.double() if t is not None else None for t in ins), dout.double(), dh_.double(), l2, cu,
                   plain)
    rt = autograd(dtype, *ins, dout, dh_, l2, cu, plain)
    rc = [x for x in chunked_grads(*ins, dout, dh_, l2, cu, dtype, plain) if x is not None]
    mine = [res[0], res[1], res[2], res[3]] + ([res[4]] if gd is not None else []) + ([res[5]] if hh is not None else [])
    names = ["dq", "dk", "dv", "dbeta"] + (["dgate"] if gd is not None else []) + (["dinit"] if hh is not None else [])
    for name, a, r, t, c in zip(names, mine, r64, rt, rc):
        assert not a.isnan().any(), f"{what} {name}: NaN"
        peer = t if rel_err(t, r) >= rel_err(c, r) else c
        assert a.dtype == (dtype if name in ("dq", "dk", "dv") else a.dtype), f"{what} {name}: {a.dtype}"
        assert_close_fa2(a.float(), peer.float(), r, dtype, f"{what} {name}")
    return res


def test_the_chunked_peer_is_the_same_math():
    """delta_chunk_torch.grads on float64 tensors equals autograd of the float64 recurrence (to
    its float32 decays' rounding): gates with a reset at a chunk boundary, the L2 norm, GVA, a
    varlen pack with an empty sequence."""
    for hk, hv, s, kd, vd, l2, cu, gate in (
            (1, 2, 70, 8, 5, True, None, "head"), (2, 4, 150, 16, 8, False, None, "head"),
            (1, 2, 205, 16, 8, True, torch.tensor([0, 70, 70, 135, 200], dtype=torch.int32), "head"),
            (1, 2, 70, 8, 5, True, None, "key"), (2, 4, 150, 16, 8, False, None, "key"),
            (1, 2, 205, 16, 8, True, torch.tensor([0, 70, 70, 135, 200], dtype=torch.int32), "key")):
        q, k, v, beta, g, h0 = problem(b=1 if cu is not None else 2, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate,
                                       nseq=4 if cu is not None else None)
        if cu is None:
            g[:, :, 64] = float("-inf")
            if gate == "key":
                g[:, :, 20, ::3] = float("-inf")
        gen = torch.Generator().manual_seed(3)
        dout, dh = torch.randn(v.shape, generator=gen, dtype=F64), torch.randn(h0.shape, generator=gen, dtype=F64)
        mine = chunked_grads(q, k, v, beta, g, h0, dout, dh, l2, cu, F64)
        ref = autograd(F64, q, k, v, beta, g, h0, dout, dh, l2, cu)
        for a, r in zip(mine, ref):
            assert rel_err(a, r) < 1e-5


CASES = [  # (hk, hv, s, kd, vd, gate, l2, h0)
    (1, 1, 1, 8, 8, None, False, False),
    (1, 2, 63, 16, 24, "head", True, True),
    (2, 4, 64, 64, 72, "head", True, True),
    (1, 1, 65, 128, 64, None, False, True),
    (1, 3, 130, 72, 8, "head", False, False),
    (2, 2, 100, 120, 136, "head", True, True),
    # per-key gates (KDA): delta_chunk_key_bwd_kernel.cuh
    (1, 1, 1, 8, 8, "key", False, False),
    (1, 2, 63, 16, 24, "key", True, True),
    (2, 4, 64, 64, 72, "key", True, True),
    (1, 1, 65, 128, 64, "key", False, True),
    (1, 3, 130, 72, 8, "key", False, False),
    (2, 2, 100, 120, 136, "key", True, True),
]


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_backward_matches_float64(emu, case, dtype):
    hk, hv, s, kd, vd, gate, l2, init = case
    q, k, v, beta, g, h0 = problem(b=2, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate, h0=init)
    check_bwd(emu, q, k, v, beta, g, h0, l2=l2, what=str(case), dtype=dtype)


def test_without_final_state_gradient(emu):
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=90, kd=32, vd=40, gate="head")
    check_bwd(emu, q, k, v, beta, g, h0, l2=True, dfinal=False)


def test_varlen_with_empty_sequences(emu):
    """Sequences starting mid-chunk and an empty one: the gradients of the rows past the pack are
    0, and the empty sequence passes dfinal_state to its initial state."""
    cu = torch.tensor([0, 70, 70, 135, 200], dtype=torch.int32)
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=205, kd=64, vd=24, gate="head", nseq=4)
    res = check_bwd(emu, q, k, v, beta, g, h0, l2=True, cu=cu)
    for t in res[:5]:
        assert (t[:, :, 200:] == 0).all()


@pytest.mark.parametrize("r", [17, 64, 100])
@pytest.mark.parametrize("big", [1e4, 1e9, float("inf")])
@pytest.mark.parametrize("gate", ["head", "key"])
def test_extreme_gates(emu, big, r, gate):
    """A log-gate of -1e4, -1e9 or -inf at row r (per key: in every third channel, and in a few
    channels 5 rows on): every gradient stays finite and within the rule (a reset's own gate
    gets 0)."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=150, kd=32, vd=16, gate=gate)
    if gate == "head":
        g[:, :, r] = -big
    else:
        g[:, :, r, ::3] = -big
        g[:, :, r + 5, 4:7] = -big
    res = check_bwd(emu, q, k, v, beta, g, h0, l2=True)
    assert (res[4][0, 0, r] == 0).all() if gate == "head" else (res[4][0, 0, r, ::3] == 0).all()


@pytest.mark.parametrize("n", [16, 17, 32, 33, 48, 49])
def test_per_key_chunk_ends_at_block_edges(emu, n):
    """Per-key gates with a last chunk of n rows, at and just past the edges of the dkey kernel's
    16-row blocks (its tensor-core rounds run for the blocks a chunk reaches), K 128 and 40 with
    a reset in some channels of that chunk."""
    for kd in (128, 40):
        q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=64 + n, kd=kd, vd=24, gate="key")
        g[:, :, 64 + n // 2, ::5] = float("-inf")
        check_bwd(emu, q, k, v, beta, g, h0, l2=True, what=f"n {n} K {kd}")


def test_cost_report_counts_the_dkey_products(emu):
    """benchmarks/gpu_cost.py's tensor-core work of the dkey kernel (delta_dkey_flop, per chunk)
    equals the mma.sync count the emulated kernel issues (x 4096 flops per m16n8k16) over full
    chunks, at both kernel widths."""
    import importlib.util
    import os
    import sys

    path = os.path.join(cuda_emu.ROOT, "benchmarks", "gpu_cost.py")
    spec = importlib.util.spec_from_file_location("gpu_cost", path)
    gpu_cost = sys.modules.setdefault("gpu_cost", importlib.util.module_from_spec(spec))  # dataclasses need it there
    spec.loader.exec_module(gpu_cost)
    for kd, kk in ((128, 128), (40, 64)):
        q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=128, kd=kd, vd=16, gate="key")
        emu.launches()
        emu.launch_stats()
        emu.delta_bwd(torch.zeros(v.shape, dtype=BF16), None, q.to(BF16), k.to(BF16), v.to(BF16), beta.float(),
                      g.float(), None, None, kd ** -0.5, False, False)
        names, stats = emu.launches(), torch.tensor(emu.launch_stats()).view(-1, 5)
        (at,) = [i for i, n in enumerate(names) if "dkey" in n]
        ctas, mma = int(stats[at, 0]), int(stats[at, 2])
        assert ctas == 2 * 2
        assert mma * 4096 == ctas * gpu_cost.delta_dkey_flop(kk), (kd, mma)


@pytest.mark.parametrize("warp_serial,reverse", [(False, False), (True, True)], ids=["lockstep", "last_warp_first"])
def test_other_warp_interleavings(emu, warp_serial, reverse):
    emu.set_schedule(warp_serial, reverse)
    try:
        for gate in ("head", "key"):
            q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=2, s=140, kd=64, vd=72, gate=gate)
            check_bwd(emu, q, k, v, beta, g, h0, l2=True, what=gate)
    finally:
        emu.set_schedule(True, False)


def test_rows_off_16_bytes_are_copied(emu):
    """q, k, v and dout at an element offset (rows not 16-byte aligned): the host steps run the
    kernels on dense copies, with the same gradients."""
    q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=70, kd=16, vd=16, gate="head")

    def shifted(t):
        buf = torch.empty(t.numel() + 1, dtype=BF16)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out

    qd, kd, vd = (t.to(BF16) for t in (q, k, v))
    dout = torch.randn(v.shape, dtype=F64).to(BF16)
    args = (beta.to(BF16).float(), g.float(), h0.float(), None, 0.25, True, False)
    want = emu.delta_bwd(dout, None, qd, kd, vd, *args)
    got = emu.delta_bwd(shifted(dout), None, shifted(qd), shifted(kd), shifted(vd), *args)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("s", [40, 130])
def test_plain_write_per_key_gates(emu, s):
    """GLA's recurrence (u = v, per-key gates): T = I, no W or A terms, dbeta = 0."""
    q, k, v, beta, g, h0 = problem(b=2, hk=1, hv=2, s=s, kd=64, vd=40, gate="key")
    res = check_bwd(emu, q, k, v * 0.3, beta, g, h0, l2=False, plain=True)
    assert (res[3] == 0).all()


def test_calls_it_does_not_take(emu):
    """float32, the plain write without per-key gates, K > 128 or K not a multiple of 8: a
    ValueError saying what the kernels take."""
    for dtype, kd, gate, plain in ((torch.float32, 64, None, False), (BF16, 64, "head", True), (F16, 64, None, True),
                                   (BF16, 136, None, False), (BF16, 20, "head", False), (BF16, 136, "key", False)):
        q, k, v, beta, g, h0 = problem(b=1, hk=1, hv=1, s=10, kd=kd, vd=16, gate=gate)
        qd, kd_, vd_ = (t.to(dtype) for t in (q, k, v))
        with pytest.raises(ValueError, match="take bfloat16 or float16 calls"):
            emu.delta_bwd(torch.zeros_like(vd_), None, qd, kd_, vd_, beta.float(), g.float() if g is not None else None,
                          None, None, 0.3, False, plain)


@at_least(40)
@given(data=st.data())
def test_fuzz_chunked_delta_backward(emu, data):
    """Hypothesis over the backward: GVA, K and V (multiples of 8), no / per-head / per-key gates
    with the odd hard reset (per key: in a run of channels), bf16 and fp16, the L2 norm, initial states, final-state gradients, varlen packs."""
    draw = data.draw
    varlen = draw(st.booleans())
    b = 1 if varlen else draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    hv = hk * draw(st.integers(1, 2))
    kd = 8 * draw(st.integers(1, 16))
    vd = 8 * draw(st.integers(1, 18))
    gate = draw(st.sampled_from([None, "head", "key"]))
    plain = gate == "key" and draw(st.booleans())
    dtype = draw(st.sampled_from([BF16, F16]))
    l2, init, dfinal = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    if varlen:
        lens = draw(st.lists(st.integers(0, 140), min_size=1, max_size=3))
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        s, nseq = int(cu[-1]) + draw(st.integers(0, 2)), len(lens)
    else:
        s, cu, nseq = draw(st.integers(1, 150)), None, b
    seed = draw(st.integers(0, 2 ** 16))
    note(dict(dtype=dtype, b=b, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate, plain=plain, l2=l2, init=init,
              dfinal=dfinal, cu=cu, seed=seed))
    if s == 0 or (cu is not None and int(cu[-1]) == 0):
        return
    q, k, v, beta, g, h0 = problem(b=b, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate, seed=seed, h0=init, nseq=nseq)
    if g is not None and s > 3 and draw(st.booleans()):
        row = draw(st.integers(0, s - 1))
        if gate == "key":
            g[:, :, row, draw(st.integers(0, kd - 1)):] = float("-inf")
        else:
            g[:, :, row] = float("-inf")
    if plain:
        v = v * 0.3  # the plain write adds every token: keep the state's size moderate
    check_bwd(emu, q, k, v, beta, g, h0, l2=l2, cu=cu, seed=seed, dfinal=dfinal, what="fuzz", dtype=dtype,
              plain=plain)
