import collections
import os
import sys
import warnings
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings

# One seed for the torch inputs of a whole run, printed in the header. The default is fixed, so a
# run (CI's above all) is reproducible and a landing never depends on the draw;
# ATTENTION_EXT_TEST_SEED=random draws fresh inputs, =<n> replays the run that printed n.
_SEED_ENV = os.environ.get("ATTENTION_EXT_TEST_SEED", "0")
SEED = torch.randint(0, 2**31 - 1, (1,)).item() if _SEED_ENV == "random" else int(_SEED_ENV)
os.environ["ATTENTION_EXT_TEST_SEED"] = str(SEED)  # pytest-xdist workers start after this: one seed for all

# A pytest-xdist worker (./dev.sh test runs one per core) takes its share of the cores for torch's
# intra-op threads, so that the workers together do not oversubscribe the machine; the tests of
# thread counts set theirs themselves
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# ATTENTION_EXT_LINEAR_STANDIN=1: the linear ops from reference.py where the extension lacks them
# (defined before attention_ext is imported: its ops.py reads the registry at import)
if os.environ.get("ATTENTION_EXT_LINEAR_STANDIN") == "1":
    from tests.linear import standin

    standin.define_ops()

# Hypothesis profiles. "ci" is the default of every run (the normal suite): derandomized, so a run
# is reproducible and a failure replays, with a few hundred fuzz examples across the families;
# "long" draws fresh examples, 10,000 per fuzz test (one per family):
#     pytest tests/fuzz --hypothesis-profile=long
# deadline None: an example's time depends on its drawn sizes and on the load of the machine.
_HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
           HealthCheck.filter_too_much]
settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None, suppress_health_check=_HEALTH,
                          print_blob=True)
settings.register_profile("long", derandomize=False, max_examples=10_000, deadline=None,
                          suppress_health_check=_HEALTH, print_blob=True)
settings.load_profile("ci")  # --hypothesis-profile (read later, in pytest_configure) overrides it

FAMILIES = ("softmax", "linear", "sparse", "decode")
DEVICES = ("cpu", "cuda", "cuda-emulated")


def pytest_addoption(parser):
    parser.addoption(
        "--reference-only", action="store_true", default=False,
        help="run without the compiled extension (it is not imported even where it is built): the kernel "
             "tests skip and the functional layers run the pure-PyTorch references. Without this option a "
             "missing extension stops the session, so that a run that tested no kernel cannot pass.")


_REFERENCE_ONLY = pytest.StashKey[bool]()


class _BlockExtension:
    """sys.meta_path finder that makes attention_ext._C unimportable (--reference-only)."""

    def find_spec(self, name, path=None, target=None):
        if name == "attention_ext._C":
            raise ImportError("attention_ext._C not loaded: pytest --reference-only")
        return None


def pytest_configure(config):
    # Decided here, before any test module imports attention_ext: when the extension is missing the
    # kernel tests skip one by one and the ops fall back to the references, so a run against an
    # unbuilt source tree (e.g. after a non-editable `pip install .`) would report success.
    reference_only = config.getoption("reference_only")
    if reference_only:
        if "attention_ext._ext" in sys.modules:
            from attention_ext import _ext
            if _ext.HAS_EXT:
                raise pytest.UsageError("--reference-only: attention_ext was imported with its compiled extension "
                                        "before the option was read (by a plugin?)")
        else:
            sys.meta_path.insert(0, _BlockExtension())
    with warnings.catch_warnings():  # _ext's fallback warning: the error below says it, once
        warnings.simplefilter("ignore", RuntimeWarning)
        from attention_ext import _ext

    if not _ext.HAS_EXT and not reference_only:
        raise pytest.UsageError(
            "attention_ext: the compiled extension (attention_ext._C) is not built or does not load: "
            f"{_ext.IMPORT_ERROR!r}\n"
            "Every kernel test would skip. Build it in this source tree: `./dev.sh build` "
            "(or `pip install -e . --no-build-isolation`).\n"
            "To test the pure-PyTorch references only, on purpose: pytest --reference-only")
    config.stash[_REFERENCE_ONLY] = reference_only


