"""`dspark train` unchanged under `accelerate launch` with 2 CPU processes (DDP over gloo) on a tiny target.

accelerate 1.x starts a ``distributed_type: MULTI_CPU`` config with its simple launcher: ONE process per machine
(several CPU processes there need mpirun + ``--mpirun_hostfile``). ``scripts/accelerate_cpu2.yaml`` therefore uses
``MULTI_GPU``, which goes through ``torch.distributed.run`` with ``nproc_per_node=2``; ``--cpu`` makes each process
a CPU one (TrainingArguments(use_cpu=True) -> DistributedType.MULTI_CPU, gloo). A subprocess test (~10-20 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "scripts" / "accelerate_cpu2.yaml"

# Runs `python -m dspark.cli.train_cmd` as is (runpy); after training every rank writes its world size, distributed
# type, backend and a hash of its drafter weights, so the test can see both ranks.
DRIVER = r'''
import hashlib, json, os, runpy, torch
from dspark.training import trainer as training

_train = training.DSparkTrainer.train

def train(self, *a, **k):
    result = _train(self, *a, **k)
    h = hashlib.sha256()
    for name, t in sorted(self.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    rec = dict(rank=self.args.process_index, world_size=self.args.world_size,
               distributed_type=str(self.accelerator.distributed_type),
               backend=torch.distributed.get_backend() if dist else None,
               global_step=self.state.global_step, sha=h.hexdigest())
    with open(os.path.join(os.environ["DSPARK_RANK_DIR"], f"rank{rec['rank']}.json"), "w") as f:
        json.dump(rec, f)
    return result

training.DSparkTrainer.train = train
runpy.run_module("dspark.cli.train_cmd", run_name="__main__", alter_sys=True)
'''


def _skip_reason():
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return "accelerate is not installed"
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this torch build"
    if not torch.distributed.is_gloo_available():
        return "torch.distributed has no gloo backend (needed for multi-process CPU training)"
    return None


pytestmark = pytest.mark.requires(_skip_reason() is None, str(_skip_reason()))


def test_train_cli_under_accelerate_launch_two_cpu_processes(tmp_path, one_thread):
    from tests.test_training import saved_tiny_target

    tdir = saved_tiny_target(tmp_path, {"data": [f"what is {a} plus {b}?" for a in range(3) for b in range(3)]})
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    ranks, out = tmp_path / "ranks", tmp_path / "run"
    ranks.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="info",
               CUDA_VISIBLE_DEVICES="", DSPARK_RANK_DIR=str(ranks))
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(CONFIG),
           str(driver),
           "--data", str(tmp_path / "data"), "--target", str(tdir), "--target-layer-ids", "0,2",
           "--num-draft-layers", "1", "--block-size", "4", "--markov-rank", "8", "--max-steps", "4",
           "--batch-size", "2", "--anchors-per-seq", "2", "--cpu", "--threads", "1", "--save-steps", "4",
           "--logging-steps", "1", "--output-dir", str(out)]
    # its own process group, so a launch that runs too long is killed with both ranks, and its output is reported
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"accelerate launch ran past 400 s; its output:\n{proc.communicate()[0][-4000:]}")
    assert proc.returncode == 0, log[-4000:]

    # the Trainer saw 2 processes: global batch = 2 per device x 2
    assert "Total train batch size (w. parallel, distributed & accumulation) = 4" in log, log[-4000:]
    recs = [json.loads((ranks / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, rec in enumerate(recs):
        assert rec["rank"] == r and rec["world_size"] == 2 and rec["global_step"] == 4
        assert rec["distributed_type"].endswith("MULTI_CPU") and rec["backend"] == "gloo"
    assert recs[0]["sha"] == recs[1]["sha"], "DDP ranks ended with different drafter weights"

    man = json.loads((out / "training_manifest.json").read_text())
    assert man["global_step"] == 4
    assert man["blocks_seen_approx"] == 4 * 2 * 2 * 2  # steps x batch x anchors x world_size
    assert (out / "checkpoint-4").is_dir()
