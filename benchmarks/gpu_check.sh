#!/usr/bin/env bash
# One command for the GPU verification of the CUDA kernels:
#   build -> CUDA tests -> benchmark -> ncu -> compute-sanitizer (memcheck, racecheck) -> table.
# The sm_90a wgmma forward and backward (the default on sm_90; attention_ext.softmax.set_cuda_kernels(
# hopper_fwd=0, hopper_bwd=0) selects the mma.sync kernels there instead) have their own stage, "hopper": their SASS in the built .so, their tests (tests/softmax/test_cuda.py -k
# hopper), and the reference-shape timing (benchmarks/softmax/bench_cuda.py --ref); the ncu and
# sanitize stages also run them.
#
# The "tune" stage (not in the default list) builds a second copy of the tree with
# -DATTN_TUNING under a temp dir (the default build stays as it is), checks every candidate of
# csrc/softmax/cuda/tuning.cuh (FwdAlt, BwdAlt) with tests/softmax/test_cuda.py -k tune_candidate,
# then times them all against SDPA flash (benchmarks/softmax/bench_cuda.py --tune); about 5 minutes on 16 cores.
#
#   bash benchmarks/gpu_check.sh                  # everything
#   STAGES="build hopper" bash benchmarks/gpu_check.sh
#   STAGES="sm80" bash benchmarks/gpu_check.sh    # the compute_80 PTX, JIT-compiled on the GPU (~5 min)
#   STAGES=tune bash benchmarks/gpu_check.sh      # TUNE_FWD=0-7 TUNE_BWD=0-12 by default
#
# Logs go to $OUT (default /tmp/gpu_check; at most 8 files: summary, build, res_usage, test,
# bench log + table, ncu, sanitizer). The short summary is printed last.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test hopper families graphs models bench fbench ncu sanitize fsanitize rprobe"}  # + sm80, tune: see their stages
TMPD=$(mktemp -d)
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} ATTENTION_EXT_CUDA=1
export PYTHONUNBUFFERED=1
# op_args(d, **options): the op's positional options with every default filled in, shared by
# the inline scripts below (they run from $TMPD, so `from gc_common import op_args` finds it)
cat > "$TMPD/gc_common.py" <<'PY'
import math
from attention_ext.softmax import ops
def op_args(d, **o):
    opts = dict(bias=None, alibi_slopes=None, sinks=None, seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=0, max_seqlen_k=0, scale=1 / math.sqrt(d), softcap=0.0, window_left=-1,
                window_right=-1, bottom_right=False, dropout_p=0.0, seed=1, offset=0)
    opts.update({k: v for k, v in ops._OPTION_DEFAULTS.items() if k not in opts})  # dense, no top-k
    opts.update(o)
    return [opts[n] for n in ops.OPTION_NAMES]
PY
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

nvidia-smi -L | tee -a "$SUMMARY"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$SUMMARY"

if has build; then
  t0=$(date +%s)
  if timeout 420 python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
    note "build: ok in $(( $(date +%s) - t0 )) s (MAX_JOBS=$MAX_JOBS, arch $TORCH_CUDA_ARCH_LIST)"
  else
    note "build: FAILED (see build.log)"; tail -40 "$OUT/build.log"; cat "$SUMMARY"; exit 1
  fi
  
  so=$(python3 -c "import attention_ext._C as c; print(c.__file__)")
  cuobjdump -res-usage "$so" > "$OUT/res_usage.txt" 2>&1 || true
  # kernels with a local-memory (spill) footprint: LOCAL:<n> with n > 0
  nloc=$(grep -c "STACK:[1-9]" "$OUT/res_usage.txt" || true)
  note "resource usage: $(grep -c 'Function' "$OUT/res_usage.txt" || true) kernels, $nloc with a stack frame (spills; res_usage.txt)"
  grep -B1 "STACK:[1-9]" "$OUT/res_usage.txt" | grep Function | sed 's/^/  stack: /' | head -6 | tee -a "$SUMMARY" || true
fi

