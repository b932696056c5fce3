"""The n-gram lookup proposer, its acceptance estimate and the two-chain chooser (generation/lookup.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from generation.lookup import DRAFT, AcceptanceEstimator, LookupChain, NGramLookup
from generation.scheduler import best_prefix, choose_chain


def _lookup(tokens, max_ngram=3, num_tokens=10):
    lk = NGramLookup(max_ngram=max_ngram, num_tokens=num_tokens)
    lk.update(tokens)
    return lk


def _brute_force(tokens, max_ngram, k):
    """Reference matcher: scan the whole text right to left for the longest suffix's most recent occurrence."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k], n
    return [], 0


# ------------------------------------------------------------------------------------------------ matcher
def test_no_match_proposes_nothing():
    for tokens in ([], [5], [1, 2, 3, 4]):
        p = _lookup(tokens).propose()
        assert p.tokens == [] and p.match_length == 0 and p.start == -1


def test_match_near_the_end_proposes_only_what_follows_it():
    # suffix (5, 6) occurred at the start; K = 10 is more than the 3 tokens that follow that occurrence
    p = _lookup([5, 6, 7, 5, 6], max_ngram=2).propose()
    assert p.tokens == [7, 5, 6] and p.match_length == 2 and p.start == 2


def test_most_recent_occurrence_wins():
    p = _lookup([1, 2, 9, 1, 2, 8, 1, 2], max_ngram=2).propose()
    assert p.tokens == [8, 1, 2] and p.start == 5


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # (1, 2, 3) occurred at 0..2; (2, 3) more recently at 5..6
    p = _lookup([1, 2, 3, 8, 4, 2, 3, 9, 1, 2, 3], max_ngram=3, num_tokens=4).propose()
    assert p.tokens == [8, 4, 2, 3] and p.match_length == 3
    p2 = _lookup([1, 2, 3, 8, 4, 2, 3, 9, 1, 2, 3], max_ngram=2, num_tokens=4).propose()
    assert p2.tokens == [9, 1, 2, 3] and p2.match_length == 2


def test_self_overlapping_repetition():
    p = _lookup([4, 4, 4], max_ngram=2).propose()
    assert p.tokens == [4] and p.match_length == 2


def test_max_tokens_caps_the_proposal():
    lk = _lookup([1, 2, 3, 4, 5, 1, 2], max_ngram=2, num_tokens=4)
    assert lk.propose().tokens == [3, 4, 5, 1]
    assert lk.propose(max_tokens=2).tokens == [3, 4]
    assert lk.propose(max_tokens=0).tokens == []
    assert lk.propose(max_tokens=50).tokens == [3, 4, 5, 1]  # never more than K


def test_incremental_index_equals_a_full_rescan():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    lk = NGramLookup(max_ngram=3, num_tokens=5)
    seen = 1
    while seen < len(tokens):
        seen = min(len(tokens), seen + rng.randrange(1, 6))  # rounds commit 1..5 tokens
        lk.update(tokens[:seen])
        p = lk.propose()
        assert (p.tokens, p.match_length) == _brute_force(tokens[:seen], 3, 5), seen


def test_update_takes_tensors_and_rejects_other_sequences():
    lk = NGramLookup(max_ngram=2, num_tokens=3)
    lk.update(torch.tensor([[1, 2, 3]]))
    lk.update(torch.tensor([1, 2, 3, 1, 2]))
    assert lk.tokens == [1, 2, 3, 1, 2] and lk.propose().tokens == [3, 1, 2]
    with pytest.raises(ValueError, match="shrank"):
        lk.update([1, 2])
    with pytest.raises(ValueError, match="not an extension"):
        lk.update([1, 2, 3, 1, 7, 9])
    with pytest.raises(ValueError, match="integer tensor"):
        NGramLookup().update(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"1-D or \[1, L\]"):
        NGramLookup().update(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="must be ints"):
        NGramLookup().update([1, "a"])


