"""LoRA adaptation of a DSpark drafter (dspark.training.peft_adapt, `dspark adapt`) on a tiny random Llama target."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from .conftest import require

require(importlib.util.find_spec("peft") is not None, "peft is not installed: pip install -e '.[train]'")

import modeling_dspark as md  # noqa: E402
from dspark.training.peft_adapt import (  # noqa: E402
    add_lora,
    base_drafter,
    greedy_tau,
    load_adapter,
    merge_lora,
    read_adapter_info,
    save_adapter,
    trainable_parameter_summary,
)
from dspark.training.trainer import DSparkCollator, DSparkTrainer, prepare_dataset  # noqa: E402
from tests.test_training import GAMMA, make_args, make_data, make_drafter, make_target, saved_tiny_target  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # restored after this module


@torch.no_grad()
def domain_data(target, n=24, prompt_len=4, new=20, seed=0, lo=3, hi=16):
    """A "new domain": prompts over a token subset, responses = the target's own greedy continuation."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(lo, hi, (n, prompt_len), generator=g)
    for _ in range(new):
        nxt = target(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return prepare_dataset(Dataset.from_dict({"input_ids": ids.tolist(), "prompt_len": [prompt_len] * n}))


def trainer_for(out, target, model, data, **kw):
    kw = {"max_steps": 4, "learning_rate": 1e-2, **kw}
    return DSparkTrainer(model=model, target=target, args=make_args(out, **kw), train_dataset=data,
                         data_collator=DSparkCollator(GAMMA, anchors_per_seq=3, pad_token_id=0, seed=0))


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def base_dir(target, tmp_path_factory):
    """An "existing" drafter: trained a few steps on general (random) data, saved."""
    out = tmp_path_factory.mktemp("base")
    drafter = make_drafter(target)
    trainer_for(out / "run", target, drafter, make_data(), max_steps=6).train()
    drafter.save_pretrained(out / "drafter")
    return out / "drafter"


@pytest.fixture(scope="module")
def domain(target):
    return domain_data(target)


def load_base(base_dir, target):
    d = md.DSparkDraftModel.from_pretrained(base_dir)
    return d.bind_target(target).float()


def outputs(model, target, batch):
    """base logits, corrected draft logits and confidence logits of ``model`` (drafter or PeftModel) on a batch."""
    d = base_drafter(model)
    model.eval()
    with torch.no_grad():
        tr_feats = target(batch["input_ids"], output_hidden_states=True).hidden_states
        feats = torch.cat([tr_feats[i + 1] for i in d.config.target_layer_ids], dim=-1)
        anchors = batch["anchor_positions"]
        ids = batch["input_ids"]
        b, s = ids.shape
        from modeling_dspark.common import block_attention_mask, block_positions

        pos = torch.arange(s).expand(b, s)
        mask = block_attention_mask(anchors, pos, GAMMA, batch["attention_mask"].bool())
        out = model(anchor_ids=ids.gather(1, anchors), anchor_positions=anchors, context_features=feats,
                    context_positions=pos, attention_mask=mask, num_slots=GAMMA)
        slots = block_positions(anchors, GAMMA).clamp(max=s - 1)
        prev = ids.gather(1, slots.reshape(b, -1)).reshape(slots.shape)
        corr = d.correction_logits(prev, out.hidden_states)
        conf = d.confidence_logits(prev, out.hidden_states)
    return out.base_logits, out.base_logits + corr, conf


def batch_of(domain, n=6):
    return DSparkCollator(GAMMA, anchors_per_seq=3, pad_token_id=0, seed=1)([domain[i] for i in range(n)])


# --------------------------------------------------------------------------- tests
def test_only_lora_parameters_train(target, base_dir, domain, tmp_path):
    drafter = load_base(base_dir, target)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    before_t = {k: v.clone() for k, v in target.state_dict().items()}
    model = add_lora(drafter, r=4, alpha=8)
    summary = trainable_parameter_summary(model)
    assert summary["names"] and all("lora_" in n for n in summary["names"])
    # one A and one B per adapted projection: 7 projections in the single draft layer
    assert sum(".lora_A." in n for n in summary["names"]) == 7 and summary["fraction"] < 0.2
    tr = trainer_for(tmp_path, target, model, domain, save_strategy="steps", save_steps=4)
    tr.train()
    assert model.config is drafter.config  # the trainer reaches drafter attributes through the PeftModel
    opt = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert opt == {id(p) for p in model.parameters() if p.requires_grad}
    # every base drafter weight is unchanged (peft stores a wrapped Linear's weight under .base_layer)
    after = {k.replace(".base_layer.", "."): v for k, v in drafter.state_dict().items() if "lora_" not in k}
    assert set(after) == set(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    for k, v in target.state_dict().items():
        assert torch.equal(v, before_t[k]), k
    # the adapters did train (lora_B starts at zero)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert all(p.abs().sum() > 0 for p in lora_b)
    # the Trainer's checkpoint holds only the adapter
    ckpt = tmp_path / "checkpoint-4"
    keys = set(load_file(ckpt / "adapter_model.safetensors"))
    assert keys and all("lora_" in k for k in keys) and not (ckpt / "model.safetensors").exists()
    assert tr.state.log_history[0].keys() >= {"loss", "ce", "tv", "conf"}


def test_lora_lowers_domain_loss_and_tau_is_measured(target, base_dir, domain, tmp_path):
    model = add_lora(load_base(base_dir, target), r=8, alpha=16)
    tr = trainer_for(tmp_path, target, model, domain, max_steps=24, logging_steps=24, learning_rate=2e-2)
    batch = batch_of(domain, 8)

    def loss_now():
        model.eval()
        with torch.no_grad():
            return float(tr.compute_loss(model, batch))

    prompts = [domain[i]["input_ids"][:4] for i in range(3)]
    # the new tokens of plain greedy decoding (the same tokens): the rounds commit all but the prefill's (the first)
    # and, where one token is left to make, the last (a plain step: nothing to draft)
    plain = [target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=12, do_sample=False) for p in prompts]
    new = [out.shape[1] - len(p) for out, p in zip(plain, prompts)]
    tau_before = greedy_tau(target, model, prompts, max_new_tokens=12)
    before = loss_now()
    tr.train()
    after = loss_now()
    assert after < 0.9 * before, (before, after)
    tau_after = greedy_tau(target, model, prompts, max_new_tokens=12)
    for t in (tau_before, tau_after):
        assert sum(new) - 2 * len(new) <= t["tokens"] <= sum(new) - len(new)
        assert t["tau"] == t["tokens"] / t["rounds"] <= GAMMA + 1
        assert len(t["per_position_acceptance"]) == GAMMA
    assert tau_after["tau"] >= tau_before["tau"], (tau_before, tau_after)


@pytest.mark.parametrize("train_heads", [False, True])
def test_merged_model_equals_peft_model(target, base_dir, domain, tmp_path, train_heads):
    drafter = load_base(base_dir, target)
    head_before = drafter.confidence_head.proj.weight.clone()
    model = add_lora(drafter, r=4, alpha=8, train_heads=train_heads)
    trainer_for(tmp_path, target, model, domain, max_steps=3).train()
    batch = batch_of(domain)
    ref = outputs(model, target, batch)
    if train_heads:  # the trained copies differ from the base heads, which stay untouched
        trained = model.base_model.model.confidence_head.modules_to_save["default"].proj.weight
        assert not torch.equal(trained, head_before)
        assert torch.equal(model.base_model.model.confidence_head.original_module.proj.weight, head_before)
    merged = merge_lora(model)
    assert type(merged) is md.DSparkDraftModel
    assert not any("lora_" in k or "base_layer" in k or "modules_to_save" in k for k in merged.state_dict())
    got = outputs(merged, target, batch)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the merged drafter saves and loads (strictly) like any drafter
    merged.save_pretrained(tmp_path / "merged")
    again = md.DSparkDraftModel.from_pretrained(tmp_path / "merged").bind_target(target)
    for a, b in zip(ref, outputs(again, target, batch)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_adapter_save_load_round_trip(target, base_dir, domain, tmp_path):
    model = add_lora(load_base(base_dir, target), r=4, alpha=8, train_heads=True)
    trainer_for(tmp_path / "run", target, model, domain, max_steps=3).train()
    batch = batch_of(domain)
    ref = outputs(model, target, batch)
    path = save_adapter(model, tmp_path / "adapter", base_drafter_path=base_dir)
    keys = set(load_file(path / "adapter_model.safetensors"))
    assert keys and all("lora_" in k or "sequential_head" in k or "confidence_head" in k for k in keys)
    assert not any("layers.0.mlp.up_proj.weight" == k.split("model.", 1)[-1] for k in keys)  # no base weights
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["base_model_name_or_path"] == str(base_dir)
    assert read_adapter_info(path)["base_drafter"] == str(base_dir)
    with pytest.raises(OSError, match=r"holds a LoRA adapter: dspark.training.peft_adapt.load_adapter loads it"):
        md.DSparkDraftModel.from_pretrained(path)
    fresh = load_base(base_dir, target)
    base_out = outputs(fresh, target, batch)
    loaded = load_adapter(fresh, path)
    got = outputs(loaded, target, batch)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base_out[1], got[1])  # the adapter changes the drafter
    assert not any(p.requires_grad for p in loaded.parameters())  # loaded for inference by default
    with pytest.raises(FileNotFoundError):
        load_adapter(load_base(base_dir, target), tmp_path)


def test_resume_with_lora_continues_same_run(target, base_dir, domain, tmp_path):
    torch.manual_seed(0)  # the same LoRA init for both runs (lora_A is drawn from the global RNG)
    full_model = add_lora(load_base(base_dir, target), r=4, alpha=8)
    trainer_for(tmp_path / "full", target, full_model, domain, max_steps=4).train()
    torch.manual_seed(0)
    part = add_lora(load_base(base_dir, target), r=4, alpha=8)
    trainer_for(tmp_path / "part", target, part, domain, max_steps=4, save_strategy="steps", save_steps=2).train()
    torch.manual_seed(99)  # a different fresh LoRA init: resumption must overwrite it
    resumed = add_lora(load_base(base_dir, target), r=4, alpha=8)
    tr = trainer_for(tmp_path / "part", target, resumed, domain, max_steps=4, save_strategy="steps", save_steps=2)
    tr.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-2"))
    assert tr.state.global_step == 4
    ref = dict(full_model.named_parameters())
    for n, p in resumed.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p, ref[n], rtol=1e-4, atol=1e-5)


