"""Context-parallel delta rule (attention_ext.distributed.context_parallel_delta_rule_attention)
on 2, 3 and 4 gloo ranks on the CPU, against delta_rule_attention on the whole sequence in one
process (float64): DeltaNet, Gated DeltaNet and KDA gates, gates of -inf / -1e9 / -1e4, grouped
values, initial and final states, qk_l2norm, bshd, odd and one-token shards; forward, every
gradient and the collectives per call (tests/distributed/delta_cases.py). One spawn of 4 ranks
serves the three group sizes, as in test_linear_cp.py."""
import pytest
import torch

from attention_ext import distributed as cp
from tests.distributed import delta_cases, harness

WORLD_SIZES = (2, 3, 4)
TABLE = harness.CaseTable(delta_cases.suite, WORLD_SIZES, list(delta_cases.CASES))


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", list(delta_cases.CASES))
def test_delta_cp(world, name):
    TABLE.check(world, name)


# -- no process group needed: the argument checks come before any collective ------------------------

def _args():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 6)
    return q, k, v, torch.rand(1, 2, 4)


@pytest.mark.parametrize("shard_layout", ["zigzag", "stripe"])
def test_layout_not_contiguous(shard_layout):
    with pytest.raises(ValueError, match="contiguous"):
        cp.context_parallel_delta_rule_attention(*_args(), shard_layout=shard_layout)


def test_bad_beta_names_it():
    q, k, v, _ = _args()
    with pytest.raises(ValueError, match="beta"):
        cp.context_parallel_delta_rule_attention(q, k, v, torch.rand(1, 2, 5))


def test_not_a_tensor():
    q, k, v, beta = _args()
    with pytest.raises(TypeError, match="beta"):
        cp.context_parallel_delta_rule_attention(q, k, v, 0.5)


def test_bad_layout_value():
    with pytest.raises(ValueError, match="layout"):
        cp.context_parallel_delta_rule_attention(*_args(), layout="sbhd")
