"""`dspark eval` and `dspark calibrate` on the real SmolLM2 target with a random drafter (2 prompts, 8 tokens)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dspark_cli import calibrate_cmd
from dspark_cli.main import main
from generation.stats import RoundStats
from modeling_dspark import DSparkDraftModel
from modeling_dspark import prompts as P

from .conftest import make_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # restored after this module
BLOCK = 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def drafter_dir(smollm, tmp_path_factory):
    def save():
        path = tmp_path_factory.mktemp("drafter")
        make_drafter(smollm[0], block_size=BLOCK).save_pretrained(path)
        return path

    return save


# ---------------------------------------------------------------------------------------------- labels
def test_acceptance_matrix_lengths_and_eos():
    rounds = [
        RoundStats(drafted=4, verified=4, accepted=2, committed=3, draft_tokens=[5, 6, 7, 8]),
        RoundStats(drafted=2, verified=2, accepted=0, committed=1, draft_tokens=[5, 6]),  # cut by max length
    ]
    acc, valid = calibrate_cmd.acceptance_matrix(rounds, 4)
    assert acc.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert valid.tolist() == [[True] * 4, [True, True, False, False]]

    # transformers crops its match count at a committed EOS: a draft EOS that matched is accepted, later slots unknown
    eos_round = [RoundStats(drafted=4, verified=4, accepted=1, committed=2, draft_tokens=[5, 2, 9, 9])]
    acc, valid = calibrate_cmd.acceptance_matrix(eos_round, 4, eos_ids=[2], last_round_hit_eos=True)
    assert acc.tolist() == [[1, 1, 0, 0]] and valid.tolist() == [[True, True, False, False]]
    # the target's own EOS after a real mismatch stays a rejection
    miss = [RoundStats(drafted=4, verified=4, accepted=1, committed=2, draft_tokens=[5, 7, 9, 9])]
    acc, valid = calibrate_cmd.acceptance_matrix(miss, 4, eos_ids=[2], last_round_hit_eos=True)
    assert acc.tolist() == [[1, 0, 0, 0]] and valid.tolist() == [[True] * 4]


# ---------------------------------------------------------------------------------------------- held-out prompts
def test_calibration_prompts_share_nothing_with_eval_sets(tmp_path):
    recs, info = calibrate_cmd.calibration_prompts("sharegpt,gsm_symbolic", limit=40)
    assert len(recs) == 40 and info["per_source"] == {"sharegpt": 20, "gsm_symbolic": 20}
    assert len({r["id"] for r in recs}) == 40
    evals = [p for name in P.EVAL_SETS for p in P.load_eval_prompts(name)]
    assert P.find_overlap(recs, evals) == []
    assert P.find_overlap(recs, evals, threshold=calibrate_cmd.OVERLAP_THRESHOLD) == []
    # not the prompts a default `dspark data build` (seed 0, head of the shuffle) trains on
    train = list(P.iter_train_prompts("sharegpt", seed=0, limit=4416))
    train += list(P.iter_train_prompts("gsm_symbolic", seed=0, limit=500))
    assert P.find_overlap(recs, train) == []
    # --exclude-data drops the prompts of a training data set
    (tmp_path / "plan.json").write_text(json.dumps([{"id": recs[0]["id"], "source": "sharegpt", "prompt_ids": []}]))
    again, info2 = calibrate_cmd.calibration_prompts("sharegpt,gsm_symbolic", limit=40, exclude_data=[str(tmp_path)])
    assert recs[0]["id"] not in {r["id"] for r in again} and info2["dropped_training_data"] == 1


# ---------------------------------------------------------------------------------------------- eval
def test_eval_writes_json_md_png(drafter_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    rc = main(["eval", "--drafter", str(drafter_dir()), "--sets", "gsm8k", "--limit", "2", "--max-new-tokens", "8",
               "--dtype", "float32", "--out-dir", str(out), "--no-progress", "--threads", "1"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rep = json.loads((out / "eval.json").read_text())
    assert {"config", "results", "summary"} <= rep.keys()
    assert rep["config"]["block_size"] == BLOCK and rep["config"]["dtype"] == "float32"
    r = rep["results"]["gsm8k"]
    assert {"greedy", "sample", "plain", "prompt_lookup"} <= r.keys() and r["n_prompts"] == 2
    for mode in ("greedy", "sample"):
        m = r[mode]
        assert m["tau"] >= 1.0 and m["rounds"] >= 1 and m["new_tokens"] <= 16
        pp = m["per_position"]
        for key in ("conditional_accept_rate", "survival", "n_conditional", "implied_tau_at_block_size"):
            assert len(pp[key]) == BLOCK
        assert pp["implied_tau_at_block_size"][0] >= 1.0
    g = r["greedy"]
    assert g["all_identical"] and g["n_identical"] == 2  # float32 greedy: lossless
    assert g["speedup"] > 0 and r["plain"]["tokens_per_target_forward"] == pytest.approx(1.0)
    assert r["prompt_lookup"]["tokens_per_target_forward"] >= 1.0 and r["prompt_lookup"]["speedup"] > 0
    assert rep["summary"]["n_identical"] == rep["summary"]["n_compared"] == 2
    md = (out / "eval.md").read_text()
    assert "| gsm8k | 2 |" in md and "τ greedy" in md and "k=4" in md
    assert (out / "tau_per_position.png").read_bytes()[:8] == PNG_MAGIC


def test_eval_usage_errors(capsys):
    assert main(["eval", "--sets", "nope"]) == 2
    assert main(["eval", "--modes", "greedy,beam"]) == 2
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- calibrate
def test_calibrate_report_and_write(drafter_dir, smollm, tmp_path, capsys):
    d = drafter_dir()
    weights = d / "model.safetensors"
    mtime = os.stat(weights).st_mtime_ns
    out = tmp_path / "cal"
    rc = main(["calibrate", "--drafter", str(d), "--prompts", "gsm_symbolic", "--limit", "2", "--max-new-tokens", "8",
               "--dtype", "float32", "--out-dir", str(out), "--write", "--no-progress", "--threads", "1"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rep = json.loads((out / "calibration.json").read_text())
    temps = rep["temperatures"]
    assert len(temps) == BLOCK and all(t > 0 for t in temps)
    assert len(rep["positions"]) == BLOCK and rep["n_blocks"] >= 2 and rep["n_prompts"] == 2
    p1 = rep["positions"][0]
    assert {"ece_before", "ece_after", "auroc", "accept_rate"} <= p1.keys()
    assert p1["ece_after"] <= p1["ece_before"] + 1e-12
    assert rep["previous_temperatures"] == [1.0] * BLOCK
    assert all(pid.startswith("gsm_symbolic-") for pid in rep["prompt_ids"])
    assert (out / "reliability.png").read_bytes()[:8] == PNG_MAGIC and (out / "pairs.npz").is_file()
    # config only: temperatures stored, weights untouched, the drafter reloads with them
    assert json.loads((d / "config.json").read_text())["sts_temperatures"] == pytest.approx(temps)
    assert os.stat(weights).st_mtime_ns == mtime
    reloaded = DSparkDraftModel.from_pretrained(d, target=smollm[0])
    assert reloaded.config.sts_temperatures == pytest.approx(temps)
    # refit from the stored pairs without running a model: same temperatures
    rc = main(["calibrate", "--drafter", str(d), "--pairs", str(out / "pairs.npz"), "--out-dir", str(tmp_path / "re")])
    assert rc == 0
    assert json.loads((tmp_path / "re" / "calibration.json").read_text())["temperatures"] == pytest.approx(temps)
    # --bias: temperatures and offsets fitted together and written; the drafter applies both
    rc = main(["calibrate", "--drafter", str(d), "--pairs", str(out / "pairs.npz"), "--bias", "--write",
               "--out-dir", str(tmp_path / "b")])
    assert rc == 0
    rep_b = json.loads((tmp_path / "b" / "calibration.json").read_text())
    assert rep_b["method"].startswith("STS + logit offset") and len(rep_b["biases"]) == BLOCK
    # at position 1 the (T, 0) pairs are candidates too: never worse in-sample (later positions build on different
    # earlier factors, so no such guarantee there)
    assert rep_b["positions"][0]["ece_after"] <= rep["positions"][0]["ece_after"] + 1e-12
    assert rep_b["previous_biases"] == [0.0] * BLOCK
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["sts_temperatures"] == pytest.approx(rep_b["temperatures"])
    assert cfg["sts_biases"] == pytest.approx(rep_b["biases"])
    reloaded = DSparkDraftModel.from_pretrained(d, target=smollm[0])
    logit = torch.tensor([0.3])
    for k in range(BLOCK):
        want = torch.sigmoid(logit / rep_b["temperatures"][k] + rep_b["biases"][k])
        assert reloaded.calibrated_confidence(logit, torch.tensor([k])) == pytest.approx(want.item(), abs=1e-6)
    # refitting without --bias resets the offsets (the temperatures were fitted without them)
    assert main(["calibrate", "--drafter", str(d), "--pairs", str(out / "pairs.npz"), "--write",
                 "--out-dir", str(tmp_path / "re2")]) == 0
    assert json.loads((d / "config.json").read_text())["sts_biases"] == [0.0] * BLOCK


def test_calibrate_usage_errors(tmp_path, capsys):
    assert main(["calibrate", "--drafter", str(tmp_path)]) == 2  # no config.json
    assert "not a drafter directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["calibrate", "--drafter", str(tmp_path), "--prompts", "bogus"]) == 2  # before any model load
    assert "unknown source" in capsys.readouterr().err
