"""Builds and runs the plain C++ unit tests (tests/cpp), without torch: the shared policy, RNG and
split-KV merge, the split-KV heuristic, the fp8 e4m3 encoding, the CPU SIMD transpose and triangular gemm, and the bf16
dot product's emulation against the instruction (on CPUs with AVX512-BF16); and
compiles the CPU kernels for a baseline ISA."""
import glob
import os
import platform
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _has_avx512bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read().split()
    except OSError:
        return False


# setup.py's avx512bf16 level
BF16_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("name,flags", [("test_policy", []), ("test_split_merge", []), ("test_heuristics", []),
                                        ("test_simd", []), ("test_simd", ["-march=native"]),
                                        # -O3: where GCC contracts across statements (test_simd's exp2 check)
                                        ("test_simd", ["-march=native", "-O3"]), ("test_fp8", []),
                                        ("test_bf16dot", BF16_FLAGS)])
def test_cpp(tmp_path, name, flags):
    if name == "test_bf16dot" and (platform.machine() not in ("x86_64", "AMD64") or not _has_avx512bf16()):
        pytest.skip("this CPU has no AVX512-BF16: the instruction test_bf16dot checks its emulation against")
    exe = tmp_path / name
    subprocess.run(["g++", "-std=c++20", "-O1", *flags, "-I", os.path.join(ROOT, "csrc"),
                    os.path.join(ROOT, "tests", "cpp", name + ".cpp"), "-o", str(exe)], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("src", sorted(glob.glob(os.path.join(ROOT, "csrc", "*", "cpu", "*.cpp"))),
                         ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "csrc")))
def test_cpu_kernels_compile_portable(src):
    """The base ISA level (baseline x86-64, no AVX / FMA; csrc/cpu/isa.h) compiles every
    CPU kernel: code that holds only with -march=native (an asm register constraint that fits an
    AVX register, an intrinsic outside its #if) fails here, not on a user's machine."""
    arch = "-march=x86-64" if platform.machine() in ("x86_64", "AMD64") else "-march=armv8-a"
    res = subprocess.run(["g++", "-std=c++20", "-O1", "-fopenmp", arch, "-DATTN_CPU_ISA=base", "-I",
                          os.path.join(ROOT, "csrc"), "-c", src, "-o", os.devnull], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
