"""What each rank runs for context_parallel_linear_attention (imported by the spawned processes):
every case builds the global tensors from one seed (the same on every rank), runs
linear_attention on the whole sequence in one process (the same fused kernel, fp32), and compares
this rank's contiguous shard of the context-parallel output, gradients (q, k, v, decay, initial
state and its log_scale) and final state against it, with the collectives counted. A case's
failure is recorded, not raised, so that every rank runs the same collectives in the same order;
{case name: None or the traceback} comes back per rank."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from attention_ext import distributed as cp
from attention_ext.linear import LinearAttentionState, linear_attention
from attention_ext.linear.feature_maps import Favor
from tests.distributed.cases import CallCounter, Counter
from tests.distributed.harness import case_table
from tests.helpers import rel_err

B, H, D, DV = 2, 4, 8, 6
TOL = 1e-5  # fp32, tests.helpers.rel_err: max |x - ref| / max(max |ref|, 1)

# case name -> options: causal, decay (True: random log-gates; "extreme": with -inf, -1e9 and -1e4
# among them; "feature": GLA's gates per feature, (B, H, S, M), with a -inf on some features),
# feature map ("elu", "relu", "favor": FAVOR+ unstabilized,
# the non-fused path; "favor-stab": FAVOR+ stabilized, its global key offset one all-reduce under
# normalize), hk, lens ("odd": 5, 7, 9, 5, ... tokens per rank; "even": 6 each via
# shard_sequence), normalize, return_state, init (True: a (B, H, M, Dv') tensor; "logscale": a
# LinearAttentionState with a log_scale that requires grad), mask (key_mask: "rand" about
# a third of the keys padded; "hole": also every key of rank 1, a shard with no real key, whose
# stabilizer maximum is -inf), layout
CASES = {
    "causal": dict(),
    "causal-decay": dict(decay=True),
    "causal-decay-gqa-state": dict(decay=True, hk=2, return_state=True),
    "causal-relu-mqa": dict(fm="relu", hk=1),
    "causal-decay-init-state": dict(decay=True, init=True, return_state=True),
    "causal-decay-unnormalized": dict(decay=True, normalize=False, return_state=True),
    "causal-favor-decay": dict(fm="favor", decay=True),
    "causal-even-bshd": dict(lens="even", layout="bshd", decay=True),
    "noncausal": dict(causal=False),
    "noncausal-relu-gqa-state": dict(causal=False, fm="relu", hk=2, return_state=True),
    "noncausal-init-unnormalized": dict(causal=False, init=True, normalize=False),
    "noncausal-favor": dict(causal=False, fm="favor", return_state=True),
    "causal-mask": dict(mask="rand"),
    "causal-decay-mask-hole-init-state": dict(decay=True, mask="hole", init=True, return_state=True),
    "causal-mask-even-bshd-mqa": dict(mask="rand", lens="even", layout="bshd", hk=1),
    "causal-logscale-state": dict(init="logscale", decay=True, return_state=True),
    "noncausal-mask-gqa-state": dict(causal=False, mask="rand", hk=2, return_state=True),
    "noncausal-mask-hole-unnormalized": dict(causal=False, mask="hole", normalize=False),
    "causal-favor-stab": dict(fm="favor-stab"),
    "causal-favor-stab-decay-mask-hole-state": dict(fm="favor-stab", decay=True, mask="hole", return_state=True),
    "causal-favor-stab-logscale-gqa-state": dict(fm="favor-stab", init="logscale", decay=True, hk=2,
                                                 return_state=True),
    "causal-favor-stab-init-mask-bshd": dict(fm="favor-stab", init=True, mask="rand", layout="bshd"),
    "causal-favor-stab-unnormalized": dict(fm="favor-stab", normalize=False, return_state=True),
    "noncausal-favor-stab": dict(causal=False, fm="favor-stab"),
    "noncausal-favor-stab-mask-gqa-state": dict(causal=False, fm="favor-stab", mask="rand", hk=2, return_state=True),
    "noncausal-favor-stab-hole-logscale": dict(causal=False, fm="favor-stab", mask="hole", init="logscale"),
    "causal-extreme-gates-init-state": dict(decay="extreme", init=True, return_state=True),
    "causal-extreme-gates-mask-gqa": dict(decay="extreme", mask="rand", hk=2),
    "causal-feature-gates-init-state": dict(decay="feature", init=True, return_state=True),
    "causal-feature-gates-mask-gqa-bshd-unnormalized": dict(decay="feature", mask="rand", hk=2, layout="bshd",
                                                            normalize=False, return_state=True),
}


class LinearCounter(CallCounter):
    """Counter's all-gathers and reduce-scatters, with all_reduce on its own: the stabilizer's
    all-reduce(MAX) is not a reduce-scatter."""
    NAMES = {**{n: "gather" for n in Counter.GATHER}, **{n: "scatter" for n in Counter.SCATTER if n != "all_reduce"},
             "all_reduce": "reduce"}


def _lens(world: int, kind: str) -> List[int]:
    return [6] * world if kind == "even" else [5 + 2 * (r % 3) for r in range(world)]


def _check(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    e = rel_err(got, ref)
    assert e <= TOL, f"{name}: relative error {e:.3g} > {TOL:g}"


def linear_case(rank: int, world: int, name: str, counter: LinearCounter,
                group: Optional[dist.ProcessGroup]) -> None:
    """One case on this rank; rank and world are the ranks of `group` (None: the world)."""
    o = CASES[name]
    causal, use_decay, hk = o.get("causal", True), o.get("decay", False), o.get("hk", H)
    normalize, want_state, layout = o.get("normalize", True), o.get("return_state", False), \
        o.get("layout", "bhsd")
    lens = _lens(world, o.get("lens", "odd"))
    s = sum(lens)
    a = sum(lens[:rank])
    n = lens[rank]
    torch.manual_seed(2000 + list(CASES).index(name))  # the same global tensors on every rank
    q, k, v = torch.randn(B, H, s, D), torch.randn(B, hk, s, D), torch.randn(B, hk, s, DV)
    decay = -torch.nn.functional.softplus(torch.randn(B, H, s)) * 0.3 if use_decay else None
    if use_decay == "feature":  # (B, H, S, M), a reset of half the features inside rank 1's shard
        decay = -torch.nn.functional.softplus(torch.randn(B, H, s, D)) * 0.3
        decay[:, 1, lens[0] + 1, : D // 2] = float("-inf")
    if use_decay == "extreme":
        # a hard reset (-inf) inside rank 0's shard, -1e9 at rank 1's first key, -1e4 in the last
        # shard: the shard states are exact (suffix sums), the single process's answer
        decay[:, 0, 2], decay[:, 1, lens[0]], decay[:, :, s - 2] = float("-inf"), -1e9, -1e4
    g = torch.randn(B, H, s, DV)
    mask = None
    if o.get("mask"):
        mask = torch.rand(B, s) > 0.35  # (B, S) True = a real key
        if o["mask"] == "hole":
            mask[:, lens[0]:lens[0] + lens[1]] = False  # rank 1 holds no real key
    m = D
    fm = o.get("fm", "elu")
    stabilized = fm == "favor-stab" and normalize  # the op offsets the keys: one all-reduce(MAX) forward
    if fm in ("favor", "favor-stab"):
        fm = Favor(D, nb_features=12, stabilize=fm == "favor-stab", seed=3)
        m = 12
    s0 = torch.rand(B, H, m, DV + 1 if normalize else DV) if o.get("init") else None
    ls0 = torch.randn(B, H) if o.get("init") == "logscale" else None  # the initial state's log_scale
    gs = torch.randn(B, H, m, DV + 1 if normalize else DV)
    opts = dict(feature_map=fm, causal=causal, normalize=normalize, scale=0.7)

    def state(s_, ls_):  # the initial state as the case passes it
        if s_ is None or ls_ is None:
            return s_
        return LinearAttentionState.from_augmented(s_, normalize, ls_)

    def loss(out, g_out, st):  # sum(out * g_out) (+ the final state against gs where it is asked for)
        r = (out * g_out).sum()
        if st is not None:
            r = r + (st.augmented(normalize) * gs).sum()
        return r

    # single process, the whole sequence
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    dr = decay.clone().requires_grad_() if decay is not None else None
    sr = s0.clone().requires_grad_() if s0 is not None else None
    lsr = ls0.clone().requires_grad_() if ls0 is not None else None
    res = linear_attention(qr, kr, vr, decay=dr, key_mask=mask, initial_state=state(sr, lsr),
                           return_state=want_state, **opts)
    out, st = res if want_state else (res, None)
    loss(out, g, st).backward()

    # context parallel: this rank's contiguous shard
    if o.get("lens") == "even":
        local = [cp.shard_sequence(t, dim=2, group=group, shard_layout="contiguous") for t in (q, k, v)]
    else:
        local = [t[:, :, a:a + n] for t in (q, k, v)]
    if layout == "bshd":
        local = [t.transpose(1, 2).contiguous() for t in local]
    ql, kl, vl = (t.clone().requires_grad_() for t in local)
    dl = decay[:, :, a:a + n].clone().requires_grad_() if decay is not None else None
    sl = s0.clone().requires_grad_() if s0 is not None else None
    lsl = ls0.clone().requires_grad_() if ls0 is not None else None
    ml = mask[:, a:a + n] if mask is not None else None  # (B, n) this rank's shard of the mask, whatever the layout
    counter.take()
    res = cp.context_parallel_linear_attention(ql, kl, vl, decay=dl, key_mask=ml,
                                               initial_state=state(sl, lsl), return_state=want_state,
                                               layout=layout, group=group, **opts)
    n_fwd = counter.take()
    outl, stl = res if want_state else (res, None)
    outl_h = outl.transpose(1, 2) if layout == "bshd" else outl
    # the final state's loss term on the last rank only: the sum over ranks is the one-process loss
    loss(outl_h, g[:, :, a:a + n], stl if rank == world - 1 else None).backward()
    n_bwd = counter.take()
    if sl is not None:  # every rank holds its part of d(initial_state): the sum is the full one
        ds = sl.grad.clone()
        dist.all_reduce(ds, group=group)
        counter.take()
    if lsl is not None:  # d(log_scale) likewise
        dls = lsl.grad.clone()
        dist.all_reduce(dls, group=group)
        counter.take()
    # the checks after every collective of the case, so that a failing rank stays in step with the others
    want_fwd = {"gather": 1, "scatter": 0, "reduce": int(stabilized)}
    assert n_fwd == want_fwd, f"forward collectives {n_fwd}: want {want_fwd} (one all-gather" + \
        (", one all-reduce for the stabilizer)" if stabilized else ")")
    want_bwd = {"gather": 0, "scatter": 1, "reduce": 0}
    assert n_bwd == want_bwd, f"backward collectives {n_bwd}: want one reduce-scatter"
    as_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)  # noqa: E731
    sl_ = slice(a, a + n)
    _check("out", outl_h, out.detach()[:, :, sl_])
    _check("dq", as_bhsd(ql.grad), qr.grad[:, :, sl_])
    _check("dk", as_bhsd(kl.grad), kr.grad[:, :, sl_])
    _check("dv", as_bhsd(vl.grad), vr.grad[:, :, sl_])
    if dl is not None:
        _check("ddecay", dl.grad, dr.grad[:, :, sl_])
    if sl is not None:
        _check("dinitial_state", ds, sr.grad)
    if lsl is not None:
        _check("dinitial_state.log_scale", dls, lsr.grad)
    if want_state:
        assert isinstance(stl, LinearAttentionState) and (stl.z is not None) == normalize
        _check("final S", stl.S, st.S)
        if normalize:
            _check("final z", stl.z, st.z)
        assert (stl.log_scale is None) == (st.log_scale is None), \
            f"final log_scale {stl.log_scale} where the single process has {st.log_scale}"
        if st.log_scale is not None:
            _check("final log_scale", stl.log_scale, st.log_scale)


def suite(rank: int, world: int, sizes: List[int], names: List[str]) -> Dict[str, Optional[str]]:
    """Every case on every group size of `sizes` (harness.case_table)."""
    return case_table(linear_case, LinearCounter(), rank, world, sizes, names)
