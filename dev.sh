#!/usr/bin/env bash
# One entry point from a fresh clone: installs what is missing, builds when sources changed, runs.
#   ./dev.sh demo [args]   the main job: python -m attention_ext demo
#   ./dev.sh test [args]   the test suite (pytest)
#   ./dev.sh bench [args]  the CPU benchmark table (benchmarks/softmax/bench_cpu.py)
#   ./dev.sh build         (re)build the extension
# Environment: PYTHON (default python3), MAX_JOBS, ATTENTION_EXT_CUDA=0/1, TORCH_CUDA_ARCH_LIST,
# ATTENTION_EXT_NATIVE=1 (adds a -march=native CPU level; see setup.py).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

deps() {
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.14.1"
  fi
  "$PY" -m pip install -q ninja pybind11 numpy tqdm matplotlib pytest hypothesis expecttest "transformers>=4.53"
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

cmd=${1:-demo}
shift || true
case "$cmd" in
  build) deps; build ;;
  demo) deps; ensure_built; exec "$PY" -m attention_ext demo "$@" ;;
  test) deps; ensure_built; exec "$PY" -m pytest tests -q -p no:cacheprovider "$@" ;;
  bench) deps; ensure_built; exec "$PY" benchmarks/softmax/bench_cpu.py "$@" ;;
  *) echo "usage: ./dev.sh demo|test|bench|build" >&2; exit 2 ;;
esac
