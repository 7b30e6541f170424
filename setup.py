"""Build attention_ext._C: the CPU kernels always, the CUDA kernels when torch has CUDA and nvcc
is found. Environment switches:

  ATTENTION_EXT_CUDA=0/1     force the CUDA kernels off / on (default: auto)
  ATTENTION_EXT_NATIVE=0     portable CPU build (no -march=native)
  ATTENTION_EXT_SANITIZE=1   CPU-only build under AddressSanitizer + UBSan (-O1 -g); it defines
                             ATTN_SANITIZE, which compiles in the test-only canaries. Importing it
                             needs libasan preloaded: `./dev.sh sanitize` builds it in a copy of the
                             tree (build/sanitize/tree) and runs the tests there
  TORCH_CUDA_ARCH_LIST       CUDA archs; default "8.0;9.0+PTX" when no GPU is visible. A 9.0 cubin
                             is built as sm_90a (the wgmma forward needs it; same GPUs, same cost)
  ATTENTION_EXT_CUDA_SKIP=bwd,hdim256,hopper
                             faster developer builds: compile out the CUDA backward (bwd), a
                             head-dim bucket (hdim64 / hdim128 / hdim256: it then runs on the SIMT
                             kernels) or the sm_90a wgmma kernels (hopper: plain sm_90 cubins); a
                             call that needs what was left out raises
  MAX_JOBS                   parallel compile jobs (ninja)
"""
import glob
import os
import shutil
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _find_cuda_home():
    # torch's own guess from `which nvcc` is /usr/local here, which has no lib64: look first
    # where toolkits live.
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.exists(os.path.join(cand, "bin", "nvcc")):
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.isdir(os.path.join(root, "lib64")) or os.path.isdir(os.path.join(root, "targets")):
            return root
    return None


_cuda_home = _find_cuda_home()
if _cuda_home:
    os.environ["CUDA_HOME"] = _cuda_home  # before cpp_extension reads it at import

try:
    import torch  # noqa: E402
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402
except ImportError as e:
    # the kernels compile against the torch that will run them, so pip's isolated build env (a
    # fresh torch) is the wrong one: say so in one line instead of a traceback
    sys.exit(f"attention_ext: torch must be installed before building (it compiles against your torch; {e}): "
             "pip install torch, then pip install --no-build-isolation .")


def _want_cuda():
    flag = os.environ.get("ATTENTION_EXT_CUDA", "auto").lower()
    have = torch.version.cuda is not None and _cuda_home is not None
    if flag in ("0", "false", "off", "no"):
        return False
    if flag in ("1", "true", "on", "yes"):
        if not have:
            sys.exit("ATTENTION_EXT_CUDA=1 but torch has no CUDA or nvcc was not found (set CUDA_HOME)")
        return True
    return have


def _arch_list():
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not archs:
        # torch's auto-detection needs a visible GPU and crashes on an empty list
        archs = "8.0;9.0+PTX"
        if torch.cuda.is_available():
            caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
            archs = ";".join(f"{a}.{b}" for a, b in caps)
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    return archs


_SKIPPABLE = ("bwd", "hdim64", "hdim128", "hdim256", "hopper")


def _skips():
    """The parts ATTENTION_EXT_CUDA_SKIP (comma-separated) compiles out."""
    parts = {x.strip().lower() for x in os.environ.get("ATTENTION_EXT_CUDA_SKIP", "").split(",") if x.strip()}
    bad = parts - set(_SKIPPABLE)
    if bad:
        sys.exit(f"ATTENTION_EXT_CUDA_SKIP: unknown part(s) {sorted(bad)}; choose from {', '.join(_SKIPPABLE)}")
    return parts


def _skip_hopper():
    return "hopper" in _skips()


def _gencode_flags():
    """nvcc -gencode flags for TORCH_CUDA_ARCH_LIST as torch makes them, except that the 9.0 cubin
    is built for sm_90a: wgmma and setmaxnreg (csrc/softmax/cuda/sm90/) exist only there,
    an sm_90a cubin runs on the same GPUs as an sm_90 one, and building it instead of sm_90 (not
    beside it) costs no extra compile pass and leaves the loader one cubin to pick on an H100.
    "+PTX" keeps the portable compute_XX PTX for newer GPUs. Returns (flags, has_sm90a)."""
    from torch.utils.cpp_extension import _get_cuda_arch_flags  # private, same since torch 1.x

    flags = _get_cuda_arch_flags()
    if not _skip_hopper():
        flags = [f.replace("arch=compute_90,code=sm_90", "arch=compute_90a,code=sm_90a") for f in flags]
    flags = sorted(set(flags))
    return flags, any("code=sm_90a" in f for f in flags)


