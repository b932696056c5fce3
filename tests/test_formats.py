"""Format detection, import and export of other implementations' drafter checkpoints (modeling_dspark.formats).

DeepSpec is not on PyPI: its checkpoints are built here by hand from its documented layout (config keys written by
``build_draft_config``, tensor names of ``Qwen3DSparkModel``); the peers that are on PyPI are exercised against
their own code in tests/test_peers.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

import modeling_dspark as md
from dspark.cli.main import main as cli_main
from modeling_dspark import export, formats
from tests.test_peers import MASK, VOCAB, check_rounds, dspark_rounds, prompt, scale_weights, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

H, HD, R = 64, 16, 8


def deepspec_checkpoint(path, target, block=5, layer_ids=(-1, 1, 3), rank=R, head="vanilla", confidence=True,
                        with_markov=True, seed=0):
    """A DeepSpec-flat checkpoint for ``target`` with random weights: the target's config edited as DeepSpec's
    ``build_draft_config`` does, the tensors ``Qwen3DSparkModel`` saves."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, norm=False):
        return 1 + 0.1 * torch.randn(shape, generator=g) if norm else 0.2 * torch.randn(shape, generator=g)

    config = target.config.to_dict()
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=target.config.num_hidden_layers,
                  num_hidden_layers=2, block_size=block, tie_word_embeddings=False,
                  layer_types=["full_attention"] * 2, mask_token_id=MASK, target_layer_ids=list(layer_ids),
                  num_anchors=512, enable_confidence_head=confidence, markov_rank=rank)
    if confidence:
        config["confidence_head_with_markov"] = with_markov
    if rank:
        config["markov_head_type"] = head
    config["model_type"] = "qwen3"
    nh, nkv, ff = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    state = {
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
        "lm_head.weight": target.get_output_embeddings().weight.detach().clone(),
        "fc.weight": rand(H, len(layer_ids) * H), "hidden_norm.weight": rand(H, norm=True),
        "norm.weight": rand(H, norm=True),
    }
    for i in range(2):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rand(nh * HD, H), p + "self_attn.k_proj.weight": rand(nkv * HD, H),
            p + "self_attn.v_proj.weight": rand(nkv * HD, H), p + "self_attn.o_proj.weight": rand(H, nh * HD),
            p + "self_attn.q_norm.weight": rand(HD, norm=True), p + "self_attn.k_norm.weight": rand(HD, norm=True),
            p + "mlp.gate_proj.weight": rand(ff, H), p + "mlp.up_proj.weight": rand(ff, H),
            p + "mlp.down_proj.weight": rand(H, ff),
            p + "input_layernorm.weight": rand(H, norm=True), p + "post_attention_layernorm.weight": rand(H, norm=True),
        })
    if rank:
        state["markov_head.markov_w1.weight"] = rand(VOCAB, rank)
        state["markov_head.markov_w2.weight"] = rand(VOCAB, rank)
        if head == "gated":
            state["markov_head.gate_proj.weight"] = rand(rank, H + rank)
            state["markov_head.gate_proj.bias"] = rand(rank)
        if head == "rnn":
            state["markov_head.joint_proj.weight"] = rand(3 * rank, 2 * rank + H)
            state["markov_head.joint_proj.bias"] = rand(3 * rank)
    if confidence:
        state["confidence_head.proj.weight"] = rand(1, H + (rank if with_markov else 0))
        state["confidence_head.proj.bias"] = rand(1)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    return config, state


def new_drafter(target, **kw):
    """A random Qwen3-style dspark drafter for ``target`` (weights of a scale that makes drafts vary)."""
    fields = dict(block_size=4, num_draft_layers=1, target_layer_ids=[0, 2], mask_token_id=MASK, markov_rank=R)
    fields.update(kw)
    drafter = md.DSparkDraftModel(md.DSparkConfig.from_target_config(target.config, **fields)).eval()
    scale_weights(drafter, seed=1)
    if drafter.draft_vocab_ids is not None:
        drafter.draft_vocab_ids.copy_(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[
            : drafter.config.draft_vocab_size].sort().values)
    return drafter.bind_target(target)


