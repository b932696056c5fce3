"""The target feature cache (dspark.training.feature_cache) on a tiny random Llama target (CPU, seconds)."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from dspark.training.feature_cache import (
    CachedFeatureCollator,
    FeatureCache,
    FeatureCacheError,
    build_feature_cache,
)
from dspark.training.trainer import DSparkCollator

from tests.test_training import GAMMA, make_args, make_data, make_drafter, make_target

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def data():
    return make_data()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, target, data):
    return build_feature_cache(data, target, LAYERS, tmp_path_factory.mktemp("cache"), batch_size=5, progress=False)


def _trainer(tmp_path, target, drafter, data, collator):
    from dspark.training.trainer import DSparkTrainer

    return DSparkTrainer(model=drafter, target=target, args=make_args(tmp_path), train_dataset=data,
                         data_collator=collator)


@pytest.mark.parametrize("draft_vocab", [None, 24])
def test_cached_batch_gives_the_online_loss(tmp_path, target, data, cache_dir, draft_vocab):
    """Same batch, same drafter: the loss from cached target outputs equals the loss with the target run online
    (up to the bf16 storage of the features), with the full vocabulary and with a draft vocabulary (exact lse)."""
    drafter = make_drafter(target, draft_vocab_size=draft_vocab)
    if draft_vocab:
        drafter.draft_vocab_ids.copy_(torch.randperm(64, generator=torch.Generator().manual_seed(1))[:draft_vocab]
                                      .sort().values)
    cache = FeatureCache(cache_dir, LAYERS, target.config.hidden_size)
    rows = [data[i] for i in range(6)]
    online = DSparkCollator(GAMMA, anchors_per_seq=3, pad_token_id=0, seed=0)(rows)
    cached = CachedFeatureCollator(GAMMA, anchors_per_seq=3, pad_token_id=0, seed=0, cache=cache)(rows)
    for k in online:
        assert torch.equal(online[k], cached[k]), k
    tr = _trainer(tmp_path, target, drafter, data, None)
    drafter.eval()
    with torch.no_grad():
        a = float(tr.compute_loss(drafter, online))
        b = float(tr.compute_loss(drafter, cached))
    assert a > 0 and b == pytest.approx(a, rel=2e-3)
    # the cached rows are the target's own outputs (bf16-rounded), position by position
    feats, _ = tr.target_outputs(online["input_ids"], online["attention_mask"], online["anchor_positions"], LAYERS,
                                 GAMMA)
    real = online["attention_mask"].bool()
    torch.testing.assert_close(cached["context_features"][real].float(), feats[real], rtol=1e-2, atol=1e-2)
    # and the loss reads them: other target outputs give another loss
    bad = dict(cached, slot_hidden=cached["slot_hidden"].flip(0))
    with torch.no_grad():
        assert float(tr.compute_loss(drafter, bad)) != pytest.approx(a, rel=2e-2)


def test_training_from_the_cache_never_runs_the_target(tmp_path, target, data, cache_dir):
    drafter = make_drafter(target)
    cache = FeatureCache(cache_dir, LAYERS, target.config.hidden_size)
    tr = _trainer(tmp_path, target, drafter, data,
                  CachedFeatureCollator(GAMMA, anchors_per_seq=3, pad_token_id=0, seed=0, cache=cache))
    calls = []
    handle = target.model.register_forward_hook(lambda *a: calls.append(1))
    before = drafter.fc.weight.detach().clone()
    try:
        tr.train()
    finally:
        handle.remove()
    assert calls == [] and not torch.equal(before, drafter.fc.weight)


def _assert_same_files(a, b, names=("features.u16", "last_hidden.u16", "lse.f32", "index.npy")):
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@contextlib.contextmanager
def _count_forwards(target):
    """Yield a list that collects the batch size of every target decoder forward inside the block."""
    rows = []
    handle = target.model.register_forward_hook(lambda m, a, k, out: rows.append(k["input_ids"].shape[0]),
                                                with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


def test_build_resumes_after_a_kill(tmp_path, target, data, cache_dir):
    """A build killed after two batches resumes at row 10: rows 0..9 are not recomputed (kept as written) and the
    result equals an uninterrupted build, file for file."""
    out = tmp_path / "c"
    build_feature_cache(data, target, LAYERS, out, batch_size=5, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    meta.update(rows_done=10, complete=False)  # as if killed after two batches
    (out / "meta.json").write_text(json.dumps(meta))
    first_row_10 = int(np.load(out / "index.npy")[10, 1])
    feats = np.memmap(out / "features.u16", dtype=np.uint16, mode="r+").reshape(meta["num_tokens"], -1)
    feats[first_row_10:] = 0  # the rows the killed build had not written yet
    feats.flush()
    del feats
    with pytest.raises(FeatureCacheError, match="incomplete"):
        FeatureCache(out)
    with _count_forwards(target) as rows:
        build_feature_cache(data, target, LAYERS, out, batch_size=5, progress=False)
    assert sum(rows) == len(data) - 10
    _assert_same_files(out, cache_dir)


def test_lost_files_restart_the_build(tmp_path, target, data, cache_dir):
    out = tmp_path / "lost"
    build_feature_cache(data, target, LAYERS, out, batch_size=5, progress=False)
    (out / "lse.f32").unlink()
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps(dict(meta, complete=False)))
    build_feature_cache(data, target, LAYERS, out, batch_size=5, progress=False)
    _assert_same_files(out, cache_dir)


def test_mismatches_are_named(tmp_path, target, data, cache_dir):
    with pytest.raises(FeatureCacheError, match="target layers"):
        FeatureCache(cache_dir, [0, 1], target.config.hidden_size)
    with pytest.raises(FeatureCacheError, match="hidden size"):
        FeatureCache(cache_dir, LAYERS, 128)
    with pytest.raises(FeatureCacheError, match="not a feature cache"):
        FeatureCache(tmp_path)
    with pytest.raises(FeatureCacheError, match="other settings or data"):
        build_feature_cache(data.select(range(5)), target, LAYERS, cache_dir, progress=False)
    cache = FeatureCache(cache_dir, LAYERS)
    row = dict(data[0])
    row["input_ids"] = [3] + list(row["input_ids"][1:]) if row["input_ids"][0] != 3 else [4] + list(row["input_ids"][1:])
    col = CachedFeatureCollator(GAMMA, anchors_per_seq=3, pad_token_id=0, seed=0, cache=cache)
    with pytest.raises(FeatureCacheError, match="tokens differ"):
        col([row])
    with pytest.raises(FeatureCacheError, match="not in the feature cache"):
        col([dict(data[0], idx=10_000)])


def test_a_grown_data_set_extends_the_cache(tmp_path, target, data, cache_dir):
    """Rows appended at the end (more data shards) extend an existing cache, computing only the new rows; the
    result equals a fresh build."""
    out = tmp_path / "g"
    build_feature_cache(data.select(range(10)), target, LAYERS, out, batch_size=5, progress=False)
    assert FeatureCache(out).meta["num_rows"] == 10
    with _count_forwards(target) as rows:
        build_feature_cache(data, target, LAYERS, out, batch_size=5, progress=False)
    assert sum(rows) == len(data) - 10
    _assert_same_files(out, cache_dir)
    with pytest.raises(FeatureCacheError, match="other settings or data"):  # not a prefix: refused
        build_feature_cache(data.select(range(1, 12)), target, LAYERS, out, progress=False)


def test_a_cache_of_another_target_is_refused(tmp_path, target, data, cache_dir):
    other = make_target(seed=5)  # same architecture, other weights
    with pytest.raises(FeatureCacheError, match="another target"):
        FeatureCache(cache_dir, LAYERS, target.config.hidden_size, target=other)
    FeatureCache(cache_dir, LAYERS, target.config.hidden_size, target=target)  # its own target: fine
    with pytest.raises(FeatureCacheError, match="other settings or data"):
        build_feature_cache(data, other, LAYERS, cache_dir, progress=False)


def test_train_cli_two_data_dirs_feature_cache_and_resume(tmp_path, one_thread, capsys):
    """`dspark train` on a saved tiny target with two data directories and --feature-cache: the cache covers both,
    the run saves a drafter + manifest, and --resume continues to the new max-steps from the checkpoint."""
    from dspark.cli import train_cmd
    from tests.test_training import saved_tiny_target

    tdir = saved_tiny_target(tmp_path, {"a": [f"what is {a} plus {b}?" for a in range(3) for b in range(3)],
                                        "b": [f"name {a} colors" for a in range(6)]})
    out, cache = tmp_path / "run", tmp_path / "cache"
    common = ["--data", str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(out), "--target", str(tdir),
              "--target-layer-ids", "0,2", "--num-draft-layers", "1", "--block-size", "4", "--markov-rank", "8",
              "--draft-vocab-size", "24", "--anchors-per-seq", "2", "--batch-size", "4", "--lr", "1e-2",
              "--save-steps", "2", "--logging-steps", "1", "--feature-cache", str(cache), "--cpu", "--threads", "1"]
    assert train_cmd.main(common + ["--max-steps", "2"]) == 0
    meta = json.loads((cache / "meta.json").read_text())
    man = json.loads((out / "training_manifest.json").read_text())
    assert meta["complete"] and meta["num_rows"] == man["sequences"] == 15
    assert man["global_step"] == 2 and man["feature_cache"] == str(cache)
    assert man["args"]["max_steps"] == 2 and "<function" not in json.dumps(man)  # options only, no callables
    assert set(man["data_manifest"]) == {str(tmp_path / "a"), str(tmp_path / "b")}
    assert train_cmd.main(common + ["--max-steps", "4", "--resume"]) == 0
    man = json.loads((out / "training_manifest.json").read_text())
    assert man["global_step"] == 4 and man["resumed_from"].endswith("checkpoint-2")
    # resuming with drafter options the checkpoint was not trained with is refused, naming them
    assert train_cmd.main(common + ["--max-steps", "6", "--resume", "--mask-token-id", "3"]) == 2
    assert "mask_token_id: checkpoint None, now 3" in capsys.readouterr().err
    import modeling_dspark as md

    drafter = md.DSparkDraftModel.from_pretrained(out)
    assert drafter.config.draft_vocab_size == 24 and drafter.draft_vocab_ids.numel() == 24
    # one plain save_to_disk directory (no manifest), online target: trains and writes its manifest
    from dspark.training.data import load_data

    load_data(tmp_path / "a").save_to_disk(str(tmp_path / "plain"))
    plain = ["--data", str(tmp_path / "plain")] + common[common.index("--output-dir"):common.index("--feature-cache")]
    assert train_cmd.main(plain + ["--output-dir", str(tmp_path / "run2"), "--max-steps", "1", "--cpu",
                                   "--mask-token-id", "3"]) == 0
    man = json.loads((tmp_path / "run2" / "training_manifest.json").read_text())
    assert man["global_step"] == 1 and man["data_manifest"] is None and man["feature_cache"] is None
    # --mask-token-id: mask slots read E[3], no learned mask embedding (what the export formats need)
    drafter = md.DSparkDraftModel.from_pretrained(tmp_path / "run2")
    assert drafter.config.mask_token_id == 3 and drafter.mask_embedding is None
    from dspark.cli.main import main as cli_main

    # the drafter names its target by the absolute --target path: the export names it portably instead
    assert cli_main(["export", str(tmp_path / "run2"), str(tmp_path / "spec"), "--format", "speculators",
                     "--target", str(tdir), "--verifier-name", "tiny-target"]) == 0
    assert md.DSparkDraftModel.from_pretrained(tmp_path / "spec").config.source_format == "speculators"
