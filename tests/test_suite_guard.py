"""tests/conftest.py's session-wide behaviour, by pytest runs in a subprocess on tiny temporary tests:
the suite refuses to pass without the compiled extension (attention_ext._C made unimportable by a
sys.meta_path finder, as in a source tree where it was never built), and the summary table of tests
per family and device."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import family_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# blocks the extension the way a missing .so does (ImportError from `from . import _C`), then runs
# pytest with tests/conftest.py as a plugin (-p tests.conftest: the temporary tree has no conftest)
RUNNER = textwrap.dedent("""
    import sys
    import pytest

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "attention_ext._C":
                raise ImportError("blocked by test_suite_guard")

    if sys.argv[1] == "block":
        sys.meta_path.insert(0, Block())
    sys.exit(pytest.main(sys.argv[2:]))
""")

TINY = textwrap.dedent("""
    import pytest
    import torch

    import attention_ext as ae
    from attention_ext import _ext, reference


    def test_reference_path():
        q = torch.randn(1, 2, 5, 8)
        torch.testing.assert_close(ae.attention(q, q, q), reference.attention(q, q, q)[0])  # (out, lse)


    @pytest.mark.skipif(not _ext.HAS_EXT, reason="compiled extension not built")
    def test_kernel():
        pass
""")


def run_pytest(tmp_path, block, *args, files=None):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for name, text in (files or {"test_tiny.py": TINY}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cmd = [sys.executable, "-c", RUNNER, "block" if block else "noblock", str(tmp_path), "-p", "tests.conftest",
           "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
           "-c", str(tmp_path / "pytest.ini"), *args]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return res.returncode, res.stdout + res.stderr


def test_missing_extension_stops_the_session(tmp_path):
    rc, out = run_pytest(tmp_path, True, "-q")
    assert rc != 0, out
    assert "compiled extension (attention_ext._C) is not built" in out, out
    assert "blocked by test_suite_guard" in out, out  # the import error
    assert "./dev.sh build" in out and "--reference-only" in out, out
    assert "passed" not in out and "skipped" not in out, out  # stopped before any test ran


def test_reference_only_runs_on_purpose(tmp_path):
    rc, out = run_pytest(tmp_path, True, "--reference-only")
    assert rc == 0, out
    assert "1 passed, 1 skipped" in out, out
    assert "REFERENCE ONLY" in out, out  # in the header and the summary


@pytest.mark.parametrize("nodeid, expected", [
    ("tests/softmax/test_cpu.py::test_fwd[float32]", ("softmax", "cpu")),
    ("tests/softmax/test_cuda.py::test_fwd", ("softmax", "cuda")),
    ("tests/sparse/test_cuda.py::test_x", ("sparse", "cuda")),
    ("tests/decode/test_generate.py::test_x", ("decode", "cpu")),
    ("tests/cuda_emu/test_emulated.py::test_x", ("softmax", "cuda-emulated")),
    ("tests/cuda_emu/test_linear_emulated.py::test_x", ("linear", "cuda-emulated")),
    ("tests/cuda_emu/test_decode_emulated.py::test_x", ("decode", "cuda-emulated")),
    ("tests/test_nn.py::test_x", ("other", "cpu")),
    ("tests/cpp/test_cpp.py::test_x", ("other", "cpu")),
])
def test_family_device(nodeid, expected):
    assert family_device(nodeid) == expected


def test_summary_table_under_q(tmp_path):
    """The CI command's -q still prints the table; counts per family and device, failures included.
    Also: --reference-only does not load the extension where it is built (no blocker here)."""
    ok = "def test_a():\n    pass\n\ndef test_b():\n    pass\n"
    files = {
        "tests/softmax/test_cpu.py": ok,
        "tests/softmax/test_cuda.py": "import pytest\n\n@pytest.mark.skip(reason='no GPU')\ndef test_a():\n    pass\n",
        "tests/cuda_emu/test_linear_emulated.py": ok + "\ndef test_c():\n    assert False\n",
        "tests/test_top.py": ok,
    }
    rc, out = run_pytest(tmp_path, False, "-q", "--import-mode=importlib", "--reference-only", files=files)
    assert rc == 1, out
    table = out[out.index("tests per family and device"):].splitlines()
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in table[2:6]}
    assert rows == {("softmax", "cpu"): ["2", "0", "0"], ("softmax", "cuda"): ["0", "0", "1"],
                    ("linear", "cuda-emulated"): ["2", "1", "0"], ("other", "cpu"): ["2", "0", "0"]}, out
    assert table[1].split() == ["family", "device", "passed", "failed", "skipped"], out
    assert "REFERENCE ONLY" in table[6], out
