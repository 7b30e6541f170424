"""The context-parallel stack (attention_ext.nn / models with context_parallel) on 2 and 3 gloo
ranks, and examples/train_distributed.py on 2 ranks against one process.

One spawned group per world size runs every stack case (tests/distributed/stack_cases.py): the
LanguageModel on this rank's sequence shard vs the full sequence in one process (logits, loss,
all-reduced parameter gradients; fp32, 1e-5), contiguous and zigzag, causal, with RoPE, learned
positions, ALiBi + sinks, a sliding window and GQA. The training test runs the example's main()
for a few steps: data parallel (DDP), context parallel, FSDP2, each against one process on the
global batch.
"""
import pytest

from tests.distributed import harness, stack_cases

WORLD_SIZES = (2, 3)
_results = {}


def _suite(world):
    if world not in _results:
        try:
            _results[world] = harness.run(stack_cases.stack_suite, world, stack_cases.STACK_CASES, timeout=120)
        except harness.RankFailed as e:
            _results[world] = e
    if isinstance(_results[world], Exception):
        raise _results[world]
    return _results[world]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", stack_cases.STACK_CASES)
def test_lm_context_parallel(world, name):
    failed = {r: res[name] for r, res in enumerate(_suite(world)) if res[name] is not None}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
