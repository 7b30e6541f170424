#!/usr/bin/env bash
# gpu_check.sh past a 10-minute limit per command (the device tool's): the first call starts the
# whole check in its own process session, so it outlives the call; every call then waits for it
# up to WAIT seconds (default 540), packs its logs into $OUT/gpu_check.tgz and prints the summary
# so far. Call again (within the machine's idle window, so the machine and the run are still
# there) until it prints "finished".
#
# PLAN runs gpu_check.sh once per ';'-separated group of stages, in that order (the build once,
# first), so the most important answers arrive first if the device time runs out:
#   PLAN="build hopper test;families;bench;fbench;sanitize ncu models;tune" bash benchmarks/gpu_check_bg.sh
#   STAGES="build hopper sanitize" bash benchmarks/gpu_check_bg.sh     # one group
# Wheels under .whl/ (flash-linear-attention for the linear bench: see the device README) are
# installed to /tmp/site first.
set -u
cd "$(dirname "$0")/.."
RUN=/tmp/gpu_check_bg
WAIT=${WAIT:-540}
PLAN=${PLAN:-${STAGES:-build test hopper families graphs models bench fbench ncu sanitize fsanitize}}
mkdir -p "$RUN"
# a finished run of another plan is replaced by a new one; a live run is never restarted
if [ -f "$RUN/pid" ] && ! kill -0 "$(cat "$RUN/pid")" 2>/dev/null && [ "$(cat "$RUN/plan")" != "$PLAN" ]; then
  rm -rf "$RUN"; mkdir -p "$RUN"
fi
if [ ! -f "$RUN/pid" ]; then
  echo "$PLAN" > "$RUN/plan"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site
  fi
  cat > "$RUN/plan.sh" <<'SH'
i=0
IFS=';' read -ra groups <<< "$PLAN"
for g in "${groups[@]}"; do
  i=$((i + 1))
  echo "#### group $i: $g ($(date -u +%H:%M:%S))"
  STAGES="$g" OUT="$RUN/out/$i" bash benchmarks/gpu_check.sh
done
echo "#### plan done ($(date -u +%H:%M:%S))"
SH
  PLAN="$PLAN" RUN="$RUN" setsid bash "$RUN/plan.sh" >"$RUN/console.log" 2>&1 < /dev/null &
  echo $! > "$RUN/pid"
  echo "gpu_check_bg: started (pid $(cat "$RUN/pid"), plan: $PLAN)"
fi
pid=$(cat "$RUN/pid")
t0=$(date +%s)
while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$WAIT" ]; do sleep 5; done
[ -n "${OUT:-}" ] && tar -czf "$OUT/gpu_check.tgz" -C "$RUN" out console.log plan 2>/dev/null
for f in "$RUN"/out/*/summary.txt; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
if kill -0 "$pid" 2>/dev/null; then
  echo "gpu_check_bg: still running after $(( $(date +%s) - t0 )) s in this call; call again."
  grep "^#### group" "$RUN/console.log" | tail -1
else
  echo "gpu_check_bg: finished"
fi
