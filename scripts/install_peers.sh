#!/usr/bin/env bash
# Install the peer implementations the interoperability tests (tests/test_peers.py) compare dspark against:
# SpecForge (SGLang's trainer), vLLM's speculators and z-lab's DFlash, at pinned versions.
# Each pins other torch/transformers versions (or heavy serving stacks) than dspark's, so they are installed with
# --no-deps into dspark's environment; the modules the tests import need only torch, transformers, pydantic and
# safetensors (already there) plus the light packages below.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VPY="${PYTHON:-.venv/bin/python}"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --no-deps "specforge==0.2.0" "speculators==0.9.0" "dflash==0.1.0" "hs-connectors==0.9.0" "loguru==0.7.3"
# speculators imports the OpenAI client at package import (its data tools); a pure-Python package
"${PIP[@]}" "openai==3.57.0"
