"""The checked, table-taking forms of DSpark Algorithm 1 (docs/method.md §4), for the tests: the paper's statement
of the scheduler, built on the runtime's :func:`~dspark.generation.scheduler.greedy_prefix` and
:func:`~dspark.generation.scheduler.fill`, with the validation a user-facing entry point would need.

* :func:`prefix_schedule` — Algorithm 1 exactly: greedy over the pooled (r, j) ranking with an early STOP at the
  first non-improving Θ = τ* · SPS(B).
* :func:`budget_from_confidences` + :func:`fill_budget` — the lagged variant: the verify budget K from a full search
  of the Θ(B) curve over the confidences of ``lag`` rounds earlier, the K slots filled by the current round's ranking.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import torch

from dspark.generation.scheduler import ScheduleResult, SPSLike, _SPSLookup, fill, greedy_prefix

ConfidencesLike = Union[torch.Tensor, Sequence[Sequence[float]]]
"""R sequences of γ calibrated confidences c_{r,k} ∈ [0, 1]: an [R, γ] tensor (any float dtype, any device) or a list
of R lists of length γ."""


def _confidence_table(confidences: ConfidencesLike) -> torch.Tensor:
    """Validate ``confidences`` (where a user hands them in) and return them as a float64 CPU tensor ``[R, γ]``.

    Raises:
        ValueError: not 2-D, R = 0, γ = 0, ragged rows, an entry that is not a number, NaN, or values outside [0, 1].
    """
    if isinstance(confidences, (str, bytes)) or not hasattr(confidences, "__len__"):
        raise ValueError(f"confidences must be an [R, gamma] tensor or a list of R lists; got "
                         f"{type(confidences).__name__}")
    if not isinstance(confidences, torch.Tensor):
        if len(confidences) == 0:
            raise ValueError("confidences must hold at least one request (R >= 1); got R = 0")
        for r, row in enumerate(confidences):
            if isinstance(row, (str, bytes)) or not hasattr(row, "__len__"):
                raise ValueError(f"confidences must be 2-D [R, gamma]; row {r} is {row!r}, not a sequence")
            if len(row) != len(confidences[0]):
                raise ValueError(f"confidences are ragged: row 0 has gamma = {len(confidences[0])} entries but "
                                 f"row {r} has {len(row)}")
        try:
            confidences = torch.tensor([[float(c) for c in row] for row in confidences], dtype=torch.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"confidences must be 2-D [R, gamma] numbers: {exc}") from None
    if confidences.dim() != 2 or confidences.is_complex():
        raise ValueError(f"confidences must be 2-D [R, gamma] real numbers; got a tensor of shape "
                         f"{tuple(confidences.shape)}, dtype {confidences.dtype}")
    if confidences.shape[0] == 0:
        raise ValueError("confidences must hold at least one request (R >= 1); got R = 0")
    if confidences.shape[1] == 0:
        raise ValueError(f"confidences must have gamma >= 1 positions per request; got shape "
                         f"{tuple(confidences.shape)}")
    table = confidences.detach().to("cpu", torch.float64)
    bad = table.isnan() | (table < 0.0) | (table > 1.0)
    if bad.any():
        r, k = (int(i) for i in bad.nonzero()[0])
        value = table[r, k].item()
        raise ValueError(f"confidences[{r}][{k}] is NaN" if math.isnan(value) else
                         f"confidences[{r}][{k}] = {value!r} is outside [0, 1]")
    return table


def _as_lookup(sps: SPSLike | _SPSLookup) -> _SPSLookup:
    return sps if isinstance(sps, _SPSLookup) else _SPSLookup(sps)


def survival(confidences: ConfidencesLike) -> torch.Tensor:
    """Prefix survival probabilities a_{r,j} = Π_{i≤j} c_{r,i} (docs/method.md eq. 9; Algorithm 1 step 1).

    Args:
        confidences: [R, γ] calibrated confidences c_{r,k} ∈ [0, 1] (tensor or
            list of R lists of length γ).

    Returns:
        torch.float64 CPU tensor of shape [R, γ]; non-increasing along j.

    Raises:
        ValueError: not 2-D, R = 0, γ = 0, ragged rows, NaN, or values
            outside [0, 1].
    """
    return _confidence_table(confidences).cumprod(dim=1)


def prefix_schedule_detailed(confidences: ConfidencesLike, sps: SPSLike) -> ScheduleResult:
    """DSpark Algorithm 1 (docs/method.md §4) with early STOP; returns ℓ* and Θ_best.

    1. a_{r,j} = Π_{i≤j} c_{r,i}.
    2. Pool E = {(r, j)} sorted by a_{r,j} descending (ties: smaller j, then smaller r).
    3. ℓ_r = 0, B = R, τ* = R, Θ_best = R · SPS(R).
    4. For (r, j) in order: ℓ_r = j, B += 1, τ* += a_{r,j}, Θ = τ* · SPS(B); if Θ > Θ_best keep a snapshot,
       else STOP.

    The STOP keeps the decision non-anticipating (lossless); it reaches the global optimum when Θ(B) along the
    sorted order is unimodal.

    Args:
        confidences: [R, γ] calibrated c_{r,k} ∈ [0, 1] (tensor or lists).
        sps: SPS(B) in target steps/s for a verify batch of B tokens (one anchor slot per request included); a
            Mapping[int, float] or a callable. Only the B values the scan reaches are looked up.

    Returns:
        :class:`ScheduleResult` with ``lengths`` = ℓ* (R ints in 0..γ), ``theta`` = Θ_best (tokens/s),
        ``batch_tokens`` = R + Σℓ*, ``expected_tokens`` = τ* at ℓ*.

    Raises:
        ValueError: bad confidences (see :func:`survival`); a B the scan needs missing from an SPS table (the
            message names B); an SPS value that is non-positive, NaN or infinite.
        TypeError: ``sps`` neither a Mapping nor callable.
    """
    a, lookup = survival(confidences), _as_lookup(sps)
    num, gamma = a.shape
    return greedy_prefix(a, [gamma] * num, lambda b: 1.0 / lookup(b), base_tokens=num, base_expected=num)


def prefix_schedule(confidences: ConfidencesLike, sps: SPSLike) -> list[int]:
    """DSpark Algorithm 1 (docs/method.md §4): verify lengths ℓ* (R ints in 0..γ).

    See :func:`prefix_schedule_detailed` for arguments, semantics and errors.
    """
    return prefix_schedule_detailed(confidences, sps).lengths


def budget_from_confidences(confidences: ConfidencesLike, sps: SPSLike) -> int:
    """Verify budget K for the production scheduler (DSpark §5.2).

    Full search (no early stop) over the greedy Θ(B) curve,
    B = R .. R·(1+γ): Θ(B) = (R + sum of the top B−R values a_{r,j}) · SPS(B).
    Returns K = B* − R for the first B* attaining the maximum.

    Only safe (lossless) when ``confidences`` are from an EARLIER round than
    the draft tokens the budget will be spent on (see
    :meth:`dspark.generation.policies.PolicyRun.end_round`); applied to the current round it
    anticipates and biases the output distribution (docs/method.md §4 counterexample).

    Args:
        confidences: [R, γ] calibrated c_{r,k} ∈ [0, 1].
        sps: SPS(B) in steps/s (Mapping or callable); every B in
            R..R·(1+γ) is looked up.

    Returns:
        K, an int in 0..R·γ: extra verify tokens beyond the R anchor slots.

    Raises:
        ValueError / TypeError: as :func:`prefix_schedule_detailed`.
    """
    a, lookup = survival(confidences), _as_lookup(sps)
    num, gamma = a.shape
    best = greedy_prefix(a, [gamma] * num, lambda b: 1.0 / lookup(b), base_tokens=num, base_expected=num, stop=False)
    return best.batch_tokens - num


def fill_budget(confidences: ConfidencesLike, budget: int) -> list[int]:
    """Fill K verify slots by the current a_{r,j} ranking (DSpark §5.2).

    Admits the top-K entries of the pooled order (a_{r,j} desc, then j asc,
    then r asc); the result is prefix-closed per request. If K exceeds R·γ
    (the budget came from a round with more requests or longer blocks) it is
    capped at R·γ.

    Args:
        confidences: [R, γ] calibrated c_{r,k} ∈ [0, 1] of the CURRENT round.
        budget: K ≥ 0, extra verify tokens beyond the R anchor slots.

    Returns:
        ℓ (R ints in 0..γ) with Σℓ = min(K, R·γ).

    Raises:
        ValueError: bad confidences; K negative or not an integer.
    """
    if isinstance(budget, bool) or not isinstance(budget, int):
        try:
            as_int = int(budget)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"verify budget K must be a non-negative int; got {budget!r}") from exc
        if as_int != budget:
            raise ValueError(f"verify budget K must be a non-negative int; got {budget!r}")
        budget = as_int
    if budget < 0:
        raise ValueError(f"verify budget K must be a non-negative int; got {budget}")
    a = survival(confidences)
    return fill(a, [a.shape[1]] * a.shape[0], budget)