# ---------------------------------------------------------------------------------------------------- detection
@pytest.mark.parametrize("config,expected", [
    ({"model_type": "dspark"}, "dspark"),
    ({"model_type": "qwen3", "architectures": ["Qwen3DSparkModel"]}, "deepspec"),
    ({"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 1}}, "dflash"),
    ({"model_type": "qwen3", "architectures": ["DFlashDraftModel"]}, "dflash"),
    ({"architectures": ["DSparkDraftModel"], "dflash_config": {"projector_type": "dspark"}}, "specforge"),
    ({"architectures": ["DFlashDraftModel"], "dflash_config": {"projector_type": "dspark", "shift_label": 0}},
     "specforge"),
    ({"speculators_model_type": "dspark"}, "speculators"),
    ({"speculators_model_type": "dflash"}, "speculators"),
])
def test_detect_format(config, expected):
    assert formats.detect_format(config) == expected


@pytest.mark.parametrize("config,message", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "unrecognised drafter config"),
    ({"architectures": ["Gemma4DSparkModel"]}, "Gemma-4"),
    ({"architectures": ["DFlash2DraftModel"], "dflash_config": {}}, "DFlash2"),
    ({"speculators_model_type": "eagle3"}, "eagle3"),
    ([1, 2], "JSON object"),
])
def test_detect_format_refuses_unknown(config, message):
    with pytest.raises(ValueError, match=message):
        formats.detect_format(config)


# ---------------------------------------------------------------------------------------------------- DeepSpec
@pytest.mark.parametrize("family,head,confidence,with_markov", [
    ("qwen3", "vanilla", True, True), ("qwen3", "gated", True, False), ("qwen3", "rnn", True, True),
    ("qwen3", None, True, False), ("llama", "vanilla", False, False),
])
def test_deepspec_checkpoint_loads_and_is_lossless(tmp_path, family, head, confidence, with_markov):
    target = tiny_target(family)
    deepspec_checkpoint(tmp_path, target, rank=R if head else 0, head=head or "vanilla", confidence=confidence,
                        with_markov=with_markov)
    drafter = md.DSparkDraftModel.from_pretrained(tmp_path, target=target).eval()
    c = drafter.config
    assert (c.block_size, c.anchor_predicts, c.mask_token_id, c.own_embeddings) == (5, True, MASK, True)
    assert c.target_layer_ids == [-1, 1, 3] and c.target_model_type == family
    assert c.sequential_head == {"vanilla": "markov", None: "none"}.get(head, head)
    assert (c.use_confidence_head, c.confidence_head_with_markov) == (confidence, with_markov)
    # the loaded tensors are the checkpoint's, renamed
    saved = load_file(str(tmp_path / "model.safetensors"))
    mine = drafter.state_dict()
    assert torch.equal(mine["layers.1.self_attn.k_norm.weight"], saved["layers.1.self_attn.k_norm.weight"])
    if head:
        assert torch.equal(mine["sequential_head.out.weight"], saved["markov_head.markov_w2.weight"])
    ids = prompt(seed=4)
    plain = target.generate(ids, do_sample=False, max_new_tokens=20)
    assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=20), plain)


def deepspec_round(config, state, target):
    """DeepSpec's drafting round at a committed prefix, written from its code independently of dspark's forward:
    ``Qwen3DSparkModel._forward_backbone`` over the block [anchor, mask_token_id × (γ−1)] attending to the whole
    context (`forward_dspark_draft_block`), every slot predicting; the Markov head's greedy
    ``sample_block_tokens`` (bias from the previous token, an RNN state carried left to right); confidences
    σ(``predict_confidence_step``) with the previous token x_{k−1} (`build_dspark_proposal`). Plain torch over the
    checkpoint's tensors, float32."""
    S = {k: v.float() for k, v in state.items()}
    gamma, eps = config["block_size"], config["rms_norm_eps"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    rank, head = config["markov_rank"], config.get("markov_head_type")

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x, pos):  # x [T, heads, d], pos [T]
        freqs = pos[:, None].float() * theta ** (-torch.arange(0, hd, 2).float() / hd)
        cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin

    def run(prefix):
        start = prefix.shape[1] - 1
        with torch.no_grad():
            hs = target(prefix, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[0 if i == -1 else i + 1] for i in config["target_layer_ids"]], -1)[0, :start]
        ctx = rms(feats @ S["fc.weight"].T, S["hidden_norm.weight"])
        block = torch.tensor([int(prefix[0, -1])] + [config["mask_token_id"]] * (gamma - 1))
        x = S["embed_tokens.weight"][block]
        pos = torch.arange(start + gamma)
        for i in range(config["num_hidden_layers"]):
            w = {k[len(f"layers.{i}."):]: v for k, v in S.items() if k.startswith(f"layers.{i}.")}
            h = rms(x, w["input_layernorm.weight"])
            q = rope(rms((h @ w["self_attn.q_proj.weight"].T).view(gamma, nh, hd), w["self_attn.q_norm.weight"]),
                     pos[start:])
            kv_in = torch.cat([ctx, h])  # the same k_proj / k_norm over context and block keys
            k = rope(rms((kv_in @ w["self_attn.k_proj.weight"].T).view(-1, nkv, hd), w["self_attn.k_norm.weight"]),
                     pos)
            v = (kv_in @ w["self_attn.v_proj.weight"].T).view(-1, nkv, hd)
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5, -1)  # no mask: bidirectional
            x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(gamma, nh * hd) @ w["self_attn.o_proj.weight"].T
            m = rms(x, w["post_attention_layernorm.weight"])
            x = x + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ \
                w["mlp.down_proj.weight"].T
        hidden = rms(x, S["norm.weight"])
        logits = hidden @ S["lm_head.weight"].T
        tokens, prev, state_r = [], int(block[0]), torch.zeros(rank)
        for k in range(gamma):
            step = logits[k]
            if rank:
                e = S["markov_head.markov_w1.weight"][prev]
                if head == "gated":
                    e = torch.sigmoid(S["markov_head.gate_proj.weight"] @ torch.cat([hidden[k], e])
                                      + S["markov_head.gate_proj.bias"]) * e
                elif head == "rnn":
                    g, c, o = (S["markov_head.joint_proj.weight"] @ torch.cat([state_r, e, hidden[k]])
                               + S["markov_head.joint_proj.bias"]).chunk(3)
                    state_r = torch.sigmoid(g) * state_r + (1 - torch.sigmoid(g)) * torch.tanh(c)
                    e = torch.tanh(o)
                step = step + S["markov_head.markov_w2.weight"] @ e
            prev = int(step.argmax())
            tokens.append(prev)
        confs = None
        if config["enable_confidence_head"]:
            feats = hidden
            if config.get("confidence_head_with_markov"):
                prev_ids = torch.tensor([int(block[0])] + tokens[:-1])
                feats = torch.cat([hidden, S["markov_head.markov_w1.weight"][prev_ids]], -1)
            confs = torch.sigmoid(feats @ S["confidence_head.proj.weight"][0] + S["confidence_head.proj.bias"])
            confs = confs.tolist()
        return tokens, confs
    return run