def _cpu_flags():
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-Wno-unknown-pragmas"]
    if os.environ.get("ATTENTION_EXT_NATIVE", "1") != "0":
        flags.append("-march=native")
    return flags


def _sanitizing():
    """ATTENTION_EXT_SANITIZE=1 (CPU-only: nvcc objects would be uninstrumented, and the CUDA
    driver's address-space reservations clash with ASan's shadow memory)."""
    on = os.environ.get("ATTENTION_EXT_SANITIZE", "0").lower() in ("1", "true", "on", "yes")
    if on and os.environ.get("ATTENTION_EXT_CUDA", "auto").lower() in ("1", "true", "on", "yes"):
        sys.exit("ATTENTION_EXT_SANITIZE=1 builds the CPU kernels only: unset ATTENTION_EXT_CUDA=1")
    return on


def _sanitize(cxx, link, macros):
    """The CPU compile / link flags and macros recompiled under ASan + UBSan when
    ATTENTION_EXT_SANITIZE=1, unchanged otherwise. -O1 -g and frame pointers give reports with
    whole stacks at a tolerable speed; -march=native stays as the default build has it
    (ATTENTION_EXT_NATIVE), so the same SIMD paths run. UBSan stays recoverable: its suppressions
    (tests/sanitizers/ubsan.supp) apply only to recoverable checks, and UBSAN_OPTIONS=
    halt_on_error=1 makes every unsuppressed report fatal. ATTN_SANITIZE compiles in the
    test-only canaries (csrc/torch/library.cpp)."""
    if not _sanitizing():
        return cxx, link, macros
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
    cxx = [f for f in cxx if not f.startswith("-O")] + ["-O1"] + san
    return cxx, link + san, macros + [("ATTN_SANITIZE", None)]


def _sources():
    """(CPU sources, CUDA sources). Family first: csrc/<family>/cpu/*.cpp and
    csrc/<family>/cuda/**/*.cu (instantiations/ included); the torch bindings in csrc/torch,
    *_cuda.cpp with the CUDA ones."""
    torch_cpp = sorted(glob.glob("csrc/torch/*.cpp"))
    cpu = sorted(glob.glob("csrc/*/cpu/*.cpp")) + [f for f in torch_cpp if not f.endswith("_cuda.cpp")]
    cuda = sorted(glob.glob("csrc/*/cuda/**/*.cu", recursive=True)) + [f for f in torch_cpp if f.endswith("_cuda.cpp")]
    return cpu, cuda


def extensions():
    cpu_sources, cuda_sources = _sources()
    cxx, link, define_macros = _sanitize(_cpu_flags(), ["-fopenmp"], [])
    if _want_cuda() and not _sanitizing():
        archs = _arch_list()
        define_macros += [("ATTN_WITH_CUDA", None), ("ATTN_CUDA_ARCHS", '"' + archs + '"')]
        nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-Xptxas=-warn-spills"]
        # explicit -gencode flags: torch then adds none of its own
        gencode, has_sm90a = _gencode_flags()
        nvcc += gencode
        if has_sm90a:
            define_macros.append(("ATTN_CUDA_HAVE_SM90A", None))
        # the generated instantiation files and the dispatch test these macros
        define_macros += [("ATTN_CUDA_SKIP_" + part.upper(), None) for part in sorted(_skips())]
        if os.environ.get("NVCC_THREADS"):
            nvcc.append(f"--threads={os.environ['NVCC_THREADS']}")
        return [
            CUDAExtension(
                "attention_ext._C",
                cpu_sources + cuda_sources,
                include_dirs=[os.path.join(HERE, "csrc")],
                define_macros=define_macros,
                extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                extra_link_args=["-fopenmp"],
            )
        ]
    return [
        CppExtension(
            "attention_ext._C",
            cpu_sources,
            include_dirs=[os.path.join(HERE, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
    ]


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
