#!/usr/bin/env bash
# Recipe ablation at fixed compute (issue 30, item 3): drafters trained from the target's last layers with the
# same data, steps, learning rate and seed, each differing from the base recipe in one option; then greedy
# acceptance on held-out target-generated sequences (benchmarks/tau_gap.py, paired: same blocks for every arm).
#
#   bash benchmarks/ablate_recipe.sh DATA_DIR FEATURE_CACHE HELDOUT_DIR OUT_DIR [STEPS]
#
# Two arms run at a time, one thread each; every arm resumes from its last checkpoint, so the script can be
# re-run after an interruption. Writes OUT_DIR/<arm>/ (drafters), OUT_DIR/<arm>.log and OUT_DIR/tau.json.
set -euo pipefail
DATA=$1 CACHE=$2 HELDOUT=$3 OUT=$4 STEPS=${5:-600}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
BASE="--data $DATA --feature-cache $CACHE --block-size 8 --markov-rank 64 --mask-token-id 16 --init-from-target
  --max-steps $STEPS --lr 8e-4 --dtype bfloat16 --save-steps 200 --save-total-limit 1 --logging-steps 50
  --threads 1 --seed 0 --no-progress --resume"
# name|options that differ from the base recipe (2 draft layers, draft vocab 8192, 32 anchors x 8 sequences,
# loss decay γ, CE 0.1 / TV 0.9)
ARMS="base|--num-draft-layers 2 --draft-vocab-size 8192
layers3|--num-draft-layers 3 --draft-vocab-size 8192
layers4|--num-draft-layers 4 --draft-vocab-size 8192
nodecay|--num-draft-layers 2 --draft-vocab-size 8192 --loss-decay 1e9
anchors16x16|--num-draft-layers 2 --draft-vocab-size 8192 --anchors-per-seq 16 --batch-size 16
anchors64x4|--num-draft-layers 2 --draft-vocab-size 8192 --anchors-per-seq 64 --batch-size 4
ceonly|--num-draft-layers 2 --draft-vocab-size 8192 --ce-weight 1.0 --tv-weight 0.0
vocab32k|--num-draft-layers 2 --draft-vocab-size 32768
vocabfull|--num-draft-layers 2"
run_arm() {
  local name=${1%%|*} opts=${1#*|}
  [ -f "$OUT/$name/model.safetensors" ] && return 0
  # shellcheck disable=SC2086
  $PY -m dspark_cli train $BASE $opts --out-dir "$OUT/$name" > "$OUT/$name.log" 2>&1
}
export -f run_arm; export OUT BASE PY
printf '%s\n' "$ARMS" | xargs -d '\n' -P 2 -I{} bash -c 'run_arm "$@"' _ {}
names=$(printf '%s\n' "$ARMS" | cut -d'|' -f1 | sed "s#^#$OUT/#")
# shellcheck disable=SC2086
$PY benchmarks/tau_gap.py --drafter $names --data heldout="$HELDOUT" --rows 256 --threads 2 --out "$OUT/tau.json"