def test_add_lora_rejects_bad_arguments(target):
    with pytest.raises(ValueError):
        add_lora(make_drafter(target), target_modules=["nonexistent_proj"])
    with pytest.raises(ValueError):
        add_lora(make_drafter(target), r=0)
    with pytest.raises(TypeError):
        add_lora(target)


def test_adapt_cli_end_to_end(tmp_path):
    """`dspark adapt` on a saved tiny target + tokenizer, a built domain data set and a saved base drafter."""
    import argparse

    from dspark.cli import adapt_cmd

    prompts = [f"what is {a} plus {b}?" for a in range(3) for b in range(3)]
    tdir = saved_tiny_target(tmp_path, {"data": prompts})
    tgt = make_target(seed=1)  # the saved target's weights (same seed): the drafter needs its config
    drafter = make_drafter(tgt)
    drafter.config.target_name_or_path = str(tdir)  # `dspark adapt` finds the target through the drafter
    drafter.save_pretrained(tmp_path / "base")
    out = tmp_path / "adapted"
    rc = adapt_cmd.main([
        "--drafter", str(tmp_path / "base"), "--data", str(tmp_path / "data"), "--output-dir", str(out),
        "--lora-r", "4", "--max-steps", "3", "--lr", "1e-2", "--batch-size", "4", "--anchors-per-seq", "2",
        "--eval-prompts", "2", "--eval-max-new-tokens", "6", "--save-steps", "3", "--logging-steps", "1",
        "--merge", "--cpu",
    ])
    assert rc == 0
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()
    man = json.loads((out / "adapt_manifest.json").read_text())
    assert man["global_step"] == 3 and man["train_sequences"] == 7 and len(man["eval_ids"]) == 2
    for key in ("tau_before", "tau_after"):  # τ = committed / rounds; the prefill's token is not a round's
        t = man[key]
        assert t["prompts"] == 2 and 1 <= t["rounds"] <= t["tokens"] <= 2 * (6 - 1)
        assert t["tau"] == pytest.approx(t["tokens"] / t["rounds"])
    # the trainable parameters are the adapter's: every tensor in the saved adapter file
    adapter = load_file(out / "adapter_model.safetensors")
    assert man["lora"]["trainable_params"] == sum(v.numel() for v in adapter.values()) > 0
    info = read_adapter_info(out)
    assert info["base_drafter"] == str(tmp_path / "base") and info["tau_after"] == man["tau_after"]["tau"]
    merged = md.DSparkDraftModel.from_pretrained(out / "merged")
    base = md.DSparkDraftModel.from_pretrained(tmp_path / "base")
    assert not torch.equal(merged.layers[0].mlp.up_proj.weight, base.layers[0].mlp.up_proj.weight)
    # the adapter loads back onto the base drafter and equals the merged drafter
    adapted = merge_lora(load_adapter(base, out))
    for (k, v), (k2, v2) in zip(adapted.state_dict().items(), merged.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v, v2, rtol=1e-5, atol=1e-6)
    # the sub-command registers on a `dspark`-style parser
    sub = argparse.ArgumentParser().add_subparsers()
    p = adapt_cmd.add_parser(sub)
    args = p.parse_args(["--drafter", "d", "--data", "x", "--output-dir", "o", "--merge", "--lora-r", "16"])
    assert args.merge and args.lora_r == 16


