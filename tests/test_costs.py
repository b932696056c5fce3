"""The round's prices and acceptance records (`dspark.generation.costs`) and the scheduler's plan (`PolicyRun.plan`):
fast, no models, except the last test (a tiny random target)."""

from __future__ import annotations

import pytest
import torch

from dspark.generation import costs, policies
from dspark.generation.candidate_generator import learned_prices
from dspark.generation.costs import Prices, AcceptanceRecord
from dspark.generation.policies import Exploration, parse_policy
from dspark.generation.round import Chain, RequestState, record

from .conftest import make_drafter, tiny_target


def test_record_prior_update_and_decay():
    r = AcceptanceRecord()
    assert r.p == pytest.approx(costs.PRIOR_ACCEPT)
    r.update(4, 4)  # all 4 accepted: 4 tried
    assert (r.accepted, r.tried) == (4, 4)
    r.update(4, 1)  # 1 accepted, then a rejection: 2 tried
    d = costs.ACCEPT_DECAY
    assert (r.accepted, r.tried) == pytest.approx((4 * d + 1, 4 * d + 2))
    expected = (4 * d + 1 + costs.PRIOR_ACCEPT * costs.PRIOR_STRENGTH) / (4 * d + 2 + costs.PRIOR_STRENGTH)
    assert r.p == pytest.approx(expected)
    assert r.survival(3) == pytest.approx([expected, expected**2, expected**3])
    bad = AcceptanceRecord()
    for _ in range(20):
        bad.update(8, 0)  # always rejected at once
    low = bad.p
    assert low < 0.15
    for _ in range(30):
        bad.update(None)  # the proposer did not run: the counts decay, p drifts back to the prior
    assert low < bad.p < costs.PRIOR_ACCEPT and bad.p > 0.5


def test_prices_fit_a_line_and_shrink_to_the_prior():
    p = Prices()
    assert not p.known
    with pytest.raises(RuntimeError, match="observe a round first"):
        p.verify_s(1)
    p.observe_verify(9, 3.0)  # one round: the prior line through it
    prior = costs.PRIOR_SLOPE * 3.0 / (1 + costs.PRIOR_SLOPE * 8)
    assert p.verify_s(1) == pytest.approx(3.0 - 8 * prior)
    for _ in range(30):  # a steep machine: t(B) = 1 + 0.5 (B - 1), seen at B = 1, 3 and 9
        for b in (1, 3, 9):
            p.observe_verify(b, 1 + 0.5 * (b - 1))
    assert [p.verify_s(b) for b in (1, 2, 9)] == pytest.approx([1.0, 1.5, 5.0], rel=0.02)
    for _ in range(200):  # a bigger batch measured faster (noise): the price never falls with B
        p.observe_verify(1, 2.0)
        p.observe_verify(9, 1.0)
    assert p.verify_s(9) >= p.verify_s(1)
    p.observe_verify(5, float("nan"))  # ignored
    assert p.verify_s(5) == p.verify_s(5)
    table = Prices({b: 10.0 / b for b in range(1, 6)})  # an explicit SPS(B) replaces the line
    assert table.known and table.verify_s(4) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="B = 7"):
        table.verify_s(7)


def test_a_drafting_round_that_verified_nothing_counts_against_the_drafter():
    """The drafter ran for the first request but its policy verified no slot: its record drops below the prior, as
    after a chain rejected at position 1; the second request did not draft, its record stays at the prior."""
    policy = parse_policy("scheduler").start()
    ran, idle = RequestState(None, None), RequestState(None, None)
    chains = [Chain([], "", draft_tokens=[], confidences=[0.1], ingested=1, t_draft_ms=10.0),
              Chain([], "", t_draft_ms=10.0)]
    record(policy, [ran, idle], chains, accepted=[0, 0], committed=[1, 1], t_verify_ms=30.0, block_size=8)
    assert policy.prices.draft == {1: pytest.approx(0.010)}  # the round's 10 ms, priced for one drafting request
    expected = AcceptanceRecord()
    expected.update(1, 0)
    assert ran.draft_record.p == pytest.approx(expected.p) and expected.p < costs.PRIOR_ACCEPT
    assert idle.draft_record.p == pytest.approx(costs.PRIOR_ACCEPT)
    assert ran.lookup_record.p == pytest.approx(costs.PRIOR_ACCEPT)


def test_a_verify_of_another_request_count_is_priced_before_any_multi_token_verify():
    """Plain steps of one request count seen, nothing else: a round of another count is priced on the nearest
    count's plain step along the prior line (as when the engine's batch grows before any multi-token verify)."""
    p = Prices()
    p.observe_verify(2, 0.05, requests=2)
    assert p.verify_s(3, requests=3) == pytest.approx(0.05)
    assert p.verify_s(5, requests=3) == pytest.approx(0.05 * (1 + 2 * costs.PRIOR_SLOPE))
    with pytest.raises(RuntimeError, match="no verify price yet"):
        Prices().verify_s(1)


