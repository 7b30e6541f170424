"""What each rank runs for context_parallel_delta_rule_attention (imported by the spawned
processes): every case builds the global tensors from one seed (the same on every rank), runs
delta_rule_attention on the whole sequence in one process (float64: the reference recurrence's
precision, so the comparison measures the context-parallel composition alone), and compares this
rank's shard of the context-parallel output, gradients (q, k, v, beta, gate, initial state) and
final state against it, with the collectives counted. A failure is recorded, not raised, so that
every rank runs the same collectives in the same order; {case name: None or the traceback} comes
back per rank."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from attention_ext import delta_rule_attention
from attention_ext import distributed as cp
from tests.distributed.cases import Counter
from tests.distributed.harness import case_table
from tests.helpers import rel_err

B, HK, K, V = 2, 2, 8, 6
# tests.helpers.rel_err (max |x - ref| / max(max |ref|, 1)) per dtype: float64 measures the
# composition alone; float32 and bfloat16 check the casts (the context-parallel call computes in
# float32 and rounds once, the one process's kernel likewise: bf16 outputs may differ by an ulp)
TOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 2e-2}

# case name -> options: gate (None, "head": (B, H_v, S), "key": (B, H_v, S, K) as KDA, "extreme":
# per head with -inf, -1e9 and -1e4 among them), hv (value heads; > HK: grouped values), init,
# return_state, layout, l2 (qk_l2norm), lens ("odd": 5, 7, 9, 5, ... per rank; "one": 1 each),
# dtype (of q, k, v; beta, gate and states are float32 below float64)
CASES = {
    "deltanet": dict(),
    "gated-state": dict(gate="head", return_state=True),
    "gated-init-state": dict(gate="head", init=True, return_state=True),
    "kda-gva-init": dict(gate="key", hv=4, init=True),
    "extreme-gates-init-state": dict(gate="extreme", init=True, return_state=True),
    "kda-l2norm-bshd-state": dict(gate="key", l2=True, layout="bshd", return_state=True),
    "gated-one-token-shards": dict(gate="head", lens="one", init=True, return_state=True),
    "kda-gva-init-state-f32": dict(gate="key", hv=4, init=True, return_state=True, dtype=torch.float32),
    "gated-init-state-bf16": dict(gate="head", init=True, return_state=True, dtype=torch.bfloat16),
}


def _lens(world: int, kind: str) -> List[int]:
    return [1] * world if kind == "one" else [5 + 2 * (r % 3) for r in range(world)]


def _check(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} != {ref.dtype}"
    e = rel_err(got.double(), ref.double())
    assert e <= tol, f"{name}: relative error {e:.3g} > {tol:g}"


def delta_case(rank: int, world: int, name: str, counter: Counter, group: Optional[dist.ProcessGroup]) -> None:
    """One case on this rank; rank and world are the ranks of `group` (None: the world)."""
    o = CASES[name]
    hv, layout, want_state, l2 = o.get("hv", HK), o.get("layout", "bhsd"), o.get("return_state", False), \
        o.get("l2", False)
    lens = _lens(world, o.get("lens", "odd"))
    s, a = sum(lens), sum(lens[:rank])
    n = lens[rank]
    f64 = torch.float64
    torch.manual_seed(3000 + list(CASES).index(name))  # the same global tensors on every rank
    q, k = torch.randn(B, HK, s, K, dtype=f64), torch.randn(B, HK, s, K, dtype=f64)
    if not l2:
        k = torch.nn.functional.normalize(k, dim=-1)  # the delta rule's usual unit keys: a contraction
    v = torch.randn(B, hv, s, V, dtype=f64)
    beta = torch.rand(B, hv, s, dtype=f64)
    gate = None
    if o.get("gate") in ("head", "extreme"):
        gate = -0.3 * torch.rand(B, hv, s, dtype=f64)
        if o["gate"] == "extreme":  # -inf inside rank 0's shard, -1e9 at rank 1's first token, -1e4 near the end
            gate[:, 0, 2], gate[:, 1, lens[0]], gate[:, :, s - 2] = float("-inf"), -1e9, -1e4
    elif o.get("gate") == "key":
        gate = -0.3 * torch.rand(B, hv, s, K, dtype=f64)
    s0 = torch.randn(B, hv, K, V, dtype=f64) if o.get("init") else None
    g_out, g_state = torch.randn(B, hv, s, V, dtype=f64), torch.randn(B, hv, K, V, dtype=f64)
    dt = o.get("dtype", f64)
    side = f64 if dt == f64 else torch.float32
    q, k, v, g_out = (t.to(dt) for t in (q, k, v, g_out))
    beta, g_state = beta.to(side), g_state.to(side)
    gate = gate.to(side) if gate is not None else None
    s0 = s0.to(side) if s0 is not None else None
    tol = TOL[dt]
    opts = dict(scale=0.6, qk_l2norm=l2)

    def loss(out, g, st):  # sum(out * g) (+ the final state against g_state where it is asked for)
        return (out * g).sum() + ((st * g_state).sum() if st is not None else 0.0)

    # single process, the whole sequence
    full = [t.clone().requires_grad_() if t is not None else None for t in (q, k, v, beta, gate, s0)]
    res = delta_rule_attention(*full[:4], gate=full[4], initial_state=full[5], return_state=want_state, **opts)
    out, st = res if want_state else (res, None)
    loss(out, g_out, st).backward()

    # context parallel: this rank's contiguous shard
    sl = slice(a, a + n)
    local = [t[:, :, sl] for t in (q, k, v)]
    if layout == "bshd":
        local = [t.transpose(1, 2).contiguous() for t in local]
    ql, kl, vl = (t.clone().requires_grad_() for t in local)
    bl = beta[:, :, sl].clone().requires_grad_()
    gl = gate[:, :, sl].clone().requires_grad_() if gate is not None else None
    s0l = s0.clone().requires_grad_() if s0 is not None else None
    counter.take()
    res = cp.context_parallel_delta_rule_attention(ql, kl, vl, bl, gate=gl, initial_state=s0l,
                                                   return_state=want_state, layout=layout, group=group, **opts)
    n_fwd = counter.take()
    outl, stl = res if want_state else (res, None)
    outl_h = outl.transpose(1, 2) if layout == "bshd" else outl
    # the final state's loss term on the last rank only: the sum over ranks is the one-process loss
    loss(outl_h, g_out[:, :, a:a + n], stl if rank == world - 1 else None).backward()
    n_bwd = counter.take()
    if s0l is not None:  # every rank holds its part of d(initial_state): the sum is the full one
        ds = s0l.grad.clone()
        dist.all_reduce(ds, group=group)
        counter.take()
    # the checks after every collective of the case, so that a failing rank stays in step
    assert n_fwd == {"gather": 1, "scatter": 0}, f"forward collectives {n_fwd}: want one all-gather"
    assert n_bwd == {"gather": 0, "scatter": 1}, f"backward collectives {n_bwd}: want one reduce-scatter"
    as_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)  # noqa: E731
    assert outl.dtype == q.dtype and torch.isfinite(outl).all()
    _check("out", outl_h, out.detach()[:, :, sl], tol)
    _check("dq", as_bhsd(ql.grad), full[0].grad[:, :, sl], tol)
    _check("dk", as_bhsd(kl.grad), full[1].grad[:, :, sl], tol)
    _check("dv", as_bhsd(vl.grad), full[2].grad[:, :, sl], tol)
    _check("dbeta", bl.grad, full[3].grad[:, :, sl], tol)
    if gl is not None:
        _check("dgate", gl.grad, full[4].grad[:, :, sl], tol)
    if s0l is not None:
        _check("dinitial_state", ds, full[5].grad, tol)
    if want_state:
        _check("final state", stl, st.detach(), tol)


def suite(rank: int, world: int, sizes: List[int], names: List[str]) -> Dict[str, Optional[str]]:
    """Every case on every group size of `sizes` (harness.case_table)."""
    return case_table(delta_case, Counter(), rank, world, sizes, names)