if has test; then
  # the wgmma forward's tests run in the hopper stage
  # (and the int8 Q.K^T forward's: tests/softmax/test_qk_int8_cuda.py)
  timeout 300 python3 -m pytest tests/softmax/test_cuda.py tests/softmax/test_qk_int8_cuda.py -k "not hopper" -q -rf \
    -p no:cacheprovider --maxfail=40 >"$OUT/test.log" 2>&1
  note "tests: $(tail -1 "$OUT/test.log")"
  grep -E "^FAILED" "$OUT/test.log" | head -15 | tee -a "$SUMMARY" || true
fi

if has hopper; then
  # the sm_90a cubin and its wgmma kernels (appended to res_usage.txt: $OUT holds at most 8 files)
  so=$(python3 -c "import attention_ext._C as c; print(c.__file__)")
  cuobjdump -lelf "$so" > "$TMPD/lelf.txt" 2>&1
  { echo "==== hopper: cuobjdump -lelf"; cat "$TMPD/lelf.txt"; } >> "$OUT/res_usage.txt"
  cuobjdump -sass -arch sm_90a "$so" > "$TMPD/sm90a.sass" 2>&1
  # mangled names: attn::hopper::fwd_kernel = ...6hopper10fwd_kernel..., likewise bwd_kernel
  for k in fwd bwd; do
    nh=$(awk -v k="hopper10${k}_kernel" '/Function :/{f = index($0, k) > 0; next} f && /HGMMA/' "$TMPD/sm90a.sass" | wc -l)
    nl=$(awk -v k="hopper10${k}_kernel" '/Function :/{f = index($0, k) > 0; next} f && /LDL|STL/' "$TMPD/sm90a.sass" | wc -l)
    nf=$(grep -c "Function : .*hopper10${k}_kernel" "$TMPD/sm90a.sass")
    # the forward's count moved with its int8 / fp8 instances (IGMMA / QGMMA for their Q.K^T)
    want=$([ $k = fwd ] && echo "> 56" || echo 112)
    note "hopper $k SASS: $nf kernels, $nh HGMMA and $nl LDL/STL (expect $want and 0)"
  done
  note "hopper SASS: $(grep -c 'sm_90a' "$TMPD/lelf.txt") sm_90a cubins"
  { echo "==== hopper tests"; } >> "$OUT/test.log"
  # the isolating checks first, under a short timeout: a hang here is the mbarrier protocol
  timeout 90 python3 -m pytest tests/softmax/test_cuda.py -k hopper_triage -q -rf -p no:cacheprovider >"$TMPD/triage.log" 2>&1
  rc=$?
  note "hopper triage: $([ $rc = 124 ] && echo 'HANG (timeout 90 s)' || tail -1 "$TMPD/triage.log")"
  grep -oE "wgmma forward triage: .*" "$TMPD/triage.log" | cut -c1-400 | sort -u | head -4 | tee -a "$SUMMARY" || true
  cat "$TMPD/triage.log" >> "$OUT/test.log"
  # timeouts sized for passing runs (the CUDA suite takes ~15 s): a device call ends at 10 min
  timeout 240 python3 -m pytest tests/softmax/test_cuda.py -k "hopper and not hopper_bwd and not triage" -q -rf -p no:cacheprovider --maxfail=20 >"$TMPD/hopper_test.log" 2>&1
  note "hopper (forward) tests: $(tail -1 "$TMPD/hopper_test.log")"
  grep -E "^FAILED" "$TMPD/hopper_test.log" | head -10 | tee -a "$SUMMARY" || true
  cat "$TMPD/hopper_test.log" >> "$OUT/test.log"
  # the wgmma backward: the smallest cases first (a hang or a wrong descriptor shows there), then all
  timeout 60 python3 -m pytest tests/softmax/test_cuda.py -k "hopper_bwd_shapes and 1-1" -x -q -rf -p no:cacheprovider >"$TMPD/hopper_bwd_test.log" 2>&1
  note "hopper backward smoke (1 x 1): $(tail -1 "$TMPD/hopper_bwd_test.log")"
  timeout 240 python3 -m pytest tests/softmax/test_cuda.py -k "hopper_bwd" -q -rf -p no:cacheprovider --maxfail=20 >>"$TMPD/hopper_bwd_test.log" 2>&1
  note "hopper backward tests: $(tail -1 "$TMPD/hopper_bwd_test.log")"
  grep -E "^FAILED" "$TMPD/hopper_bwd_test.log" | head -10 | tee -a "$SUMMARY" || true
  cat "$TMPD/hopper_bwd_test.log" >> "$OUT/test.log"
  timeout 150 python3 benchmarks/softmax/bench_cuda.py --ref >"$TMPD/ref.log" 2>&1
  note "hopper reference shape (benchmarks/softmax/bench_cuda.py --ref, rc=$?):"
  sed 's/^/  /' "$TMPD/ref.log" | tail -14 | tee -a "$SUMMARY"
