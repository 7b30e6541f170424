"""What each rank runs (imported by the spawned processes): every case computes the single-process
result on the global tensors (the same seed on every rank gives the same tensors) and compares
this rank's shard of the context-parallel result against it. A case's failure is recorded, not
raised, so that every rank runs the same collectives in the same order and the suite goes on;
{case name: None or the traceback} comes back per rank."""
from __future__ import annotations

import sys
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import attention_ext as ae
from attention_ext import distributed as cp
from attention_ext import reference
from attention_ext.distributed.sharding import real_rows
from tests.helpers import assert_close_fa2, reference_in, rel_err

B, H, D, S = 2, 4, 16, 48   # S: a multiple of 2P for P = 2, 3, 4
S_ODD = 45                  # padded to 48 by pad_to_multiple
TOL = 1e-5                  # fp32, relative (tests.helpers.rel_err)

# variant name -> options (causal, window, alibi, sinks, softcap, hk, layout, real length)
VARIANTS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "gqa": dict(hk=2),
    "causal-gqa": dict(causal=True, hk=1),
    "window": dict(window=(5, 3)),
    "window-left": dict(window=(6, -1)),
    "causal-window": dict(causal=True, window=(7, -1)),
    "alibi": dict(alibi=True),
    "causal-alibi": dict(causal=True, alibi=True, hk=2),
    "causal-window-alibi": dict(causal=True, window=(9, -1), alibi=True),
    "sinks-softcap": dict(sinks=True, softcap=2.0),
    "causal-sinks-softcap": dict(causal=True, sinks=True, softcap=2.0, hk=2),
    "bshd-causal-gqa": dict(causal=True, hk=2, layout="bshd"),
    "bshd-window": dict(window=(4, 4), layout="bshd"),
    "odd-plain": dict(real=S_ODD),
    "odd-causal": dict(causal=True, real=S_ODD),
    "odd-window": dict(window=(3, 2), real=S_ODD, hk=2),
    "odd-causal-alibi": dict(causal=True, alibi=True, real=S_ODD),
    # bf16 under the project's rule: error vs float64 <= 2x PyTorch's own bf16 error + a floor
    "bf16-causal-gqa": dict(causal=True, hk=2, dtype=torch.bfloat16),
    "bf16-window-alibi-sinks": dict(window=(6, 2), alibi=True, sinks=True, dtype=torch.bfloat16),
    # dropout at global positions: the single process's mask for the same seed (fp32 only)
    "dropout": dict(dropout=0.25),
    "causal-gqa-dropout": dict(causal=True, hk=2, dropout=0.25),
    "window-alibi-dropout": dict(window=(5, 3), alibi=True, dropout=0.25),
    "odd-causal-dropout": dict(causal=True, real=S_ODD, dropout=0.25),
    "sinks-dropout-seedless": dict(sinks=True, dropout=0.25, seedless=True),
}
ATTN_CASES = [f"{shard_layout}-{v}" for shard_layout in cp.LAYOUTS for v in VARIANTS]
GROUP_CASES = ["zigzag-causal-gqa", "stripe-window", "contiguous-causal-sinks-softcap"]  # on subgroups of 4


SEEDLESS = 99  # rank 0's generator seed in the seedless dropout cases (the other ranks' differ)


def dropout_kw(o: dict, name: str):
    """(single-process kwargs, context-parallel kwargs) of a case's dropout: the same seed on
    both sides; "seedless" gives the CP call no seed, so group rank 0 draws one from torch's
    generator (seeded with SEEDLESS just before the call, see seed_before_cp) and broadcasts it:
    the single process gets the value that draw makes."""
    if "dropout" not in o:
        return {}, {}
    p = o["dropout"]
    if o.get("seedless"):
        seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=torch.Generator().manual_seed(SEEDLESS)))
        return dict(dropout_p=p, seed=seed), dict(dropout_p=p)
    seed = 7000 + sum(map(ord, name))
    return dict(dropout_p=p, seed=seed), dict(dropout_p=p, seed=seed)


def seed_before_cp(o: dict, rank: int) -> None:
    """Seedless dropout: every rank's generator in a different state, rank 0's at SEEDLESS."""
    if o.get("seedless"):
        torch.manual_seed(SEEDLESS if rank == 0 else SEEDLESS + 1 + rank)