@pytest.mark.parametrize("kw", [{"max_ngram": 0}, {"num_tokens": 0}, {"max_ngram": 2.0}, {"num_tokens": True}])
def test_bad_matcher_arguments(kw):
    with pytest.raises(ValueError):
        NGramLookup(**kw)


# ------------------------------------------------------------------------------------------------ estimator
def test_estimator_prior_then_counts():
    est = AcceptanceEstimator(4, prior=0.5, prior_strength=2.0, decay=1.0)
    assert est.survival(3) == [0.5, 0.25, 0.125, 0.0625]
    assert est.observe(3, [1, 2, 3], [1, 2, 9]) == 2  # tokens 1, 2 accepted, token 3 rejected
    # reached = [1, 1, 1, 0], accepted = [1, 1, 0, 0]; pooled m = (2 + 2·0.5) / (3 + 2) = 0.6
    c = est.conditional(3)
    assert c == pytest.approx([2.2 / 3, 2.2 / 3, 1.2 / 3, 0.6])
    a = est.survival(3, 2)
    assert a == pytest.approx([2.2 / 3, (2.2 / 3) ** 2])
    assert est.survival(2) == [0.5, 0.25, 0.125, 0.0625]  # keys are independent
    assert est.survival(DRAFT, 1) == [0.5]


def test_estimator_judges_only_committed_positions():
    est = AcceptanceEstimator(4, decay=1.0)
    assert est.observe(1, [5, 6, 7], [5]) == 1  # only position 1 judged: tokens 2, 3 are censored
    assert est._reached[1] == [1.0, 0.0, 0.0, 0.0] and est._accepted[1] == [1.0, 0.0, 0.0, 0.0]
    assert est.observe(1, [], [5, 6]) == 0 and est.observe(1, [5], []) == 0
    assert est._reached[1] == [1.0, 0.0, 0.0, 0.0]
    assert est.observe(1, list(range(10)), list(range(10))) == 4  # only K = 4 positions are kept


def test_estimator_decay_follows_a_change_of_regime():
    est = AcceptanceEstimator(2, decay=0.8)
    for _ in range(20):
        est.observe(1, [1, 2], [1, 2])
    high = est.conditional(1)[0]
    for _ in range(20):
        est.observe(1, [1, 2], [3, 4])
    low = est.conditional(1)[0]
    # about 1/(1 − 0.8) = 5 rounds count: pooled m ≈ 11/12, c_1 ≈ (5 + 2m)/7 ≈ 0.976; then m ≈ 0.16, c_1 ≈ 0.05
    assert high > 0.97 and low < 0.06
    assert est._reached[1][0] < 5.0


def test_estimator_survival_is_non_increasing_and_in_range():
    rng = random.Random(1)
    est = AcceptanceEstimator(6)
    for _ in range(50):
        prop = [rng.randrange(3) for _ in range(6)]
        est.observe(2, prop, [rng.randrange(3) for _ in range(rng.randrange(0, 8))])
        a = est.survival(2)
        assert all(0.0 < x < 1.0 for x in a) and all(x >= y for x, y in zip(a, a[1:]))


@pytest.mark.parametrize("kw", [{"num_positions": 0}, {"num_positions": 3, "prior": 1.0},
                                {"num_positions": 3, "prior_strength": 0.0}, {"num_positions": 3, "decay": 0.0}])
def test_bad_estimator_arguments(kw):
    with pytest.raises(ValueError):
        AcceptanceEstimator(**kw)


# ------------------------------------------------------------------------------------------------ chooser
SPS = {1: 10.0, 2: 8.0, 3: 7.0, 4: 6.5, 5: 4.0}
LOOKUP_A = [0.9, 0.8, 0.6, 0.3]
DRAFT_A = [0.95, 0.9, 0.8, 0.7]


