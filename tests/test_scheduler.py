"""Tests for the hardware-aware prefix scheduler (DSpark Algorithm 1, docs/method.md §4).

Fast, CPU only, no models.
"""

from __future__ import annotations

import dataclasses

import itertools
import math

import pytest
import torch

from dspark.generation.policies import parse_policy
from dspark.generation.round import RequestState

from .algorithm1 import (
    budget_from_confidences,
    fill_budget,
    prefix_schedule,
    prefix_schedule_detailed,
    survival,
)

class LaggedScheduler:
    """The ``lagged`` policy over whole rounds (:meth:`PolicyRun.plan`, :meth:`PolicyRun.lengths`,
    :meth:`PolicyRun.end_round`), every request drafting its whole row."""

    def __init__(self, sps, lag=2):
        self.policy, self.last_budget = parse_policy(f"lagged:{lag}").start(sps), None

    def schedule(self, confidences):
        rows = [[float(c) for c in row] for row in (confidences.tolist() if hasattr(confidences, "tolist")
                                                    else confidences)]
        budgets = [len(row) for row in rows]
        plan = self.policy.plan([RequestState(None, None) for _ in rows], budgets, [[] for _ in rows], 0)
        plan = dataclasses.replace(plan, budgets=tuple(budgets))  # every request drafts its row, whatever the plan
        self.last_budget = self.policy._budget
        lengths = self.policy.lengths(plan, torch.tensor(rows, dtype=torch.float64))
        self.policy.end_round(plan, rows, len(rows) + sum(lengths))
        return lengths



# --------------------------------------------------------------------------
# fixtures / reference implementations (test-only)
# --------------------------------------------------------------------------
def full_scan_schedule(confidences, sps) -> list[int]:
    """TEST FIXTURE ONLY — not lossless. Scans the whole greedy Θ(B) curve of
    the CURRENT confidences without early stop and returns the best lengths.
    This is the anticipating scheduler of the counterexample of docs/method.md §4."""
    a = survival(confidences).tolist()
    num_requests = len(a)
    pool = sorted(
        ((r, j + 1, a_rj) for r, row in enumerate(a) for j, a_rj in enumerate(row)),
        key=lambda e: (-e[2], e[1], e[0]),
    )
    lengths, best_lengths = [0] * num_requests, [0] * num_requests
    tau = float(num_requests)
    best_theta = tau * sps[num_requests]
    for extra, (r, j, a_rj) in enumerate(pool, start=1):
        lengths[r] = j
        tau += a_rj
        theta = tau * sps[num_requests + extra]
        if theta > best_theta:
            best_theta, best_lengths = theta, list(lengths)
    return best_lengths


def theta_of(lengths, confidences, sps) -> float:
    """Θ(ℓ) = (R + Σ_r Σ_{j≤ℓ_r} a_{r,j}) · SPS(R + Σℓ)."""
    a = survival(confidences)
    tau = len(lengths) + sum(float(a[r, :ell].sum()) for r, ell in enumerate(lengths))
    return tau * sps[len(lengths) + sum(lengths)]


def brute_force_best_theta(confidences, sps) -> float:
    """max Θ over every prefix-length vector ℓ ∈ {0..γ}^R."""
    num_requests, gamma = survival(confidences).shape
    return max(
        theta_of(list(lengths), confidences, sps)
        for lengths in itertools.product(range(gamma + 1), repeat=num_requests)
    )


def greedy_theta_curve(confidences, sps) -> list[float]:
    """Θ(B) for B = R..R(1+γ) along the sorted pool."""
    a = survival(confidences)
    num_requests = a.shape[0]
    values = sorted(a.flatten().tolist(), reverse=True)
    curve, tau = [num_requests * sps[num_requests]], float(num_requests)
    for extra, value in enumerate(values, start=1):
        tau += value
        curve.append(tau * sps[num_requests + extra])
    return curve


def is_unimodal(curve: list[float]) -> bool:
    """Strictly increasing up to its peak, strictly decreasing after."""
    peak = max(range(len(curve)), key=curve.__getitem__)
    rising = all(curve[i] < curve[i + 1] for i in range(peak))
    falling = all(curve[i] > curve[i + 1] for i in range(peak, len(curve) - 1))
    return rising and falling