@pytest.fixture
def cli_inputs(target, tmp_path, no_target_load):
    """A drafter directory and a 4-row data set for `dspark adapt`; the input must be refused before the target
    loads (``no_target_load``)."""
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    Dataset.from_dict({"input_ids": [list(range(3, 12))] * 4, "prompt_len": [3] * 4}).save_to_disk(
        str(tmp_path / "data"))
    return ["adapt", "--drafter", str(tmp_path / "drafter"), "--data", str(tmp_path / "data"),
            "--out-dir", str(tmp_path / "out")]


@pytest.mark.parametrize("extra, message", [
    (["--drafter", "/nonexistent"], "drafter directory not found: '/nonexistent'"),
    (["--data", "/nonexistent"], "--data /nonexistent: directory not found"),
    (["--eval-data", "/nonexistent"], "--eval-data /nonexistent: directory not found"),
    (["--target", "/nonexistent"], "--target '/nonexistent' is not a local model directory"),
    (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["--lora-r", "0"], "--lora-r must be >= 1"),
    (["--lora-alpha", "-1"], "--lora-alpha must be > 0"),
    (["--lora-dropout", "1"], "--lora-dropout must be < 1"),
    (["--lr", "inf"], "--lr must be > 0, got inf"),
    (["--target-modules", ","], "--target-modules is empty"),
    (["--eval-prompts", "-1"], "--eval-prompts must be >= 0"),
    (["--eval-prompts", "4"], "--eval-prompts 4 leaves no training rows (--data has 4 rows)"),
    (["--eval-block-size", "99"], f"--eval-block-size must be in [1, {GAMMA}] for this drafter, got 99"),
    (["--resume", "/nonexistent"], "--resume /nonexistent: checkpoint directory not found"),
])
def test_adapt_refuses_bad_input_before_loading(extra, message, cli_inputs, capsys):
    from dspark.cli.main import main

    assert main(cli_inputs + extra) == 2
    err = capsys.readouterr().err
    assert "dspark adapt: error: " in err and message in err and "Traceback" not in err, err


