# Sourced by scripts/gpu_check.sh and scripts/gpu_drafter.sh (docs/gpu.md). `step NAME SECONDS CMD...` runs CMD under
# `timeout` (so one slow step cannot take the others' minutes), appends its output to $WORK/all.log and records
# "NAME rc=… seconds=… limit=…" in $STEP_LOG and on stdout.
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "=== $name: $*" >> "$WORK/all.log"
  timeout -k 10 "$limit" "$@" >> "$WORK/all.log" 2>&1
  rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - t0 )) limit=$limit" | tee -a "$STEP_LOG"
}