# Markers of opt-in tests (minutes, or several GB): collected always, run only when the -m
# expression names them (`pytest -m bigmem`), so the default suite stays fast on any machine.
OPT_IN = ("bigmem", "int64_big")


def pytest_collection_modifyitems(config, items):
    chosen = config.getoption("-m") or ""
    for item in items:
        for name in OPT_IN:
            if item.get_closest_marker(name) is not None and name not in chosen:
                item.add_marker(pytest.mark.skip(reason=f"opt-in: pytest -m {name}"))


def _mode_line(config):
    if config.stash.get(_REFERENCE_ONLY, False):
        return "attention_ext: REFERENCE ONLY (--reference-only): compiled extension not loaded, kernel tests skip"
    return "attention_ext: compiled extension loaded"


def pytest_report_header(config):
    return [f"attention_ext test seed: ATTENTION_EXT_TEST_SEED={SEED}", _mode_line(config)]


@pytest.fixture(autouse=True)
def _seed(request):
    # crc32, not hash(): str hashes change with PYTHONHASHSEED, so a printed seed would not replay
    torch.manual_seed(SEED + zlib.crc32(request.node.nodeid.encode()) % 100003)
    yield


def family_device(nodeid):
    """(family, device) of a test from its path: tests/<family>/test_cuda.py runs on "cuda",
    tests/cuda_emu/test_<family>_emulated.py on "cuda-emulated" (test_emulated.py is softmax's), any
    other file under tests/<family>/ on "cpu"; the rest (top-level tests, tests/cpp, ...) is
    ("other", "cpu")."""
    parts = nodeid.split("::", 1)[0].replace("\\", "/").split("/")
    if "tests" in parts:  # relative to the rootdir, or to a temporary tree's root
        parts = parts[len(parts) - 1 - parts[::-1].index("tests"):]
    if len(parts) == 3 and parts[1] == "cuda_emu" and parts[2].endswith("_emulated.py"):
        family = parts[2][len("test_"):-len("_emulated.py")] or "softmax"
        return (family if family in FAMILIES else "other"), "cuda-emulated"
    if len(parts) >= 3 and parts[1] in FAMILIES:
        return parts[1], ("cuda" if parts[-1] == "test_cuda.py" else "cpu")
    return "other", "cpu"


# outcome buckets of the table: errors count as failed, xfail as skipped, xpass as passed
_BUCKET = {"passed": "passed", "xpassed": "passed", "failed": "failed", "error": "failed",
           "skipped": "skipped", "xfailed": "skipped"}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Tests per family and device, printed also under -q (the CI command) so that a run in which a
    family or device ran nothing is visible."""
    outcome = {}  # nodeid -> bucket; a failure in any phase wins over the phase's other outcomes
    for key, bucket in _BUCKET.items():
        for rep in terminalreporter.stats.get(key, ()):
            nodeid = getattr(rep, "nodeid", None)
            if nodeid and outcome.get(nodeid) != "failed":
                outcome[nodeid] = bucket
    if not outcome:
        return
    counts = collections.defaultdict(collections.Counter)
    for nodeid, bucket in outcome.items():
        counts[family_device(nodeid)][bucket] += 1
    order = {f: i for i, f in enumerate(FAMILIES + ("other",))}
    rows = sorted(counts, key=lambda fd: (order.get(fd[0], len(order)), fd[0], DEVICES.index(fd[1])))
    tr = terminalreporter
    tr.write_sep("-", "tests per family and device")
    tr.write_line(f"{'family':<8} {'device':<14} {'passed':>7} {'failed':>7} {'skipped':>8}")
    for fd in rows:
        c = counts[fd]
        tr.write_line(f"{fd[0]:<8} {fd[1]:<14} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}")
    tr.write_line(_mode_line(config))
