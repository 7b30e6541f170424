"""Packed documents under context parallelism (cu_seqlens): the plan of kernel calls
(attention_ext/distributed/documents.py) against the pair rule, the balanced shard layout, the
argument checks, and every mode on 2, 3 and 4 gloo ranks against flash_attn_varlen_func on the
whole pack in one process (tests/distributed/documents_cases.py)."""
import itertools
import random

import pytest
import torch

from attention_ext import distributed as cp
from attention_ext.distributed import documents
from attention_ext.distributed.sharding import balanced_positions, shard_work
from tests.distributed import documents_cases, harness


# -- the plan, no process group --------------------------------------------------------------------

def _covered(calls, pq, pk, n_heads=1):
    """{(query row, key index): times covered} of a plan, each call's pairs through its own rule:
    the kernel's window about its diagonal, or its mask."""
    seen = {}
    for c in calls:
        rows = list(range(c.rows.start, c.rows.stop)) if isinstance(c.rows, slice) else c.rows.tolist()
        cols = list(range(c.cols.start, c.cols.stop)) if isinstance(c.cols, slice) else c.cols.tolist()
        assert len(set(rows)) == len(rows), "a query row twice in one call (its results merge per row)"
        if c.cu_q is not None:
            segs = list(zip(c.cu_q.tolist()[:-1], c.cu_q.tolist()[1:], c.cu_k.tolist()[:-1], c.cu_k.tolist()[1:]))
        else:
            segs = [(0, len(rows), 0, len(cols))]
        for q0, q1, k0, k1 in segs:
            sq, sk = q1 - q0, k1 - k0
            diag = sk - sq if c.bottom_right else 0
            wl, wr = c.window
            for i in range(sq):
                for j in range(sk):
                    if c.mask is not None:
                        m = c.mask[0, 0, q0 + i, k0 + j]
                        ok = bool(m) if m.dtype == torch.bool else bool(m > float("-inf"))
                    else:
                        ok = (wr < 0 or j <= i + diag + wr) and (wl < 0 or j >= i + diag - wl)
                    if ok:
                        key = (rows[q0 + i], cols[k0 + j])
                        seen[key] = seen.get(key, 0) + 1
                    if c.mask is None and c.window != (-1, -1) or c.alibi:
                        # a kernel rule must put the pair at its global distance
                        assert (j - i - diag) == (pk[cols[k0 + j]] - pq[rows[q0 + i]]), "misaligned diagonal"
    return seen


def _expected(pq, pk, cu, wl, wr):
    real = cu[-1]
    doc = lambda t: max(i for i in range(len(cu) - 1) if cu[i] <= t)  # noqa: E731
    want = {}
    for i, a in enumerate(pq):
        for j, b in enumerate(pk):
            if a < real and b < real and doc(a) == doc(b) and (wr < 0 or b - a <= wr) and (wl < 0 or b - a >= -wl):
                want[(i, j)] = 1
    return want


