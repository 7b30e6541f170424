"""The ranks' agreement before context parallelism's collectives (attention_ext/distributed/agree.py),
on 2 gloo ranks: ranks that pass different shapes, dtypes, options or modes, or a bad argument on
one rank only, raise a ValueError on EVERY rank (naming the argument and each rank's value, or
the rank whose own error names it) instead of hanging, aborting in the transport or returning a
wrong result; the group stays usable for the next call. check_ranks=False runs no exchange."""
import re

import pytest

from attention_ext import distributed as cp
from tests.distributed import agree_cases, harness

_results = {}


def _suite():
    if "r" not in _results:
        try:
            _results["r"] = harness.run(agree_cases.suite, 2, timeout=240)
        except harness.RankFailed as e:
            _results["r"] = e
    if isinstance(_results["r"], Exception):
        raise _results["r"]
    return _results["r"]


# name -> (rank 0's message, rank 1's): regexes
_DIFFERENT = {
    "heads differ": r"passed different k, v \(k: rank 0 '\(1, 2, 8, 8\) float32 on cpu', rank 1 '\(1, 1, 8, 8\)",
    "lengths differ": r"passed different q, k, v",
    "dtypes differ": r"passed different q, k, v .*rank 1 '\(1, 2, 8, 8\) float64",
    "dropout on one rank": r"passed different dropout_p \(dropout_p: rank 0 0\.1, rank 1 0\.0\)",
    "grad on one rank": r"passed different q, k, v \(q: rank 0 '\(1, 2, 8, 8\) float32 on cpu requiring grad'",
    "documents differ": r"passed different cu_seqlens \(cu_seqlens: rank 0 \(0, 5, 16\), rank 1 \(0, 9, 16\)\)",
}
_ONE_BAD = {"bad sinks on one rank": r"sinks must be \(H,\) = \(2,\), got \(3,\)",
            "3-D q on one rank": r"q must be a 4-D tensor"}
CASES = {f"{m}: {n}": (rx, rx) for m in cp.MODES for n, rx in _DIFFERENT.items()}
CASES.update({f"{m}: {n}": (r"rank 1 of the group rejected its arguments", rx)
              for m in cp.MODES for n, rx in _ONE_BAD.items()})
CASES.update({f"{m}: the same bad heads everywhere": (r"multiple of (kv|the KV) heads",) * 2 for m in cp.MODES})
CASES.update({
    "mode differs": (r"passed different mode \(mode: rank 0 'allgather', rank 1 'ring'\)",) * 2,
    "linear: value widths differ": (r"passed different v \(v: rank 0 '\(1, 2, n, 8\) float32 on cpu', "
                                    r"rank 1 '\(1, 2, n, 5\)",) * 2,
    "linear: bad decay on one rank": (r"rank 1 of the group rejected", r"decay must be this rank's"),
    "delta: key widths differ": (r"passed different q, k",) * 2,
    "delta: initial state on one rank": (r"passed different initial_state",) * 2,
    "ring: the same bad heads, rank 1's rows all padding": (r"multiple of kv heads",) * 2,
    "dropout_p left out on rank 0, 0 on rank 1": ("ok",) * 2,  # the options as built agree
    "different entry points": (r"called different context-parallel functions",) * 2,
    "ring_attention and context_parallel_attention(mode='ring')": ("ok",) * 2,
    "linear: feature map widths differ": (r"passed different feature_map \(feature_map: rank 0 \('Favor', "
                                          r"'head_dim=8, nb_features=16",) * 2,
    "linear: a float key_mask with documents on one rank": (r"rank 1 of the group rejected", r"."),
})


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_rank_raises_and_the_group_goes_on(name):
    for rank, res in enumerate(_suite()):
        kind, msg, after_ok = res[name]
        if CASES[name][rank] == "ok":
            assert kind == "ok", (rank, kind, msg)
        elif name.endswith("float key_mask with documents on one rank") and rank == 1:
            assert kind != "ok", (rank, kind, msg)  # this rank's own error (torch's, for a float mask & bool)
        else:
            assert kind == "ValueError" and re.search(CASES[name][rank], msg), (rank, kind, msg)
        assert after_ok, f"rank {rank}: the call after {name!r} failed"


def test_the_suite_has_every_case():
    assert set(_suite()[0]) == set(CASES)


def test_check_ranks_false_runs_no_exchange():
    got = harness.run(agree_cases.counted_suite, 2, timeout=120)
    for res in got:
        assert res == {"softmax check_ranks=True": 1, "softmax check_ranks=False": 0,
                       "linear check_ranks=False": 0}, res


def test_context_parallel_checks_its_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        cp.ContextParallel(mode="bogus")
    assert cp.ContextParallel(check_ranks=False).check_ranks is False
