"""Context-parallel linear attention (attention_ext.distributed.context_parallel_linear_attention)
on 2, 3 and 4 gloo ranks on the CPU.

One spawned group per world size runs every case of tests/distributed/linear_cases.py (causal and
non-causal, decay, elu / relu / unstabilized FAVOR+, MHA / GQA / MQA, odd and unequal shard
lengths, initial and final states, bshd; forward, gradients and the collectives per call, against
linear_attention on the whole sequence in one process); the tests below report the cases one by
one. The argument errors need no group.
"""
import pytest
import torch

from attention_ext import distributed as cp
from attention_ext.linear.feature_maps import Favor
from tests.distributed import harness, linear_cases

WORLD_SIZES = (2, 3, 4)
_results = {}


def _suite(world):
    """The cases' results on every rank, run once per world size."""
    if world not in _results:
        try:
            _results[world] = harness.run(linear_cases.suite, world, list(linear_cases.CASES), timeout=120)
        except harness.RankFailed as e:
            _results[world] = e
    if isinstance(_results[world], Exception):
        raise _results[world]
    return _results[world]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", list(linear_cases.CASES))
def test_linear_cp(world, name):
    failed = {r: res[name] for r, res in enumerate(_suite(world)) if res[name] is not None}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())


# -- no process group needed: the argument checks come before any collective ------------------------

def _qkv():
    return torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)


@pytest.mark.parametrize("layout", ["zigzag", "stripe"])
def test_layout_not_contiguous(layout):
    with pytest.raises(ValueError, match="contiguous"):
        cp.context_parallel_linear_attention(*_qkv(), layout=layout)


def test_bad_layout_name():
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.context_parallel_linear_attention(*_qkv(), layout="ring")


def test_decay_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="causal"):
        cp.context_parallel_linear_attention(q, k, v, causal=False, decay=torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=r"\(B, H, n\)"):
        cp.context_parallel_linear_attention(q, k, v, decay=torch.zeros(2))  # no per-head scalar form


def test_stabilized_favor_not_built():
    with pytest.raises(NotImplementedError, match="stabilize"):
        cp.context_parallel_linear_attention(*_qkv(), feature_map=Favor(8, seed=0))