def random_instance(gen: torch.Generator, monotone_sps: bool):
    num_requests = int(torch.randint(1, 4, (), generator=gen))
    gamma = int(torch.randint(1, 5, (), generator=gen))
    confidences = torch.rand(num_requests, gamma, generator=gen, dtype=torch.float64)
    max_b = num_requests * (1 + gamma)
    if monotone_sps:  # smooth-ish decreasing curve: SPS(B+1) = SPS(B) · factor
        factors = 0.55 + 0.45 * torch.rand(max_b, generator=gen, dtype=torch.float64)
        rates = torch.cumprod(factors, 0) * 100.0
    else:  # jagged curve
        rates = 1.0 + 99.0 * torch.rand(max_b, generator=gen, dtype=torch.float64)
    sps = {b: float(rates[b - 1]) for b in range(1, max_b + 1)}
    return confidences, sps


# --------------------------------------------------------------------------
# worked examples (docs/method.md §4)
# --------------------------------------------------------------------------
TWO_REQ_C = [[0.9, 0.5], [0.6, 0.6]]
TWO_REQ_SPS = {2: 1.0, 3: 0.8, 4: 0.55, 5: 0.5, 6: 0.3}

THREE_REQ_C = [[0.95, 0.85, 0.70], [0.80, 0.55, 0.30], [0.65, 0.25, 0.10]]
THREE_REQ_SPS = dict(zip(range(3, 13), [1.0, 0.85, 0.70, 0.60, 0.42, 0.30, 0.20, 0.12, 0.07, 0.04]))


def test_survival_values_and_dtype():
    a = survival(torch.tensor(TWO_REQ_C, dtype=torch.float32))
    assert a.dtype == torch.float64 and a.shape == (2, 2)
    expected = torch.tensor([[0.9, 0.45], [0.6, 0.36]], dtype=torch.float64)
    torch.testing.assert_close(a, expected, atol=1e-7, rtol=0)  # float32 input rounding
    torch.testing.assert_close(survival(TWO_REQ_C), expected)


def test_two_request_example():
    result = prefix_schedule_detailed(TWO_REQ_C, TWO_REQ_SPS)
    assert result.lengths == [1, 0]
    assert result.theta == pytest.approx(2.32, abs=1e-12)
    assert result.batch_tokens == 3
    assert result.expected_tokens == pytest.approx(2.9, abs=1e-12)
    assert prefix_schedule(TWO_REQ_C, TWO_REQ_SPS) == [1, 0]
    assert greedy_theta_curve(TWO_REQ_C, TWO_REQ_SPS) == pytest.approx([2.0, 2.32, 1.925, 1.975, 1.293], abs=1e-12)


def test_three_request_example():
    result = prefix_schedule_detailed(torch.tensor(THREE_REQ_C, dtype=torch.float64), THREE_REQ_SPS)
    assert result.lengths == [1, 0, 0]
    assert result.theta == pytest.approx(3.3575, abs=1e-12)  # = 3.95 · 0.85 (docs/method.md §4)
    assert result.theta == pytest.approx(3.358, abs=1e-3)
    assert result.batch_tokens == 4


def test_callable_sps_matches_table():
    assert prefix_schedule_detailed(THREE_REQ_C, THREE_REQ_SPS.__getitem__) == prefix_schedule_detailed(
        THREE_REQ_C, THREE_REQ_SPS
    )


def test_tie_order_smaller_j_then_smaller_r():
    ones = [[1.0, 1.0], [1.0, 1.0]]
    assert fill_budget(ones, 1) == [1, 0]
    assert fill_budget(ones, 2) == [1, 1]
    assert fill_budget(ones, 3) == [2, 1]
    # a rising SPS: every admission helps, all ties resolved prefix-closed
    assert prefix_schedule(ones, {b: float(b) for b in range(2, 7)}) == [2, 2]


