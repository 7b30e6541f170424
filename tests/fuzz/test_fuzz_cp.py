"""Property-based fuzzing of context parallelism (attention_ext.distributed) on live gloo groups of
1 to 4 CPU ranks (tests/distributed/harness.Group, one per world size, kept across examples):
every mode (allgather, ring, ulysses) and shard_layout, with padding to the sharding's multiple, GQA,
causal, windows, ALiBi, softcap, sinks and both qkv layouts, in every dtype; and packed documents
(cu_seqlens, B = 1, shard_layout "balanced" too) of random lengths: documents longer than a shard,
runs of 1-token documents (shards made only of document boundaries), one document.

Per example, the ranks run the drawn case (tests/distributed/fuzz_cases.py) and check on their
own shards that strided inputs with a non-contiguous grad_output, and NaN in every padded position
of q, k and v, change no bit of what the real positions get. Here the shards are put back in global
order and the forward, LSE and every gradient are held to the project's rule against the float64
reference on the unpadded sequence (tests/fuzz/common.py).

Not drawn: dropout (its mask is the single process's for a seed: tests/distributed/cases.py
checks that against attention_ext.attention itself) and process subgroups (cases.py too).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from attention_ext import distributed as cp
from attention_ext.softmax import ops, reference
from tests.distributed import fuzz_cases, harness
from tests.fuzz.common import (F64, LOW, at_least, check_grad, check_out, few_keys, head_dims, lengths, log_example,
                               seeds)

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")

_groups = {}


@pytest.fixture(scope="module")
def groups():
    yield _groups
    for g in _groups.values():
        g.close()
    _groups.clear()


def _group(world: int) -> harness.Group:
    if world not in _groups:
        _groups[world] = harness.Group(world)
    return _groups[world]


@st.composite
def cp_case(draw):
    world = draw(st.sampled_from([1, 2, 3, 4]))
    mode = draw(st.sampled_from(cp.MODES))
    hk = draw(st.integers(1, 3))
    h = hk * draw(st.integers(1, 3))
    if mode == "ulysses":  # heads shard across the ranks: H % P == 0
        h = world * draw(st.integers(1, 2))
        hk = draw(st.sampled_from([x for x in range(1, h + 1) if h % x == 0]))
    real = draw(lengths)
    cu = None
    if draw(st.booleans()):  # packed documents: the pack is the real length, cut at random points
        cuts = draw(st.lists(st.integers(0, real), max_size=6))
        if draw(st.booleans()):  # a run of 1-token documents
            cuts += list(range(draw(st.integers(0, real)), min(real, draw(st.integers(0, real)) + 12)))
        cu = sorted(set([0, real] + cuts))
    return dict(
        world=world, mode=mode, shard_layout=draw(st.sampled_from(cp.SHARD_LAYOUTS if cu else cp.LAYOUTS)),
        dtype=draw(st.sampled_from(list(fuzz_cases.DTYPES))), b=1 if cu else draw(st.integers(1, 2)), h=h, hk=hk,
        real=real, cu=cu, d=draw(head_dims), causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (-1, -1), (5, 3), (0, 0), (17, -1), (-1, 2)])),
        alibi=draw(st.booleans()), softcap=draw(st.sampled_from([0.0, 0.0, 3.0])), sinks=draw(st.booleans()),
        layout=draw(st.sampled_from(["bhsd", "bshd"])),
        storage=draw(st.sampled_from(["contig", "transposed", "sliced", "strided_seq"])),
        grad=draw(st.booleans()), seed=draw(seeds))


def _unshard(parts, positions, real):
    """Rank shards (B, H, n, ...) -> the global (B, H, real, ...) in position order."""
    x = torch.cat(parts, 2)
    order = torch.cat(positions)
    full = torch.empty_like(x)
    full[:, :, order] = x
    return full[:, :, :real]


@at_least(300)
@given(c=cp_case())
def test_fuzz_cp(groups, c):
    log_example("cp", c["mode"])
    note(c)
    world, dtype, real = c["world"], fuzz_cases.DTYPES[c["dtype"]], c["real"]
    res = _group(world).call(fuzz_cases.fuzz_rank, c)
    pos = [r["pos"] for r in res]

    t = fuzz_cases.make_inputs(c)
    win = (c["window"][0], 0) if c["causal"] else c["window"]

    cu = c["cu"] or [0, real]

    def ref(dt):
        leaves = [t[n].to(dt, copy=True).requires_grad_(c["grad"]) for n in ("q", "k", "v")]
        sinks = t["sinks"].to(dt, copy=True).requires_grad_(c["grad"]) if t["sinks"] is not None else None
        slopes = t["slopes"].float().to(dt) if t["slopes"] is not None else None
        parts = [reference.attention(*(x[:, :, a:e] for x in leaves), window=win, alibi_slopes=slopes,
                                     softcap=c["softcap"], sinks=sinks) for a, e in zip(cu[:-1], cu[1:])]
        out, lse = torch.cat([o for o, _ in parts], 2), torch.cat([l for _, l in parts], 2)  # one call per document
        grads = {}
        if c["grad"]:
            out.backward(t["g"].to(dt))
            grads = dict(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad,
                         dsinks=sinks.grad if sinks is not None else None)
        return dict(out=out.detach(), lse=lse.detach(), **grads)

    r64, low = ref(F64), ref(dtype)
    # the gradients' known limit in bf16 / fp16 (tests/fuzz/common.few_keys): finite only
    i, j = torch.arange(real).view(-1, 1), torch.arange(real).view(1, -1)
    doc = torch.searchsorted(torch.tensor(cu[1:]), torch.arange(real), right=True)
    ok = ((win[0] < 0) | (j >= i - win[0])) & ((win[1] < 0) | (j <= i + win[1])) & (doc.view(-1, 1) == doc.view(1, -1))
    exempt = dtype in LOW and (few_keys(ok) or t["sinks"] is not None)
    for what in ("out", "lse") + (("dq", "dk", "dv") if c["grad"] else ()):
        got = _unshard([r[what] for r in res], pos, real)
        assert got.dtype == (torch.float32 if what == "lse" and dtype != F64 else dtype), (what, got.dtype)
        if what in ("out", "lse"):
            check_out(got, low[what], r64[what], dtype, what)
        elif exempt:
            assert torch.isfinite(got).all(), what
        else:
            check_grad(got, low[what], r64[what], dtype, what)
    if c["grad"] and t["sinks"] is not None:  # each rank holds its queries' part of dsinks
        ds = sum(r["dsinks"] for r in res)
        if exempt:
            assert torch.isfinite(ds).all(), "dsinks"
        else:  # -sum_i P_sink,i D_i: the floor scales with the D_i-sized terms, as test_fuzz_softmax's
            terms = (r64["out"].abs() * t["g"].abs()).sum(-1).max().item() if real else 0.0
            check_grad(ds, low["dsinks"], r64["dsinks"], dtype, "dsinks",
                       max(1.0, terms / max(r64["dsinks"].abs().max().item(), 1.0)))
