"""Context parallelism (attention_ext.distributed) on 2, 3 and 4 gloo ranks on the CPU.

One spawned group per world size runs every case (tests/distributed/cases.py: shard / unshard
round trips, then context_parallel_attention vs the single-process attention for every sharding and
option, forward, LSE and gradients, with the number of collectives per call); the tests below
report the cases one by one. The sharding arithmetic and the argument errors need no group.
"""
import pytest
import torch

from attention_ext import distributed as cp
from tests.distributed import cases, harness

WORLD_SIZES = (2, 3, 4)
_results = {}


def _suite(world):
    """The cases' results on every rank, run once per world size."""
    if world not in _results:
        try:
            _results[world] = harness.run(cases.suite, world, cases.ATTN_CASES, timeout=150)
        except harness.RankFailed as e:
            _results[world] = e
    if isinstance(_results[world], Exception):
        raise _results[world]
    return _results[world]


def _assert_case(world, name):
    failed = {r: res[name] for r, res in enumerate(_suite(world)) if res[name] is not None}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("shard_layout", cp.LAYOUTS)
def test_roundtrip(world, shard_layout):
    _assert_case(world, f"roundtrip-{shard_layout}")


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", cases.ATTN_CASES)
def test_attention(world, name):
    _assert_case(world, name)


@pytest.mark.parametrize("name", cases.GROUP_CASES)
def test_subgroups(name):
    """4 ranks split into two groups of 2, each running context parallelism on its own."""
    _assert_case(4, f"group-{name}")


# -- no process group needed ---------------------------------------------------------------------

@pytest.mark.parametrize("world", (1, 2, 3, 4))
@pytest.mark.parametrize("shard_layout", cp.LAYOUTS)
def test_positions_partition(world, shard_layout):
    s = 2 * world * 3
    pos = [cp.global_positions(s, rank=r, world_size=world, shard_layout=shard_layout) for r in range(world)]
    assert all(p.numel() == s // world for p in pos)
    assert torch.equal(torch.sort(torch.cat(pos)).values, torch.arange(s))
    if shard_layout == "zigzag":  # equal causal work: the same sum of query positions on every rank
        assert len({int(p.sum()) for p in pos}) == 1


@pytest.mark.parametrize("world", (1, 2, 3, 4))
@pytest.mark.parametrize("shard_layout", cp.LAYOUTS)
def test_real_rows(world, shard_layout):
    """real_rows counts a shard's positions below seq_len, and they are its first rows (the
    padding a suffix), for every padded length: context_parallel_attention computes only those."""
    from attention_ext.distributed.sharding import real_rows
    m = cp.sequence_multiple(world, shard_layout)
    for s in (m, 2 * m, 5 * m):
        for seq_len in range(1, s + 1):
            for r in range(world):
                real = cp.global_positions(s, rank=r, world_size=world, shard_layout=shard_layout) < seq_len
                nr = real_rows(seq_len, s, rank=r, world_size=world, shard_layout=shard_layout)
                assert nr == int(real.sum()) and bool(real[:nr].all()), (s, seq_len, r)


def test_positions_values():
    assert cp.global_positions(8, rank=1, world_size=2, shard_layout="zigzag").tolist() == [2, 3, 4, 5]
    assert cp.global_positions(8, rank=0, world_size=2, shard_layout="zigzag").tolist() == [0, 1, 6, 7]
    assert cp.global_positions(6, rank=1, world_size=3, shard_layout="stripe").tolist() == [1, 4]
    assert cp.global_positions(6, rank=2, world_size=3, shard_layout="contiguous").tolist() == [4, 5]


def test_length_rule():
    with pytest.raises(ValueError, match="pad_to_multiple"):
        cp.global_positions(10, rank=0, world_size=3, shard_layout="zigzag")
    with pytest.raises(ValueError, match="shard_layout"):
        cp.global_positions(8, rank=0, world_size=2, shard_layout="ring")
    x = torch.randn(2, 10, 3)
    xp, n = cp.pad_to_multiple(x, 1, 6)
    assert n == 10 and xp.shape == (2, 12, 3) and torch.equal(xp[:, :10], x) and not xp[:, 10:].any()
    assert cp.pad_to_multiple(x, 1, 5)[0] is x
    assert cp.sequence_multiple(3, "zigzag") == 6 and cp.sequence_multiple(3, "stripe") == 3


@pytest.mark.parametrize("mode", ["allgather", "ring", "ulysses"])
@pytest.mark.parametrize("p", [1.0, -0.1])
def test_dropout_p_range(mode, p):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        cp.context_parallel_attention(q, q, q, mode=mode, dropout_p=p)


def test_harness_fails_fast():
    """A rank that raises while the others wait in a barrier fails the run with its traceback."""
    with pytest.raises(harness.RankFailed, match="deliberate failure on rank 1"):
        harness.run(cases.fail_on, 2, 1, timeout=60)
