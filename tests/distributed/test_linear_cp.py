"""Context-parallel linear attention (attention_ext.distributed.context_parallel_linear_attention)
on 2, 3 and 4 gloo ranks on the CPU.

One spawn of 4 gloo ranks runs every case of tests/distributed/linear_cases.py on the world (4)
and on the subgroups of ranks {0, 1, 2} and {0, 1} (3 and 2): spawning is most of the time on a
busy machine, so the three world sizes share one spawn (and `group=` is exercised). The cases
cover causal and non-causal, decay, elu / relu / unstabilized and stabilized FAVOR+, key padding
masks (a shard with no real key among them), MHA / GQA / MQA, odd and unequal shard lengths,
initial states (with and without a log_scale) and final states, and bshd, comparing the forward,
the gradients and the collectives per call (the stabilizer's all-reduce included) against
linear_attention on the whole sequence in one process; the tests below report them one by one.
The argument errors need no group.
"""
import pytest
import torch

from attention_ext import distributed as cp
from attention_ext.linear import LinearAttentionState
from tests.distributed import harness, linear_cases

WORLD_SIZES = (2, 3, 4)
TABLE = harness.CaseTable(linear_cases.suite, WORLD_SIZES, list(linear_cases.CASES))


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", list(linear_cases.CASES))
def test_linear_cp(world, name):
    TABLE.check(world, name)


# -- no process group needed: the argument checks come before any collective ------------------------

def _qkv():
    return torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)


@pytest.mark.parametrize("shard_layout", ["zigzag", "stripe"])
def test_layout_not_contiguous(shard_layout):
    with pytest.raises(ValueError, match="contiguous"):
        cp.context_parallel_linear_attention(*_qkv(), shard_layout=shard_layout)


def test_bad_layout_name():
    with pytest.raises(ValueError, match="shard_layout must be one of"):
        cp.context_parallel_linear_attention(*_qkv(), shard_layout="ring")


def test_decay_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="causal"):
        cp.context_parallel_linear_attention(q, k, v, causal=False, decay=torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=r"\(B, H, n\)"):
        cp.context_parallel_linear_attention(q, k, v, decay=torch.zeros(2))  # no per-head scalar form
    with pytest.raises(ValueError, match=r"\(B, H, n, M\) = \(1, 2, 4, 8\)"):  # per feature: M = the map's width
        cp.context_parallel_linear_attention(q, k, v, decay=torch.zeros(1, 2, 4, 5))


def test_key_mask_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"key_mask must be this rank's \(B, n\)"):
        cp.context_parallel_linear_attention(q, k, v, key_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_mask must be this rank's \(B, n\)"):
        cp.context_parallel_linear_attention(q, k, v, key_mask=torch.ones(1, 2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_mask must be bool"):
        cp.context_parallel_linear_attention(q, k, v, key_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="key_mask must be this rank's"):  # bshd: still (B, n)
        cp.context_parallel_linear_attention(*(t.transpose(1, 2) for t in (q, k, v)), layout="bshd",
                                             key_mask=torch.ones(1, 2, dtype=torch.bool))


def test_initial_state_log_scale_shape():
    # the state checks its own log_scale when made; one changed afterwards meets the CP check
    with pytest.raises(ValueError, match=r"log_scale must be \(1, 2\)"):
        LinearAttentionState(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8), torch.zeros(2))
    s = LinearAttentionState(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2))
    s.log_scale = torch.zeros(2)
    with pytest.raises(ValueError, match=r"initial_state.log_scale must be \(B, H\)"):
        cp.context_parallel_linear_attention(*_qkv(), initial_state=s)