# --------------------------------------------------------------------------
# optimality on random instances
# --------------------------------------------------------------------------
def test_early_stop_is_optimal_when_theta_unimodal():
    gen = torch.Generator().manual_seed(1234)
    checked = interior_peaks = 0
    for _ in range(600):
        confidences, sps = random_instance(gen, monotone_sps=True)
        if not is_unimodal(greedy_theta_curve(confidences, sps)):
            continue
        result = prefix_schedule_detailed(confidences, sps)
        best = brute_force_best_theta(confidences, sps)
        assert result.theta == pytest.approx(best, rel=1e-12)
        assert theta_of(result.lengths, confidences, sps) == pytest.approx(best, rel=1e-12)
        checked += 1
        interior_peaks += 0 < sum(result.lengths) < confidences.numel()
    assert checked >= 200 and interior_peaks >= 50, (checked, interior_peaks)


def test_full_budget_search_is_optimal_on_any_curve():
    # Lemmas 1–2: greedy is value-maximal for every B, so a full Θ(B) search
    # (budget_from_confidences + fill_budget on the same confidences) finds
    # the brute-force optimum even on jagged curves.
    gen = torch.Generator().manual_seed(99)
    for i in range(300):
        confidences, sps = random_instance(gen, monotone_sps=(i % 2 == 0))
        budget = budget_from_confidences(confidences, sps)
        lengths = fill_budget(confidences, budget)
        assert sum(lengths) == budget
        assert lengths == full_scan_schedule(confidences, sps)
        assert theta_of(lengths, confidences, sps) == pytest.approx(
            brute_force_best_theta(confidences, sps), rel=1e-12
        )


def test_fill_budget_prefix_closed_and_capped():
    gen = torch.Generator().manual_seed(7)
    confidences = torch.rand(4, 5, generator=gen, dtype=torch.float64)
    a = survival(confidences)
    for budget in range(0, 25):
        lengths = fill_budget(confidences, budget)
        assert sum(lengths) == min(budget, 20)
        chosen = [a[r, j].item() for r, ell in enumerate(lengths) for j in range(ell)]
        rest = [a[r, j].item() for r, ell in enumerate(lengths) for j in range(ell, 5)]
        assert not chosen or not rest or min(chosen) >= max(rest)


# --------------------------------------------------------------------------
# production variant: lagged budget
# --------------------------------------------------------------------------
def test_lagged_scheduler_uses_budget_from_lag_rounds_ago():
    gen = torch.Generator().manual_seed(5)
    sps = {b: 100.0 * 0.85 ** (b - 3) for b in range(3, 13)}
    rounds = [torch.rand(3, 3, generator=gen, dtype=torch.float64) for _ in range(8)]
    scheduler = LaggedScheduler(sps, lag=2)
    for t, confidences in enumerate(rounds):
        lengths = scheduler.schedule(confidences)
        expected_budget = 3 if t < 2 else budget_from_confidences(rounds[t - 2], sps)  # fallback K = R
        assert scheduler.last_budget == expected_budget
        assert lengths == fill_budget(confidences, expected_budget)
    assert list(scheduler.policy._budgets) == [budget_from_confidences(c, sps) for c in rounds[-2:]]


def test_lagged_budget_ignores_current_confidences():
    sps = {b: 100.0 * 0.8 ** (b - 2) for b in range(2, 9)}
    history = [[[0.9, 0.9, 0.9], [0.9, 0.9, 0.1]], [[0.5, 0.5, 0.5], [0.2, 0.2, 0.2]]]
    totals = set()
    for current in ([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[0.0, 0.0, 0.0], [0.01, 0.0, 0.0]]):
        scheduler = LaggedScheduler(sps, lag=2)
        for past in history:
            scheduler.schedule(past)
        totals.add(sum(scheduler.schedule(current)))
    assert totals == {budget_from_confidences(history[0], sps)}


# --------------------------------------------------------------------------
# non-anticipation counterexample (docs/method.md §4, paper appendix A), statistically
# --------------------------------------------------------------------------
TOKEN_A, TOKEN_B = 0, 1
P_TARGET = torch.tensor([0.7, 0.3], dtype=torch.float64)
P_DRAFT = torch.tensor([0.5, 0.5], dtype=torch.float64)
COUNTER_SPS = {1: 1.0, 2: 0.5, 3: 0.45}