fi

if has sm80; then
  # The sm_80 code path on this GPU: a second build of the tree (in $TMPD, the default build stays)
  # with only sm_80 SASS + compute_80 PTX, so the driver JIT-compiles the compute_80 PTX for the H100.
  # That runs the code an A100 runs (no sm_90 paths: no 16-byte dQ atomics, no wgmma), with the
  # sm_90 tile choices made at run time (BwdTraitsSm90) still taken. Not an A100: its timing and
  # its 163 KB shared-memory limit are not exercised (the traits' static_asserts cover the latter).
  t0=$(date +%s)
  mkdir -p "$TMPD/sm80"
  tar --exclude=./build --exclude='*.so' --exclude=./.git -cf - . | tar -xf - -C "$TMPD/sm80"
  if (cd "$TMPD/sm80" && TORCH_CUDA_ARCH_LIST="8.0+PTX" timeout 420 python3 setup.py build_ext --inplace \
        >"$TMPD/sm80_build.log" 2>&1); then
    so80=$(ls "$TMPD"/sm80/attention_ext/_C*.so)
    note "sm80 build: ok in $(( $(date +%s) - t0 )) s; cubins: $(cuobjdump -lelf "$so80" | grep -o 'sm_[0-9a]*' | sort -u | tr '\n' ' ')ptx: $(cuobjdump -lptx "$so80" | grep -o 'compute_[0-9a]*' | sort -u | tr '\n' ' ')"
    note "sm80 tests import $(cd "$TMPD/sm80" && PYTHONPATH="$TMPD/sm80" python3 -c 'import attention_ext._C as c; print(c.__file__)')"
    # the first call of each kernel JIT-compiles its PTX: a cache keeps the second test run cheap
    (cd "$TMPD/sm80" && CUDA_CACHE_MAXSIZE=4294967296 PYTHONPATH="$TMPD/sm80" timeout 480 python3 -m pytest \
        tests/softmax/test_cuda.py -k "not hopper" -q -rf -p no:cacheprovider --maxfail=20 >"$TMPD/sm80_test.log" 2>&1)
    note "sm80 (compute_80 PTX, JIT on this GPU) tests: $(tail -1 "$TMPD/sm80_test.log")"
    grep -E "^FAILED" "$TMPD/sm80_test.log" | head -10 | tee -a "$SUMMARY" || true
    { echo "==== sm80 PTX tests"; cat "$TMPD/sm80_test.log"; } >> "$OUT/test.log"
  else
    note "sm80 build: FAILED"; tail -20 "$TMPD/sm80_build.log" | tee -a "$SUMMARY"
  fi
fi

if has models; then
  # its log joins test.log: $OUT brings back at most 8 files
  timeout 120 python3 benchmarks/gpu_models_check.py >"$TMPD/models.log" 2>&1
  note "models on CUDA: rc=$? ($(grep -c '^ok' "$TMPD/models.log") ok, $(grep -c '^FAIL' "$TMPD/models.log") failed)"
  grep -E "^(ok|FAIL)" "$TMPD/models.log" | sed 's/^/  /' | tee -a "$SUMMARY"
  cat "$TMPD/models.log" >>"$OUT/test.log"
fi

