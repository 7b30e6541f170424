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
            _results[world] = harness.run(stack_cases.stack_suite, world,
                                          stack_cases.STACK_CASES + stack_cases.PACKED_CASES, timeout=120)
        except harness.RankFailed as e:
            _results[world] = e
    if isinstance(_results[world], Exception):
        raise _results[world]
    return _results[world]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", stack_cases.STACK_CASES + stack_cases.PACKED_CASES)
def test_lm_context_parallel(world, name):
    failed = {r: res[name] for r, res in enumerate(_suite(world)) if res[name] is not None}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())


# -- examples/train_distributed.py: 2 ranks vs one process on the global batch -------------------

TRAIN_ARGS = ["--steps", "5", "--quiet"]
TRAIN_RUNS = {  # name -> extra options: DDP over the batch, or with --cp the sequence sharded; FSDP2 likewise
    "ddp": [],
    "cp-zigzag": ["--cp"],
    "cp-contiguous": ["--cp", "--shard-layout", "contiguous"],
    "fsdp": ["--fsdp"],
    "fsdp-cp": ["--fsdp", "--cp"],
    "cp-packed-balanced": ["--cp", "--packed", "--shard-layout", "balanced"],  # against one process --packed
    "cp-packed-ring": ["--cp", "--packed", "--mode", "ring"],
}
_train = {}


def _train_losses():
    if not _train:
        try:
            got = harness.run(stack_cases.train_runs, 2, [TRAIN_ARGS + o for o in TRAIN_RUNS.values()], timeout=150)
            _train["ranks"] = [dict(zip(TRAIN_RUNS, r)) for r in got]
        except harness.RankFailed as e:
            _train["ranks"] = e
        main = stack_cases._example().main
        _train["one"] = main(TRAIN_ARGS)  # one process (no group), the global batch
        _train["one-packed"] = main(TRAIN_ARGS + ["--packed"])  # each document alone
    if isinstance(_train["ranks"], Exception):
        raise _train["ranks"]
    return _train["ranks"], _train["one"], _train["one-packed"]


@pytest.mark.parametrize("name", list(TRAIN_RUNS))
def test_train_example(name):
    ranks, one, one_packed = _train_losses()
    if "--packed" in TRAIN_RUNS[name]:
        one = one_packed
    assert len(one) == 5 and all(isinstance(x, float) for x in one)
    for r, res in enumerate(ranks):
        got = res[name]
        assert isinstance(got, list), f"rank {r}: {got}"
        assert len(got) == len(one)
        for step, (a, b) in enumerate(zip(got, one)):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"rank {r} step {step}: loss {a} vs one process {b}"
    assert one[-1] < one[0], "the loss should fall over 5 steps"
