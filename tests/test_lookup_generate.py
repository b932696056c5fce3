"""`generate(assistant_model=drafter)` with the lookup proposer on: lossless under greedy and sampling.

Greedy: on the real SmolLM2 target in fp32, prompts that make the answer copy text (so the lookup fires and is
accepted), the output equals plain `generate()` token for token, with the drafter and lookup together and with
lookup alone (policy ``none``).

Sampling: on the tiny random Llama of tests/test_lossless_sampling.py, with a prompt that holds every token of the
vocabulary (so every round has a lookup match), the joint distribution of the first three new tokens equals the
target's exact one by the χ² checks of that module.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dspark.generation import collect_stats, dspark_options
from dspark.generation.lookup import LookupProposal, NGramLookup
from modeling_dspark.target import apply_chat_template

from . import test_lossless_sampling as tls
from .test_lossless_sampling import tiny  # noqa: F401  (the fixture: tiny target and drafters)

pytestmark = pytest.mark.core  # also run at the highest supported versions (scripts/test_versions.sh)

COPY_PROMPTS = [
    "Repeat the following sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.",
    "Here is a function:\n\ndef area(width, height):\n    return width * height\n\nRewrite it with the parameter "
    "names w and h instead, and keep everything else the same.",
]


@pytest.fixture(scope="module")
def copy_references(smollm):
    """[(prompt ids, plain greedy `generate()` output of 48 new tokens)] for the copy prompts."""
    target, tok = smollm
    ids = [torch.tensor([apply_chat_template(tok, prompt)]) for prompt in COPY_PROMPTS]
    return [(x, target.generate(x, max_new_tokens=48, do_sample=False)) for x in ids]


@pytest.mark.parametrize("policy", [None, "none", "scheduler"])
def test_greedy_identical_with_lookup(smollm, random_drafter, copy_references, policy):
    target, _ = smollm
    sps = {b: 1.0 / (1.0 + 0.05 * b) for b in range(1, 40)} if policy == "scheduler" else None
    lookup_accepted = 0
    for prompt, (ids, ref) in zip(COPY_PROMPTS, copy_references):
        with dspark_options(policy=policy, sps=sps, block_size=4), collect_stats() as runs:
            out = target.generate(ids, assistant_model=random_drafter, max_new_tokens=48, do_sample=False)
        assert torch.equal(out, ref), f"policy {policy}: outputs differ on {prompt[:30]!r}"
        rounds = runs[-1].rounds
        lookup_accepted += sum(r.accepted for r in rounds if r.source == "lookup")
        if policy == "none":
            assert all(r.drafted == 0 and r.source in ("lookup", "") for r in rounds)
    if policy is not None:  # the default prices lookup chains with this machine's timings: its choice may vary
        assert lookup_accepted >= 10, "the copy prompts should make the lookup chain accepted"


def test_lookup_off_never_verifies_a_lookup_chain(smollm, random_drafter):
    target, tok = smollm
    ids = torch.tensor([apply_chat_template(tok, COPY_PROMPTS[0])])
    with dspark_options(block_size=4, lookup=False), collect_stats() as runs:
        target.generate(ids, assistant_model=random_drafter, max_new_tokens=24, do_sample=False)
    assert runs[-1].rounds and all(r.source != "lookup" for r in runs[-1].rounds)
    with pytest.raises(ValueError, match="lookup must be True or False"):
        with dspark_options(lookup="no"):
            pass


# --------------------------------------------------------------------------------------------- sampling
# every token but the pad id 0 (a 0 in the prompt would be masked out by generate()'s inferred attention mask, which
# the exact enumeration does not apply)
ALL_TOKENS_PROMPT = torch.tensor([[3, 7, 1, 12, 5, 2, 4, 6, 8, 9, 10, 11, 13, 14, 15, 3, 7]])
GEN = {"temperature": 0.9, "top_k": 8, "top_p": 1.0}  # the processing of the sampling tests here


@pytest.fixture
def all_tokens_prompt(monkeypatch):
    monkeypatch.setattr(tls, "PROMPT", ALL_TOKENS_PROMPT)


def _lookup_counts(runs):
    rounds = [r for s in runs for r in s.rounds]
    lookup = [r for r in rounds if r.source == "lookup"]
    return rounds, lookup, sum(r.accepted for r in lookup), sum(r.verified - r.accepted for r in lookup)


def test_plain_sampling_matches_enumeration_on_this_prompt(tiny, all_tokens_prompt):
    """Control for the enumeration with this module's prompt."""
    target, _ = tiny
    exact = tls.exact_joint(target, GEN["temperature"], GEN["top_k"], None)
    counts = tls._plain_counts(target, seed=7, **GEN)
    tls._assert_matches(counts, exact, "plain generate")