def first_emitted_token(draft_tokens: list[int], verify_length: int, gen: torch.Generator) -> int:
    """Standard rejection sampling on the verified prefix, first output token only.

    ℓ = 0: nothing to verify, sample from p_t. Otherwise accept x_1 with
    probability min(1, p_t(x_1)/p_d(x_1)); on rejection resample from the
    residual norm(max(p_t − p_d, 0)). (Later positions cannot change the first
    emitted token.)"""
    if verify_length == 0:
        return int(torch.multinomial(P_TARGET, 1, generator=gen))
    x1 = draft_tokens[0]
    accept_prob = min(1.0, float(P_TARGET[x1] / P_DRAFT[x1]))
    if float(torch.rand((), generator=gen, dtype=torch.float64)) < accept_prob:
        return x1
    residual = (P_TARGET - P_DRAFT).clamp(min=0.0)
    return int(torch.multinomial(residual / residual.sum(), 1, generator=gen))


def simulate_first_token_rate(schedule, rounds: int, seed: int) -> tuple[float, float]:
    """Returns (P̂(first token = A), fraction of rounds that verified x_1)."""
    gen = torch.Generator().manual_seed(seed)
    count_a = verified = 0
    for _ in range(rounds):
        draft = torch.multinomial(P_DRAFT, 2, replacement=True, generator=gen).tolist()  # x_1, x_2 ~ p_d
        c2 = 0.9 if draft[0] == TOKEN_A else 0.0  # Markov confidence head depends on x_1
        (ell,) = schedule([[0.8, c2]])
        verified += ell > 0
        count_a += first_emitted_token(draft, ell, gen) == TOKEN_A
    return count_a / rounds, verified / rounds


ROUNDS = 40_000


def band(p: float, n: int = ROUNDS) -> float:
    return 5.0 * math.sqrt(p * (1.0 - p) / n)


def test_counterexample_deterministic_decisions():
    assert prefix_schedule([[0.8, 0.9]], COUNTER_SPS) == [0]
    assert prefix_schedule([[0.8, 0.0]], COUNTER_SPS) == [0]
    assert full_scan_schedule([[0.8, 0.9]], COUNTER_SPS) == [2]  # Θ_2 = 1.134 > 1
    assert full_scan_schedule([[0.8, 0.0]], COUNTER_SPS) == [0]  # Θ_2 = 0.81
    assert 0.85 - 0.7 > band(0.7) + band(0.85)  # the sample size can tell them apart


def test_counterexample_early_stop_is_lossless():
    p_hat, _ = simulate_first_token_rate(lambda c: prefix_schedule(c, COUNTER_SPS), ROUNDS, seed=1)
    assert abs(p_hat - 0.7) <= band(0.7), p_hat


def test_early_stop_lossless_when_it_verifies():
    """A table where early stop *does* verify x_1 (Θ(2) = 1.8·0.9 = 1.62 > 1): rejection sampling runs on every
    round and the emitted token still follows p_t (0.7), so the lossless result is not plain target sampling."""
    sps = {1: 1.0, 2: 0.9, 3: 0.45}
    assert prefix_schedule([[0.8, 0.9]], sps) == [1]  # Θ(3) = 2.52·0.45 = 1.13 < 1.62: stop at ℓ = 1
    p_hat, verified = simulate_first_token_rate(lambda c: prefix_schedule(c, sps), ROUNDS, seed=5)
    assert verified == 1.0
    assert abs(p_hat - 0.7) <= band(0.7), p_hat


def test_counterexample_full_scan_is_biased():
    p_hat, verified = simulate_first_token_rate(lambda c: full_scan_schedule(c, COUNTER_SPS), ROUNDS, seed=2)
    assert abs(p_hat - 0.85) <= band(0.85), p_hat
    assert abs(p_hat - 0.7) > band(0.7), p_hat  # detectably not the target distribution
    assert abs(verified - 0.5) <= band(0.5)