if has families; then
  # the decode, linear and sparse families' CUDA tests (appended to test.log; $OUT holds at most 8 files)
  for fam in decode linear sparse; do
    timeout 240 python3 -m pytest tests/$fam/test_*cuda.py -q -rf -p no:cacheprovider --maxfail=30 >"$TMPD/fam_$fam.log" 2>&1
    note "$fam CUDA tests (rc=$?): $(tail -1 "$TMPD/fam_$fam.log")"
    grep -E "^FAILED" "$TMPD/fam_$fam.log" | cut -c1-200 | head -8 | tee -a "$SUMMARY" || true
    { echo "==== tests/$fam/test_*cuda.py"; cat "$TMPD/fam_$fam.log"; } >> "$OUT/test.log"
  done
fi

if has lbench; then
  # the linear bench alone (issue 37: the default and the chunk-state kernels against FLA and SDPA)
  timeout 150 python3 benchmarks/linear/bench_cuda.py --reps 5 --out "$TMPD/linear.md" >>"$OUT/bench.log" 2>&1
  note "linear bench: rc=$?"; cat "$TMPD/linear.md" | tee -a "$SUMMARY" >> "$OUT/bench.md" 2>/dev/null
fi

if has lncu; then
  # why the chunk-parallel linear kernels run 7-12x the static model's time (H200, 2026-11-29):
  # ncu on one forward and one backward at issue 37's shape, the stall reasons of each kernel
  cat > "$TMPD/lncu_case.py" <<'PY'
