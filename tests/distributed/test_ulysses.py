"""context_parallel_attention(mode="ulysses") on 2, 3 and 4 gloo ranks on the CPU.

One spawned group per world size runs every case (tests/distributed/cases.py: ulysses_suite):
each sharding x option (causal, window, ALiBi, sinks, softcap, GQA with split / replicated /
straddling KV heads, bshd, odd lengths, bf16) against the single-process fused kernel on the whole
sequence, forward, LSE and every gradient, with 2 all-to-alls forward and 2 backward counted;
then the H % P error. The tests below report the cases one by one.
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
            _results[world] = harness.run(cases.ulysses_suite, world, cases.U_CASES, timeout=150)
        except harness.RankFailed as e:
            _results[world] = e
    if isinstance(_results[world], Exception):
        raise _results[world]
    return _results[world]


def _assert_case(world, name):
    failed = {r: res[name] for r, res in enumerate(_suite(world)) if res[name] is not None}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", cases.U_CASES)
def test_ulysses(world, name):
    _assert_case(world, name)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_heads_not_divisible(world):
    _assert_case(world, "errors")


@pytest.mark.parametrize("name", cases.U_GROUP_CASES)
def test_ulysses_subgroups(name):
    """4 ranks split into two groups of 2, each running ulysses on its own."""
    _assert_case(4, f"group-{name}")


# -- no process group needed ---------------------------------------------------------------------


@pytest.mark.parametrize("hq,hk,world", [(8, 4, 2), (8, 2, 4), (8, 1, 4), (6, 2, 3), (12, 3, 4), (6, 3, 2)])
def test_kv_head_rule(hq, hk, world):
    """Every local query head gets its own KV head: local head i uses local KV head i // gl."""
    from attention_ext.distributed.ulysses import kv_heads_for_rank
    h, g = hq // world, hq // hk
    for r in range(world):
        ids, gl = kv_heads_for_rank(hq, hk, r, world)
        assert h % gl == 0 and len(ids) == h // gl
        assert all(ids[i // gl] == (r * h + i) // g for i in range(h))
        if hk % world == 0:  # split: each KV head on one rank only
            assert ids == list(range(r * hk // world, (r + 1) * hk // world))