@pytest.mark.parametrize("family,head,rank,confidence,with_markov,layer_ids,block,seed", [
    ("qwen3", "vanilla", R, True, True, (-1, 1, 3), 5, 11), ("qwen3", "gated", R, True, False, (0, 2, 4), 4, 12),
    ("qwen3", "rnn", R, True, True, (-1, 3), 5, 13), ("llama", "vanilla", R, True, True, (-1, 2), 3, 14),
    ("qwen3", "vanilla", 0, True, False, (1, 3), 5, 15), ("qwen3", "rnn", R, False, False, (-1, 0, 4), 6, 16),
])
def test_deepspec_drafts_as_deepspec(tmp_path, family, head, rank, confidence, with_markov, layer_ids, block, seed):
    """A DeepSpec checkpoint loaded with from_pretrained(dir, target=...) drafts, round by round, the tokens and
    confidences of DeepSpec's own drafting round (:func:`deepspec_round`) at each committed prefix."""
    target = tiny_target(family)
    config, state = deepspec_checkpoint(tmp_path, target, block=block, layer_ids=layer_ids, rank=rank, head=head,
                                        confidence=confidence, with_markov=with_markov, seed=seed)
    drafter = md.DSparkDraftModel.from_pretrained(tmp_path, target=target).eval()
    rounds = check_rounds(target, drafter, deepspec_round(config, state, target), prompt(seed=seed), max_new_tokens=30)
    assert any(len(set(t)) > 1 for _, t, _ in rounds)  # drafts vary: the comparison is not vacuous


def test_published_deepspec_config():
    """The config of deepseek-ai/dspark_qwen3_8b_block7 as DeepSpec's build_draft_config writes it (Qwen3-8B's
    config.json edited with DeepSpec's config/dspark/dspark_qwen3_8b.py) converts field by field."""
    config = {
        "architectures": ["Qwen3DSparkModel"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936, "num_target_layers": 36, "block_size": 7,
        "layer_types": ["full_attention"] * 5, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33],
        "num_anchors": 512, "enable_confidence_head": True, "confidence_head_with_markov": True,
        "markov_rank": 256, "markov_head_type": "vanilla",
    }
    c, _ = formats.convert_to_dspark("deepspec", config, {"embed_tokens.weight": 0, "lm_head.weight": 0})
    assert (c.block_size, c.anchor_predicts, c.mask_token_id, c.own_embeddings) == (7, True, 151669, True)
    assert (c.num_draft_layers, c.target_num_hidden_layers, c.target_layer_ids) == (5, 36, [1, 9, 17, 25, 33])
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        4096, 12288, 32, 8, 128)
    assert c.rope_parameters["rope_theta"] == 1000000 and c.rms_norm_eps == 1e-06 and c.draft_layer_style == "qwen3"
    assert (c.sequential_head, c.markov_rank, c.use_confidence_head, c.confidence_head_with_markov) == (
        "markov", 256, True, True)


