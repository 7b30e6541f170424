"""The sanitized build's canaries (ATTENTION_EXT_SANITIZE=1, run by `./dev.sh sanitize`): each
commits one defect in C++ (csrc/torch/library.cpp, compiled in only with ATTN_SANITIZE) in a
subprocess, which must end with the sanitizer's report and a non-zero exit. A clean sanitized run
is evidence only if these pass: they prove ASan and UBSan were live and fatal. In the normal build
the canaries are not compiled in and these tests skip; test_normal_build_has_no_canaries checks
that."""
import os
import subprocess
import sys

import pytest

from attention_ext import _ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SANITIZED = _ext.HAS_EXT and getattr(_ext._C, "sanitize", 0) == 1
needs_sanitized = pytest.mark.skipif(
    not SANITIZED, reason="normal build: the canaries exist only in the sanitized build (./dev.sh sanitize)")


def _run(code):
    # the environment as inherited: LD_PRELOAD=libasan, ASAN_OPTIONS, UBSAN_OPTIONS (dev.sh)
    res = subprocess.run([sys.executable, "-c", "import attention_ext._C as C; " + code],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    return res.returncode, res.stdout + res.stderr


@needs_sanitized
def test_asan_reports_heap_overflow():
    rc, out = _run("print('survived', C._canary_heap_overflow())")
    assert rc != 0, out
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in out, out
    assert "canary_heap_overflow" in out, out  # symbolized stack through our frame
    assert "survived" not in out, out


@needs_sanitized
def test_ubsan_reports_shift_overflow():
    rc, out = _run("print('survived', C._canary_shift_overflow(40))")
    assert rc != 0, out
    assert "runtime error: shift exponent 40 is too large for 32-bit type 'int'" in out, out
    assert "survived" not in out, out


@needs_sanitized
def test_canaries_silent_without_the_defect():
    # the same calls in bounds / without overflow: the reports above come from the defect alone
    rc, out = _run("print('ok', C._canary_shift_overflow(5))")
    assert rc == 0 and "ok 32" in out, out


@pytest.mark.skipif(not _ext.HAS_EXT, reason="compiled extension not built")
@pytest.mark.skipif(SANITIZED, reason="sanitized build")
def test_normal_build_has_no_canaries():
    assert getattr(_ext._C, "sanitize", 0) == 0  # an extension built before the switch has none
    assert not hasattr(_ext._C, "_canary_heap_overflow")
    assert not hasattr(_ext._C, "_canary_shift_overflow")
