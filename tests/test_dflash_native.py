"""A DSpark drafter in transformers' own DFlash loop (modeling_dspark.dflash): lossless, and drafting for real."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import modeling_dspark as md
from modeling_dspark.dflash import DFlashAssistant
from modeling_dspark.target import apply_chat_template

pytestmark = pytest.mark.core  # also run at the highest supported versions (scripts/test_versions.sh)

PROMPT = torch.tensor([[1, 5, 9, 13, 17, 21]])


def _tiny_target(family: str):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)  # a peaked random model: greedy continuations vary
    return model


def _rounds(assistant):
    """A counter of the assistant's forwards (one per DFlash round)."""
    calls = {"n": 0}
    assistant.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kw", [{}, {"mask_token_id": None}, {"anchor_predicts": False}])
def test_dflash_loop_with_a_dspark_drafter_equals_plain_greedy(family, kw):
    """transformers' DFlash loop (no dspark code deciding) with a DSpark drafter's backbone: plain greedy's tokens,
    with a token-id mask, a learned mask embedding, and the DFlash slot convention."""
    target = _tiny_target(family)
    torch.manual_seed(1)
    cfg = md.DSparkConfig.from_target_config(target.config, block_size=4, markov_rank=8,
                                             **{"mask_token_id": 3, **kw})
    drafter = md.DSparkDraftModel(cfg).eval().bind_target(target)
    assistant = DFlashAssistant(drafter)
    rounds = _rounds(assistant)
    mask = torch.ones_like(PROMPT)
    plain = target.generate(PROMPT, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = target.generate(PROMPT, attention_mask=mask, assistant_model=assistant, speculation_type="dflash",
                          max_new_tokens=24, do_sample=False)
    assert torch.equal(out, plain)
    assert rounds["n"] >= 1
    assert assistant.config.block_size == 5  # the anchor's slot and γ = 4 drafts


def test_dflash_loop_drafts_what_the_backbone_drafts(smollm):
    """With the shipped SmolLM2 drafter, transformers' DFlash loop gives plain greedy's output and accepts drafts
    (τ = new tokens / rounds above 1: some drafts are accepted, although the loop drafts over the full vocabulary
    and the shipped drafter was trained on an 8,192-token draft vocabulary), and its
    first round's drafts are the argmax of the drafter's own backbone logits U_k over the full vocabulary."""
    target, tok = smollm
    drafter = md.DSparkDraftModel.from_pretrained("smollm2-135m-dspark", target=target, dtype=torch.float32)
    ids = torch.tensor([apply_chat_template(tok, "What is 12 times 12? Explain step by step.")])
    assistant = DFlashAssistant(drafter)
    rounds = _rounds(assistant)
    plain = target.generate(ids, max_new_tokens=48, do_sample=False)
    out = target.generate(ids, assistant_model=assistant, speculation_type="dflash", max_new_tokens=48,
                          do_sample=False)
    assert torch.equal(out, plain)
    tau = (out.shape[1] - ids.shape[1]) / rounds["n"]
    assert tau > 1.1, tau

    # the first round by hand: the backbone's hidden states through the target's head
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in drafter.config.target_layer_ids], dim=-1)[:, :-1]
        p = ids.shape[1] - 1
        own = drafter(ids[:, -1:], torch.tensor([[p]]), feats, torch.arange(p)[None], num_slots=8,
                      return_logits=False).hidden_states[0, 0]
        noise = target.get_input_embeddings()(torch.tensor([[ids[0, -1]] + [16] * 8]))
        got = assistant(noise, feats, torch.arange(p + 9)[None]).last_hidden_state[0, 1:]
    assert torch.allclose(got, own, atol=1e-5)


def test_dflash_assistant_refuses_what_it_cannot_run(smollm):
    target, _ = smollm
    cfg = md.DSparkConfig.from_target_config(target.config, block_size=4, markov_rank=8)
    with pytest.raises(ValueError, match="bound to its target"):
        DFlashAssistant(md.DSparkDraftModel(cfg))
    drafter = md.DSparkDraftModel(cfg).bind_target(target)
    with pytest.raises(ValueError, match=r"block_size must be an int in \[1, 4\]"):
        DFlashAssistant(drafter, block_size=5)