def test_deepspec_checkpoint_without_table_copies(tmp_path):
    """vLLM also loads DeepSpec-flat files without embed_tokens / lm_head (the target's are used): so does dspark."""
    target = tiny_target("qwen3")
    _, state = deepspec_checkpoint(tmp_path / "full", target)
    deepspec_checkpoint(tmp_path / "bare", target)
    del state["embed_tokens.weight"], state["lm_head.weight"]
    save_file(state, str(tmp_path / "bare" / "model.safetensors"))
    full = md.DSparkDraftModel.from_pretrained(tmp_path / "full", target=target).eval()
    bare = md.DSparkDraftModel.from_pretrained(tmp_path / "bare", target=target).eval()
    assert full.config.own_embeddings and not bare.config.own_embeddings
    check_rounds(target, bare, lambda prefix: _rounds_of(target, full, prefix), prompt(seed=8))


def test_deepspec_export_round_trip(tmp_path):
    """DeepSpec checkpoint -> dspark -> DeepSpec: the same config keys and the same tensors."""
    target = tiny_target("qwen3")
    config, state = deepspec_checkpoint(tmp_path / "src", target, layer_ids=(0, 2, 4))
    drafter = md.DSparkDraftModel.from_pretrained(tmp_path / "src", target=target)
    export.export_drafter(drafter, tmp_path / "out", format="deepspec")
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("architectures", "num_target_layers", "num_hidden_layers", "block_size", "mask_token_id",
                "target_layer_ids", "enable_confidence_head", "confidence_head_with_markov", "markov_rank",
                "markov_head_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "vocab_size", "tie_word_embeddings", "layer_types", "model_type"):
        assert out_config[key] == config[key], key
    out_state = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert out_state.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(out_state[key], value), key


def test_deepspec_import_exports_as_speculators(tmp_path):
    """A DeepSpec checkpoint (own copies of the target's table and head) written as speculators drafts the same;
    copies that differ from the target's are refused."""
    target = tiny_target("qwen3")
    deepspec_checkpoint(tmp_path / "src", target)
    drafter = md.DSparkDraftModel.from_pretrained(tmp_path / "src", target=target).eval()
    export.export_drafter(drafter, tmp_path / "spec", format="speculators")
    back = md.DSparkDraftModel.from_pretrained(tmp_path / "spec", target=target).eval()
    assert not back.config.own_embeddings and back.config.anchor_predicts
    ids = prompt(seed=7)
    _, rounds_a = dspark_rounds(target, drafter, ids)
    _, rounds_b = dspark_rounds(target, back, ids)
    assert [(p.tolist(), t, c) for p, t, c in rounds_a] == [(p.tolist(), t, c) for p, t, c in rounds_b]
    with torch.no_grad():
        drafter.lm_head.weight[0] += 1.0
    with pytest.raises(ValueError, match="copies differ"):
        export.export_drafter(drafter, tmp_path / "bad", format="speculators")


def test_export_carries_sts_and_own_embeddings(tmp_path):
    """A dspark drafter (target's embedding shared) exported as DeepSpec gets the target's table and head, its STS
    temperatures and offsets as extra keys, and drafts the same after loading back."""
    target = tiny_target("qwen3")
    drafter = new_drafter(target, sts_temperatures=[1.3, 0.9, 1.1, 1.0], sts_biases=[0.2, -0.1, 0.0, 0.3])
    export.export_drafter(drafter, tmp_path / "ds", format="deepspec")
    saved = load_file(str(tmp_path / "ds" / "model.safetensors"))
    assert torch.equal(saved["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert torch.equal(saved["lm_head.weight"], target.get_output_embeddings().weight)
    assert not (tmp_path / "ds" / export.SGLANG_STS_FILE).exists()  # SGLang's STS file has no offsets
    back = md.DSparkDraftModel.from_pretrained(tmp_path / "ds", target=target).eval()
    assert back.config.sts_temperatures == [1.3, 0.9, 1.1, 1.0] and back.config.sts_biases == [0.2, -0.1, 0.0, 0.3]
    ids = prompt(seed=5)
    _, rounds_a = dspark_rounds(target, drafter, ids)
    _, rounds_b = dspark_rounds(target, back, ids)
    assert [(p.tolist(), t, c) for p, t, c in rounds_a] == [(p.tolist(), t, c) for p, t, c in rounds_b]
    assert any(c for _, _, c in rounds_a)
    back.config.sts_biases = [0.0] * 4
    export.export_drafter(back, tmp_path / "ds2", format="deepspec")
    sts = json.loads((tmp_path / "ds2" / export.SGLANG_STS_FILE).read_text())
    assert sts == {"temperatures": [1.3, 0.9, 1.1, 1.0]}


# ---------------------------------------------------------------------------------------------------- speculators
def test_speculators_d2t_is_an_offset(tmp_path):
    """speculators' d2t holds offsets (target id = draft id + d2t[draft id]); dspark's draft_vocab_ids the ids."""
    target = tiny_target("qwen3")
    drafter = new_drafter(target, draft_vocab_size=24)
    export.export_drafter(drafter, tmp_path / "s", format="speculators")
    saved = load_file(str(tmp_path / "s" / "model.safetensors"))
    ids = drafter.draft_vocab_ids
    assert torch.equal(torch.arange(24) + saved["d2t"], ids)
    assert saved["t2d"].dtype == torch.bool and saved["t2d"].sum() == 24 and saved["t2d"][ids].all()
    assert torch.equal(saved["lm_head.weight"], target.get_output_embeddings().weight[ids])
    assert saved["markov_head.markov_w1.weight"].shape == (VOCAB, R)
    assert saved["markov_head.markov_w2.weight"].shape == (24, R)
    back = md.DSparkDraftModel.from_pretrained(tmp_path / "s", target=target)
    assert torch.equal(back.draft_vocab_ids, ids)
    check_rounds(target, back, lambda prefix: _rounds_of(target, drafter, prefix), prompt(seed=6))


def _rounds_of(target, drafter, prefix):
    """The tokens and confidences ``drafter`` drafts in the first round after ``prefix`` (a one-round generate)."""
    _, rounds = dspark_rounds(target, drafter, prefix[:, :-1], max_new_tokens=drafter.config.block_size + 2)
    return rounds[0][1], rounds[0][2] or None


# ---------------------------------------------------------------------------------------------------- DFlash rules
def _dflash_config(**dflash_config):
    return {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "vocab_size": VOCAB, "hidden_size": H,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": HD, "num_target_layers": 6, "block_size": 16, "dflash_config": dflash_config}


def test_dflash_conventions():
    config, _ = formats.convert_to_dspark("dflash", _dflash_config(mask_token_id=MASK, block_size=8), {})
    assert (config.block_size, config.anchor_predicts, config.own_embeddings) == (7, False, False)
    assert config.target_layer_ids == [1, 3]  # DFlash's default rule for 2 draft layers of a 6-layer target
    assert config.sequential_head == "none" and not config.use_confidence_head


def test_dflash_reads_top_level_keys():
    """z-lab DFlash reads mask_token_id and target_layer_ids from dflash_config first, then the top level."""
    cfg = _dflash_config()
    cfg.update(mask_token_id=MASK, target_layer_ids=[0, 2, 4])
    config, _ = formats.convert_to_dspark("dflash", cfg, {})
    assert (config.mask_token_id, config.target_layer_ids) == (MASK, [0, 2, 4])
    cfg["dflash_config"] = {"mask_token_id": MASK + 1, "target_layer_ids": [1, 3]}
    config, _ = formats.convert_to_dspark("dflash", cfg, {})
    assert (config.mask_token_id, config.target_layer_ids) == (MASK + 1, [1, 3])


@pytest.mark.parametrize("dflash_config,message", [
    ({}, "no mask_token_id"),
    ({"mask_token_id": MASK, "output_multiplier": 2.0}, "output_multiplier"),
    ({"mask_token_id": MASK, "block_size": 1}, "leaves no draft slot"),
    ({"mask_token_id": MASK, "target_layer_ids": [1, 5]}, "target_layer_ids"),
])
def test_dflash_refuses_what_it_cannot_reproduce(dflash_config, message):
    with pytest.raises(ValueError, match=message):
        formats.convert_to_dspark("dflash", _dflash_config(**dflash_config), {})


def test_specforge_for_gemma_targets_is_refused():
    """SpecForge embeds through a Gemma target's √H-scaled embedding layer and never soft-caps: refused; for other
    targets the DFlash-only keys input_embedding_scale / final_logit_softcapping are not read."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = _dflash_config(mask_token_id=MASK, projector_type="dspark", markov_rank=R, input_embedding_scale=8.0,
                         final_logit_softcapping=30.0)
    gemma = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=96, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=HD)
    with pytest.raises(ValueError, match="SpecForge drafters for Gemma targets"):
        formats.convert_to_dspark("specforge", cfg, {}, gemma)
    config, _ = formats.convert_to_dspark("specforge", cfg, {}, tiny_target("qwen3").config)
    assert (config.embedding_scale, config.final_logit_softcapping) == (1.0, None)
    # converted without a target, the drafter remembers its format and refuses a Gemma target when bound
    config, _ = formats.convert_to_dspark("specforge", cfg, {})
    assert config.source_format == "specforge"
    with pytest.raises(ValueError, match="SpecForge drafters for Gemma targets"):
        md.DSparkDraftModel(config).bind_target(Gemma3ForCausalLM(gemma).eval())
    # exporting it needs the target bound (the written file no longer says it came from SpecForge)
    with pytest.raises(ValueError, match="SpecForge conversion"):
        export.check_exportable(md.DSparkDraftModel(config), "speculators")
    with pytest.raises(ValueError, match="source_format"):
        md.DSparkConfig(source_format="SpecForge")


@pytest.mark.parametrize("key", ["sts_temperatures", "sts_biases"])
def test_sts_of_the_wrong_length_is_refused(key):
    cfg = _dflash_config(mask_token_id=MASK, block_size=5)
    cfg[key] = [1.0] * 5  # one per slot, but the anchor's slot drafts nothing: γ = 4
    with pytest.raises(ValueError, match=f"{key} must be a list of 4 numbers"):
        formats.convert_to_dspark("dflash", cfg, {})
    cfg[key] = [1.0] * 4
    assert len(getattr(formats.convert_to_dspark("dflash", cfg, {})[0], key)) == 4


def test_sliding_window_draft_layers_are_refused():
    cfg = _dflash_config(mask_token_id=MASK)
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=64, use_sliding_window=True)
    with pytest.raises(ValueError, match="full-attention"):
        formats.convert_to_dspark("dflash", cfg, {})


def test_target_config_mismatch_is_refused():
    target = tiny_target("qwen3")
    cfg = _dflash_config(mask_token_id=MASK)
    cfg["num_target_layers"] = 8
    with pytest.raises(ValueError, match="8 layers"):
        formats.convert_to_dspark("dflash", cfg, {}, target.config)


# ---------------------------------------------------------------------------------------------------- refusals
def test_shipped_drafter_exports_to_speculators_only(tmp_path, smollm):
    """The shipped drafter (Qwen3-style layers, mask token id, 8,192-token draft vocabulary) exports to speculators,
    whose checkpoint loads back tensor for tensor equal with the same calibration; DeepSpec and DFlash, which cannot
    hold a reduced vocabulary, are refused with nothing written."""
    target, _ = smollm
    drafter = md.DSparkDraftModel.from_pretrained("smollm2-135m-dspark", target=target)
    for fmt in ("deepspec", "dflash"):
        with pytest.raises(ValueError, match="reduced vocabulary"):
            export.export_drafter(drafter, tmp_path / fmt, format=fmt)
        assert not (tmp_path / fmt).exists()
    out = export.export_drafter(drafter, tmp_path / "spec", format="speculators")
    back = md.DSparkDraftModel.from_pretrained(out, target=target)
    state = back.state_dict()
    for key, value in drafter.state_dict().items():
        assert torch.equal(state[key], value), key
    for key in ("sts_temperatures", "sts_biases", "mask_token_id", "block_size", "target_layer_ids"):
        assert getattr(back.config, key) == getattr(drafter.config, key), key


@pytest.mark.parametrize("fields,fmt,message", [
    (dict(mask_token_id=None), "speculators", "learned mask embedding"),
    (dict(sequential_head="gated"), "deepspec", "only the vanilla"),
    (dict(sequential_head="rnn"), "speculators", "only the vanilla"),
    (dict(sequential_head="none", confidence_head_with_markov=False), "deepspec", "markov_rank > 0"),
    (dict(draft_vocab_size=24), "deepspec", "reduced vocabulary"),
    (dict(draft_vocab_size=24), "dflash", "reduced vocabulary"),
    (dict(), "dflash", "DFlash has neither"),
    (dict(anchor_predicts=False), "deepspec", "anchor slot predicts nothing"),
    (dict(sequential_head="none", use_confidence_head=False), "dflash", "anchor_predicts=True"),
    (dict(sequential_head="none"), "speculators", "target embedding of x_{k-1}"),
    (dict(logit_scale=0.125), "speculators", "logit_scale=0.125 (Granite, Cohere) has no key"),
    (dict(logit_scale=0.125, anchor_predicts=False, sequential_head="none", use_confidence_head=False), "dflash",
     "logit_scale=0.125 (Granite, Cohere) has no key"),
])
def test_export_refuses_what_the_format_cannot_hold(tmp_path, fields, fmt, message):
    drafter = new_drafter(tiny_target("qwen3"), **fields)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{")
                       .replace("}", r"\}")):
        export.export_drafter(drafter, tmp_path / "out", format=fmt)
    assert not (tmp_path / "out").exists()


def test_deepspec_export_needs_the_target(tmp_path):
    target = tiny_target("qwen3")
    drafter = md.DSparkDraftModel(new_drafter(target).config)  # unbound, shares no table
    with pytest.raises(ValueError, match="target="):
        export.export_drafter(drafter, tmp_path / "out", format="deepspec")


def test_deepspec_export_of_a_tied_target_and_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    """A target with tied word embeddings (SmolLM2, Gemma): its table and head are one tensor, written under both
    DeepSpec names; the export loads back and drafts the same. An export that fails half-way leaves no directory."""
    target = tiny_target("llama")
    target.config.tie_word_embeddings = True
    target.lm_head.weight = target.model.embed_tokens.weight
    drafter = new_drafter(target)
    (tmp_path / "ds").mkdir()  # an empty directory is written into
    export.export_drafter(drafter, tmp_path / "ds", format="deepspec")
    saved = load_file(str(tmp_path / "ds" / "model.safetensors"))
    assert torch.equal(saved["lm_head.weight"], saved["embed_tokens.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temporary directory left
    back = md.DSparkDraftModel.from_pretrained(tmp_path / "ds", target=target).eval()
    _, rounds_a = dspark_rounds(target, drafter, prompt(seed=3))
    _, rounds_b = dspark_rounds(target, back, prompt(seed=3))
    assert [(p.tolist(), t, c) for p, t, c in rounds_a] == [(p.tolist(), t, c) for p, t, c in rounds_b]

    def save_file(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", save_file)
    with pytest.raises(OSError, match="disk full"):
        export.export_drafter(drafter, tmp_path / "failed", format="deepspec")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_export_refuses_a_non_empty_output(tmp_path):
    drafter = new_drafter(tiny_target("qwen3"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty directory"):
        export.export_drafter(drafter, tmp_path / "out", format="speculators")


def test_load_refuses_missing_or_invalid_pieces(tmp_path):
    with pytest.raises(OSError, match="no config.json"):
        formats.load_config_and_state(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_dflash_config(mask_token_id=MASK)))
    with pytest.raises(OSError, match="no safetensors"):
        formats.load_config_and_state(tmp_path)
    for text, problem in (('{"model_type": ', "not valid JSON"), ("[1]", "JSON list, expected an object")):
        (tmp_path / "config.json").write_text(text)
        for load in (formats.load_config_and_state, md.DSparkDraftModel.from_pretrained):
            with pytest.raises(OSError, match=problem) as err:
                load(tmp_path)
            assert str(tmp_path / "config.json") in str(err.value)


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli_export(tmp_path, capsys):
    rc = cli_main(["export", "smollm2-135m-dspark", str(tmp_path / "refused"), "--format", "deepspec"])
    assert rc == 2 and not (tmp_path / "refused").exists()
    assert "reduced vocabulary" in capsys.readouterr().err

    target = tiny_target("qwen3")
    drafter = new_drafter(target, draft_vocab_size=24)
    drafter.save_pretrained(tmp_path / "mine")
    target.save_pretrained(tmp_path / "target")
    assert cli_main(["export", str(tmp_path / "mine"), str(tmp_path / "spec"), "--format", "speculators",
                     "--target", str(tmp_path / "target")]) == 0
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["draft_vocab_size"] == 24
    back = md.DSparkDraftModel.from_pretrained(tmp_path / "spec", target=target)
    for key, value in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def _strings(obj):
    """Every string inside a JSON value (keys and values, nested)."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield key
            yield from _strings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _strings(value)


@pytest.mark.parametrize("fmt", export.EXPORT_FORMATS)
def test_exports_hold_no_absolute_path(tmp_path, monkeypatch, capsys, fmt):
    """No exported config holds a path of the exporting machine: the default target's local copy is written as its
    Hub id, another absolute path is refused (library and CLI, nothing written) unless --verifier-name names the
    verifier, which the speculators config then carries."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    extra = dict(anchor_predicts=False, sequential_head="none", use_confidence_head=False) if fmt == "dflash" else {}
    drafter = new_drafter(target, **extra)
    drafter.config.target_name_or_path = str(tmp_path / "cache" / "SmolLM2-135M-Instruct")  # the default target
    config = export.export_drafter(drafter, tmp_path / "default", format=fmt)
    config = json.loads((config / "config.json").read_text())
    assert not [s for s in _strings(config) if s.startswith(str(tmp_path)) or s.startswith("/")]
    if fmt == "speculators":
        assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"

    drafter.config.target_name_or_path = str(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "mine")
    args = ["export", str(tmp_path / "mine"), str(tmp_path / "cli"), "--format", fmt, "--target",
            str(tmp_path / "target")]
    if fmt != "speculators":  # no verifier recorded: the absolute target path is not written, so not refused
        assert cli_main(args) == 0
        assert not [s for s in _strings(json.loads((tmp_path / "cli" / "config.json").read_text())) if "/" in s]
        assert cli_main([*args[:2], str(tmp_path / "named"), *args[3:], "--verifier-name", "x"]) == 2
        assert "speculators format only" in capsys.readouterr().err and not (tmp_path / "named").exists()
        return
    with pytest.raises(ValueError, match="absolute path of this machine"):
        export.export_drafter(drafter, tmp_path / "lib", format=fmt)
    assert cli_main(args) == 2
    assert "--verifier-name" in capsys.readouterr().err and not (tmp_path / "cli").exists()
    assert cli_main([*args, "--verifier-name", "Qwen/Qwen3-8B"]) == 0
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"
    with pytest.raises(ValueError, match="absolute path"):
        export.export_drafter(drafter, tmp_path / "abs", format=fmt, verifier_name=str(tmp_path / "target"))


def test_portable_verifier_name(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abc"
    assert export.portable_verifier_name(str(snapshot)) == "Qwen/Qwen3-8B"
    for name in ("SmolLM2-135M-Instruct", str(tmp_path / "SmolLM2-135M-Instruct")):
        assert export.portable_verifier_name(name) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for name in ("Qwen2.5-Coder-0.5B-Instruct", str(tmp_path / "Qwen2.5-Coder-0.5B-Instruct")):
        assert export.portable_verifier_name(name) == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert export.portable_verifier_name("models/target") == "models/target"
    assert export.portable_verifier_name("") is None
    for name in (str(tmp_path / "target"), "~/target"):
        with pytest.raises(ValueError, match="absolute path"):
            export.portable_verifier_name(name)


def test_dflash_export_for_a_llama_target_loads_without_target(tmp_path):
    """DFlash configs name "qwen3" (the draft layers' type) whatever the target: a drafter loaded without target=
    binds to a Llama target at its first generate() and drafts losslessly; the CLI export with --target too."""
    target = tiny_target("llama")
    drafter = new_drafter(target, anchor_predicts=False, sequential_head="none", use_confidence_head=False)
    export.export_drafter(drafter, tmp_path / "lib", format="dflash")
    drafter.save_pretrained(tmp_path / "mine")
    target.save_pretrained(tmp_path / "target")
    assert cli_main(["export", str(tmp_path / "mine"), str(tmp_path / "cli"), "--format", "dflash",
                     "--target", str(tmp_path / "target")]) == 0
    ids = prompt(seed=3)
    plain = target.generate(ids, do_sample=False, max_new_tokens=16)
    for out in ("lib", "cli"):
        loaded = md.DSparkDraftModel.from_pretrained(tmp_path / out).eval()
        assert torch.equal(target.generate(ids, assistant_model=loaded, do_sample=False, max_new_tokens=16), plain)
        assert loaded.config.target_model_type == "llama"


def test_deepspec_import_as_speculators_checks_its_copies(tmp_path, capsys):
    """A DeepSpec import's own embedding / LM-head copies are dropped by speculators for the target's: unbound it is
    refused, and the CLI binds --target and refuses copies that differ from the target's."""
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    _, state = deepspec_checkpoint(tmp_path / "good", target)
    deepspec_checkpoint(tmp_path / "bad", target)
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    save_file(state, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"own embedding / LM-head copies.*target="):
        export.export_drafter(md.DSparkDraftModel.from_pretrained(tmp_path / "good"), tmp_path / "x",
                               format="speculators")
    args = ["--format", "speculators", "--target", str(tmp_path / "target")]
    assert cli_main(["export", str(tmp_path / "bad"), str(tmp_path / "bad_out"), *args]) == 2
    assert "copies differ" in capsys.readouterr().err and not (tmp_path / "bad_out").exists()
    assert cli_main(["export", str(tmp_path / "good"), str(tmp_path / "good_out"), *args]) == 0
    assert not md.DSparkDraftModel.from_pretrained(tmp_path / "good_out").config.own_embeddings


def test_from_pretrained_options_of_a_converted_drafter(tmp_path):
    """dtype, attn_implementation and device_map apply to an imported drafter; other options are refused, named."""
    target = tiny_target("qwen3")
    deepspec_checkpoint(tmp_path, target)
    drafter = md.DSparkDraftModel.from_pretrained(tmp_path, target=target, attn_implementation="sdpa",
                                                  dtype=torch.float64, device_map="cpu")
    assert drafter.config._attn_implementation == "sdpa" and drafter.fc.weight.dtype == torch.float64
    with pytest.raises(ValueError, match="low_cpu_mem_usage"):
        md.DSparkDraftModel.from_pretrained(tmp_path, low_cpu_mem_usage=True)
    with pytest.raises(ValueError, match="one device"):
        md.DSparkDraftModel.from_pretrained(tmp_path, device_map="auto")
