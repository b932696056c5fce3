"""The n-gram lookup proposer (generation/lookup.py) and the round's rule for it (generation/round.py)."""

from __future__ import annotations

import random

import pytest
import torch

from dspark.generation.lookup import NGramLookup


def _lookup(tokens, max_ngram=3, num_tokens=10):
    lk = NGramLookup(max_ngram=max_ngram, num_tokens=num_tokens)
    lk.update(tokens)
    return lk


def _brute_force(tokens, max_ngram, k, min_ngram=2):
    """Reference matcher: scan the whole text right to left for the longest suffix's most recent occurrence."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
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


def test_a_single_repeated_token_is_no_match_by_default():
    assert _lookup([7, 1, 2, 7]).propose().tokens == []  # the 1-gram (7,) alone does not count
    lk = NGramLookup(min_ngram=1)
    lk.update([7, 1, 2, 7])
    assert lk.propose().tokens == [1, 2, 7] and lk.propose().match_length == 1


@pytest.mark.parametrize("kw", [{"max_ngram": 0}, {"num_tokens": 0}, {"max_ngram": 2.0}, {"num_tokens": True},
                                {"min_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}])
def test_bad_matcher_arguments(kw):
    with pytest.raises(ValueError):
        NGramLookup(**kw)


# ------------------------------------------------------------------------------------------------ the round's rule
def test_a_lookup_match_skips_the_drafter_and_is_verified():
    """`dspark.generation.round.propose`: a request whose lookup matches verifies the continuation (capped by its room)
    and does not draft; one without a match drafts; with the lookup off every request drafts."""
    from dspark.generation.drafting import DraftResult
    from dspark.generation.policies import parse_policy
    from dspark.generation.round import RequestState, propose, record

    calls = []

    def fake_draft_round(drafter, contexts, anchors, positions, plan, policy, **kw):
        budgets = plan.budgets
        calls.append((list(budgets), anchors, positions))
        return DraftResult([[9] * b for b in budgets], list(budgets), [[] for _ in budgets], [None] * len(budgets),
                           [1 if b else 0 for b in budgets])

    states = [RequestState(object(), NGramLookup(num_tokens=4)), RequestState(object(), NGramLookup(num_tokens=4)),
              RequestState(object(), None)]
    committed = [[1, 2, 3, 4, 5, 1, 2], [1, 2, 3], [1, 2, 3, 4, 5, 1, 2]]
    policy = parse_policy("full").start()
    import dspark.generation.round as rnd

    original, rnd.draft_round = rnd.draft_round, fake_draft_round
    try:
        chains = propose("drafter", policy, states, committed, [2, 6, 6], block_size=4)
    finally:
        rnd.draft_round = original
    assert calls == [([0, 4, 4], [2, 3, 2], [6, 2, 6])]
    assert [(c.tokens, c.source) for c in chains] == [([3, 4], "lookup"), ([9] * 4, "draft"), ([9] * 4, "draft")]
    assert chains[0].draft_tokens == [] and chains[1].ingested == 1
    record(policy, states, chains, [1, 0, 4], [2, 1, 5], 3.0, 4)
    first = states[0].stats.rounds[0]
    assert (first.drafted, first.verified, first.accepted, first.committed, first.source) == (0, 2, 1, 2, "lookup")
    assert first.draft_tokens == [3, 4] and states[2].stats.rounds[0].draft_tokens == [9] * 4
