#!/usr/bin/env bash
# Does a source change leave the default kernels' machine code alone? Compiles instantiation
# files (paths under csrc/, without .cu) at a base git ref and at the working tree, with
# setup.py's nvcc flags for sm_80 and sm_90a, and diffs `cuobjdump -sass` with instruction
# addresses and the source path stripped. Exit 0 when every file's SASS is identical. Both trees
# must have the file at the same path; across a move, compare whole builds with
# tools/sass_compare.py.
#
#   tools/check_sass_identity.sh [BASE_REF] [FILE ...]
#   (default: HEAD, softmax/cuda/instantiations/fwd_bf16_hd128 .../bwd_bf16_hd128)
#
# Environment: CUDA_HOME (/usr/local/cuda), CUOBJDUMP (cuobjdump from PATH or CUDA_HOME/bin);
# cuobjdump -sass needs nvdisasm on PATH. One nvcc at a time: about 30 s per file.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BASE=${1:-HEAD}
shift || true
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=(softmax/cuda/instantiations/fwd_bf16_hd128 softmax/cuda/instantiations/bwd_bf16_hd128)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || echo "$CUDA_HOME/bin/cuobjdump")}
TORCH_INC=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

mkdir -p "$WORK/base" "$WORK/head"
git -C "$ROOT" archive "$BASE" csrc | tar -x -C "$WORK/base"
cp -r "$ROOT/csrc" "$WORK/head/"

sass() {  # sass TREE FILE -> stdout
  local tree=$1 f=$2
  "$CUDA_HOME/bin/nvcc" -DATTN_WITH_CUDA '-DATTN_CUDA_ARCHS="8.0;9.0"' -DATTN_CUDA_HAVE_SM90A \
    -I"$tree/csrc" $TORCH_INC -I"$CUDA_HOME/include" -c "$tree/csrc/$f.cu" -o "$WORK/$(basename "$f").o" \
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
    -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr --compiler-options -fPIC -O3 -lineinfo \
    -Xptxas=-warn-spills -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a \
    -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -std=c++20 2>/dev/null
  "$CUOBJDUMP" -sass "$WORK/$(basename "$f").o" | sed -E 's@/\*[0-9a-f]{4,}\*/@@g; /identifier = /d'
}

rc=0
for f in "${FILES[@]}"; do
  b=$(basename "$f")
  sass "$WORK/base" "$f" > "$WORK/$b.base.sass"
  sass "$WORK/head" "$f" > "$WORK/$b.head.sass"
  n=$(grep -c "Function :" "$WORK/$b.head.sass" || true)
  if cmp -s "$WORK/$b.base.sass" "$WORK/$b.head.sass"; then
    echo "$f: SASS identical ($n kernels, $(wc -l < "$WORK/$b.head.sass") lines, sm_80 + sm_90a)"
  else
    echo "$f: SASS DIFFERS from $BASE"
    diff "$WORK/$b.base.sass" "$WORK/$b.head.sass" | head -20
    rc=1
  fi
done
exit $rc
