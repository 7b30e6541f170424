#!/usr/bin/env bash
# One entry point from a fresh clone: installs what is missing, builds when sources changed, runs.
#   ./dev.sh demo [args]   the main job: python -m attention_ext demo
#   ./dev.sh test [args]   the test suite (pytest)
#   ./dev.sh bench [args]  the CPU benchmark table (benchmarks/softmax/bench_cpu.py)
#   ./dev.sh build         (re)build the extension
#   ./dev.sh sanitize [args]  ASan + UBSan: build a sanitized copy in build/sanitize/tree and run
#                          the CPU kernel tests there (test paths given replace the default slice)
# Environment: PYTHON (default python3), MAX_JOBS, ATTENTION_EXT_CUDA=0/1, TORCH_CUDA_ARCH_LIST,
# ATTENTION_EXT_NATIVE=1 (adds a -march=native CPU level; see setup.py).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

deps() {
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.14.1"
  fi
  "$PY" -m pip install -q ninja pybind11 numpy tqdm matplotlib pytest pytest-xdist hypothesis expecttest "transformers>=4.53"
  if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
  fi
}

build() {
  local t0
  t0=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -n 3
  echo "attention_ext build time: $(( $(date +%s) - t0 )) s"
}

ensure_built() {
  local so
  so=$(ls attention_ext/_C*.so 2>/dev/null | head -n 1 || true)
  if [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -type f | head -n 1)" ] ||
     ! "$PY" -c "import attention_ext._C" 2>/dev/null; then
    build
  fi
}

# The sanitized extension is built in a copy of the tree (the files git tracks or would track), so
# the in-place attention_ext/_C*.so stays the normal build; the copy keeps its own ninja objects
# and its files' mtimes, so a second run recompiles only what changed.
SAN_TREE=build/sanitize/tree
SAN_TESTS=(tests/sanitizers tests/softmax/test_cpu.py tests/softmax/test_exact.py tests/linear/test_cpu.py
           tests/linear/test_step.py tests/linear/test_delta.py tests/sparse/test_kernels.py tests/decode/test_cpu.py
           tests/decode/test_kvcache.py)

sanitize_build() {
  local t0 f
  t0=$(date +%s)
  mkdir -p "$SAN_TREE"
  # sources removed since the last copy must not linger (setup.py globs csrc/)
  find "$SAN_TREE" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
  git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$SAN_TREE"
  (cd "$SAN_TREE" && ATTENTION_EXT_SANITIZE=1 ATTENTION_EXT_CUDA=0 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
     "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v -E "^(copying|running|creating|\[[0-9]+/[0-9]+\] )" | tail -n 20)
  for f in "$SAN_TREE"/attention_ext/_C*.so; do [ -e "$f" ] || { echo "sanitized build failed" >&2; exit 1; }; done
  echo "attention_ext sanitized build time: $(( $(date +%s) - t0 )) s"
}

sanitize_env() {
  local asan
  asan=$(gcc -print-file-name=libasan.so)
  [ -e "$asan" ] || { echo "libasan.so not found (gcc -print-file-name=libasan.so)" >&2; exit 1; }
  # libstdc++ beside it: Python does not link it, so ASan's __cxa_throw interceptor finds no real
  # __cxa_throw at start-up and CHECK-fails at the first C++ exception of a later-loaded library
  # (triton's, imported by torch.compile and opcheck)
  export LD_PRELOAD="$asan $(gcc -print-file-name=libstdc++.so.6)"
  # Python and torch leak by design at exit; halt at the first report so that it fails the test
  export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:detect_odr_violation=0
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:exitcode=87:suppressions=$PWD/tests/sanitizers/ubsan.supp
}

cmd=${1:-demo}
shift || true
case "$cmd" in
  build) deps; build ;;
  demo) deps; ensure_built; exec "$PY" -m attention_ext demo "$@" ;;
  # -n auto: one pytest-xdist worker per core (at most 8), each with cores / workers torch
  # threads (tests/conftest.py); -n 0 runs in this process
  # no path: pyproject's testpaths (tests/); paths given replace it, options alone (-k) apply to it
  test) deps; ensure_built; exec "$PY" -m pytest -q -p no:cacheprovider -n auto --maxprocesses=8 "$@" ;;
  bench) deps; ensure_built; exec "$PY" benchmarks/softmax/bench_cpu.py "$@" ;;
  sanitize)
    deps; sanitize_build; sanitize_env
    # test paths given replace the slice; options alone (-k EXPR, -rs) apply to it: the value of an
    # option that takes one as the next argument (-k decode) is not a path
    paths=0 value=0
    for a in "$@"; do
      if [ $value = 1 ]; then value=0; continue; fi
      case $a in -k|-m|-p|-o|-n|-c|--deselect|--ignore|--maxfail|--hypothesis-profile) value=1 ;; -*) ;; *) paths=1 ;; esac
    done
    [ $paths = 1 ] || set -- "$@" "${SAN_TESTS[@]}"
    cd "$SAN_TREE"
    # --capture=sys: a report is written to fd 2 by the dying process, which pytest's default
    # fd capture would swallow with the rest of the test's output
    exec "$PY" -m pytest -q -p no:cacheprovider --capture=sys "$@" ;;
  *) echo "usage: ./dev.sh demo|test|bench|build|sanitize" >&2; exit 2 ;;
esac