def test_counterexample_lagged_budget_is_lossless():
    scheduler = LaggedScheduler(COUNTER_SPS, lag=2)
    p_hat, verified = simulate_first_token_rate(scheduler.schedule, ROUNDS, seed=3)
    assert abs(p_hat - 0.7) <= band(0.7), p_hat
    # it does verify x_1 in about half the rounds (whenever x_1 = A two rounds earlier)
    assert abs(verified - 0.5) <= band(0.5), verified


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "confidences, match",
    [
        ([[0.5, 1.5]], r"confidences\[0\]\[1\] = 1.5 is outside \[0, 1\]"),
        ([[0.5], [-0.1]], r"confidences\[1\]\[0\] = -0.1 is outside"),
        ([[0.5, float("nan")]], r"confidences\[0\]\[1\] is NaN"),
        (torch.tensor([[0.5, float("nan")]]), r"is NaN"),
        ([[0.5, 0.5], [0.5]], r"ragged: row 0 has gamma = 2 entries but row 1 has 1"),
        ([0.5, 0.5], r"2-D"),
        (torch.tensor([0.5, 0.5]), r"2-D .* shape \(2,\)"),
        (torch.zeros(1, 2, 2), r"2-D .* shape \(1, 2, 2\)"),
        ([[[0.5]]], r"2-D"),
        ([[], []], r"gamma >= 1"),
        (torch.empty(2, 0), r"gamma >= 1"),
        ([], r"R >= 1"),
        ("0.5", r"tensor or a list"),
    ],
)
def test_bad_confidences(confidences, match):
    for call in (
        lambda: survival(confidences),
        lambda: prefix_schedule(confidences, TWO_REQ_SPS),
        lambda: budget_from_confidences(confidences, TWO_REQ_SPS),
        lambda: fill_budget(confidences, 1),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_missing_batch_size_in_table():
    with pytest.raises(ValueError, match=r"no entry for verify batch size B = 4"):
        prefix_schedule(TWO_REQ_C, {2: 1.0, 3: 0.8})  # Θ(3) improves, so B = 4 is needed
    with pytest.raises(ValueError, match=r"B = 2"):
        prefix_schedule(TWO_REQ_C, {3: 0.8})
    with pytest.raises(ValueError, match=r"B = 6"):
        budget_from_confidences(TWO_REQ_C, {2: 1.0, 3: 0.8, 4: 0.5, 5: 0.4})
    with pytest.raises(ValueError, match=r"B = 6"):
        LaggedScheduler({2: 1.0, 3: 0.8, 4: 0.5, 5: 0.4}).schedule(TWO_REQ_C)


@pytest.mark.parametrize("bad_rate", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_sps(bad_rate):
    table = {**TWO_REQ_SPS, 3: bad_rate}
    with pytest.raises(ValueError, match=r"SPS\(3\) = .* finite positive"):
        prefix_schedule(TWO_REQ_C, table)
    with pytest.raises(ValueError, match=r"SPS\(2\) = .* finite positive"):
        prefix_schedule(TWO_REQ_C, lambda b: bad_rate)


def test_bad_sps_type_budget_and_lag():
    with pytest.raises(TypeError, match="sps must be"):
        prefix_schedule(TWO_REQ_C, [1.0, 0.8])
    with pytest.raises(ValueError, match=r"verify budget K .* got -1"):
        fill_budget(TWO_REQ_C, -1)
    with pytest.raises(ValueError, match=r"verify budget K .* got 1.5"):
        fill_budget(TWO_REQ_C, 1.5)
    with pytest.raises(ValueError, match=r"'lagged:LAG' needs an integer LAG >= 1"):
        parse_policy("lagged:0")


def test_lagged_keeps_drafting_after_a_plain_step():
    """A round that does not draft (the plain step a priced run takes every PLAIN_EVERY rounds) has no confidences
    to set the budget K of LAG rounds later: it passes on the K it was given, so one plain step does not leave a K = 0
    that recurs every LAG rounds (with a cheap verify and c = 0.9, nearly every round drafts)."""
    from dspark.generation.costs import Prices

    prices = Prices()
    policy = parse_policy("lagged").start(prices=prices)
    state = RequestState(None, None)
    drafted = []
    for _ in range(64):
        plan = policy.plan([state], [8], [[]], 100)
        conf = torch.full((1, 8), 0.9, dtype=torch.float64)
        lengths = policy.lengths(plan, conf) if plan.drafts else [0]
        batch = 1 + lengths[0]
        policy.end_round(plan, [conf[0].tolist()] if plan.drafts else [[]], batch)
        state.draft_record.update(lengths[0] or None, lengths[0])
        prices.observe_verify(batch, 0.010 + 0.0005 * batch)
        if plan.drafts:
            prices.observe_draft(0.001)
        drafted.append(plan.drafts)
    assert sum(drafted[20:]) >= 0.85 * len(drafted[20:]), drafted
