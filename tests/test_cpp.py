"""Builds and runs the plain C++ unit tests (tests/cpp): the shared policy and RNG, without torch."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_policy_cpp(tmp_path):
    exe = tmp_path / "test_policy"
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", os.path.join(ROOT, "csrc"),
                    os.path.join(ROOT, "tests", "cpp", "test_policy.cpp"), "-o", str(exe)], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