def test_each_request_count_has_its_own_line():
    """Few-request rounds, whose extra tokens cost little, do not price the extra tokens of 16 requests (which jump
    after the plain step); a count without a line takes the nearest count's at the same B − R, shifted by the two
    plain steps' difference."""
    p = Prices()
    for _ in range(40):
        p.observe_verify(1, 0.050)
        for b in (2, 5, 9):  # R = 1: 1 ms per extra token
            p.observe_verify(b, 0.050 + 0.001 * (b - 1))
        p.observe_verify(16, 0.130, requests=16)
        for b in (25, 40):  # R = 16: 150 ms after the jump, then 3 ms per token
            p.observe_verify(b, 0.150 + 0.003 * (b - 17), requests=16)
    p.observe_verify(12, 0.110, requests=12)
    assert p.verify_s(3) == pytest.approx(0.052, rel=0.03)
    assert p.verify_s(17, requests=16) == pytest.approx(0.150, rel=0.03)
    assert p.verify_s(16, requests=16) == pytest.approx(0.130)
    # R = 12 has no line of its own: R = 16's at B − R = 4, less the 20 ms between the two plain steps
    assert p.verify_s(16, requests=12) == pytest.approx(0.150 + 0.003 * 3 - 0.020, rel=0.03)


def test_draft_price_is_a_running_average_per_request_count():
    p = Prices()
    assert p.draft_s() is None
    p.observe_draft(0.1)
    p.observe_draft(0.2)
    assert p.draft_s() == pytest.approx(costs.DRAFT_DECAY * 0.1 + (1 - costs.DRAFT_DECAY) * 0.2)
    p.observe_draft(0.5, requests=16)  # 16 drafting requests: their own price, the one-request price unchanged
    assert p.draft_s(16) == 0.5 and p.draft_s(1) == pytest.approx(0.12)
    assert p.draft_s(12) == 0.5 and p.draft_s(3) == pytest.approx(0.12)  # an untimed count: the nearest timed one
    p.observe_draft(0.9, requests=16, steady=False)  # a catch-up round may only lower the price
    assert p.draft_s(16) == 0.5
    p.observe_draft(0.3, requests=16, steady=False)
    assert p.draft_s(16) == 0.3


def _plan(prices, lookups, budgets, draft_p=None, lookup_p=None, exploration=None):
    policy = parse_policy("scheduler").start(prices=prices, exploration=exploration)
    states = [RequestState(None, None) for _ in budgets]
    for s in states:
        for _ in range(40):
            if draft_p is not None:
                s.draft_record.update(1, int(draft_p >= 0.5))
            if lookup_p is not None:
                s.lookup_record.update(1, int(lookup_p >= 0.5))
    plan = policy.plan(states, budgets, lookups, 100)
    return policy, plan, (list(plan.lookup_lengths), list(plan.budgets))


def _prices(slope, draft_s):
    p = Prices()
    for _ in range(30):
        for b in (1, 5, 9):
            p.observe_verify(b, 1 + slope * (b - 1))
    if draft_s is not None:
        p.observe_draft(draft_s)
    return p


def test_plan_drafts_only_where_it_pays():
    """Cheap verify and drafting with a good record: every request drafts; a dear verify, dear drafting or a bad
    record: nobody drafts (plain steps, the drafter does not run)."""
    assert _plan(_prices(0.02, 0.05), [[], []], [8, 8], draft_p=0.9)[2] == ([0, 0], [8, 8])
    assert _plan(_prices(1.0, 0.5), [[], []], [8, 8], draft_p=0.9)[2] == ([0, 0], [0, 0])
    assert _plan(_prices(0.02, 20.0), [[], []], [8, 8], draft_p=0.9)[2] == ([0, 0], [0, 0])
    assert _plan(_prices(0.02, 0.2), [[], []], [8, 8], draft_p=0.0)[2] == ([0, 0], [0, 0])
    per_count = _prices(0.02, None)  # drafting is priced for the number of requests that would draft
    per_count.observe_draft(0.05, requests=1)
    per_count.observe_draft(20.0, requests=2)
    assert _plan(per_count, [[]], [8], draft_p=0.9)[2] == ([0], [8])
    assert _plan(per_count, [[], []], [8, 8], draft_p=0.9)[2] == ([0, 0], [0, 0])
    # unpriced (nothing timed yet): every lookup match verified whole, every other request drafts
    assert _plan(Prices(), [[5, 6, 7], []], [8, 8])[2] == ([3, 0], [0, 8])


def test_plan_prices_lookup_chains():
    """A lookup chain is verified as far as its record pays; a request whose chain is not worth verifying drafts."""
    good = _plan(_prices(0.05, 0.05), [[5, 6, 7, 8], []], [8, 8], draft_p=0.9, lookup_p=0.9)[2]
    assert good[0][0] == 4 and good[1] == [0, 8]
    bad = _plan(_prices(0.3, 0.05), [[5, 6, 7, 8], []], [8, 8], draft_p=0.9, lookup_p=0.0)[2]
    assert bad == ([0, 0], [8, 8])


