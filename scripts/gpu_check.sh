#!/usr/bin/env bash
# One lease call (~7.5 minutes on the GPU): the lossless checks on CUDA, then the default generate() against plain
# and against transformers' prompt lookup on the packaged SmolLM2 target in float32 and bfloat16 (tok/s and τ per
# domain), and the engine at R = 1, 4, 16, 64. Writes $OUT/gpu_check.json (every step's result, per-domain
# aggregates, markdown tables, each step's exit status and seconds) and $OUT/gpu_check.log (the steps' output).
# docs/gpu.md gives the whole lease.
#
#   bash scripts/gpu_check.sh             on the GPU machine, after `python3 scripts/lease_tree.py receive`
#   bash scripts/gpu_check.sh --dry-run   the same steps on the CPU with a tiny random target (seconds; CI)
#
# OUT: where the results go (default: .lease/out). PYTHON: the interpreter (default: .venv/bin/python on the CPU when
# it exists, else python3). Each step runs under `timeout`, so one slow step cannot take the others' minutes.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    *) echo "usage: scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
  esac
done
OUTDIR=${OUT:-$REPO/.lease/out}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
mkdir -p "$OUTDIR"
if [ -z "${PYTHON:-}" ]; then
  if [ "$DRY" = 1 ] && [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
  "$PYTHON" scripts/gpu_tools.py tiny "$WORK/tiny" >/dev/null 2>&1 || { echo "could not make the tiny models" >&2; exit 1; }
  MODELS=(--target "$WORK/tiny/target" --drafter "$WORK/tiny/drafter")
  DEVICE=cpu; THREADS=(--threads 1)
  LOSSLESS=(--per-domain 1 --max-new-tokens 12)
  SPEED=(--per-domain 1 --max-new-tokens 12)
  ENGINE=(--engine-requests 1,4 --engine-tokens 6 --engine-waves 1 --repeats 1)
  T_LOSSLESS=120; T_DEFAULT=120; T_PLD=120
else
  eval "$("$PYTHON" scripts/lease_tree.py env)"
  if [ ! -f .lease/ready.json ]; then
    echo "no .lease/ready.json: stage the target first (docs/gpu.md: lease_tree.py receive)" >&2; exit 2
  fi
  if ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "torch sees no GPU: use --dry-run" >&2; exit 2
  fi
  MODELS=(--target SmolLM2-135M-Instruct)
  DEVICE=cuda; THREADS=()
  LOSSLESS=(--per-domain 4 --max-new-tokens 96)
  SPEED=(--per-domain 4 --max-new-tokens 96)
  ENGINE=(--engine-requests 1,4,16,64 --engine-tokens 48 --engine-waves 2 --repeats 2)
  T_LOSSLESS=120; T_DEFAULT=210; T_PLD=120
fi

STEP_LOG=$WORK/steps.log
: > "$STEP_LOG"
source "$REPO/scripts/gpu_steps.sh"

mkdir -p "$WORK/results"
"$PYTHON" - > "$WORK/results/env.json" 2>>"$WORK/all.log" <<'EOF'
import json, platform, torch, transformers
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "transformers": transformers.__version__, "gpu": gpu}))
EOF
step lossless "$T_LOSSLESS" "$PYTHON" scripts/gpu_tools.py lossless "${MODELS[@]}" --device "$DEVICE" \
  "${LOSSLESS[@]}" "${THREADS[@]}" --out "$WORK/results/lossless.json"
# bfloat16 first: the GPU's dtype keeps its rows if a step runs out of time (each result file is written after
# every finished part; float32's exactness is the lossless step's)
step default "$T_DEFAULT" "$PYTHON" benchmarks/bench_default.py "${MODELS[@]}" --device "$DEVICE" "${SPEED[@]}" \
  --dtypes bfloat16,float32 "${ENGINE[@]}" "${THREADS[@]}" --out "$WORK/results/default.json"
step transformers "$T_PLD" "$PYTHON" benchmarks/bench_transformers.py "${MODELS[@]}" --device "$DEVICE" \
  "${SPEED[@]}" --dtypes bfloat16,float32 "${THREADS[@]}" --out "$WORK/results/transformers.json"
cp "$WORK/steps.log" "$WORK/results/steps.log"
"$PYTHON" scripts/gpu_tools.py summary --dir "$WORK/results" --out "$OUTDIR/gpu_check.json"
tail -c 2000000 "$WORK/all.log" > "$OUTDIR/gpu_check.log"
rm -rf "$WORK"
echo "results: $OUTDIR/gpu_check.json"
"$PYTHON" -c "import json, sys; s = json.load(open(sys.argv[1])); sys.exit(any(' rc=0 ' not in l for l in s['step_status']))" \
  "$OUTDIR/gpu_check.json"  # exit 1 when a step failed or ran out of time