import torch, attention_ext as ae
q, k, v = (torch.randn(4, 16, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
ae.linear.set_cuda_kernels(chunk_parallel=True)
out = ae.linear_attention(q, k, v, causal=True)
out.backward(torch.randn_like(out))
ae.linear.set_cuda_kernels(chunk_states=True)  # the chunk-state kernels (chunk_fwd / chunk_bwd_kernel.cuh)
out = ae.linear_attention(q, k, v, causal=True)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
PY
  M="gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__occupancy_limit_shared_mem,launch__registers_per_thread,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"
  timeout 240 ncu --clock-control none --kernel-name-base demangled -k "regex:linear" --metrics "$M" python3 "$TMPD/lncu_case.py" >"$TMPD/lncu.log" 2>&1
  note "ncu, linear chunk-parallel (bf16, 4 x 16 x 8192 x 128, causal; rc=$?):"
  grep -E "linear|gpu__time|warps_active|hmma|dram__|grid_size|occupancy_limit|registers_per|stalled|inst_executed|bank_conflicts" "$TMPD/lncu.log" \
    | sed 's/^ */  /' | cut -c1-160 | head -120 | tee -a "$SUMMARY"
  { echo "==== ncu linear chunk-parallel"; cat "$TMPD/lncu.log"; } >> "$OUT/bench.log"
fi

if has dbench; then
  # the decode bench alone (issue 37: both CUDA decode kernels, CUDA cores and tensor cores, against
  # SDPA and the copy bandwidth, caches 4k and 32k, contiguous and paged)
  timeout 150 python3 benchmarks/decode/bench_cuda.py --quick --md "$TMPD/decode.md" >>"$OUT/bench.log" 2>&1
  note "decode bench: rc=$?"; cat "$TMPD/decode.md" | tee -a "$SUMMARY" >> "$OUT/bench.md" 2>/dev/null
fi

if has deltabench; then
  # the delta rule's CUDA forward and in-place step against FLA's Gated DeltaNet kernels (issue 38)
  timeout 150 python3 benchmarks/linear/bench_delta_cuda.py --reps 5 --out "$TMPD/delta.md" >>"$OUT/bench.log" 2>&1
  note "delta bench: rc=$?"; cat "$TMPD/delta.md" | tee -a "$SUMMARY" >> "$OUT/bench.md" 2>/dev/null
fi

if has fbench; then
  # the families' benchmarks, tables appended to bench.md (FLA's column needs its wheels: see the device README)
  timeout 240 python3 benchmarks/decode/bench_cuda.py --md "$OUT/bench.md" >>"$OUT/bench.log" 2>&1
  note "decode bench: rc=$?"
  timeout 240 python3 benchmarks/linear/bench_cuda.py --out "$TMPD/linear.md" >>"$OUT/bench.log" 2>&1
  note "linear bench: rc=$?"; cat "$TMPD/linear.md" >> "$OUT/bench.md" 2>/dev/null
  timeout 400 python3 benchmarks/sparse/bench_cuda.py ${SPARSE_ARGS:---quick} --out "$TMPD/sparse.md" >>"$OUT/bench.log" 2>&1
  note "sparse bench: rc=$?"; cat "$TMPD/sparse.md" >> "$OUT/bench.md" 2>/dev/null
fi

if has ncu; then
  cat > "$TMPD/ncu_case.py" <<'PY'
import math, torch
from attention_ext.softmax import ops
from gc_common import op_args
b, h, s, d = 4, 16, 4096, 128
args = op_args(d)
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
ops.set_cuda_kernels(hopper_fwd=0, hopper_bwd=0)  # the mma.sync kernels first
out, lse = torch.ops.attention_ext.softmax_fwd(q, k, v, *args)
torch.ops.attention_ext.softmax_bwd(do, q, k, v, out, lse, *args, False, False)
ops.set_cuda_kernels(hopper_fwd=1, hopper_bwd=0)  # the sm_90a wgmma forward, same inputs
torch.ops.attention_ext.softmax_fwd(q, k, v, *args)
ops.set_cuda_kernels(hopper_fwd=1, hopper_bwd=1)  # the sm_90a wgmma backward, same inputs
torch.ops.attention_ext.softmax_bwd(do, q, k, v, out, lse, *args, False, False)
torch.cuda.synchronize()
PY
  M="gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"
  timeout 180 ncu --clock-control none -k "regex:fwd_kernel|bwd_dkdv_kernel|bwd_kernel" --metrics "$M" \
    python3 "$TMPD/ncu_case.py" >"$OUT/ncu.log" 2>&1
  note "ncu (bf16, B=4 H=16 S=4096 D=128, non-causal; --clock-control none; tc:: = mma.sync, hopper:: = wgmma):"
  grep -E "fwd_kernel|bwd_dkdv_kernel|bwd_kernel|gpu__time|warps_active|hmma|registers_per|occupancy_limit|local_op" "$OUT/ncu.log" \
    | sed 's/^ */  /' | cut -c1-150 | tee -a "$SUMMARY"
fi

if has bench; then
  timeout 420 python3 benchmarks/softmax/bench_cuda.py ${BENCH_ARGS:-} --md "$OUT/bench.md" >"$OUT/bench.log" 2>&1
  note "bench: rc=$? (bench.log, bench.md)"
  # fp16, deterministic, GQA, window, ALiBi, softcap, sinks, bias, dropout: appended to bench.md
  timeout 240 python3 benchmarks/softmax/bench_cuda.py --options --md "$OUT/bench.md" >>"$OUT/bench.log" 2>&1
  note "bench --options: rc=$?"
  # decode steps (Sq = 1, KV cache): split-KV heuristic vs num_splits=1 vs SDPA flash, appended
  timeout 240 python3 benchmarks/softmax/bench_cuda.py --decode --md "$OUT/bench.md" >>"$OUT/bench.log" 2>&1
  note "bench --decode: rc=$?"
  # the int8 Q.K^T forward (qk_quant) against our bf16 forward and SDPA flash, appended
  timeout 180 python3 benchmarks/softmax/bench_cuda.py --qk-int8 --md "$OUT/bench.md" >>"$OUT/bench.log" 2>&1
  note "bench --qk-int8: rc=$?"
fi

if has tune; then
  # its logs join build.log, test.log and bench.log, its table the summary ($OUT: at most 8 files)
  TUNE_FWD=${TUNE_FWD:-0-7} TUNE_BWD=${TUNE_BWD:-0-12}
  TT="$TMPD/tune"
  mkdir -p "$TT"
  tar --exclude=./build --exclude=./.git --exclude='*.so' -cf - . | tar -xf - -C "$TT"
  t0=$(date +%s)
  if (cd "$TT" && NVCC_APPEND_FLAGS="-DATTN_TUNING" timeout 420 python3 setup.py build_ext --inplace) \
      >"$TMPD/tune_build.log" 2>&1; then
    note "tune build (-DATTN_TUNING, copy in $TT): ok in $(( $(date +%s) - t0 )) s"
  else
    note "tune build: FAILED (see build.log)"; tail -30 "$TMPD/tune_build.log"
  fi
  { echo "==== tune build (-DATTN_TUNING)"; cat "$TMPD/tune_build.log"; } >> "$OUT/build.log"
  mod=$(cd "$TT" && PYTHONPATH="$TT" python3 -c "import attention_ext._C as c; print(c.__file__)" 2>&1)
  if [[ "$mod" != "$TT"* ]]; then
    note "tune: attention_ext._C did not load from the tuning copy ($mod); stage skipped"
  else
    (cd "$TT" && PYTHONPATH="$TT" ATTENTION_EXT_TEST_TUNE="fwd=$TUNE_FWD bwd=$TUNE_BWD" timeout 360 \
      python3 -m pytest tests/softmax/test_cuda.py -k tune_candidate -q -rf -p no:cacheprovider --maxfail=60) \
      >"$TMPD/tune_test.log" 2>&1
    note "tune tests (fwd $TUNE_FWD, bwd $TUNE_BWD): $(tail -1 "$TMPD/tune_test.log")"
    grep -E "^FAILED" "$TMPD/tune_test.log" | sed 's/ - .*//' | head -20 | tee -a "$SUMMARY" || true
    { echo "==== tune tests"; cat "$TMPD/tune_test.log"; } >> "$OUT/test.log"
    (cd "$TT" && PYTHONPATH="$TT" timeout 420 python3 benchmarks/softmax/bench_cuda.py --tune \
      --fwd-variants "$TUNE_FWD" --bwd-variants "$TUNE_BWD") >"$TMPD/tune_bench.log" 2>&1
    note "tune bench: rc=$? (bf16, H=16, B*S=32k; ratio to SDPA flash, ! = output moved, not counted)"
    { echo "==== bench_cuda.py --tune"; cat "$TMPD/tune_bench.log"; } >> "$OUT/bench.log"
    grep -E "^\||^fwd:|^bwd:|Error|error" "$TMPD/tune_bench.log" | cut -c1-200 | tee -a "$SUMMARY"
  fi
fi

if has sanitize; then
  cat > "$TMPD/san_cases.py" <<'PY'
import math, torch
from attention_ext.softmax import ops
from gc_common import op_args
ops.set_cuda_kernels(hopper_fwd=0, hopper_bwd=0)  # the mma.sync and SIMT kernels (the wgmma ones: below)
def run(b, h, hk, sq, sk, d, dtype, deterministic=False, num_splits=1, **o):
    args = op_args(d, **o)
    q = torch.randn(b, h, sq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hk, sk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hk, sk, d, device="cuda", dtype=dtype)
    out, lse = torch.ops.attention_ext.softmax_fwd(q, k, v, *args, num_splits)
    bias_grad = o.get("bias") is not None and o["bias"].dtype == torch.float32
    g = torch.ops.attention_ext.softmax_bwd(torch.randn_like(out), q, k, v, out, lse, *args, bias_grad, deterministic)
    torch.cuda.synchronize()
bf, f16 = torch.bfloat16, torch.float16
run(1, 2, 1, 70, 130, 64, bf, window_right=0, bottom_right=True)
run(1, 2, 2, 33, 65, 128, f16, bias=torch.randn(1, 2, 33, 65, device="cuda"), dropout_p=0.2)
run(1, 2, 2, 40, 40, 256, bf, sinks=torch.randn(2, device="cuda"), deterministic=True)
run(1, 2, 1, 20, 30, 80, bf, window_left=5, window_right=3, seqlens_k=torch.tensor([17], device="cuda", dtype=torch.int32))
run(1, 2, 2, 20, 30, 36, torch.float32, softcap=3.0)
# split-KV forward (forced splits, more than key blocks in the second): the scratch and the combine
run(2, 4, 2, 1, 700, 128, bf, num_splits=3, window_right=0, bottom_right=True, sinks=torch.randn(4, device="cuda"),
    seqlens_k=torch.tensor([700, 100], device="cuda", dtype=torch.int32))
run(1, 2, 1, 7, 300, 64, f16, num_splits=64, bias=torch.randn(1, 2, 7, 300, device="cuda"), dropout_p=0.2)
print("sanitizer cases done")
PY
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 3 \
      python3 "$TMPD/san_cases.py" >"$TMPD/san_$tool.log" 2>&1
    rc=$?
    { echo "==== $tool (rc=$rc)"; cat "$TMPD/san_$tool.log"; } >> "$OUT/sanitizer.log"
    note "compute-sanitizer $tool: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|cases done' "$TMPD/san_$tool.log" | tr '\n' ' ')"
  done
  # the sm_90a wgmma forward: its cases (causal, GQA, window + key padding, odd head dim, varlen,
  # several ring wraps); the sanitizer cases above run with it too
  cat > "$TMPD/san_hopper.py" <<'PY'
import math, torch
from attention_ext.softmax import ops
from gc_common import op_args
def fwd(q, k, v, **o):
    return torch.ops.attention_ext.softmax_fwd(q, k, v, *op_args(q.shape[-1], **o))
r = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dt)
# (no profiler under the sanitizer: tests/softmax/test_cuda.py -k hopper checks that these take the wgmma path)
fwd(r(1, 2, 70, 64), r(1, 1, 130, 64), r(1, 1, 130, 64), window_right=0, bottom_right=True)
fwd(r(2, 4, 300, 128, dt=torch.float16), r(2, 2, 300, 128, dt=torch.float16), r(2, 2, 300, 128, dt=torch.float16))
fwd(r(1, 2, 200, 40), r(1, 2, 333, 40), r(1, 2, 333, 40), window_left=50, window_right=7,
    seqlens_k=torch.tensor([250], device="cuda", dtype=torch.int32), sinks=torch.randn(2, device="cuda"))
cu_q = torch.tensor([0, 1, 130, 430], device="cuda", dtype=torch.int32)
cu_k = torch.tensor([0, 7, 300, 301], device="cuda", dtype=torch.int32)
fwd(r(1, 4, 430, 128), r(1, 2, 301, 128), r(1, 2, 301, 128), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
    max_seqlen_q=300, max_seqlen_k=293, window_right=0, bottom_right=True)
torch.cuda.synchronize()
print("hopper sanitizer cases done")
PY
  for tool in memcheck racecheck synccheck; do  # the wgmma forward (the default selection)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} compute-sanitizer \
      --tool $tool --error-exitcode 3 python3 "$TMPD/san_hopper.py" >"$TMPD/san_h.log" 2>&1
    rc=$?
    { echo "==== hopper_fwd=1 $tool (rc=$rc)"; cat "$TMPD/san_h.log"; } >> "$OUT/sanitizer.log"
    note "compute-sanitizer $tool, hopper_fwd=1: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK|cases done' "$TMPD/san_h.log" | tr '\n' ' ')"
  done
  # the sm_90a wgmma backward (hopper_bwd=1; forward on wgmma too, the defaults): GQA with causal
  # bottom-right and ragged lengths, MQA with a window and key padding, odd head dims in both
  # buckets, sinks, varlen, and enough query blocks that the Q / dO ring and the dS^T buffers wrap
  cat > "$TMPD/san_hopper_bwd.py" <<'PY'
import math, torch
from attention_ext.softmax import ops
from gc_common import op_args
def fwd_bwd(q, k, v, **o):
    args = op_args(q.shape[-1], **o)
    out, lse = torch.ops.attention_ext.softmax_fwd(q, k, v, *args)
    torch.ops.attention_ext.softmax_bwd(torch.randn_like(out), q, k, v, out, lse, *args, False, False)
r = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dt)
# (no profiler under the sanitizer: tests/softmax/test_cuda.py -k hopper_bwd checks that these take the wgmma path)
fwd_bwd(r(1, 4, 70, 64), r(1, 2, 130, 64), r(1, 2, 130, 64), window_right=0, bottom_right=True)
fwd_bwd(r(2, 4, 300, 128, dt=torch.float16), r(2, 2, 257, 128, dt=torch.float16), r(2, 2, 257, 128, dt=torch.float16))
fwd_bwd(r(1, 2, 200, 40), r(1, 1, 333, 40), r(1, 1, 333, 40), window_left=50, window_right=7,
        seqlens_k=torch.tensor([250], device="cuda", dtype=torch.int32), sinks=torch.randn(2, device="cuda"))
