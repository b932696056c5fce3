"""`generate(assistant_model=drafter)` ends exactly where plain `generate()` ends: stop strings that complete inside
an accepted block, and a custom EOS id with the attention mask transformers infers from the pad id (real SmolLM2
target, float32, greedy)."""

from __future__ import annotations

import pytest
import torch

from dspark.generation import dspark_options

pytestmark = pytest.mark.core  # also run at the highest supported versions (scripts/test_versions.sh)


def _stop_strings(tok, new_ids: list[int], positions) -> list[str]:
    """The text of the token at each position of a greedy continuation, when it reads as a word (≥ 3 letters)."""
    out = []
    for j in positions:
        text = tok.decode(new_ids[j : j + 1]).strip()
        if len(text) >= 3 and text.isalpha():
            out.append(text)
    return out


def test_stop_string_inside_accepted_block_ends_like_plain_generate(smollm, prompt_ids, random_drafter, scripted):
    """Drafts are the target's own tokens (every block accepted in full, 9 tokens per round with γ' = 8): a stop
    string whose last token sits in the middle of a block must end the output there, as plain generate() does."""
    target, tok = smollm
    checked = 0
    for ids in prompt_ids[:4]:
        plain = target.generate(ids, max_new_tokens=60, do_sample=False)
        new = plain[0, ids.shape[1]:].tolist()
        for stop in _stop_strings(tok, new, range(3, 40)):
            ref = target.generate(ids, max_new_tokens=60, do_sample=False, stop_strings=[stop], tokenizer=tok)
            stop_at = ref.shape[1] - ids.shape[1]  # tokens plain generate() produced
            if stop_at >= len(new) or stop_at % 9 == 1:  # no early stop, or at a round's last token anyway
                continue
            scripted(plain, "oracle", target.config.vocab_size)
            with dspark_options(policy="full", block_size=8):
                out = target.generate(ids, assistant_model=random_drafter, max_new_tokens=60, do_sample=False,
                                      stop_strings=[stop], tokenizer=tok)
            assert torch.equal(out, ref), (stop, out.shape[1] - ids.shape[1], stop_at)
            checked += 1
            if checked >= 6:
                return
    assert checked >= 3


def test_custom_eos_with_inferred_attention_mask_equals_plain_generate(smollm, prompt_ids, random_drafter):
    """SmolLM2's pad id is its EOS id <|im_end|>, which the chat prompt contains. With another eos_token_id (and
    min_new_tokens), transformers infers an attention mask from the pad id, with zeros inside the prompt; the
    speculative output equals plain generate()'s under that same mask."""
    target, tok = smollm
    eos = tok.convert_tokens_to_ids(".")
    for ids in prompt_ids[:2]:
        assert bool((ids == target.generation_config.pad_token_id).any())  # the case: pad ids inside the prompt
        kw = {"max_new_tokens": 24, "do_sample": False, "min_new_tokens": 4, "eos_token_id": eos}
        ref = target.generate(ids, **kw)
        with dspark_options(policy="full", block_size=8):
            out = target.generate(ids, assistant_model=random_drafter, **kw)
        assert torch.equal(out, ref)