def test_adapt_into_a_non_empty_out_dir_needs_resume(cli_inputs, tmp_path, capsys):
    from dspark.cli.main import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "adapter_config.json").write_text("{}")
    assert main(cli_inputs) == 2
    assert "is not empty: pass --resume" in capsys.readouterr().err


def test_a_peft_drafter_drafts_in_generate(target, base_dir, domain, tmp_path):
    """A PeftModel of a drafter passed as assistant_model drafts with DSpark, through its LoRA layers, and gives plain
    greedy's output."""
    from dspark.generation import collect_stats, dspark_options

    model = add_lora(load_base(base_dir, target), r=4, alpha=8, train_heads=True)
    trainer_for(tmp_path, target, model, domain, max_steps=3).train()
    model.eval()
    ids = torch.tensor([domain[0]["input_ids"][:4]])
    kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 16, "do_sample": False}
    reference = target.generate(ids, **kw)
    lora = next(m for name, m in model.named_modules() if name.endswith("lora_A.default"))
    calls = []
    handle = lora.register_forward_hook(lambda *a: calls.append(1))
    try:
        with dspark_options(policy="full", lookup=False), collect_stats() as runs:
            assert torch.equal(target.generate(ids, assistant_model=model, **kw), reference)
    finally:
        handle.remove()
    assert runs and sum(r.drafted for r in runs[-1].rounds) > 0 and calls
