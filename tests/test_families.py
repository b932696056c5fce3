"""Target families and drafter conventions: greedy output identical to plain generate() (fp32), tiny random models.

Each supported family drafts with a random Qwen3-style drafter: Llama with Llama-3 RoPE scaling; Mistral with a
sliding window; Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4-MoE, ERNIE-4.5-MoE and gpt-oss with routed experts, gpt-oss with
attention sinks; Phi-3 with fused projections, tied embeddings and Phi-4-mini's partial longrope; GLM-4 with partial
RoPE; OLMo 2 and GLM-4 with norms after each sublayer; SmolLM3 with RoPE-free layers; Ministral 3 with Llama-4 query
scaling; Ministral, OLMo 3, EXAONE 4 and CWM with sliding-window layers; Qwen2, Qwen3, ERNIE 4.5, Seed-OSS (biases),
Hunyuan, Apertus (xIELU), Helium; Gemma 1–4 with the embedding scale √H, Gemma 2–4 with final-logit soft-capping and
sliding-window layers; Granite with an embedding multiplier and logits divided by logits_scaling, Cohere with logits
times logit_scale. Lossless must hold whatever the draft quality, and in float32 the drafter
must read the target's embedding output and reproduce its logits. Every convention of other implementations (a
real mask token, the anchor slot that predicts nothing, layer id −1, the drafter's own embedding / LM head, gated and
RNN heads, confidence without the Markov features) runs the same forward path, and greedy output stays identical.
Unsupported families fail with a clear error before any compute.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    ApertusConfig,
    Cohere2Config,
    CohereConfig,
    CwmConfig,
    Ernie4_5_MoeConfig,
    Ernie4_5Config,
    Exaone4Config,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    Glm4Config,
    Glm4MoeConfig,
    GPT2LMHeadModel,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    GraniteMoeSharedConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    LlamaConfig,
    Ministral3Config,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Olmo3Config,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SeedOssConfig,
    SmolLM3Config,
)

import modeling_dspark as md
from dspark.generation import collect_stats, dspark_options

pytestmark = pytest.mark.core  # also run at the highest supported versions (scripts/test_versions.sh)

VOCAB = 48
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=None, tie_word_embeddings=False)


WINDOWS = dict(sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"])
"""Sliding-window layers whose window (4 tokens) cuts within the prompt and the generated tokens."""


def _gemma4_config():
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    return Gemma4TextConfig(**SHAPE, sliding_window=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                            hidden_size_per_layer_input=0, final_logit_softcapping=30.0)


FAMILIES = {
    "llama3": lambda: LlamaConfig(**SHAPE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2": lambda: Qwen2Config(**SHAPE),
    "qwen3": lambda: Qwen3Config(**SHAPE),
    # sliding window 4 < the prompt + generated length: the window really cuts; soft-capping on
    "gemma3": lambda: Gemma3TextConfig(**SHAPE, sliding_window=4, query_pre_attn_scalar=8,
                                       final_logit_softcapping=30.0,
                                       layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "gemma4": _gemma4_config,
    "gemma": lambda: GemmaConfig(**SHAPE),
    "gemma2": lambda: Gemma2Config(**SHAPE, sliding_window=4, query_pre_attn_scalar=8, final_logit_softcapping=30.0,
                                   attn_logit_softcapping=50.0),
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=4),
    "phi3": lambda: Phi3Config(**{**SHAPE, "tie_word_embeddings": True}, partial_rotary_factor=0.75,  # Phi-4-mini
                               original_max_position_embeddings=64, rope_scaling={
                                   "type": "longrope", "long_factor": [1.5] * 3, "short_factor": [1.0] * 3}),
    "olmo2": lambda: Olmo2Config(**SHAPE),
    "smollm3": lambda: SmolLM3Config(**SHAPE, no_rope_layer_interval=2),
    "mixtral": lambda: MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=16),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "gpt_oss": lambda: GptOssConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                    layer_types=["sliding_attention", "full_attention"] * 2,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 4.0,
                                                     "original_max_position_embeddings": 64}),
    "ministral": lambda: MinistralConfig(**SHAPE, **WINDOWS),
    # Ministral 3: yarn with Llama-4's position-dependent query scaling
    "ministral3": lambda: Ministral3Config(**SHAPE, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64,
        "llama_4_scaling_beta": 0.1, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "olmo3": lambda: Olmo3Config(**SHAPE, **WINDOWS),
    "glm4": lambda: Glm4Config(**SHAPE, partial_rotary_factor=0.5),  # norms after each sublayer too
    "glm4_moe": lambda: Glm4MoeConfig(**SHAPE, partial_rotary_factor=0.5, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, first_k_dense_replace=1, use_qk_norm=True),
    "ernie4_5": lambda: Ernie4_5Config(**SHAPE),
    "ernie4_5_moe": lambda: Ernie4_5_MoeConfig(**SHAPE, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                                               moe_layer_start_index=1, moe_num_shared_experts=1),
    "exaone4": lambda: Exaone4Config(**SHAPE, **WINDOWS),
    "seed_oss": lambda: SeedOssConfig(**SHAPE, attention_bias=True),
    "hunyuan_v1_dense": lambda: HunYuanDenseV1Config(**SHAPE),
    "apertus": lambda: ApertusConfig(**SHAPE),  # xIELU MLP
    "helium": lambda: HeliumConfig(**SHAPE),
    "cwm": lambda: CwmConfig(**SHAPE, sliding_window=4, layer_types=["full_attention"] + ["sliding_attention"] * 3),
    # Granite: embeddings × embedding_multiplier, logits / logits_scaling (and its residual and attention multipliers)
    "granite": lambda: GraniteConfig(**SHAPE, embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.2,
                                     attention_multiplier=0.0625),
    "granitemoe": lambda: GraniteMoeConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                           embedding_multiplier=12.0, logits_scaling=8.0),
    "granitemoeshared": lambda: GraniteMoeSharedConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                                       shared_intermediate_size=16, embedding_multiplier=12.0,
                                                       logits_scaling=8.0),
    # Cohere: logits × logit_scale, LayerNorm, attention and MLP in parallel; Command R7B with sliding windows too
    "cohere": lambda: CohereConfig(**SHAPE, logit_scale=0.0625),
    "cohere2": lambda: Cohere2Config(**SHAPE, logit_scale=0.25, **WINDOWS),
}
WINDOWED = {"gemma2", "gemma3", "gemma4", "gpt_oss", "mistral", "ministral", "olmo3", "exaone4", "cwm", "cohere2"}
"""The families of :data:`FAMILIES` configured with sliding windows of 4 tokens."""


def test_every_supported_family_is_tested_here():
    """Each family DSpark admits has a configuration in :data:`FAMILIES`, so every test below runs it."""
    tested = {FAMILIES[name]().model_type for name in FAMILIES}
    assert set(md.configuration_dspark.SUPPORTED_TARGET_FAMILIES) == tested


def _target(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[name](), dtype=torch.float32).eval()
    with torch.no_grad():  # sharpen the random model so greedy continuations are not flat
        model.get_input_embeddings().weight.mul_(4.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _drafter(target, seed: int = 1, **kw):
    torch.manual_seed(seed)
    cfg = md.DSparkConfig.from_target_config(target.config, block_size=4, markov_rank=8, num_draft_layers=1,
                                             target_layer_ids=kw.pop("target_layer_ids", [0, 2]), **kw)
    drafter = md.DSparkDraftModel(cfg).eval()
    with torch.no_grad():  # a random non-zero correction, so the sequential head changes drafts
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if drafter.embed_tokens is not None:
        drafter.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
        drafter.lm_head.weight.data.copy_(target.get_output_embeddings().weight)
    return drafter.bind_target(target)


PROMPTS = [[1, 5, 9, 13], [1, 30, 2, 2, 7, 41, 3], [1]]


def _assert_greedy_identical(target, drafter, max_new=24, block_sizes=(1, 4)):
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=max_new, do_sample=False)
        for gamma in block_sizes:
            with dspark_options(block_size=gamma):
                out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, do_sample=False)
            assert torch.equal(out, ref), f"prompt {prompt}, block size {gamma}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_greedy_identical(one_thread, scripted, family):
    target = _target(family)
    drafter = _drafter(target)
    tc = target.config.get_text_config()
    assert drafter.config.draft_layer_style == "qwen3"
    assert drafter.config.target_model_type == tc.model_type
    if family.startswith("gemma"):  # the target's own embedding layer multiplies by √H; the drafter reads the same
        assert drafter.config.embedding_scale == pytest.approx(32**0.5)
        ids = torch.tensor([[3, 7]])
        torch.testing.assert_close(drafter.embed(ids), target.get_input_embeddings()(ids))
    if family == "phi3":  # a partial longrope (Phi-4-mini) is not the draft layers': they rotate whole heads
        assert drafter.config.rope_parameters == {"rope_type": "default", "rope_theta": 1e4}
    if family in ("gemma2", "gemma3", "gemma4"):
        assert drafter.config.final_logit_softcapping == 30.0
        assert drafter.lm_logits(torch.randn(2, 32) * 100).abs().max() <= 30.0
    _assert_greedy_identical(target, drafter)
    # drafts that are all accepted (the target's own continuation) exercise the accept / cache-crop path too
    ids = torch.tensor([PROMPTS[1]])
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    scripted(ref, "oracle", VOCAB)
    with dspark_options(block_size=4, policy="full"), collect_stats() as runs:  # full: every round drafts
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, ref)
    assert all(r.accepted == r.drafted > 0 for r in runs[-1].rounds[:-1])


def _reproduces_target(target, drafter) -> bool:
    """The drafter's block embedding equals what the target's first layer reads, and the target's logits are its
    LM head on the final hidden state, soft-capped as the drafter caps its own (what the trainer fits)."""
    from modeling_dspark.common import softcap
    from modeling_dspark.configuration_dspark import logit_transform
    from modeling_dspark.target import decoder_of

    ids = torch.tensor([PROMPTS[1]])
    scale, cap = logit_transform(target.config)  # what the trainer applies to the target's LM head
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        last = decoder_of(target)(input_ids=ids).last_hidden_state
        logits = softcap(target.get_output_embeddings()(last), cap, scale)
        draft = drafter.lm_logits(last)  # the drafter's own head on the same state
    return (torch.allclose(drafter.embed(ids), out.hidden_states[0]) and torch.allclose(logits, out.logits, atol=1e-5)
            and torch.allclose(draft, out.logits, atol=1e-5))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_embeddings_and_logits_reproduced(family):
    target = _target(family)
    assert _reproduces_target(target, _drafter(target))


def test_granite_and_cohere_scales_are_read_from_the_target():
    """Granite's embedding multiplier becomes the block-input scale and 1 / logits_scaling the logit scale; Cohere's
    logit_scale is the logit scale. Without them the drafter would be lossless but trained against logits its target
    never computes (test_family_embeddings_and_logits_reproduced fails for both)."""
    granite = md.DSparkConfig.from_target_config(FAMILIES["granite"]())
    assert (granite.embedding_scale, granite.logit_scale, granite.final_logit_softcapping) == (12.0, 0.125, None)
    assert md.DSparkConfig.from_target_config(FAMILIES["cohere"]()).logit_scale == 0.0625
    with pytest.raises(ValueError, match="logit_scale must be a finite number > 0"):
        md.DSparkConfig.from_target_config(FAMILIES["cohere"](), logit_scale=0.0)


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere"])
def test_trainer_scores_against_the_targets_own_logits(tmp_path, family):
    """The logits the trainer fits at the block slots are the target's own: scaled and soft-capped as it computes
    them."""
    from dspark.training.trainer import DSparkCollator, DSparkTrainer

    from .test_training import make_args, make_data

    target = _target(family)
    drafter = _drafter(target)
    data = make_data(vocab=VOCAB)
    tr = DSparkTrainer(model=drafter, target=target, args=make_args(tmp_path), train_dataset=data,
                       data_collator=DSparkCollator(4, anchors_per_seq=2, pad_token_id=0, seed=0))
    batch = tr.data_collator([data[i] for i in range(2)])
    ids, attn, anchors = batch["input_ids"], batch["attention_mask"], batch["anchor_positions"]
    _, logits = tr.target_outputs(ids, attn, anchors, drafter.config.target_layer_ids, 4)
    with torch.no_grad():
        full = target(ids, attention_mask=attn).logits
    p = int(anchors[1, 0])
    torch.testing.assert_close(logits[1, 0], full[1, p : p + 4], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_serves_each_full_attention_family_and_refuses_windows(one_thread, family):
    """The batched engine's packed attention is plain causal SDPA: a target with sliding-window layers (or a window
    on every layer, Mistral's) is refused before any forward; every other family decodes exactly as generate().
    Windows that never cut: :func:`test_engine_refuses_a_window_where_it_cuts`."""
    from dspark.generation import DSparkEngine

    target = _target(family)
    drafter = _drafter(target)
    if family in WINDOWED:
        calls = []
        target.register_forward_hook(lambda *a: calls.append(1))
        with pytest.raises(ValueError, match="sliding"):
            DSparkEngine(target, drafter, "full", max_batch_size=2)
        assert not calls
        return
    engine = DSparkEngine(target, drafter, "full", max_batch_size=2)
    ids = [engine.add_request(p, 16) for p in PROMPTS]
    outs = {o.request_id: o.output_ids for o in engine.run()}
    for i, p in zip(ids, PROMPTS):
        assert outs[i] == target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()


@pytest.mark.parametrize("config, refused", [
    (MistralConfig(**SHAPE, sliding_window=4), True),
    (MistralConfig(**SHAPE, sliding_window=256), False),  # as long as the context: it never cuts
    (MistralConfig(**SHAPE, sliding_window=None), False),
    (Qwen2Config(**SHAPE, sliding_window=4, use_sliding_window=False), False),
    (Qwen2Config(**SHAPE, sliding_window=4, use_sliding_window=True, max_window_layers=2), True),
    # a window in use is refused whatever layer_types say: Mistral's models apply it to every layer regardless
    (MistralConfig(**SHAPE, sliding_window=4, layer_types=["full_attention"] * 4), True),
], ids=["mistral-4", "mistral-context", "mistral-none", "qwen2-off", "qwen2-layers-2-3", "mistral-full-types"])
def test_engine_refuses_a_window_where_it_cuts(config, refused):
    from dspark.generation.packed_target import PackedTarget

    target = SimpleNamespace(config=config)
    if refused:
        with pytest.raises(ValueError, match="sliding_attention"):
            PackedTarget(target)
    else:
        assert PackedTarget(target).num_layers == 4


CONVENTIONS = {
    "deepspec": dict(mask_token_id=VOCAB - 1, own_embeddings=True, target_layer_ids=[-1, 1],
                     sequential_head="markov", confidence_head_with_markov=True),
    "dflash": dict(mask_token_id=VOCAB - 1, anchor_predicts=False, sequential_head="none",
                   use_confidence_head=False),
    "specforge-gated": dict(mask_token_id=VOCAB - 1, anchor_predicts=False, sequential_head="gated",
                            confidence_head_with_markov=False),
    "rnn-learned-mask": dict(sequential_head="rnn", draft_vocab_size=20),
    "target-layers": dict(draft_layer_style="target"),
}


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
def test_conventions_greedy_identical(one_thread, convention):
    target = _target("qwen3")
    drafter = _drafter(target, **CONVENTIONS[convention])
    _assert_greedy_identical(target, drafter, block_sizes=(4,))


def test_anchor_slot_convention():
    """anchor_predicts=False: a block of γ+1 slots whose first output is dropped; entry k still drafts anchor+k+1."""
    target = _target("qwen3")
    d = _drafter(target, mask_token_id=VOCAB - 1, anchor_predicts=False)
    assert d.block_slots() == 5 and d.block_slots(2) == 3
    feats = torch.randn(1, 6, 2 * 32)
    out = d(torch.tensor([[4]]), torch.tensor([[6]]), feats, torch.arange(6)[None], num_slots=4)
    assert out.hidden_states.shape == (1, 1, 4, 32) and out.base_logits.shape == (1, 1, 4, VOCAB)
    # the same numbers by hand: the DFlash block [anchor, mask × 4] at positions 6..10, outputs of slots 1..4
    ctx = d.encode_context(feats)
    x = d.embed(torch.tensor([[4] + [VOCAB - 1] * 4]))
    pos, ctx_pos = torch.arange(6, 11)[None], torch.arange(6)[None]
    pe, ce = d.rotary_emb(x, pos), d.rotary_emb(ctx, ctx_pos)
    for layer in d.layers:
        x = layer(x, pe, ctx, ce, None, None)
    torch.testing.assert_close(out.hidden_states[0, 0], d.norm(x)[0, 1:])


def test_layer_id_minus_one_reads_embeddings():
    from dspark.generation.features import context_features, hidden_state_indices

    target = _target("llama3")
    assert hidden_state_indices([-1, 0, 2]) == [0, 1, 3]
    out = target(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    feats = context_features(out.hidden_states, [-1, 2])
    torch.testing.assert_close(feats[..., :32], out.hidden_states[0])
    with pytest.raises(ValueError, match=r"target_layer_ids=\[-2, 1\]"):
        md.DSparkConfig.from_target_config(target.config, target_layer_ids=[-2, 1])


def test_unsupported_family_fails_before_compute():
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, bos_token_id=1, eos_token_id=None)
    with pytest.raises(ValueError, match=r"target family 'gpt2' is not supported: GPT-2"):
        md.DSparkConfig.from_target_config(cfg)
    gpt2 = GPT2LMHeadModel(cfg).eval()
    drafter = _drafter(_target("llama3"))
    calls = []
    gpt2.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="gpt2"):
        drafter.bind_target(gpt2)
    assert not calls
    # a supported family whose config lacks a field the drafter needs: named, with the family
    bad = SimpleNamespace(**{k: v for k, v in SHAPE.items() if k != "intermediate_size"}, model_type="qwen3")
    with pytest.raises(ValueError, match=r"'qwen3' has no intermediate_size"):
        md.DSparkConfig.from_target_config(bad)


def test_training_with_other_conventions(one_thread, tmp_path):
    """DSparkTrainer runs the same loss for a DFlash-slot, real-mask-token, own-embedding, gated-head drafter on a
    soft-capped Gemma 3 target: the target distribution it fits is the target's own (capped) logits, the frozen
    embedding copies stay put, the trained weights move."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from modeling_dspark.common import gather_slots
    from dspark.training.trainer import DSparkCollator, DSparkTrainer, init_from_target, prepare_dataset

    target = _target("gemma3")
    drafter = _drafter(target, mask_token_id=VOCAB - 1, anchor_predicts=False, own_embeddings=True,
                       sequential_head="gated", target_layer_ids=[-1, 1]).train()
    init_from_target(drafter, target, layer_ids=[3])
    x = torch.randn(3, 32)  # Gemma 3 norms multiply by 1 + weight: the copies compute what the target's do
    with torch.no_grad():
        torch.testing.assert_close(drafter.layers[0].input_layernorm(x), target.model.layers[3].input_layernorm(x))
        torch.testing.assert_close(drafter.norm(x), target.model.norm(x))
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(2, VOCAB - 1, (int(torch.randint(10, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(8)]
    data = prepare_dataset(Dataset.from_dict({"input_ids": rows, "prompt_len": [2] * len(rows)}))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, learning_rate=1e-2, per_device_train_batch_size=4,
                             save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = DSparkTrainer(model=drafter, target=target, args=args, train_dataset=data,
                            data_collator=DSparkCollator(4, anchors_per_seq=2, pad_token_id=0, seed=0))
    ids = torch.tensor([rows[0]])
    anchors = torch.tensor([[3, 6]])
    with torch.no_grad():
        _, last = trainer._decoder_pass(ids, torch.ones_like(ids), [-1, 1])
        fitted, _ = trainer.slot_targets(drafter, gather_slots(last, anchors, 4))
        own = gather_slots(target(ids).logits, anchors, 4)
    torch.testing.assert_close(fitted, own)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    trainer.train()
    after = drafter.state_dict()
    assert torch.equal(after["embed_tokens.weight"], before["embed_tokens.weight"])
    assert torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    for name in ("fc.weight", "layers.0.self_attn.k_norm.weight", "sequential_head.gate_proj.weight",
                 "confidence_head.proj.weight"):
        assert not torch.equal(after[name], before[name]), name
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