class CallCounter:
    """Wraps the torch.distributed functions named in NAMES ({function: kind}) to count the
    calls per kind; take() returns the counts and starts again. The ranks' agreement before a
    call's collectives (attention_ext/distributed/agree.py, one all-gather) is counted apart, in
    `agreed`: the counts are the attention's own collectives."""
    NAMES: Dict[str, str] = {}

    def __init__(self):
        self.n = dict.fromkeys(self.NAMES.values(), 0)
        self.agreed = 0
        for name, kind in self.NAMES.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn, kind))

    def _wrap(self, fn, kind):
        def wrapped(*a, **kw):
            if sys._getframe(1).f_globals.get("__name__") == "attention_ext.distributed.agree":
                self.agreed += 1
            else:
                self.n[kind] += 1
            return fn(*a, **kw)
        return wrapped

    def take(self) -> Dict[str, int]:
        n, self.n = dict(self.n), dict.fromkeys(self.n, 0)
        return n


class Counter(CallCounter):
    """Counts torch.distributed's all-gather / reduce-scatter calls."""
    GATHER = ("all_gather_single", "all_gather_into_tensor", "all_gather")
    SCATTER = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "all_reduce")
    NAMES = {**{n: "gather" for n in GATHER}, **{n: "scatter" for n in SCATTER}}


class GatherCounter(Counter):
    """Counter, with all_to_all_single calls as "a2a" (the overlapped all-gather's collective)."""
    NAMES = {**Counter.NAMES, "all_to_all_single": "a2a"}


# mode="allgather"'s collectives per form (overlap=...): forward, backward
ALLGATHER_COLLECTIVES = {
    False: ({"gather": 1, "scatter": 0, "a2a": 0}, {"gather": 0, "scatter": 1, "a2a": 0}),  # all-gather, reduce-scatter
    True: ({"gather": 0, "scatter": 0, "a2a": 1}, {"gather": 0, "scatter": 0, "a2a": 1}),   # one all-to-all each way
}


