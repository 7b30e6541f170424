"""What each rank runs for test_agree.py (imported by the spawned processes): calls whose ranks
disagree, or where one rank's argument is bad, each followed by a valid call on the same group.
Without the ranks' agreement (attention_ext/distributed/agree.py) these hung until the group's
timeout, aborted the process in gloo ("Received data size doesn't match"), or returned a result
built from a partly unfilled buffer."""
from __future__ import annotations

import sys
from typing import Callable, Dict, Tuple

import numpy as np
import torch
import torch.distributed as dist

import attention_ext as ae
from attention_ext import distributed as cp


def _qkv(n=8, h=2, hk=2, d=8, b=1, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, x, n, d, generator=g).to(dtype).requires_grad_(grad) for x in (h, hk, hk)]


def _attn(mode: str, q, k, v, **kw):
    out = cp.context_parallel_attention(q, k, v, mode=mode, **kw)
    if out.requires_grad:
        out.sum().backward()
    return out


def softmax_cases(mode: str) -> Dict[str, Callable[[int], object]]:
    """name -> run(rank): the call of this rank."""
    return {
        "heads differ": lambda r: _attn(mode, *_qkv(hk=2 if r == 0 else 1)),
        "lengths differ": lambda r: _attn(mode, *_qkv(n=8 if r == 0 else 12), causal=True),
        "dtypes differ": lambda r: _attn(mode, *_qkv(dtype=torch.float32 if r == 0 else torch.float64)),
        "dropout on one rank": lambda r: _attn(mode, *_qkv(), dropout_p=0.1 if r == 0 else 0.0),
        "grad on one rank": lambda r: _attn(mode, *_qkv(grad=r == 0)),
        "documents differ": lambda r: _attn(mode, *_qkv(), causal=True, cu_seqlens=[0, 5 if r == 0 else 9, 16]),
        "bad sinks on one rank": lambda r: _attn(mode, *_qkv(), sinks=torch.zeros(2 if r == 0 else 3)),
        "3-D q on one rank": lambda r: _attn(mode, *((lambda q, k, v: (q[0] if r else q, k, v))(*_qkv()))),
        # the same bad heads on every rank: the kernel's own check raises, in ring mode with the
        # step's transfers in flight (they are waited for before the error leaves)
        "the same bad heads everywhere": lambda r: _attn(mode, *_qkv(h=4, hk=3)),
    }


def other_cases() -> Dict[str, Callable[[int], object]]:
    def lin(r, **over):
        q, k, v = _qkv(n=6)
        kw = dict(causal=True)
        kw.update(over.get("kw", {}))
        if "dv" in over:
            v = torch.randn(1, 2, 6, over["dv"] if r == 1 else 8)
        return cp.context_parallel_linear_attention(q, k, v, **kw)

    def delta(r, **over):
        g = torch.Generator().manual_seed(1)
        d = 4 if (over.get("k") and r == 1) else 8
        q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 6, d, generator=g), dim=-1) for _ in range(2))
        v, beta = torch.randn(1, 2, 6, 5, generator=g), torch.rand(1, 2, 6, generator=g)
        init = torch.zeros(1, 2, d, 5) if (over.get("init") and r == 0) else None
        return cp.context_parallel_delta_rule_attention(q, k, v, beta, initial_state=init)

    def favor(r):
        q, k, v = _qkv(n=6)
        fm = ae.linear.feature_maps.Favor(8, 16 if r == 0 else 32, seed=0)
        return cp.context_parallel_linear_attention(q, k, v, feature_map=fm)

    def same_call(r):  # the same collectives under two names: one call
        q, k, v = _qkv()
        if r == 0:
            return cp.context_parallel_attention(q, k, v, mode="ring")
        from attention_ext.distributed.ring import ring_attention
        return ring_attention(q, k, v)

    def entry(r):
        q, k, v = _qkv()
        if r == 0:
            return cp.context_parallel_attention(q, k, v)
        return cp.context_parallel_linear_attention(q, k, v)

    return {
        "mode differs": lambda r: _attn("allgather" if r == 0 else "ring", *_qkv()),
        # found by a review: a rank whose queries are all padding calls no kernel, so only the
        # others raised in the ring (the kernel's own input rules now run on every rank first)
        "ring: the same bad heads, rank 1's rows all padding": lambda r: _attn(
            "ring", *_qkv(h=4, hk=3), causal=True, shard_layout="contiguous", seq_len=4),
        "dropout_p left out on rank 0, 0 on rank 1": lambda r: _attn(
            "allgather", *_qkv(), **(dict(scale=0.25) if r == 0 else dict(dropout_p=0, scale=np.float32(0.25)))),
        "different entry points": entry,
        "ring_attention and context_parallel_attention(mode='ring')": same_call,
        "linear: feature map widths differ": favor,
        "linear: a float key_mask with documents on one rank": lambda r: lin(
            r, kw=dict(cu_seqlens=[0, 3, 12], key_mask=torch.ones(1, 6, dtype=torch.float32 if r else torch.bool))),
        "linear: value widths differ": lambda r: lin(r, dv=5),
        "linear: bad decay on one rank": lambda r: lin(r, kw=dict(decay=torch.zeros(1, 2, 6 if r == 0 else 5))),
        "delta: key widths differ": lambda r: delta(r, k=True),
        "delta: initial state on one rank": lambda r: delta(r, init=True),
    }


def _outcome(fn: Callable[[int], object], rank: int) -> Tuple[str, str]:
    try:
        fn(rank)
        return "ok", ""
    except Exception as e:  # noqa: BLE001  (reported, then checked by the test)
        return type(e).__name__, str(e)


def suite(rank: int, world: int) -> Dict[str, Tuple[str, str, bool]]:
    """Every case: (this rank's exception type, its message, whether a valid call on the same group
    right after it returned, finite)."""
    cases = {f"{mode}: {name}": fn for mode in cp.MODES for name, fn in softmax_cases(mode).items()}
    cases.update(other_cases())
    q, k, v = _qkv(n=8, seed=3)
    res = {}
    for name, fn in cases.items():
        kind, msg = _outcome(fn, rank)
        # the group still works: a valid call (every mode) gives the unsharded answer
        mode = name.split(":")[0] if name.split(":")[0] in cp.MODES else "allgather"
        out = cp.context_parallel_attention(q, k, v, mode=mode, shard_layout="contiguous")
        res[name] = (kind, msg, bool(torch.isfinite(out).all()))
    return res


def counted_suite(rank: int, world: int) -> Dict[str, int]:
    """The agreement's all-gathers per call: one by default, none with check_ranks=False (also
    through ContextParallel)."""
    n = {"calls": 0}
    real = dist.all_gather

    def counting(*a, **kw):
        if sys._getframe(1).f_globals.get("__name__") == "attention_ext.distributed.agree":
            n["calls"] += 1
        return real(*a, **kw)

    dist.all_gather = counting
    try:
        q, k, v = _qkv()
        got = {}
        for check in (True, False):
            n["calls"] = 0
            cp.context_parallel_attention(q, k, v, mode="ring", check_ranks=check)
            got[f"softmax check_ranks={check}"] = n["calls"]
        n["calls"] = 0
        cp.context_parallel_linear_attention(q, k, v, check_ranks=False)
        got["linear check_ranks=False"] = n["calls"]
        return got
    finally:
        dist.all_gather = real
