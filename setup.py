"""Build attention_ext._C: the CPU kernels always, the CUDA kernels when torch has CUDA and nvcc
is found. Environment switches:

  ATTENTION_EXT_CUDA=0/1     force the CUDA kernels off / on (default: auto)
  ATTENTION_EXT_NATIVE=1     also build the CPU kernels with -march=native, a level the run-time
                             dispatch prefers where it runs (the build machine's CPU); the default
                             build runs on any x86-64 CPU (see _cpu_levels)
  ATTENTION_EXT_SANITIZE=1   CPU-only build under AddressSanitizer + UBSan (-O1 -g) of the highest
                             CPU level the build machine runs; it defines ATTN_SANITIZE, which
                             compiles in the test-only canaries. Importing it needs libasan
                             preloaded: `./dev.sh sanitize` builds it in a copy of the tree
                             (build/sanitize/tree) and runs the tests there
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
import platform
import re
import shlex
import shutil
import subprocess
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


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _cpu_flags():
    """Flags of every CPU translation unit: the torch bindings, the dispatcher and each level's
    kernels (which add the level's own). x86: the baseline every x86-64 CPU has, whatever the
    compiler's default."""
    return ["-O3", "-fopenmp", "-fno-math-errno", "-Wno-unknown-pragmas"] + (
        ["-march=x86-64", "-mtune=generic"] if _X86 else [])


# The CPU kernels' ISA levels, lowest first, with their flags (csrc/cpu/isa.h): each is compiled
# from the same sources into its own namespace, and csrc/cpu/dispatch.h runs the highest one
# the CPU supports (attention_ext.set_cpu_isa forces a lower one).
_X86_LEVELS = [
    ("base", []),  # any x86-64 (_cpu_flags): SSE2, 4 floats per instruction
    ("avx2", ["-mavx2", "-mfma", "-mf16c"]),  # Haswell, Zen 1 and later: 8 floats
    ("avx512", ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]),  # 16 floats
    # + bf16 dot products (Zen 4, Cooper Lake, Sapphire Rapids): the softmax bf16 path (cpu/bf16dot.h);
    # + VNNI int8 dot products, which every AVX512-BF16 CPU has: the int8 Q K^T (cpu/q8dot.h)
    ("avx512bf16", ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-mavx512vnni"]),
]
_NATIVE = ("native", ["-march=native", "-mtune=native"])  # after _cpu_flags' -march: this one wins


def _isa_macros(cxx, flags):
    """The x86 feature macros (__AVX2__, ...) the compiler defines under `flags`."""
    out = subprocess.run([cxx, "-x", "c++", "-E", "-dM", *flags, "-"], input="", capture_output=True, text=True,
                         check=True).stdout
    return set(re.findall(r"#define (__(?:SSE|AVX|FMA|F16C|BMI|POPCNT|LZCNT|MOVBE)\w*__) 1", out))


def _cpu_levels(cxx):
    """[(level, flags)], lowest first. The link keeps the first copy of an inline function that
    several levels' objects emit out of line (a std:: one: our own are per-level, csrc/cpu/isa.h),
    so the levels are linked in this order and each includes the ones before it: a level's code
    then only ever calls a copy compiled for itself or a level below. That is also why native
    (ATTENTION_EXT_NATIVE=1) comes last and is built only beside the levels -march=native includes
    (no avx512 level next to a native AVX2 one)."""
    levels = list(_X86_LEVELS) if _X86 else [("base", [])]
    if _sanitizing():
        # a sanitized build is a test tool for this machine, and ~4x slower to compile per level:
        # only the highest level the build machine runs (the one its tests dispatch to)
        if _X86:
            here = _isa_macros(cxx, _cpu_flags() + _NATIVE[1])
            levels = [lv for lv in levels if _isa_macros(cxx, _cpu_flags() + lv[1]) <= here]
        return levels[-1:]
    if os.environ.get("ATTENTION_EXT_NATIVE", "0").lower() in ("0", "false", "off", "no", ""):
        return levels
    if _X86:
        native = _isa_macros(cxx, _cpu_flags() + _NATIVE[1])
        levels = [lv for lv in levels if _isa_macros(cxx, _cpu_flags() + lv[1]) <= native]
    return levels + [_NATIVE]


def _cpu_kernel_sources():
    """The CPU kernels (no torch headers), compiled once per level: csrc/<family>/cpu/*.cpp (each
    registers its kernels in its family's dispatch stubs, csrc/cpu/dispatch.h) and the level's
    description (csrc/cpu/level.cpp)."""
    return sorted(glob.glob("csrc/*/cpu/*.cpp")) + ["csrc/cpu/level.cpp"]


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
    whole stacks at a tolerable speed; the kernels are built for the highest level the machine
    runs (_cpu_levels), the one its tests dispatch to. UBSan stays recoverable: its suppressions
    (tests/sanitizers/ubsan.supp) apply only to recoverable checks, and UBSAN_OPTIONS=
    halt_on_error=1 makes every unsuppressed report fatal. ATTN_SANITIZE compiles in the
    test-only canaries (csrc/torch/library.cpp)."""
    if not _sanitizing():
        return cxx, link, macros
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
    cxx = [f for f in cxx if not f.startswith("-O")] + ["-O1"] + san
    return cxx, link + san, macros + [("ATTN_SANITIZE", None)]


def _sources():
    """(CPU sources, CUDA sources) of the extension itself: the CPU kernels' dispatcher and the
    torch bindings in csrc/torch (the CPU kernels are built per level, _cpu_kernel_sources);
    csrc/<family>/cuda/**/*.cu (instantiations/ included), *_cuda.cpp with the CUDA ones."""
    torch_cpp = sorted(glob.glob("csrc/torch/*.cpp"))
    cpu = ["csrc/cpu/dispatch.cpp"] + [f for f in torch_cpp if not f.endswith("_cuda.cpp")]
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


def _ninja_path(p):
    return p.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


class BuildExtensionWithLevels(BuildExtension):
    """torch's BuildExtension, first compiling the CPU kernels once per ISA level with the level's
    flags (torch's build has one flag set per extension), then linking them into the extension
    as extra objects, after its own and lowest level first (_cpu_levels). Incremental like
    torch's: a ninja file in build_temp."""

    def build_extensions(self):
        cxx = _cxx()
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        # as torch's compile of the other .cpp files: Python's compiler flags (-O3 -DNDEBUG -fPIC ...)
        cflags, _, macros = _sanitize(_cpu_flags(), [], [])  # the kernels are what a sanitized build is for
        common = [*self.compiler.compiler_so[1:], "-std=c++20", *cflags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                  *[f"-D{m}" for m, _ in macros], "-I" + os.path.join(HERE, "csrc")]
        root = os.path.abspath(os.path.join(self.build_temp, "cpu_levels"))
        os.makedirs(root, exist_ok=True)
        lines = ["ninja_required_version = 1.3", f"builddir = {_ninja_path(root)}", f"cxx = {shlex.quote(cxx)}",
                 "rule cxx", "  command = $cxx -MMD -MF $out.d $flags -c $in -o $out", "  depfile = $out.d",
                 "  deps = gcc", ""]
        objects, commands = [], []
        for level, flags in _cpu_levels(cxx):
            args = common + flags + [f"-DATTN_CPU_ISA={level}"]
            for src in _cpu_kernel_sources():
                obj = os.path.join(root, level, src.replace("/", "_").replace(".cpp", ".o"))
                os.makedirs(os.path.dirname(obj), exist_ok=True)
                src = os.path.join(HERE, src)
                lines += [f"build {_ninja_path(obj)}: cxx {_ninja_path(src)}",
                          "  flags = " + " ".join(shlex.quote(a) for a in args)]
                objects.append(obj)
                commands.append([cxx, *args, "-c", src, "-o", obj])
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        ninja = shutil.which("ninja")
        if ninja:
            with open(os.path.join(root, "build.ninja"), "w") as f:
                f.write("\n".join(lines) + "\n")
            subprocess.run([ninja, "-C", root, "-j", jobs], check=True)
        else:
            for cmd in commands:
                print(" ".join(cmd))
                subprocess.run(cmd, check=True)
        for ext in self.extensions:
            ext.extra_objects = objects + list(ext.extra_objects or [])
        super().build_extensions()


def _cxx():
    # the compiler torch's ninja build uses for the .cpp files
    return os.environ.get("CXX", "c++")


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtensionWithLevels.with_options(use_ninja=True)},
)
