"""Builds and runs the plain C++ unit tests (tests/cpp), without torch: the shared policy, RNG and
split-KV merge, the split-KV heuristic, and the CPU SIMD transpose and triangular gemm."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("name,flags", [("test_policy", []), ("test_split_merge", []), ("test_heuristics", []),
                                        ("test_simd", []), ("test_simd", ["-march=native"])])
def test_cpp(tmp_path, name, flags):
    exe = tmp_path / name
    subprocess.run(["g++", "-std=c++20", "-O1", *flags, "-I", os.path.join(ROOT, "csrc"),
                    os.path.join(ROOT, "tests", "cpp", name + ".cpp"), "-o", str(exe)], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
