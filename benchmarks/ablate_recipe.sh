#!/usr/bin/env bash
# Recipe ablation at fixed steps (issue 30, item 3): drafters trained from the target's last layers with the
# same data, steps, learning rate and seed, each differing from the base recipe in one option; then greedy
# acceptance on held-out target-generated sequences (benchmarks/tau_gap.py, paired: same blocks for every arm).
# Each arm's training time is in its training_manifest.json (wall_s_this_run): the options differ in cost.
#
#   bash benchmarks/ablate_recipe.sh DATA_DIR FEATURE_CACHE HELDOUT_DIR OUT_DIR [STEPS]
#
# Two arms run at a time, one thread each; every arm resumes from its last checkpoint, so the script can be
# re-run after an interruption. Writes OUT_DIR/<arm>/ (drafters), OUT_DIR/<arm>.log, OUT_DIR/tau.json (every
# arm against the base) and OUT_DIR/tau-anchors.json (the base and the anchors arms against anchors32x8).
set -euo pipefail
DATA=$1 CACHE=$2 HELDOUT=$3 OUT=$4 STEPS=${5:-600}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
BASE="--data $DATA --feature-cache $CACHE --block-size 8 --markov-rank 64 --mask-token-id 16 --init-from-target
  --max-steps $STEPS --lr 8e-4 --dtype bfloat16 --save-steps 200 --save-total-limit 1 --logging-steps 50
  --threads 1 --seed 0 --no-progress --resume"
# name|options that differ from the base recipe (the CLI defaults: 2 draft layers, 8 anchors x 8 sequences = 64
# blocks per step, loss decay γ, CE 0.1 / TV 0.9; draft vocab 8192). The anchors arms train on 256 blocks per step,
# 4x the base's, and are compared with each other (anchors32x8 is the recipe of the shipped drafter).
ARMS="base|--draft-vocab-size 8192
layers3|--num-draft-layers 3 --draft-vocab-size 8192
nodecay|--draft-vocab-size 8192 --loss-decay 1e9
anchors16x16|--draft-vocab-size 8192 --anchors-per-seq 16 --batch-size 16
anchors32x8|--draft-vocab-size 8192 --anchors-per-seq 32 --batch-size 8
anchors64x4|--draft-vocab-size 8192 --anchors-per-seq 64 --batch-size 4
vocab32k|--draft-vocab-size 32768
vocabfull|"
run_arm() {
  local name=${1%%|*} opts=${1#*|}
  [ -f "$OUT/$name/model.safetensors" ] && return 0
  # shellcheck disable=SC2086
  $PY -m dspark.cli train $BASE $opts --out-dir "$OUT/$name" > "$OUT/$name.log" 2>&1
}
export -f run_arm; export OUT BASE PY
# one process builds the feature cache (a one-step run), so that the two workers do not build it at once
# shellcheck disable=SC2086
[ -f "$OUT/cache-warmup/model.safetensors" ] || $PY -m dspark.cli train $BASE --max-steps 1 --threads 2 \
  --draft-vocab-size 8192 --out-dir "$OUT/cache-warmup" > "$OUT/cache-warmup.log" 2>&1
# the costlier arms (last in the list) start first, so that the two workers finish together
printf '%s\n' "$ARMS" | tac | xargs -d '\n' -P 2 -I{} bash -c 'run_arm "$@"' _ {}
names=$(printf '%s\n' "$ARMS" | cut -d'|' -f1 | grep -v '^anchors' | sed "s#^#$OUT/#")
# shellcheck disable=SC2086
$PY benchmarks/tau_gap.py --drafter $names --data heldout="$HELDOUT" --rows 256 --threads 2 --out "$OUT/tau.json"
$PY benchmarks/tau_gap.py --drafter "$OUT/anchors32x8" "$OUT/base" "$OUT/anchors16x16" "$OUT/anchors64x4" \
  --data heldout="$HELDOUT" --rows 256 --threads 2 --out "$OUT/tau-anchors.json"
