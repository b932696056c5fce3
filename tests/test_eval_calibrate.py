"""`dspark eval` and `dspark calibrate` on the real SmolLM2 target with a random drafter (2 prompts, 8 tokens)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dspark.cli.common import CLIError
from dspark.cli.main import main
from dspark.generation.stats import RoundStats
from modeling_dspark import DSparkDraftModel
from dspark.evaluation import acceptance
from dspark.training import heldout
from dspark.training import prompts as P

from .conftest import make_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # restored after this module
BLOCK = 4


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
    acc, valid = acceptance.acceptance_matrix(rounds, 4)
    assert acc.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert valid.tolist() == [[True] * 4, [True, True, False, False]]

    # transformers crops its match count at a committed EOS: a draft EOS that matched is accepted, later slots unknown
    eos_round = [RoundStats(drafted=4, verified=4, accepted=1, committed=2, draft_tokens=[5, 2, 9, 9])]
    acc, valid = acceptance.acceptance_matrix(eos_round, 4, eos_ids=[2], last_round_hit_eos=True)
    assert acc.tolist() == [[1, 1, 0, 0]] and valid.tolist() == [[True, True, False, False]]
    # the target's own EOS after a real mismatch stays a rejection
    miss = [RoundStats(drafted=4, verified=4, accepted=1, committed=2, draft_tokens=[5, 7, 9, 9])]
    acc, valid = acceptance.acceptance_matrix(miss, 4, eos_ids=[2], last_round_hit_eos=True)
    assert acc.tolist() == [[1, 0, 0, 0]] and valid.tolist() == [[True] * 4]


# ---------------------------------------------------------------------------------------------- held-out prompts
def test_calibration_prompts_share_nothing_with_eval_sets(tmp_path):
    recs, info = heldout.calibration_prompts("sharegpt,gsm_symbolic", limit=40)
    assert len(recs) == 40 and info["per_source"] == {"sharegpt": 20, "gsm_symbolic": 20}
    assert len({r["id"] for r in recs}) == 40
    evals = [p for name in P.EVAL_SETS for p in P.load_eval_prompts(name)]
    assert P.find_overlap(recs, evals) == []
    assert P.find_overlap(recs, evals, threshold=heldout.OVERLAP_THRESHOLD) == []
    # not the prompts a default `dspark data build` (seed 0, head of the shuffle) trains on
    train = list(P.iter_train_prompts("sharegpt", seed=0, limit=4416))
    train += list(P.iter_train_prompts("gsm_symbolic", seed=0, limit=500))
    assert P.find_overlap(recs, train) == []
    # --exclude-data drops the prompts of a training data set
    (tmp_path / "plan.json").write_text(json.dumps([{"id": recs[0]["id"], "source": "sharegpt", "prompt_ids": []}]))
    again, info2 = heldout.calibration_prompts("sharegpt,gsm_symbolic", limit=40, exclude_data=[str(tmp_path)])
    assert recs[0]["id"] not in {r["id"] for r in again} and info2["dropped_training_data"] == 1


def test_calibration_prompts_after_extends_with_new_prompts_only():
    first, _ = heldout.calibration_prompts("sharegpt,gsm_symbolic", limit=12)
    both, _ = heldout.calibration_prompts("sharegpt,gsm_symbolic", limit=30)
    extra, info = heldout.calibration_prompts("sharegpt,gsm_symbolic", limit=30, after=12)
    ids = [r["id"] for r in extra]
    assert not set(ids) & {r["id"] for r in first}
    assert set(ids) | {r["id"] for r in first} == {r["id"] for r in both} and len(ids) == 18
    assert ids == [r["id"] for r in both if r not in first]  # same order as the longer selection
    assert info["after"] == {"limit": 12, "left_out": 12}
    assert info["per_source"] == {"sharegpt": 9, "gsm_symbolic": 9}
    with pytest.raises(ValueError, match="after"):
        heldout.calibration_prompts("sharegpt", limit=4, after=4)


def _fake_pairs(path, n_prompts, rows_per_prompt, gamma, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    n = n_prompts * rows_per_prompt
    logits = rng.normal(size=(n, gamma))
    accepted = np.cumprod(rng.random((n, gamma)) < 1 / (1 + np.exp(-logits)), axis=1).astype(np.int8)
    np.savez_compressed(path, logits=logits, accepted=accepted, valid=np.ones((n, gamma), bool),
                        prompt_index=np.repeat(np.arange(n_prompts), rows_per_prompt))


def test_calibrate_merges_several_pairs_files(tmp_path, capsys):
    import numpy as np

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    _fake_pairs(a, 7, 20, BLOCK, 0)
    _fake_pairs(b, 5, 20, BLOCK, 1)
    merged = acceptance.load_pairs([a, b])
    assert merged["logits"].shape == (240, BLOCK)
    # the second file's prompts come after the first's: 12 distinct prompts, none shared
    assert np.array_equal(np.unique(merged["prompt_index"]), np.arange(12))
    assert np.array_equal(merged["prompt_index"][140:], np.load(b)["prompt_index"] + 7)
    # a refit from both files is the fit of the concatenated pairs
    both = tmp_path / "both.npz"
    np.savez_compressed(both, **merged)
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--pairs", str(a), "--pairs", str(b),
                 "--out-dir", str(tmp_path / "m")]) == 0
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--pairs", str(both),
                 "--out-dir", str(tmp_path / "c")]) == 0
    rep_m = json.loads((tmp_path / "m" / "calibration.json").read_text())
    rep_c = json.loads((tmp_path / "c" / "calibration.json").read_text())
    assert rep_m["pairs_from"] == [str(a), str(b)] and rep_m["n_blocks"] == 240
    assert rep_m["temperatures"] == rep_c["temperatures"]
    assert rep_m["two_fold_ece_after"] == rep_c["two_fold_ece_after"]
    # a file of another block size, or not a pairs file, is refused by name before any fit
    other = tmp_path / "g2.npz"
    _fake_pairs(other, 3, 5, BLOCK + 1, 2)
    capsys.readouterr()
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--pairs", str(a), "--pairs", str(other)]) == 2
    assert "g2.npz" in capsys.readouterr().err
    np.savez(tmp_path / "x.npz", foo=np.zeros(3))
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--pairs", str(tmp_path / "x.npz")]) == 2
    assert "missing array" in capsys.readouterr().err
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not a zip")
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--pairs", str(tmp_path / "junk.npz")]) == 2
    assert "cannot read" in capsys.readouterr().err
    # the same file twice, or one prompt in two files, would put a prompt in both halves of the 2-fold check
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--pairs", str(a), "--pairs", str(a)]) == 2
    assert "twice" in capsys.readouterr().err
    with np.load(a) as z:
        np.savez(tmp_path / "a_ids.npz", **z, prompt_ids=np.array([f"p{i}" for i in range(7)]))
    with np.load(b) as z:
        np.savez(tmp_path / "b_ids.npz", **z, prompt_ids=np.array(["p6", "q1", "q2", "q3", "q4"]))
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--pairs", str(tmp_path / "a_ids.npz"),
                 "--pairs", str(tmp_path / "b_ids.npz")]) == 2
    assert "'p6' is also in" in capsys.readouterr().err
    # --after means nothing for a refit; a refit never overwrites a collection's record
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--pairs", str(a), "--after", "2"]) == 2
    assert "--after" in capsys.readouterr().err
    (tmp_path / "coll").mkdir()
    (tmp_path / "coll" / "calibration.json").write_text(json.dumps({"prompt_ids": ["p0"]}))
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--pairs", str(a), "--out-dir",
                 str(tmp_path / "coll")]) == 2
    assert "collection" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- eval
def test_eval_writes_json_md_png(drafter_dir, tmp_path, capsys, saved_figures):
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
        assert m["rounds"] >= 1 and m["new_tokens"] <= 16
        pp = m["per_position"]
        for key in ("conditional_accept_rate", "survival", "n_conditional", "implied_tau_at_block_size"):
            assert len(pp[key]) == BLOCK
        surv = [s or 0.0 for s in pp["survival"]]  # P(x_1..x_k accepted): within [0, 1], never rising with k
        assert all(0 <= b <= a <= 1 for a, b in zip(surv, surv[1:]))
        assert pp["implied_tau_at_block_size"][0] == pytest.approx(1 + surv[0])
        per = m["per_prompt"]  # per-prompt counts add up to the set's totals
        assert len(per["rounds"]) == len(per["committed"]) == 2 and sum(per["rounds"]) == m["rounds"]
        committed = sum(per["committed"])
        assert committed == pytest.approx(m["tau"] * m["rounds"])
        # each round commits its accepted drafts and at most one more token; the tokens the rounds do not commit
        # are each prompt's prefill token and at most one last plain step (no room left to draft)
        assert committed <= m["accepted"] + m["rounds"]
        assert 2 <= m["new_tokens"] - committed <= 2 * 2
    g, plain, pld = r["greedy"], r["plain"], r["prompt_lookup"]
    assert g["all_identical"] and g["n_identical"] == 2  # float32 greedy: lossless
    assert plain["tokens_per_target_forward"] == pytest.approx(1.0)
    # identical outputs, so a speed-up is the inverse ratio of the seconds taken
    assert g["new_tokens"] == plain["new_tokens"] == pld["new_tokens"]
    assert g["speedup"] == pytest.approx(plain["seconds"] / g["seconds"])
    assert pld["speedup"] == pytest.approx(plain["seconds"] / pld["seconds"])
    # prompt lookup commits at least one token per target forward: never more forwards than plain decoding
    assert pld["target_forwards"] <= plain["target_forwards"]
    assert rep["summary"]["n_identical"] == rep["summary"]["n_compared"] == 2
    md = (out / "eval.md").read_text()
    assert "| gsm8k | 2 |" in md and "τ greedy" in md and "k=4" in md
    # two prompts timed once: the speed-ups are marked as noise, in the table, the overall line and the JSON
    assert md.count("× (noise)") == 4 and "(noise): a speed-up from fewer than 8 prompts" in md
    assert rep["summary"]["speedup_is_noise"] is True
    import matplotlib.pyplot as plt

    # the plot: per mode one line in each panel, the acceptance rate per position and the implied τ(k) from τ(0) = 1
    (fig,) = saved_figures
    rate_ax, tau_ax = fig.axes
    assert [ln.get_label() for ln in rate_ax.get_lines()] == ["gsm8k (greedy)", "gsm8k (T=1)"]
    for mode, ln in zip(("greedy", "sample"), tau_ax.get_lines()):
        implied = r[mode]["per_position"]["implied_tau_at_block_size"]
        assert list(ln.get_xdata()) == list(range(BLOCK + 1))
        assert list(ln.get_ydata()) == pytest.approx([1.0, *implied])
    assert plt.imread(out / "tau_per_position.png").shape[:2] == (4 * 120, 10 * 120)  # 10 x 4 in at 120 dpi


def test_eval_speedups_from_enough_prompts_are_not_marked():
    from dspark.evaluation.eval_sets import markdown

    row = {"n_prompts": 8, "greedy": {"tau": 2.0, "speedup": 1.3, "n_identical": 8, "n_prompts": 8,
                                      "per_position": {"conditional_accept_rate": [0.5]}},
           "prompt_lookup": {"speedup": 1.1}}
    cfg = {"drafter": "d", "target": "t", "dtype": "float32", "device": "cpu", "block_size": 1, "policy": "full",
           "max_new_tokens": 8, "limit": 8, "machine": {"torch_threads": 1}, "command": "dspark eval"}
    summary = {"speedup": 1.3, "prompt_lookup_speedup": 1.1, "n_compared": 8}
    md = markdown({"config": cfg, "results": {"gsm8k": row}, "summary": summary})
    assert "1.30×" in md and "noise" not in md
    md = markdown({"config": cfg, "results": {"gsm8k": {**row, "n_prompts": 7}}, "summary": {**summary,
                                                                                          "n_compared": 7}})
    assert "1.30× (noise)" in md and "1.10× (noise)" in md


def test_eval_usage_errors(capsys):
    assert main(["eval", "--sets", "nope"]) == 2
    assert main(["eval", "--modes", "greedy,beam"]) == 2
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- calibrate
def test_calibrate_report_and_write(drafter_dir, smollm, tmp_path, capsys, saved_figures):
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
    assert len(temps) == BLOCK
    assert len(rep["positions"]) == BLOCK and rep["n_blocks"] >= 2 and rep["n_prompts"] == 2
    p1 = rep["positions"][0]
    assert {"ece_before", "ece_after", "auroc", "accept_rate"} <= p1.keys()
    assert p1["ece_after"] <= p1["ece_before"] + 1e-12
    assert rep["previous_temperatures"] == [1.0] * BLOCK
    assert all(pid.startswith("gsm_symbolic-") for pid in rep["prompt_ids"])
    import matplotlib.pyplot as plt
    import numpy as np

    with np.load(out / "pairs.npz") as z:  # the raw data: a row per block, a column per position
        assert z["logits"].shape == z["accepted"].shape == (rep["n_blocks"], BLOCK)

    (fig,) = saved_figures  # the reliability diagram: one panel per position, raw and calibrated curves
    assert [ax.get_title().split(",")[0] for ax in fig.axes] == [f"position {k}" for k in range(1, BLOCK + 1)]
    assert plt.imread(out / "reliability.png").shape[:2] == (round(3.2 * 120), round(BLOCK * 3.2 * 120))
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
    # the written pair is the maximum-likelihood fit of the stored pairs
    from dspark.training.calibration import fit_sts_bias

    with np.load(out / "pairs.npz") as z:
        want_t, want_b = fit_sts_bias(z["logits"], z["accepted"], valid=z["valid"])
    assert rep_b["temperatures"] == pytest.approx(want_t) and rep_b["biases"] == pytest.approx(want_b)
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
    assert main(["calibrate", "--drafter", str(tmp_path)]) == 2
    assert "has no *.safetensors weights file" in capsys.readouterr().err
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert main(["calibrate", "--drafter", str(tmp_path)]) == 2
    assert "corrupt weights file model.safetensors" in capsys.readouterr().err
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))  # valid file; no model loads below
    assert main(["calibrate", "--drafter", str(tmp_path), "--prompts", "bogus"]) == 2  # before any model load
    assert "unknown source" in capsys.readouterr().err
    assert main(["calibrate", "--drafter", str(tmp_path), "--limit", "8", "--after", "8"]) == 2
    assert "--after" in capsys.readouterr().err


def test_eval_default_drafter_follows_the_target():
    """The shipped drafter for the default target, named or not; a random one for any other target."""
    from modeling_dspark.target import shipped_drafter_for
    from dspark.cli.common import drafter_or_shipped

    shipped = str(shipped_drafter_for())
    assert drafter_or_shipped(None, None) == drafter_or_shipped(None, "SmolLM2-135M-Instruct") == (shipped, shipped)
    assert drafter_or_shipped(None, "/some/other/target") == ("random", "random")


def test_a_drafter_brings_its_target(tmp_path):
    """Without --target, a drafter trained for a packaged target, or for a model directory here named by absolute
    path, runs with it; an explicit --target wins, and a drafter for a directory missing here, named relatively or
    without a config.json, or a random one, keeps the default target."""
    from dspark.cli.common import target_for_drafter

    here = tmp_path / "target"
    here.mkdir()
    (tmp_path / "empty").mkdir()
    (here / "config.json").write_text("{}")
    for name, expected in (("Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-0.5B-Instruct"), ("/models/mine", None),
                           ("", None), (str(here), str(here)), (os.path.relpath(here), None),
                           (str(tmp_path / "empty"), None)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "dspark", "target_name_or_path": name}))
        assert target_for_drafter(None, str(tmp_path)) == expected
        assert target_for_drafter("/models/other", str(tmp_path)) == "/models/other"
    assert target_for_drafter(None, "random") is None and target_for_drafter(None, None) is None
    (tmp_path / "config.json").write_text("[")  # unreadable: no target recorded
    assert target_for_drafter(None, str(tmp_path)) is None
    # a packaged --target that is not the drafter's own is refused from the configs, before anything loads
    (tmp_path / "config.json").write_text(json.dumps({"target_name_or_path": "Qwen2.5-Coder-0.5B-Instruct"}))
    assert target_for_drafter("Qwen2.5-Coder-0.5B-Instruct", str(tmp_path)) == "Qwen2.5-Coder-0.5B-Instruct"
    with pytest.raises(CLIError, match="made with target Qwen2.5-Coder-0.5B-Instruct, not SmolLM2-135M-Instruct"):
        target_for_drafter("SmolLM2-135M-Instruct", str(tmp_path))
    # a speculators export names its verifier by Hub id: a packaged target's Hub id is that target
    for verifier, expected in (("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"), ("org/other", None),
                               ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-0.5B-Instruct")):
        (tmp_path / "config.json").write_text(json.dumps(
            {"speculators_model_type": "dspark", "speculators_config": {"verifier": {"name_or_path": verifier}}}))
        assert target_for_drafter(None, str(tmp_path)) == expected
    with pytest.raises(CLIError, match="made with target Qwen2.5-Coder-0.5B-Instruct, not SmolLM2-135M-Instruct"):
        target_for_drafter("SmolLM2-135M-Instruct", str(tmp_path))


def test_packaged_targets_bring_their_drafters_and_refuse_foreign_data(tmp_path, capsys):
    """--target NAME picks that target's shipped drafter; dspark train and dspark adapt refuse data or a drafter made
    with another packaged target before anything loads, naming the --target to pass."""
    from dspark.cli.common import shipped_drafter_for, target_of_data
    from modeling_dspark.target import shipped_drafter_for as shipped_dir
    from dspark.cli.main import main
    from modeling_dspark.target import cache_dir

    qwen = "Qwen2.5-Coder-0.5B-Instruct"
    assert shipped_drafter_for(qwen) == str(shipped_dir(qwen)) != shipped_drafter_for(None)
    assert shipped_drafter_for("/some/other/target") is None
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"config": {"target": str(cache_dir() / qwen)}}))
    assert target_of_data(None, [str(data)]) == qwen  # dspark train without --target trains for the data's target
    local = tmp_path / "local-data"  # built with a model directory here, recorded by its absolute path
    local.mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (local / "manifest.json").write_text(json.dumps({"config": {"target": str(tmp_path / "model")}}))
    assert target_of_data(None, [str(local), str(tmp_path / "plain-none")]) == str(tmp_path / "model")
    for mixed in ([str(local), str(data)], [str(data), str(local)]):
        with pytest.raises(CLIError, match="built with different targets"):
            target_of_data(None, mixed)
    (local / "manifest.json").write_text(json.dumps({"config": {"target": "model"}}))  # relative: found nowhere
    with pytest.raises(CLIError, match="built with target 'model', which is not a packaged target or a model "):
        target_of_data(None, [str(local)])
    assert main(["train", "--data", str(data), "--target", "SmolLM2-135M-Instruct",
                 "--out-dir", str(tmp_path / "a")]) == 2
    assert f"was made with target {qwen}, not SmolLM2-135M-Instruct: pass --target {qwen}" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()  # no manifest: a save_to_disk directory records no target
    assert main(["train", "--data", str(tmp_path / "plain"), "--target", "SmolLM2-135M-Instruct",
                 "--init-from-drafter", str(shipped_dir(qwen)), "--out-dir", str(tmp_path / "b")]) == 2
    assert f"--init-from-drafter {shipped_dir(qwen)} was made with target {qwen}" in capsys.readouterr().err
    # dspark adapt takes the drafter's packaged target, and refuses data made with another one
    smol = tmp_path / "smol-data"
    smol.mkdir()
    (smol / "manifest.json").write_text(json.dumps({"config": {"target": str(cache_dir() / "SmolLM2-135M-Instruct")}}))
    adapt = ["adapt", "--drafter", str(shipped_dir(qwen)), "--out-dir", str(tmp_path / "c")]
    assert main(adapt + ["--data", str(smol)]) == 2
    assert (f"--data {smol} was made with target SmolLM2-135M-Instruct, not {qwen}: build it with --target {qwen}"
            in capsys.readouterr().err)
    assert main(adapt + ["--data", str(data), "--eval-data", str(smol)]) == 2
    assert f"--eval-data {smol} was made with target SmolLM2-135M-Instruct" in capsys.readouterr().err
    assert main(adapt + ["--data", str(smol), "--target", "SmolLM2-135M-Instruct"]) == 2
    assert f"--drafter {shipped_dir(qwen)} was made with target {qwen}" in capsys.readouterr().err
    for command in (["generate", "--prompt", "x"], ["eval", "--sets", "gsm8k", "--limit", "1"]):
        assert main(command + ["--target", "SmolLM2-135M-Instruct", "--drafter", str(shipped_dir(qwen))]) == 2
        assert f"--drafter {shipped_dir(qwen)} was made with target {qwen}" in capsys.readouterr().err
    assert main(["export", str(shipped_dir(qwen)), str(tmp_path / "e"), "--format", "speculators",
                 "--target", "SmolLM2-135M-Instruct"]) == 2
    assert f"DRAFTER {shipped_dir(qwen)} was made with target {qwen}" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    # a drafter directory given as --data records no data build's target: not refused for that
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("")  # the next check's refusal shows the target checks passed
    assert main(["train", "--data", str(shipped_dir(qwen)), "--target", qwen, "--init-from-drafter",
                 str(shipped_dir(qwen)), "--out-dir", str(tmp_path / "d")]) == 2
    assert f"--out-dir {tmp_path / 'd'} is not empty" in capsys.readouterr().err


def test_paired_eval_compares_prompt_by_prompt(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("paired_eval", Path(__file__).parent.parent / "benchmarks"
                                                  / "paired_eval.py")
    pe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pe)
    config = {"sets": ["gsm8k", "mtbench"], "limit": 3, "block_size": 8, "policy": "full", "max_new_tokens": 16,
              "dtype": "float32", "seed": 0}

    def report(committed, cfg=config):
        return {"config": dict(cfg), "results": {name: {"greedy": {"per_prompt": {"rounds": [4] * len(c),
                                                                                  "committed": c}}}
                                                for name, c in zip(cfg["sets"], committed)}}

    base = report([[8, 8, 8], [4, 8, 8]])
    new = report([[12, 8, 12], [8, 4, 16]])
    res = pe.compare(base, new)
    assert (res["gsm8k"]["won"], res["gsm8k"]["lost"], res["gsm8k"]["mean_delta"]) == (2, 0, pytest.approx(2 / 3))
    assert (res["mtbench"]["won"], res["mtbench"]["lost"]) == (2, 1)
    assert (res["pooled"]["won"], res["pooled"]["lost"], res["pooled"]["batches"]) == (4, 1, 6)
    assert res["pooled"]["p"] == pytest.approx(0.375)  # two-sided binomial, 4 of 5
    with pytest.raises(ValueError, match="set 'mtbench': 3 prompts in the base report, 2 in the new one"):
        pe.compare(base, report([[12, 8, 12], [8, 4]]))
    with pytest.raises(ValueError, match="the new report has no 'greedy' results for set 'mtbench'"):
        pe.compare(base, report([[12, 8, 12]], dict(config, sets=["gsm8k"])) | {"config": config})
    with pytest.raises(ValueError, match="differ in limit"):
        pe.compare(base, report([[8, 8, 8], [4, 8, 8]], dict(config, limit=4)))
    old = report([[8, 8, 8], [4, 8, 8]])
    del old["results"]["mtbench"]["greedy"]["per_prompt"]
    with pytest.raises(ValueError, match="no per_prompt counts"):
        pe.compare(old, new)
    for name, rep in (("base", base), ("new", new)):
        (tmp_path / f"{name}.json").write_text(json.dumps(rep))
    assert pe.main([str(tmp_path / "base.json"), str(tmp_path / "new.json"), "--out", str(tmp_path / "p.json")]) == 0
    assert "| pooled | 6 | +0.667 | 4 / 1 | 0.375 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "p.json").read_text())["paired"]["pooled"]["won"] == 4


def test_tau_scaling_fits_tau_on_log_sequences(tmp_path, capsys):
    import importlib.util
    import math
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("tau_scaling", Path(__file__).parent.parent / "benchmarks"
                                                  / "tau_scaling.py")
    ts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ts)
    # points on τ = 0.5 + 0.2 ln N exactly: the fit recovers the line and where it reaches the goal
    res = ts.fit([(n, 0.5 + 0.2 * math.log(n)) for n in (1000, 2000, 4000)], goal=2.0)
    assert res["slope"] == pytest.approx(0.2) and res["intercept"] == pytest.approx(0.5)
    assert res["per_doubling"] == pytest.approx(0.2 * math.log(2)) and res["r2"] == pytest.approx(1.0)
    assert res["sequences_for_goal"] == pytest.approx(math.exp(1.5 / 0.2))
    # noisy points: the interval's ends are N_goal at b ± t(0.95, n - 2) s.e.(b), pivoting on the centroid
    import numpy as np
    from scipy.stats import t

    pts = [(1000, 1.40), (2000, 1.50), (4000, 1.66), (8000, 1.72)]
    res = ts.fit(pts, goal=2.1)
    x, y = np.log([n for n, _ in pts]), np.array([tau for _, tau in pts])
    b, a = np.polyfit(x, y, 1)
    se = np.sqrt(((y - a - b * x) ** 2).sum() / 2 / ((x - x.mean()) ** 2).sum())
    ends = [np.exp(x.mean() + (2.1 - y.mean()) / (b + d * t.ppf(0.95, 2) * se)) for d in (1, -1)]
    assert res["sequences_for_goal"] == pytest.approx(np.exp((2.1 - a) / b))
    assert res["sequences_for_goal_ci90"] == pytest.approx(ends) and 8000 < ends[0] < ends[1]
    # the answer does not depend on the unit of N: a thousandfold N needs a thousandfold N_goal
    big = ts.fit([(1000 * n, tau) for n, tau in pts], goal=2.1)
    assert big["sequences_for_goal"] == pytest.approx(1000 * res["sequences_for_goal"])
    assert big["sequences_for_goal_ci90"] == pytest.approx([1000 * e for e in ends])
    # a flat trend never reaches the goal; a nearly flat one's far end is infinite, not an overflow
    assert ts.fit([(1000, 1.5), (2000, 1.5), (4000, 1.5)], goal=2.0)["sequences_for_goal"] == math.inf
    assert ts.fit([(1000, 1.5), (2000, 1.6), (4000, 1.5)], goal=9.0)["sequences_for_goal_ci90"][1] == math.inf
    with pytest.raises(ValueError, match="at least 3"):
        ts.fit([(1000, 1.4), (2000, 1.5)], goal=2.0)
    with pytest.raises(ValueError, match="differ in their sequence counts"):
        ts.fit([(1000, 1.4)] * 3, goal=2.0)
    config = {"sets": ["gsm8k"], "limit": 3, "block_size": 8, "policy": "full", "max_new_tokens": 16,
              "dtype": "float32", "seed": 0}
    for i, tau in enumerate((1.4, 1.6, 1.7)):
        (tmp_path / f"{i}.json").write_text(json.dumps({"config": config, "summary": {"tau_greedy_macro": tau}}))
    args = [f"{n}={tmp_path / f'{i}.json'}" for i, n in enumerate((1000, 3000, 5000))]
    assert ts.main(args + ["--out", str(tmp_path / "fit.json")]) == 0
    assert "| 3,000 | 1.600 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "fit.json").read_text())["fit"]["points"][2] == {"sequences": 5000, "tau": 1.7}
    (tmp_path / "x.json").write_text(json.dumps({"config": dict(config, limit=4), "summary": {"tau_greedy_macro": 2}}))
    assert ts.main(args[:2] + [f"7000={tmp_path / 'x.json'}"]) == 2
    assert "differ in limit" in capsys.readouterr().err
    assert ts.main(args[:2] + [str(tmp_path / "2.json")]) == 2
    assert "expected SEQUENCES=EVAL_JSON" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1]")
    assert ts.main(args[:2] + [f"7000={tmp_path / 'bad.json'}"]) == 2
    assert "no summary.tau_greedy_macro" in capsys.readouterr().err
    (tmp_path / "latin1.json").write_bytes(b"\xff\xfe{")
    assert ts.main(args[:2] + [f"7000={tmp_path / 'latin1.json'}"]) == 2
    assert f"{tmp_path / 'latin1.json'}: not JSON" in capsys.readouterr().err
    assert ts.main(args[:2] + [f"7\u00b2={tmp_path / '2.json'}"]) == 2  # a superscript digit is not a count
    assert "expected SEQUENCES=EVAL_JSON" in capsys.readouterr().err
    # an unreachable goal is written as null: JSON has no infinity
    assert ts.main(args + ["--goal", "1e6", "--out", str(tmp_path / "inf.json")]) == 0
    assert json.loads((tmp_path / "inf.json").read_text())["fit"]["sequences_for_goal"] is None