def test_best_prefix_hand_computed():
    # Θ(ℓ) = (1 + Σ a) · SPS(1 + ℓ): 10, 15.2, 18.9, 21.45, 14.4 → stop at ℓ = 3
    assert best_prefix(LOOKUP_A, SPS) == pytest.approx((3, 21.45, 3.3))
    # with 0.05 s of extra time: 6.667, 10.857, 14.0, 16.189, 12.0
    ell, theta, tokens = best_prefix(LOOKUP_A, SPS, seconds=0.05)
    assert ell == 3 and theta == pytest.approx(3.3 / (0.05 + 1 / 6.5)) and tokens == pytest.approx(3.3)


def test_best_prefix_stops_early_and_at_the_end_of_a_table():
    # Θ(1) = 1.5 · 4 = 6 < Θ(0) = 10: nothing pays; a later, better entry is never looked at (early stop)
    assert best_prefix([0.5, 0.5, 0.5], {1: 10.0, 2: 4.0, 3: 9.0, 4: 9.0}) == (0, 10.0, 1.0)
    assert best_prefix([0.9, 0.9, 0.9], {1: 10.0, 2: 8.0})[0] == 1  # B = 3 is not in the table
    assert best_prefix([], SPS) == (0, 10.0, 1.0)


def test_lookup_beats_a_drafter_that_still_has_to_run():
    # draft chain with t_draft = 0.05 s: Θ(ℓ) = τ/(0.05 + 1/SPS): 11.14, 14.78, 17.91, 14.5 → ℓ = 3, 17.91 < 21.45
    choice = choose_chain(DRAFT_A, LOOKUP_A, SPS, draft_seconds=0.05)
    assert (choice.source, choice.length) == ("lookup", 3)
    assert choice.theta == pytest.approx(21.45) and choice.expected_tokens == pytest.approx(3.3)


def test_a_drafter_that_already_ran_beats_the_lookup():
    # t_draft is spent whatever is verified: lookup 3.3 / (0.05 + 1/6.5) = 16.19 < draft 3.65 / (0.05 + 1/6.5) = 17.91
    choice = choose_chain(DRAFT_A, LOOKUP_A, SPS, draft_seconds=0.05, drafted=True)
    assert (choice.source, choice.length) == ("draft", 3)
    assert choice.theta == pytest.approx(3.65 / (0.05 + 1 / 6.5))
    # a free drafter: 3.65 · 6.5 = 23.725 > 21.45
    free = choose_chain(DRAFT_A, LOOKUP_A, SPS)
    assert (free.source, free.length, free.theta) == ("draft", 3, pytest.approx(23.725))


def test_fixed_draft_length_from_the_verify_policy():
    # the policy verifies all 4 drafts: 4.35 / (0.05 + 1/4) = 14.5 < the lookup's 16.19
    choice = choose_chain(DRAFT_A, LOOKUP_A, SPS, draft_seconds=0.05, drafted=True, draft_length=4)
    assert (choice.source, choice.length) == ("lookup", 3)
    only = choose_chain(DRAFT_A, None, SPS, draft_seconds=0.05, drafted=True, draft_length=4)
    assert (only.source, only.length, only.theta) == ("draft", 4, pytest.approx(14.5))
    assert choose_chain(DRAFT_A, None, SPS, draft_length=0).source == "none"


def test_nothing_pays_and_ties_go_to_the_cheaper_option():
    flat_cost = {1: 10.0, 2: 4.0}
    choice = choose_chain([0.5], [0.5], flat_cost)
    assert (choice.source, choice.length, choice.theta) == ("none", 0, 10.0)
    tie = choose_chain(LOOKUP_A, LOOKUP_A, SPS)
    assert tie.source == "lookup"
    assert choose_chain(None, None, SPS) == choose_chain([], [], SPS)
    assert choose_chain(None, None, SPS).theta == 10.0