def test_sampling_lookup_alone_equals_target(tiny, all_tokens_prompt):
    target, _ = tiny
    exact = tls.exact_joint(target, GEN["temperature"], GEN["top_k"], None)
    assert math.isclose(exact.sum().item(), 1.0, rel_tol=1e-6)
    counts, runs = tls._sample_counts(target, tiny[1]["markov"], seed=2024, policy="none", **GEN)
    rounds, lookup, accepted, rejected = _lookup_counts(runs)
    assert all(r.drafted == 0 for r in rounds)
    assert accepted > 50 and rejected > 50, (accepted, rejected)
    tls._assert_matches(counts, exact, "lookup alone")


def install_coin_decisions(setattr_) -> None:
    """Make the lookup-versus-drafting decision by a coin flip independent of everything drawn (seeded): a single
    repeated token counts as a match (so on this module's prompt nearly every round has one), and about 40 % of the
    rounds keep their match (the drafter is skipped, its features wait); the others see none and draft.
    ``setattr_`` installs it (the test's ``monkeypatch.setattr``)."""
    coin, propose = random.Random(1), NGramLookup.propose

    def coin_propose(self, max_tokens=None):
        self.min_ngram = 1  # set before the first propose indexes the text
        proposal = propose(self, max_tokens)
        return proposal if coin.random() < 0.4 else LookupProposal([], 0)

    setattr_(NGramLookup, "propose", coin_propose)


def sample_drafter_lookup_and_skipped(target, drafter):
    """N samples under the scheduler with the lookup on and the coin installed: (exact joint, counts, statistics)."""
    exact = tls.exact_joint(target, GEN["temperature"], GEN["top_k"], None)
    counts, runs = tls._sample_counts(target, drafter, seed=4242, policy="scheduler", sps=tls.SCHEDULER_SPS, **GEN)
    return exact, counts, runs


def test_sampling_drafter_lookup_and_skipped_rounds_equal_target(tiny, all_tokens_prompt, monkeypatch):
    """Both chains under the scheduler: rounds that verify the lookup prefix (the drafter skipped) and rounds that
    draft, in one sequence (install_coin_decisions); after a lookup round the drafter ingests the skipped rounds'
    features at its next drafting round."""
    install_coin_decisions(monkeypatch.setattr)
    target, drafters = tiny
    exact, counts, runs = sample_drafter_lookup_and_skipped(target, drafters["markov"])
    rounds, lookup, accepted, rejected = _lookup_counts(runs)
    assert all(r.drafted == 0 for r in lookup)
    drafted = [r for r in rounds if r.source == "draft"]
    catch_up = sum(a.source == "lookup" and b.drafted > 0 for s in runs for a, b in zip(s.rounds, s.rounds[1:]))
    assert min(len(lookup), len(drafted), catch_up) > 100, (len(lookup), len(drafted), catch_up)
    assert accepted > 50 and rejected > 50, (accepted, rejected)
    assert sum(r.accepted for r in drafted) > 50 and sum(r.verified - r.accepted for r in drafted) > 50
    tls._assert_matches(counts, exact, "drafter + lookup + skipped rounds")