def test_in_round_lengths_price_the_spent_drafting_time():
    """In the drafting round, Algorithm 1 stops at the first slot that does not raise tokens per second; the drafting
    time already spent makes longer chains worth more."""
    conf = torch.tensor([[0.9, 0.6, 0.6, 0.6]], dtype=torch.float64)
    policy, plan, _ = _plan(_prices(0.3, 0.0), [[]], [8], draft_p=0.9)
    short = policy.lengths(plan, conf)
    policy, plan, _ = _plan(_prices(0.3, 3.0), [[]], [8], draft_p=0.9)
    long = policy.lengths(plan, conf)
    assert short[0] < long[0] <= 4
    # unknown confidences (not drafted yet) count as 0: never verified
    assert policy.lengths(plan, conf, known=[1]) == [1]


def test_default_generate_is_lossless_whatever_the_prices():
    """The default policy in generate() with prices that make it switch between plain steps and drafting keeps the
    greedy output identical, and a run's prices carry over to the next call with the same target and drafter."""
    from dspark.generation import collect_stats, dspark_options

    torch.manual_seed(0)
    target = tiny_target(vocab_size=32)
    drafter = make_drafter(target, block_size=4)
    ids = torch.tensor([[3, 5, 7, 1, 3, 5]])
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    sources = set()
    for sps in ({b: 10.0 for b in range(1, 6)}, {b: (10.0 if b == 1 else 1.0) for b in range(1, 6)}, None):
        with dspark_options(sps=sps), collect_stats() as runs:
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False)
        assert torch.equal(out, ref)
        sources |= {r.source for r in runs[-1].rounds}
    assert "" in sources and ("draft" in sources or "lookup" in sources)
    prices, _ = learned_prices(target, drafter, 4)
    assert prices.known  # the call without a table learned these


def test_a_plain_step_is_priced_apart_and_measured_now_and_then():
    """A plain step (B = R) has its own price: a multi-token verify may cost far more than the line through long
    chains says at B = R; after PLAIN_EVERY rounds without one, the scheduler's plan takes a plain step (nobody
    drafts, no lookup chain is verified)."""
    p, explore = Prices(), Exploration()
    for _ in range(20):
        for b in (1, 5, 9):
            p.observe_verify(b, 0.057 if b == 1 else 0.088)  # every multi-token verify: about 1.5 plain steps
            explore.observe(b, 1)
    assert p.verify_s(1) == pytest.approx(0.057) and p.verify_s(2) == pytest.approx(0.088, rel=0.05)
    assert p.verify_s(2, requests=2) >= 0.057  # no plain step of 2 requests seen: the line, never below R = 1's
    assert _plan(p, [[5, 6]], [8], draft_p=0.99, lookup_p=0.99, exploration=explore)[1].reason != "plain step"
    for _ in range(policies.PLAIN_EVERY):
        p.observe_verify(9, 0.088)
        explore.observe(9, 1)
    _, plan, decided = _plan(p, [[5, 6]], [8], draft_p=0.99, lookup_p=0.99, exploration=explore)
    assert plan.reason == "plain step" and decided == ([0], [0])
    explore.observe(1, 1)
    assert _plan(p, [[5, 6]], [8], draft_p=0.99, lookup_p=0.99, exploration=explore)[1].reason != "plain step"


def test_a_probe_verifies_one_draft_token_after_rounds_without_a_multi_token_verify():
    """After PROBE_EVERY plain steps in a row the plan verifies PROBE_TOKENS drafted token per drafting request,
    whatever the price says (a dear verify would otherwise never be measured again)."""
    p, explore = _prices(1.0, 0.5), Exploration()  # a dear verify: priced rounds take plain steps
    assert _plan(p, [[], []], [8, 8], draft_p=0.9, exploration=explore)[2] == ([0, 0], [0, 0])
    for _ in range(policies.PROBE_EVERY):
        explore.observe(2, 2)
    _, plan, decided = _plan(p, [[], []], [8, 8], draft_p=0.9, exploration=explore)
    assert plan.reason == "probe" and decided == ([0, 0], [policies.PROBE_TOKENS] * 2)


def test_an_explicit_table_asks_for_no_plain_step_or_probe():
    """With an SPS(B) table the verify prices are given: rounds teach nothing, so none is forced."""
    policy = parse_policy("scheduler").start({b: 10.0 for b in range(1, 20)})
    state = RequestState(None, None)
    for b in [9] * (2 * policies.PLAIN_EVERY) + [1] * (2 * policies.PROBE_EVERY):
        plan = policy.plan([state], [8], [[]], 100)
        assert plan.reason == "priced"
        policy.end_round(plan, [[]], b)
    assert policy.exploration == Exploration()