fwd_bwd(r(1, 2, 150, 120), r(1, 2, 150, 120), r(1, 2, 150, 120), window_right=0)
cu_q = torch.tensor([0, 1, 130, 430], device="cuda", dtype=torch.int32)
cu_k = torch.tensor([0, 7, 300, 301], device="cuda", dtype=torch.int32)
fwd_bwd(r(1, 4, 430, 128), r(1, 2, 301, 128), r(1, 2, 301, 128), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=300, max_seqlen_k=293, window_right=0, bottom_right=True)
fwd_bwd(r(1, 2, 700, 64), r(1, 1, 200, 64), r(1, 1, 200, 64))
torch.cuda.synchronize()
print("hopper bwd sanitizer cases done")
PY
  for tool in memcheck racecheck synccheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} compute-sanitizer \
      --tool $tool --error-exitcode 3 python3 "$TMPD/san_hopper_bwd.py" >"$TMPD/san_hb.log" 2>&1
    rc=$?
    { echo "==== hopper_bwd=1 $tool (rc=$rc)"; cat "$TMPD/san_hb.log"; } >> "$OUT/sanitizer.log"
    note "compute-sanitizer $tool, hopper_bwd=1: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK|cases done' "$TMPD/san_hb.log" | tr '\n' ' ')"
  done
