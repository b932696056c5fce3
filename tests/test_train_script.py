"""scripts/train_drafter.sh: the dry-run runs every step of the recipe (data build, train, calibrate, eval, export)
for real on the CPU and writes each step's output, with dspark found as the repository's .venv/bin/dspark when it is
not on PATH (a fresh clone after scripts/setup.sh, nothing activated). ~1 minute on a 2-core CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_drafter.sh"
VENV_DSPARK = REPO / ".venv" / "bin" / "dspark"


def _env_without_dspark() -> dict[str, str]:
    """This process's environment with no directory on PATH that holds a `dspark` (the venv's bin among them), no
    DSPARK and no VIRTUAL_ENV: the script must find dspark by itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("DSPARK", "VIRTUAL_ENV")}
    path = [d for d in env.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "dspark").exists()]
    env["PATH"] = os.pathsep.join(path or [os.defpath])
    assert shutil.which("dspark", path=env["PATH"]) is None
    return env


@pytest.mark.slow
@pytest.mark.requires(VENV_DSPARK.is_file(), f"{VENV_DSPARK} is missing: run scripts/setup.sh")
def test_dry_run_writes_every_step_with_the_venv_fallback(tmp_path):
    out = tmp_path / "new"
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "dry-run"], env=_env_without_dspark(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # set -x traces each step: every one ran the repository's own dspark
    for step in ("data build", "train", "calibrate", "eval", "export"):
        assert f"+ {VENV_DSPARK} {step} " in proc.stderr, step

    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["num_prompts"] >= 1
    assert (out / "data" / "shards").is_dir()
    assert (out / "run" / "model.safetensors").is_file()
    config = json.loads((out / "run" / "config.json").read_text())
    assert len(config["sts_temperatures"]) == config["block_size"] == 8
    calibration = json.loads((out / "calibration" / "calibration.json").read_text())
    assert calibration["written_to"] == str(out / "run" / "config.json")
    assert calibration["temperatures"] == config["sts_temperatures"]
    report = json.loads((out / "eval" / "eval.json").read_text())
    assert list(report["results"]) == ["gsm8k"] and report["config"]["max_new_tokens"] == 8
    assert (out / "eval" / "eval.md").is_file()
    export = json.loads((out / "export" / "config.json").read_text())
    assert export.get("speculators_config"), export
    assert export["sts_temperatures"] == config["sts_temperatures"]  # the calibrated drafter was exported
    assert (out / "export" / "model.safetensors").is_file()


def test_without_dspark_it_says_how_to_get_one(tmp_path):
    """A copy of the script in a tree with no .venv, dspark not on PATH: it stops at once, naming the fixes."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "train_drafter.sh"
    shutil.copy(SCRIPT, script)
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out"), "dry-run"], env=_env_without_dspark(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 127
    assert "scripts/setup.sh" in proc.stderr and "DSPARK" in proc.stderr
    assert not (tmp_path / "out").exists()
