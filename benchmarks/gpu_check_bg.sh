#!/usr/bin/env bash
# gpu_check.sh past a 10-minute limit per command (the device tool's): the first call starts the
# whole check in its own process session, so it outlives the call; every call then waits for it
# up to WAIT seconds (default 540), copies its logs to $OUT and prints the summary so far.
# Call again (within the machine's idle window, so the machine and the run are still there)
# until it prints "finished". $OUT gets gpu_check.sh's own files (8: the device returns no more).
#
#   bash benchmarks/gpu_check_bg.sh                        # all stages
#   STAGES="build hopper sanitize" bash benchmarks/gpu_check_bg.sh
set -u
cd "$(dirname "$0")/.."
RUN=/tmp/gpu_check_bg
WAIT=${WAIT:-540}
mkdir -p "$RUN"
# a finished run of other stages is replaced by a new one; a live run is never restarted
if [ -f "$RUN/pid" ] && ! kill -0 "$(cat "$RUN/pid")" 2>/dev/null && [ "$(cat "$RUN/stages")" != "${STAGES:-all}" ]; then
  rm -rf "$RUN"; mkdir -p "$RUN"
fi
if [ ! -f "$RUN/pid" ]; then
  echo "${STAGES:-all}" > "$RUN/stages"
  OUT="$RUN/out" setsid bash benchmarks/gpu_check.sh >"$RUN/console.log" 2>&1 < /dev/null &
  echo $! > "$RUN/pid"
  echo "gpu_check_bg: started (pid $(cat "$RUN/pid"), stages: ${STAGES:-all})"
fi
pid=$(cat "$RUN/pid")
t0=$(date +%s)
while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$WAIT" ]; do sleep 5; done
if [ -n "${OUT:-}" ] && [ -d "$RUN/out" ]; then
  cp "$RUN"/out/* "$OUT"/ 2>/dev/null
fi
if kill -0 "$pid" 2>/dev/null; then
  echo "gpu_check_bg: still running after $(( $(date +%s) - t0 )) s in this call; call again. Summary so far:"
  cat "$RUN/out/summary.txt" 2>/dev/null
else
  echo "gpu_check_bg: finished"
  tail -c 10000 "$RUN/console.log"
fi