def test_callable_sps_and_errors():
    choice = choose_chain([0.99] * 3, [0.2], lambda b: 10.0)  # memory-bound: verifying more is free
    assert (choice.source, choice.length) == ("draft", 3)
    with pytest.raises(ValueError, match=r"draft_survival\[1\]"):
        choose_chain([0.5, 1.5], None, SPS)
    with pytest.raises(ValueError, match=r"lookup_survival\[0\]"):
        choose_chain(None, [math.nan], SPS)
    with pytest.raises(ValueError, match="draft_seconds"):
        choose_chain(None, None, SPS, draft_seconds=-1.0)
    with pytest.raises(ValueError, match="draft_length"):
        choose_chain([0.5], None, SPS, draft_length=2)
    with pytest.raises(ValueError, match="SPS"):
        choose_chain([0.5], None, {2: 1.0})


# ------------------------------------------------------------------------------------------------ one sequence's state
def test_lookup_chain_round_protocol():
    chain = LookupChain(num_tokens=4, max_ngram=2, num_positions=4)
    text = [1, 2, 3, 4, 5, 1, 2]
    p = chain.propose(torch.tensor([text]), max_tokens=10)
    assert p.tokens == [3, 4, 5, 1] and p.match_length == 2 and chain.survival == [0.5, 0.25, 0.125, 0.0625]
    chain.verifying("lookup")
    chain.observe(torch.tensor([text + [3, 4, 9]]))  # tokens 1, 2 accepted, the third is the target's own
    assert chain.acceptance._accepted[2][:3] == [1.0, 1.0, 0.0]
    assert DRAFT not in chain.acceptance._reached  # no drafts were verified
    chain.propose(text + [3, 4, 9], max_tokens=10)
    chain.verifying("draft", [7, 7])
    chain.observe(text + [3, 4, 9, 7, 8])
    assert chain.acceptance._reached[DRAFT][:3] == [1.0, 1.0, 0.0]
    assert chain.acceptance._accepted[DRAFT][:2] == [1.0, 0.0]


def test_lookup_chain_choices():
    chain = LookupChain(num_tokens=4, max_ngram=2, num_positions=4)
    for _ in range(10):  # the lookup's 2-gram matches have been accepted in full
        chain.acceptance.observe(2, [1, 2, 3, 4], [1, 2, 3, 4])
    chain.propose([1, 2, 3, 4, 5, 1, 2], max_tokens=10)
    assert chain.before_drafting(4, SPS, draft_seconds=0.05).source == "lookup"
    assert chain.before_drafting(4, SPS, draft_seconds=0.05, gate="probe").source != "lookup"  # a probe drafts
    # under sampling a drafted chain whose first slot the policy refused (ℓ = 0) is not a candidate
    assert chain.after_drafting([0.99], 0, 4, lambda b: 10.0, 0.05, greedy=False).source == "lookup"
    # greedy: the realized survival of the drafted block (a_k = 1) against the lookup's (c_k ≈ 0.99)
    greedy = chain.after_drafting([1.0] * 4, 4, 4, lambda b: 10.0, 0.05, greedy=True)
    assert (greedy.source, greedy.length) == ("draft", 4)
    # sampling: c_1 = 0.99 then the drafter's prior 0.5 per slot, which loses to the lookup
    assert chain.after_drafting([1.0] * 4, 4, 4, lambda b: 10.0, 0.05, greedy=False).source == "lookup"
    none = LookupChain(num_tokens=4)
    none.propose([1, 2, 3], max_tokens=4)
    assert none.proposal.tokens == [] and none.without_drafter(SPS).source == "none"


def test_measured_prices_average_the_measured_times():
    from generation.lookup import MeasuredPrices

    prices = MeasuredPrices()
    assert prices.sps()(1) == 1.0 and prices.draft_seconds() == 0.0  # nothing measured yet
    prices.observe_verify(0.1)
    prices.observe_verify(0.2)  # 0.7 · 0.1 + 0.3 · 0.2
    prices.observe_draft(0.02)
    assert prices.sps()(1) == pytest.approx(1 / 0.13) == prices.sps()(9)  # flat in B
    assert prices.draft_seconds() == 0.02
