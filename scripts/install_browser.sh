#!/usr/bin/env bash
# Install what the browser test of the demo page needs (tests/test_app.py, `pytest -m browser`):
# Debian's chromium (no browser download by Playwright) and the python playwright driver, into .venv
# (or the interpreter in $PYTHON). Safe to run more than once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends chromium
fi
"$PY" -m pip install -q --disable-pip-version-check "playwright>=1.45"
# Playwright drives the system chromium through executable_path=/usr/bin/chromium; it downloads no browser.
chromium --version 2>/dev/null | head -1 || true
"$PY" -c "import playwright; print('playwright', __import__('importlib.metadata').metadata.version('playwright'))"