def _draw(rng: random.Random):
    world = rng.randint(1, 4)
    lens = [rng.choice([0, 1, 2, 3, 5, 9, 17, 40]) for _ in range(rng.randint(1, 6))]
    cu = [0] + list(itertools.accumulate(lens))
    if cu[-1] == 0:
        cu = [0, 1]
    s = -(-cu[-1] // (2 * world)) * 2 * world + 2 * world * rng.randint(0, 1)  # a multiple for every layout
    return world, cu, s, rng.choice(cp.SHARD_LAYOUTS)


@pytest.mark.parametrize("seed", range(200))
def test_plan_covers_each_allowed_pair_once(seed):
    """Random documents, shard layouts, windows, visiting shards: the plan's calls cover exactly the
    pairs of one document the window allows, each once, and every kernel-side rule is aligned."""
    rng = random.Random(seed)
    world, cu, s, shard_layout = _draw(rng)
    wl, wr = rng.choice([(-1, -1), (-1, 0), (3, 0), (2, 5), (0, 0), (4, -1)])
    alibi = torch.rand(2) if rng.random() < 0.3 else None
    r, owner = rng.randrange(world), rng.randrange(world)
    pos = [cp.global_positions(s, rank=x, world_size=world, shard_layout=shard_layout, cu_seqlens=cu)
           for x in range(world)]
    for pq, pk in ((pos[r], pos[owner]), (pos[r], torch.arange(cu[-1]))):  # ring's step, allgather's keys
        for dropout in (None, (1, 2, 2, 0)):
            calls = documents.plan(pq, pk, cu, wl, wr, alibi, torch.float32, "cpu", dropout=dropout)
            got = _covered(calls, pq.tolist(), pk.tolist())
            assert got == _expected(pq.tolist(), pk.tolist(), cu, wl, wr)
            if dropout is not None:
                assert all(c.coords is not None and c.cu_q is None for c in calls), "dropout: one document per call"


def test_plan_never_repeats_a_row_in_a_call():
    """A query run that meets two key runs of its document, clipped differently by the window
    (zigzag's own shard: chunks 0 and 3 of one document), gives two pieces with overlapping rows:
    they go to different calls, whose results merge per row (found by the fuzz)."""
    pos = [cp.global_positions(8, rank=r, world_size=2, shard_layout="zigzag") for r in range(2)]  # 0 1 6 7, 2 3 4 5
    for wl, wr in ((5, 3), (6, 6), (-1, -1)):
        for pq, pk in itertools.product(pos, pos):
            calls = documents.plan(pq, pk, [0, 7], wl, wr, None, torch.float32, "cpu")
            assert _covered(calls, pq.tolist(), pk.tolist()) == _expected(pq.tolist(), pk.tolist(), [0, 7], wl, wr)


def test_plan_groups_runs_into_varlen_calls():
    """Causal documents on a contiguous shard: every document's queries in ONE varlen call, with no
    mask; the ring's own shard likewise."""
    cu = [0, 7, 20, 21, 40, 64]
    pq = cp.global_positions(64, rank=0, world_size=1, shard_layout="contiguous")
    calls = documents.plan(pq, torch.arange(64), cu, -1, 0, None, torch.float32, "cpu")
    assert len(calls) == 1 and calls[0].cu_q is not None and calls[0].mask is None
    assert calls[0].cu_q.tolist() == cu and calls[0].bottom_right


# -- the balanced layout ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(40))
def test_balanced_partitions_in_order(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 5)
    lens = [rng.choice([1, 2, 3, 7, 50, 300, 1000]) for _ in range(rng.randint(1, 20))]
    cu = [0] + list(itertools.accumulate(lens))
    s = -(-cu[-1] // world) * world + world * rng.randint(0, 3)
    shards = balanced_positions(s, world, tuple(cu))
    assert sorted(t for p in shards for t in p) == list(range(s)), "not a partition of the positions"
    assert all(len(p) == s // world for p in shards), "unequal token counts"
    assert all(list(p) == sorted(p) for p in shards), "a shard out of order"


@pytest.mark.parametrize("world", (2, 3, 4))
def test_balanced_work_on_a_skewed_pack(world):
    """One document of 6k tokens and 64 of 32 (the issue's skew): max / mean work within 1% under
    "balanced", where zigzag is 1.77x and contiguous 1.11-2.2x."""
    cu = [0, 6144] + [6144 + 32 * i for i in range(1, 65)]
    s = -(-cu[-1] // (2 * world)) * 2 * world
    work = shard_work(s, world, "balanced", cu)
    assert max(work) / (sum(work) / world) < 1.01
    zz = shard_work(s, world, "zigzag", cu)
    assert max(zz) / (sum(zz) / world) > 1.5


def test_balanced_needs_documents():
    with pytest.raises(ValueError, match="cu_seqlens"):
        cp.global_positions(16, rank=0, world_size=2, shard_layout="balanced")


@pytest.mark.parametrize("cu, match", [
    (torch.tensor([[0, 4]]), "1-D int32 / int64"),
    (torch.tensor([0.0, 4.0]), "1-D int32 / int64"),
    ([1, 4], "start at 0"),
    ([0], "start at 0"),
    ([0, 5, 3], "non-decreasing"),
    ([0, 17], "past the sequence's 16"),
])
def test_cu_seqlens_errors(cu, match):
    with pytest.raises(ValueError, match=match):
        cp.global_positions(16, rank=0, world_size=2, shard_layout="balanced", cu_seqlens=cu)


@pytest.mark.parametrize("cu", [[0, 10.7, 16], "abc"])
def test_cu_seqlens_takes_ints_only(cu):
    """Offsets that are not ints are refused, never truncated (10.7 is not 10)."""
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int tensor or a sequence of ints"):
        cp.global_positions(16, rank=0, world_size=2, shard_layout="balanced", cu_seqlens=cu)
    with pytest.raises(TypeError, match="cu_seqlens"):
        cp.ContextParallel().with_documents(cu)


def test_with_documents_checks_the_offsets():
    with pytest.raises(ValueError, match="non-decreasing"):
        cp.ContextParallel().with_documents([0, 5, 3])
    assert cp.ContextParallel().with_documents(torch.tensor([0, 5, 9])).cu_seqlens == (0, 5, 9)


# -- every mode on live groups ---------------------------------------------------------------------

WORLD_SIZES = (2, 3, 4)
TABLE = harness.CaseTable(documents_cases.suite, WORLD_SIZES, list(documents_cases.CASE_FNS), timeout=600)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", list(documents_cases.CASE_FNS))
def test_documents(world, name):
    TABLE.check(world, name)


def test_linear_unequal_shards_raise_on_every_rank():
    got = harness.run(documents_cases.uneven_linear, 2, timeout=120)
    assert all("shards of one length" in e for e in got), got