fi

if has fsanitize; then
  # the decode, linear and sparse kernels (benchmarks/gpu_sanitize_families.py), every tool issue
  # 17 names; appended to sanitizer.log. initcheck runs last: it also sees torch's own kernels.
  for tool in ${FSAN_TOOLS:-memcheck racecheck synccheck initcheck}; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 3 \
      python3 benchmarks/gpu_sanitize_families.py >"$TMPD/fsan_$tool.log" 2>&1
    rc=$?
    { echo "==== families $tool (rc=$rc)"; cat "$TMPD/fsan_$tool.log"; } >> "$OUT/sanitizer.log"
    note "compute-sanitizer $tool, decode / linear / sparse: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|cases|cases done' "$TMPD/fsan_$tool.log" | tr '\n' ' ')"
  done
fi

if has rprobe; then
  # does racecheck follow an mbarrier hand-off? (benchmarks/probes/racecheck_mbarrier.cu says how
  # to read the five modes); the answer settles the wgmma backward's racecheck report
  if nvcc -arch=sm_90a -lineinfo -o "$TMPD/rprobe" benchmarks/probes/racecheck_mbarrier.cu >"$TMPD/rprobe.log" 2>&1; then
    for mode in 0 1 2 3 4; do
      timeout 60 compute-sanitizer --tool racecheck --racecheck-report all "$TMPD/rprobe" $mode >"$TMPD/rprobe_$mode.log" 2>&1
      { echo "==== racecheck probe mode $mode (rc=$?)"; cat "$TMPD/rprobe_$mode.log"; } >> "$OUT/sanitizer.log"
      note "racecheck probe mode $mode: $(grep -E 'RACECHECK SUMMARY' "$TMPD/rprobe_$mode.log" | tr '\n' ' ')$(grep -c 'Race reported' "$TMPD/rprobe_$mode.log") reports"
    done
  else
    note "racecheck probe: nvcc failed: $(tail -3 "$TMPD/rprobe.log" | tr '\n' ' ')"
  fi
fi

if has graphs; then
  # CUDA-graph replay (atol 0) and a side stream, every family (tests/test_cuda_graphs.py)
  timeout 240 python3 -m pytest tests/test_cuda_graphs.py -q -rfxX -p no:cacheprovider >"$TMPD/graphs.log" 2>&1
  note "CUDA graphs / streams (rc=$?): $(tail -1 "$TMPD/graphs.log")"
  grep -E "^(FAILED|XPASS|XFAIL)" "$TMPD/graphs.log" | cut -c1-200 | head -10 | tee -a "$SUMMARY" || true
  { echo "==== tests/test_cuda_graphs.py"; cat "$TMPD/graphs.log"; } >> "$OUT/test.log"
fi

echo
echo "================ summary ================"
cat "$SUMMARY"
[ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
exit 0
