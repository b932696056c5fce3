"""The lease scripts of docs/gpu.md keep working between leases: both GPU scripts' --dry-run (every step on the CPU
with a tiny random target) and scripts/lease_tree.py's set-aside / status / restore on a temporary clone."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LEASE_TREE = REPO / "scripts" / "lease_tree.py"


def _env(out: Path) -> dict:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "TMPDIR": str(out.parent)}
    env.pop("PYTHONPATH", None)
    return env


def _run_script(name: str, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "scripts" / name), *args], env=_env(out), cwd=tmp_path,
                          capture_output=True, text=True, timeout=400)
    return proc, out


def test_gpu_check_dry_run_writes_every_step(tmp_path):
    proc, out = _run_script("gpu_check.sh", tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "gpu_check.log").read_text()[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert [line.split()[0] for line in result["step_status"]] == ["lossless", "default", "transformers"]
    assert all(" rc=0 " in line for line in result["step_status"])
    lossless = result["steps"]["lossless"]
    assert lossless["pass"] and set(lossless["dtypes"]) == {"float32", "bfloat16"}
    assert lossless["dtypes"]["float32"]["engine_identical"] == lossless["dtypes"]["float32"]["engine_requests"]
    default = result["steps"]["default"]
    assert [r["dtype"] for r in default["runs"]] == ["bfloat16", "float32"] and default["device"] == "cpu"
    assert all(set(r["engine"]) == {"1", "4"} and "tau" in next(iter(r["generate"]["domains"].values()))
               for r in default["runs"])
    assert "per_prompt" not in json.dumps(result)  # the results file stays small
    pld = result["steps"]["transformers"]
    assert [r["dtype"] for r in pld["runs"]] == ["bfloat16", "float32"]
    assert "env" in result["steps"] and (out / "gpu_check.log").stat().st_size < 16 * 2**20
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]


def test_gpu_drafter_dry_run_trains_evaluates_and_exports(tmp_path):
    proc, out = _run_script("gpu_drafter.sh", tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "drafter.log").read_text()[-3000:]
    result = json.loads((out / "drafter.json").read_text())
    names = [line.split()[0] for line in result["step_status"]]
    assert names == ["data", "train", "calibrate", "eval_new", "eval_shipped", "export"]
    assert all(" rc=0 " in line for line in result["step_status"])
    assert {"eval_new", "eval_shipped", "data_manifest"} <= set(result["steps"])
    drafter = out / "drafter"
    assert (drafter / "config.json").exists()
    shards = list(drafter.glob("*.safetensors"))
    assert shards and all(s.stat().st_size <= 16 * 10**6 for s in shards)
    assert json.loads((drafter / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    # the GPU mode writes shards of at most 16 MB (what a lease can bring back)
    assert 'max_shard_size="16MB"' in (REPO / "scripts" / "gpu_drafter.sh").read_text()


def _lease_tree(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LEASE_TREE), "--repo", str(repo), *args], capture_output=True,
                          text=True, timeout=120)


def _digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts and ".lease" not in p.parts}


def test_lease_tree_set_aside_status_restore_round_trip(tmp_path):
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs the git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--shared", str(REPO), str(clone)], check=True)
    with open(clone / ".git" / "info" / "exclude", "a") as f:
        f.write("/.lease/\n/ignored.bin\n")
    (clone / "untracked.txt").write_text("x" * 1000)  # untracked, not ignored: travels
    (clone / "ignored.bin").write_bytes(b"y" * 5000)  # ignored: does not travel unless carried
    (clone / ".lease" / "carry-1").mkdir(parents=True)
    (clone / ".lease" / "carry-1" / "part.bin").write_bytes(b"z" * 3000)
    before = _digest(clone)

    full = json.loads(_lease_tree(clone, "status", "--json").stdout)
    tracked = subprocess.run(["git", "-C", str(clone), "ls-files", "-z"], capture_output=True, text=True).stdout
    want = sum((clone / p).lstat().st_size for p in tracked.split("\0") if p)
    assert full["tracked"] == want and full["untracked"] == 1000 and full["carry"] == 0
    carried = json.loads(_lease_tree(clone, "status", "--json", "--carry", ".lease/carry-1").stdout)
    assert carried["total"] == full["total"] + 3000

    proc = _lease_tree(clone, "set-aside", "--lean")
    assert proc.returncode == 0, proc.stderr
    aside = json.loads(_lease_tree(clone, "status", "--json").stdout)
    assert aside["fits"] and aside["total"] < 8 * 2**20  # the staging calls' tree
    assert not (clone / "modeling_dspark" / "drafters" / "smollm2-135m-dspark").exists()
    assert subprocess.run(["git", "-C", str(clone), "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True).stdout == ""  # skip-worktree: nothing shows as deleted
    assert _lease_tree(clone, "status").returncode == 0

    proc = _lease_tree(clone, "restore")
    assert proc.returncode == 0, proc.stderr
    assert _digest(clone) == before  # every file back, byte for byte
    flags = subprocess.run(["git", "-C", str(clone), "ls-files", "-v"], capture_output=True, text=True).stdout
    assert not [line for line in flags.splitlines() if line.startswith("S ")]  # skip-worktree cleared
    assert json.loads(_lease_tree(clone, "status", "--json").stdout)["total"] == full["total"]
    assert _lease_tree(clone, "status").returncode == 3  # the whole tree is too large to travel


def test_lease_stack_check_names_a_datasets_that_cannot_save(tmp_path):
    """receive's stack check: here datasets saves and loads; a datasets that fails (a stand-in on PYTHONPATH) is
    reported with its error, which gpu_drafter.sh refuses on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_lease_tree", LEASE_TREE)
    lease_tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lease_tree)
    ok = lease_tree.stack_check(dict(os.environ), REPO)
    assert ok["datasets_ok"] is True and ok["transformers"] and ok["torch"], ok
    (tmp_path / "datasets.py").write_text("raise ImportError('pyarrow too old')\n")
    bad = lease_tree.stack_check(dict(os.environ, PYTHONPATH=str(tmp_path)), REPO)
    assert bad["datasets_ok"] is False and "pyarrow too old" in bad["datasets_error"], bad