class KernelCalls:
    """Records the fused-kernel calls mode="allgather" makes (allgather.py's module-level
    `_attention`): [(queries, keys, attn_mask given)]."""

    def __init__(self):
        from attention_ext.distributed import allgather as mod
        self.calls, self._mod, self._fn = [], mod, mod._attention

        def wrapped(q, k, v, **kw):
            self.calls.append((q.shape[2], k.shape[2], kw.get("attn_mask") is not None))
            return self._fn(q, k, v, **kw)
        mod._attention = wrapped

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def expected_calls(shard_layout: str, o: dict, rank: int, world: int, n: int, s: int, real: int):
    """The design's kernel calls (allgather.py's three paths) for a case's options; s: the
    padded length, real: the real one."""
    causal, window = o.get("causal", False), o.get("window", (-1, -1))
    if not (causal or window != (-1, -1) or o.get("alibi") or real < s):
        return [(n, s, False)]                                     # 1: no positions
    if causal and shard_layout != "stripe":                        # 2: one call per run, keys [k0, a + c)
        pos = cp.global_positions(s, rank=rank, world_size=world, shard_layout=shard_layout).tolist()
        one_run = shard_layout == "contiguous" or rank == world - 1  # zigzag's last rank: chunks P-1, P adjacent
        runs = [(pos[0], n)] if one_run else [(pos[0], n // 2), (pos[n // 2], n // 2)]
        wl = window[0]
        calls = []
        for a, c in runs:  # padding: the run's real rows against real keys; 0 x 0 for a padded shard
            c = max(0, min(c, real - a))
            if c == 0 and calls:
                continue
            k1 = a + c if c else 0
            calls.append((c, k1 - min(max(0, a - wl) if wl >= 0 else 0, k1), False))
        return calls
    nr = real_rows(real, s, rank=rank, world_size=world, shard_layout=shard_layout)
    return [(nr, real, True)]                                      # 3: explicit mask, real rows and keys


def _check(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    e = rel_err(got, ref)
    assert e <= tol, f"{name}: relative error {e:.3g} > {tol:g}"


def attention_case(rank: int, world: int, name: str, counter: Counter, kernel: "KernelCalls",
                   group: Optional[dist.ProcessGroup] = None) -> None:
    """One case on this rank; rank and world are the ranks of `group` (default: the world)."""
    shard_layout, variant = name.split("-", 1)
    o = VARIANTS[variant]
    dtype = o.get("dtype", torch.float32)
    causal, window = o.get("causal", False), o.get("window", (-1, -1))
    hk, layout, real = o.get("hk", H), o.get("layout", "bhsd"), o.get("real", S)
    torch.manual_seed(1000 + ATTN_CASES.index(name))  # the same global tensors on every rank
    q, k, v = torch.randn(B, H, real, D), torch.randn(B, hk, real, D), torch.randn(B, hk, real, D)
    g = torch.randn(B, H, real, D)
    slopes = torch.rand(H) * 0.5 + 0.1 if o.get("alibi") else None
    sinks = torch.randn(H) if o.get("sinks") else None
    opts = dict(causal=causal, alibi_slopes=slopes, softcap=o.get("softcap", 0.0))
    drop_one, drop_cp = dropout_kw(o, name)

    # single process: our kernel in fp32; for bf16 the float64 reference and PyTorch's bf16 math
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    sr = sinks.clone().requires_grad_() if sinks is not None else None
    if dtype != torch.float32:
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (qr, kr, vr))
        sr = sr.detach().double().requires_grad_() if sr is not None else None
    win = (window[0], 0) if causal else window
    kw = dict(window=win, alibi_slopes=slopes, softcap=opts["softcap"])
    if dtype == torch.float32:
        out, lse = ae.attention(qr, kr, vr, sinks=sr, return_lse=True, window=window, **opts, **drop_one)
        (out * g).sum().backward()
    else:
        out, lse = reference.attention(qr, kr, vr, sinks=sr, **kw)
        (out * g.double()).sum().backward()
        t_out, t_lse, (tq, tk, tv, _, ts) = reference_in(
            dtype, q, k, v, sinks=sinks.clone().requires_grad_() if sinks is not None else None, **kw)
        (t_out * g.to(dtype)).sum().backward()
        torch_same = {"out": t_out, "lse": t_lse, "dq": tq.grad, "dk": tk.grad, "dv": tv.grad}
        q, k, v, g = (t.to(dtype) for t in (q, k, v, g))

    # context parallel on this rank's shard of the padded sequence
    mult = cp.sequence_multiple(world, shard_layout)
    pad = lambda t: cp.pad_to_multiple(t, 2, mult)[0]  # noqa: E731
    sp = pad(q).shape[2]
    pos = cp.global_positions(sp, rank=rank, world_size=world, shard_layout=shard_layout)
    keep = pos < real
    local = [cp.shard_sequence(pad(t), dim=2, group=group, shard_layout=shard_layout) for t in (q, k, v)]
    if layout == "bshd":
        local = [t.transpose(1, 2).contiguous() for t in local]
    gl = cp.shard_sequence(pad(g), dim=2, group=group, shard_layout=shard_layout)
    if layout == "bshd":
        gl = gl.transpose(1, 2)

    def run(overlap: bool):
        """The call with both all-gather forms: (out, lse, leaves, sinks, counts fwd / bwd, kernel calls)."""
        ql, kl, vl = (t.clone().requires_grad_() for t in local)
        sl = sinks.clone().requires_grad_() if sinks is not None else None
        seed_before_cp(o, rank)
        counter.take()
        kernel.take()
        ol, lsel = cp.context_parallel_attention(ql, kl, vl, group=group, shard_layout=shard_layout, overlap=overlap,
                                                 window_size=window, sinks=sl, return_lse=True, layout=layout,
                                                 seq_len=real, **opts, **drop_cp)
        n_fwd = counter.take()
        calls = kernel.take()
        (ol * gl).sum().backward()
        return ol, lsel, (ql, kl, vl), sl, n_fwd, counter.take(), calls

    runs = {ov: run(ov) for ov in (False, True)}
    # the checks after every collective of the case, so that a failing rank stays in step with the others
    want_calls = expected_calls(shard_layout, o, rank, world, pos.numel(), sp, real)
    for ov, (_, _, _, _, n_fwd, n_bwd, calls) in runs.items():
        if not ov:  # the non-overlapped form's design: its kernel calls (the overlapped one: steps.py's plans)
            assert calls == want_calls, f"kernel calls (queries, keys, mask) {calls}, want {want_calls}"
        assert (n_fwd, n_bwd) == ALLGATHER_COLLECTIVES[ov], \
            f"overlap={ov}: collectives {n_fwd} / {n_bwd}, want {ALLGATHER_COLLECTIVES[ov]} (K, V stacked)"
    dsinks = {}
    for ov, (_, _, _, sl, *_) in runs.items():  # each rank holds its queries' part of dsinks: the sum is the full one
        if sl is not None:
            dsinks[ov] = sl.grad.float()
            dist.all_reduce(dsinks[ov], group=group)
    counter.take()
    as_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)  # noqa: E731
    idx = pos[keep]
    want = {"out": out.detach(), "lse": lse.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    for ov, (ol, lsel, (ql, kl, vl), *_) in runs.items():
        got = {"out": as_bhsd(ol), "lse": lsel, "dq": as_bhsd(ql.grad), "dk": as_bhsd(kl.grad), "dv": as_bhsd(vl.grad)}
        for what in got:
            if dtype == torch.float32:
                _check(f"overlap={ov}: {what}", got[what][:, :, keep], want[what][:, :, idx])
            else:
                assert got[what].dtype == (torch.float32 if what == "lse" else dtype), (what, got[what].dtype)
                assert_close_fa2(got[what][:, :, keep], torch_same[what][:, :, idx], want[what][:, :, idx], dtype,
                                 f"overlap={ov}: {what}")
        if ov in dsinks:
            if dtype == torch.float32:
                _check(f"overlap={ov}: dsinks", dsinks[ov], sr.grad)
            else:
                assert_close_fa2(dsinks[ov], ts.grad, sr.grad, dtype, f"overlap={ov}: dsinks")


def roundtrip_case(rank: int, world: int, shard_layout: str) -> None:
    """shard -> unshard is the identity; unshard's backward sums every rank's gradient of the
    full tensor into the owner's shard."""
    s = 2 * world * 5
    torch.manual_seed(7)
    x = torch.randn(3, s, 5)
    w = torch.randn(3, s, 5)
    xl = cp.shard_sequence(x, dim=1, shard_layout=shard_layout)
    pos = cp.global_positions(s, rank=rank, world_size=world, shard_layout=shard_layout)
    assert torch.equal(xl, x[:, pos])
    xl = xl.clone().requires_grad_()
    full = cp.unshard_sequence(xl, dim=-2, shard_layout=shard_layout)
    assert torch.equal(full, x), "unshard(shard(x)) != x"
    (full * w * (rank + 1)).sum().backward()
    want = w[:, pos] * sum(r + 1 for r in range(world))
    torch.testing.assert_close(xl.grad, want, rtol=1e-6, atol=1e-6)


def suite(rank: int, world: int, attn_cases: List[str]) -> Dict[str, Optional[str]]:
    """Every case on this rank: {name: None (passed) or the traceback}."""
    counter, kernel = GatherCounter(), KernelCalls()
    res: Dict[str, Optional[str]] = {}
    for shard_layout in cp.LAYOUTS:
        try:
            roundtrip_case(rank, world, shard_layout)
            res[f"roundtrip-{shard_layout}"] = None
        except Exception:  # noqa: BLE001
            res[f"roundtrip-{shard_layout}"] = traceback.format_exc()
    for name in attn_cases:
        try:
            attention_case(rank, world, name, counter, kernel)
            res[name] = None
        except Exception:  # noqa: BLE001
            res[name] = traceback.format_exc()
    if world == 4:  # two independent groups of 2: `group=` is honoured (ranks, sizes, collectives)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for name in GROUP_CASES:
            try:
                attention_case(rank % 2, 2, name, counter, kernel, group=pairs[rank // 2])
                res[f"group-{name}"] = None
            except Exception:  # noqa: BLE001
                res[f"group-{name}"] = traceback.format_exc()
        for pg in pairs:
            dist.destroy_process_group(pg)
    return res


def fail_on(rank: int, world: int, bad_rank: int) -> int:
    """One rank raises while the others wait in a collective: the harness must fail, not hang."""
    if rank == bad_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return rank


# -- mode="ulysses" (tests/distributed/test_ulysses.py) --------------------------------------------

# Heads per world size P: H = 2P query heads (h = 2 per rank); GQA kinds pick H_k (and H) so that
# every KV rule of ulysses.py runs: "split" H_k % P == 0, "one" H_k = 1 < P (replicated),
# "straddle" a rank's query heads span two KV groups (gcd rule; for P = 4 also H_k = 3 < P,
# P % H_k != 0).
_STRADDLE = {2: (6, 3), 3: (6, 2), 4: (12, 3)}  # P -> (H, H_k)


def ulysses_heads(world: int, kind: str):
    """(H, H_k) of a GQA kind on `world` ranks."""
    if kind == "straddle":
        return _STRADDLE[world]
    hq = 2 * world
    return hq, {"mha": hq, "split": world, "one": 1}[kind]


U_VARIANTS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-split": dict(causal=True, kv="split"),
    "causal-one": dict(causal=True, kv="one"),
    "straddle": dict(kv="straddle"),
    "causal-window-straddle": dict(causal=True, window=(7, -1), kv="straddle"),
    "window": dict(window=(5, 3)),
    "alibi-one": dict(alibi=True, kv="one"),
    "causal-window-alibi": dict(causal=True, window=(9, -1), alibi=True, kv="split"),
    "sinks-softcap": dict(sinks=True, softcap=2.0),
    "causal-sinks-straddle": dict(causal=True, sinks=True, kv="straddle"),
    "bshd-causal-split": dict(causal=True, kv="split", layout="bshd"),
    "odd-causal": dict(causal=True, real=S_ODD),
    "odd-window-alibi-one": dict(window=(3, 2), alibi=True, real=S_ODD, kv="one"),
    "nolse-causal": dict(causal=True, lse=False),
    "bf16-causal-sinks-split": dict(causal=True, sinks=True, kv="split", dtype=torch.bfloat16),
    "causal-dropout": dict(causal=True, dropout=0.25),
    "straddle-dropout": dict(kv="straddle", dropout=0.25),
    "odd-window-sinks-dropout-seedless": dict(window=(3, 2), sinks=True, real=S_ODD, kv="one", dropout=0.25,
                                              seedless=True),
}
U_CASES = [f"{shard_layout}-{v}" for shard_layout in cp.LAYOUTS for v in U_VARIANTS]
U_GROUP_CASES = ["zigzag-causal-one", "stripe-causal-sinks-straddle"]  # on subgroups of 4 (P = 2)


class AllToAllCounter(CallCounter):
    """Counts torch.distributed.all_to_all_single calls (and the all-gather / reduce-scatter ones,
    which ulysses must not use)."""
    NAMES = {"all_to_all_single": "a2a", **{n: "other" for n in Counter.GATHER + Counter.SCATTER}}


def ulysses_case(rank: int, world: int, name: str, counter: AllToAllCounter,
                 group: Optional[dist.ProcessGroup] = None) -> None:
    """One mode="ulysses" case on this rank vs the single-process fused kernel on the whole
    sequence (fp32: within TOL; bf16: the FA2 rule vs float64); rank and world are `group`'s."""
    shard_layout, variant = name.split("-", 1)
    o = U_VARIANTS[variant]
    dtype = o.get("dtype", torch.float32)
    causal, window = o.get("causal", False), o.get("window", (-1, -1))
    hq, hk = ulysses_heads(world, o.get("kv", "mha"))
    layout, real, with_lse = o.get("layout", "bhsd"), o.get("real", S), o.get("lse", True)
    torch.manual_seed(2000 + U_CASES.index(name))  # the same global tensors on every rank
    q, k, v = torch.randn(B, hq, real, D), torch.randn(B, hk, real, D), torch.randn(B, hk, real, D)
    g = torch.randn(B, hq, real, D)
    g_lse = torch.randn(B, hq, real) if with_lse else None  # the LSE joins the loss: its gradient too
    slopes = torch.rand(hq) * 0.5 + 0.1 if o.get("alibi") else None
    sinks = torch.randn(hq) if o.get("sinks") else None
    softcap = o.get("softcap", 0.0)
    drop_one, drop_cp = dropout_kw(o, name)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    sr = sinks.clone().requires_grad_() if sinks is not None else None
    win = (window[0], 0) if causal else window
    if dtype == torch.float32:
        out, lse = ae.attention(qr, kr, vr, sinks=sr, return_lse=True, causal=causal, window=window,
                                alibi_slopes=slopes, softcap=softcap, **drop_one)
        loss = (out * g).sum() + ((lse * g_lse).sum() if with_lse else 0)
        loss.backward()
    else:  # float64 reference and PyTorch's own bf16 math; the loss without the LSE
        kw = dict(window=win, alibi_slopes=slopes, softcap=softcap)
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (qr, kr, vr))
        sr = sr.detach().double().requires_grad_() if sr is not None else None
        out, lse = reference.attention(qr, kr, vr, sinks=sr, **kw)
        (out * g.double()).sum().backward()
        t_out, t_lse, (tq, tk, tv, _, ts) = reference_in(
            dtype, q, k, v, sinks=sinks.clone().requires_grad_() if sinks is not None else None, **kw)
        (t_out * g.to(dtype)).sum().backward()
        torch_same = {"out": t_out, "lse": t_lse, "dq": tq.grad, "dk": tk.grad, "dv": tv.grad}
        q, k, v, g = (t.to(dtype) for t in (q, k, v, g))
        g_lse = None

    mult = cp.sequence_multiple(world, shard_layout)
    pad = lambda t: cp.pad_to_multiple(t, 2, mult)[0]  # noqa: E731
    sp = pad(q).shape[2]
    pos = cp.global_positions(sp, rank=rank, world_size=world, shard_layout=shard_layout)
    keep = pos < real
    local = [cp.shard_sequence(pad(t), dim=2, group=group, shard_layout=shard_layout) for t in (q, k, v)]
    if layout == "bshd":
        local = [t.transpose(1, 2).contiguous() for t in local]
    ql, kl, vl = (t.requires_grad_() for t in local)
    sl = sinks.clone().requires_grad_() if sinks is not None else None
    seed_before_cp(o, rank)
    counter.take()
    res = cp.context_parallel_attention(ql, kl, vl, group=group, mode="ulysses", shard_layout=shard_layout,
                                        causal=causal, window_size=window, alibi_slopes=slopes, softcap=softcap,
                                        sinks=sl, return_lse=with_lse, layout=layout, seq_len=real, **drop_cp)
    ol, lsel = res if with_lse else (res, None)
    n_fwd = counter.take()
    gl = cp.shard_sequence(pad(g), dim=2, group=group, shard_layout=shard_layout)
    if layout == "bshd":
        gl = gl.transpose(1, 2)
    loss = (ol * gl).sum()
    if g_lse is not None:
        loss = loss + (lsel * cp.shard_sequence(cp.pad_to_multiple(g_lse, 2, mult)[0], dim=2, group=group,
                                                shard_layout=shard_layout)).sum()
    loss.backward()
    n_bwd = counter.take()
    ds = None
    if sinks is not None:  # rank r holds its heads' dsinks: the sum over the group is the full one
        ds = sl.grad.float()
        dist.all_reduce(ds, group=group)
        counter.take()
    # the checks after every collective of the case, so that a failing rank stays in step with the others
    assert n_fwd == {"a2a": 2, "other": 0}, f"forward collectives {n_fwd}: want 2 all-to-alls (q/k/v, out/lse)"
    assert n_bwd == {"a2a": 2, "other": 0}, f"backward collectives {n_bwd}: want 2 all-to-alls"

    as_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)  # noqa: E731
    idx = pos[keep]
    got = {"out": as_bhsd(ol), "dq": as_bhsd(ql.grad), "dk": as_bhsd(kl.grad), "dv": as_bhsd(vl.grad)}
    want = {"out": out.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    if with_lse:
        got["lse"], want["lse"] = lsel, lse.detach()
    for what in got:
        if dtype == torch.float32:
            _check(what, got[what][:, :, keep], want[what][:, :, idx])
        else:
            assert got[what].dtype == (torch.float32 if what == "lse" else dtype), (what, got[what].dtype)
            assert_close_fa2(got[what][:, :, keep], torch_same[what][:, :, idx], want[what][:, :, idx], dtype, what)
    if ds is not None:
        if dtype == torch.float32:
            _check("dsinks", ds, sr.grad)
        else:
            assert_close_fa2(ds, ts.grad, sr.grad, dtype, "dsinks")


def ulysses_errors_case(rank: int, world: int) -> None:
    """H % P != 0 is a ValueError naming H and P, raised before any collective."""
    q = torch.randn(1, 2 * world + 1, 2, 8)
    try:
        cp.context_parallel_attention(q, q, q, mode="ulysses", shard_layout="contiguous")
    except ValueError as e:
        assert f"H={2 * world + 1}" in str(e) and f"P={world}" in str(e), str(e)
    else:
        raise AssertionError("H % P != 0 did not raise")


def ulysses_suite(rank: int, world: int, names: List[str]) -> Dict[str, Optional[str]]:
    """Every ulysses case on this rank: {name: None (passed) or the traceback}."""
    counter = AllToAllCounter()
    res: Dict[str, Optional[str]] = {}
    jobs = [(n, lambda n=n: ulysses_case(rank, world, n, counter)) for n in names]
    jobs.append(("errors", lambda: ulysses_errors_case(rank, world)))
    for name, job in jobs:
        try:
            job()
            res[name] = None
        except Exception:  # noqa: BLE001
            res[name] = traceback.format_exc()
    if world == 4:  # two independent groups of 2: `group=` is honoured
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for name in U_GROUP_CASES:
            try:
                ulysses_case(rank % 2, 2, name, counter, group=pairs[rank // 2])
                res[f"group-{name}"] = None
            except Exception:  # noqa: BLE001
                res[f"group-{name}"] = traceback.format_exc()
        for pg in pairs:
            dist.destroy_process_group(pg)
    return res


# -- mode="ring" (tests/distributed/test_ring.py) --------------------------------------------------
# variant name -> options as VARIANTS, plus per_rank: the real length is per_rank * P (odd shards
# for contiguous / stripe; zigzag pads it to a multiple of 2P), lse_grad: the loss also takes the LSE
RING_VARIANTS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "gqa": dict(hk=2),
    "causal-mqa": dict(causal=True, hk=1),
    "window": dict(window=(5, 3)),
    "causal-window": dict(causal=True, window=(7, -1), hk=2),
    "alibi": dict(alibi=True, hk=1),
    "causal-window-alibi": dict(causal=True, window=(9, -1), alibi=True),
    "sinks-softcap": dict(sinks=True, softcap=2.0),
    "causal-sinks-lse": dict(causal=True, sinks=True, hk=2, lse_grad=True),
    "bshd-causal-gqa": dict(causal=True, hk=2, layout="bshd"),
    "odd-causal-alibi": dict(causal=True, alibi=True, real=S_ODD),
    "n7-causal": dict(causal=True, per_rank=7, hk=2),
    "n5-window-sinks": dict(window=(3, 2), sinks=True, per_rank=5, hk=1),
    "bf16-causal-gqa-sinks": dict(causal=True, hk=2, sinks=True, dtype=torch.bfloat16),
    "dropout": dict(dropout=0.25, hk=2),
    "causal-window-alibi-dropout": dict(causal=True, window=(9, -1), alibi=True, dropout=0.25),
    "n5-causal-sinks-lse-dropout-seedless": dict(causal=True, sinks=True, per_rank=5, lse_grad=True, dropout=0.25,
                                                 seedless=True),
}
RING_CASES = [f"{shard_layout}-{v}" for shard_layout in cp.LAYOUTS for v in RING_VARIANTS]
RING_GROUP_CASES = ["zigzag-causal-sinks-lse", "stripe-window"]  # on subgroups of 4
RING_RATIO_CASE = "zigzag-bf16-causal-gqa-sinks"  # its errors vs float64 at P = 4 and P = 2 are compared


class P2PCount:
    """Wraps torch.distributed.batch_isend_irecv to count the sends (isend P2POps) posted."""

    def __init__(self):
        self.sends, self._fn = 0, dist.batch_isend_irecv

        def wrapped(p2p_ops):
            self.sends += sum(op.op is dist.isend for op in p2p_ops)
            return self._fn(p2p_ops)
        dist.batch_isend_irecv = wrapped

    def take(self) -> int:
        n, self.sends = self.sends, 0
        return n


def ring_case(rank: int, world: int, name: str, p2p: P2PCount,
              group: Optional[dist.ProcessGroup] = None) -> Dict[str, tuple]:
    """One mode="ring" case on this rank vs the single-process kernel on the whole sequence (fp32:
    every error <= TOL) or, for bf16, the float64 reference under the 2x-PyTorch rule. Returns
    {what: (max abs error, max abs reference)} of this rank's shard, vs float64 (bf16) or vs the
    kernel (fp32). rank and world are the ranks of `group` (default: the world)."""
    shard_layout, variant = name.split("-", 1)
    o = RING_VARIANTS[variant]
    dtype = o.get("dtype", torch.float32)
    causal, window = o.get("causal", False), o.get("window", (-1, -1))
    hk, layout = o.get("hk", H), o.get("layout", "bhsd")
    real = o["per_rank"] * world if "per_rank" in o else o.get("real", S)
    torch.manual_seed(3000 + RING_CASES.index(name))  # the same global tensors on every rank (and world size)
    q, k, v = torch.randn(B, H, real, D), torch.randn(B, hk, real, D), torch.randn(B, hk, real, D)
    g, g_lse = torch.randn(B, H, real, D), torch.randn(B, H, real)
    slopes = torch.rand(H) * 0.5 + 0.1 if o.get("alibi") else None
    sinks = torch.randn(H) if o.get("sinks") else None
    softcap = o.get("softcap", 0.0)
    lse_grad = o.get("lse_grad", False)
    win = (window[0], 0) if causal else window
    drop_one, drop_cp = dropout_kw(o, name)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    sr = sinks.clone().requires_grad_() if sinks is not None else None
    if dtype == torch.float32:
        out, lse = ae.attention(qr, kr, vr, sinks=sr, return_lse=True, causal=causal, window=window,
                                alibi_slopes=slopes, softcap=softcap, **drop_one)
    else:
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (qr, kr, vr))
        sr = sr.detach().double().requires_grad_() if sr is not None else None
        kw = dict(window=win, alibi_slopes=slopes, softcap=softcap)
        out, lse = reference.attention(qr, kr, vr, sinks=sr, **kw)
        t_out, t_lse, (tq, tk, tv, _, ts) = reference_in(
            dtype, q, k, v, sinks=sinks.clone().requires_grad_() if sinks is not None else None, **kw)
        (t_out * g.to(dtype)).sum().backward()
        torch_same = {"out": t_out, "lse": t_lse, "dq": tq.grad, "dk": tk.grad, "dv": tv.grad,
                      "dsinks": ts.grad if ts is not None else None}
    loss = (out * g.to(out.dtype)).sum() + ((lse * g_lse.to(lse.dtype)).sum() if lse_grad else 0)
    loss.backward()
    if dtype != torch.float32:
        q, k, v, g = (t.to(dtype) for t in (q, k, v, g))

    mult = cp.sequence_multiple(world, shard_layout)
    pad = lambda t: cp.pad_to_multiple(t, 2, mult)[0]  # noqa: E731
    sp = pad(q).shape[2]
    pos = cp.global_positions(sp, rank=rank, world_size=world, shard_layout=shard_layout)
    keep = pos < real
    local = [cp.shard_sequence(pad(t), dim=2, group=group, shard_layout=shard_layout) for t in (q, k, v)]
    if layout == "bshd":
        local = [t.transpose(1, 2).contiguous() for t in local]
    ql, kl, vl = (t.requires_grad_() for t in local)
    sl = sinks.clone().requires_grad_() if sinks is not None else None
    stats: Dict[str, float] = {}
    seed_before_cp(o, rank)
    p2p.take()
    ol, lsel = cp.context_parallel_attention(ql, kl, vl, group=group, mode="ring", shard_layout=shard_layout,
                                             causal=causal, window_size=window, alibi_slopes=slopes, softcap=softcap,
                                             sinks=sl, return_lse=True, layout=layout, seq_len=real, _stats=stats,
                                             **drop_cp)
    sends_fwd = p2p.take()
    gl = cp.shard_sequence(pad(g), dim=2, group=group, shard_layout=shard_layout)
    if layout == "bshd":
        gl = gl.transpose(1, 2)
    loss_l = (ol * gl).sum()
    if lse_grad:
        loss_l = loss_l + (lsel * cp.shard_sequence(pad(g_lse), dim=2, group=group, shard_layout=shard_layout)).sum()
    loss_l.backward()
    sends_bwd = p2p.take()
    ds = None
    if sinks is not None:  # each rank holds its queries' part of dsinks: the sum is the full one
        ds = sl.grad.float()
        dist.all_reduce(ds, group=group)
    # the checks after every collective of the case, so that a failing rank stays in step with the others
    assert sends_fwd == world - 1, f"forward K/V sends {sends_fwd}, want P - 1 = {world - 1}"
    assert sends_bwd == 2 * world - 1, f"backward sends {sends_bwd}, want P - 1 K/V + P dK/dV = {2 * world - 1}"
    assert stats["fwd_kv_sends"] == world - 1 and stats["fwd_p2p_ops"] == 2 * (world - 1), stats
    assert stats["bwd_kv_sends"] == world - 1 and stats["bwd_p2p_ops"] == 2 * (2 * world - 1), stats
    assert all(stats[f"{p}_{w}_s"] >= 0 for p in ("fwd", "bwd") for w in ("wait", "compute")), stats

    as_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)  # noqa: E731
    idx = pos[keep]
    got = {"out": as_bhsd(ol), "lse": lsel, "dq": as_bhsd(ql.grad), "dk": as_bhsd(kl.grad), "dv": as_bhsd(vl.grad)}
    want = {"out": out.detach(), "lse": lse.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    errs = {}
    for what in got:
        if dtype == torch.float32:
            _check(what, got[what][:, :, keep], want[what][:, :, idx])
        else:
            assert got[what].dtype == (torch.float32 if what == "lse" else dtype), (what, got[what].dtype)
            assert_close_fa2(got[what][:, :, keep], torch_same[what][:, :, idx], want[what][:, :, idx], dtype, what)
        errs[what] = _abs_err(got[what][:, :, keep], want[what][:, :, idx])
    if ds is not None:
        if dtype == torch.float32:
            _check("dsinks", ds, sr.grad)
        else:
            assert_close_fa2(ds, torch_same["dsinks"], sr.grad, dtype, "dsinks")
        errs["dsinks"] = _abs_err(ds, sr.grad)
    return errs


def _abs_err(got: torch.Tensor, ref: torch.Tensor) -> tuple:
    """(max |got - ref|, max |ref|) over finite entries: the shards' pairs combine into the whole
    tensor's rel_err (max of the first / max(max of the second, 1))."""
    got, ref = got.detach().double(), ref.detach().double()
    fin = torch.isfinite(ref)
    return (float((got[fin] - ref[fin]).abs().max()), float(ref[fin].abs().max()))


def ring_suite(rank: int, world: int, names: List[str]) -> Dict[str, tuple]:
    """Every ring case on this rank: {name: (None or the traceback, {what: (abs error, abs max)})}."""
    p2p = P2PCount()
    res: Dict[str, tuple] = {}
    for name in names:
        try:
            res[name] = (None, ring_case(rank, world, name, p2p))
        except Exception:  # noqa: BLE001
            res[name] = (traceback.format_exc(), {})
    if world == 4:  # two independent rings of 2: `group=` is honoured (P2P peers are the group's ranks)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        for name in RING_GROUP_CASES:
            try:
                res[f"group-{name}"] = (None, ring_case(rank % 2, 2, name, p2p, group=pairs[rank // 2]))
            except Exception:  # noqa: BLE001
                res[f"group-{name}"] = (traceback.format_exc(), {})
        for pg in pairs:
            dist.destroy_process_group(pg)
    return res
