"""Hardware-aware prefix scheduler: DSpark Algorithm 1 and the lagged budget (docs/method.md §4), pure functions.

Given R active requests, each with γ calibrated confidences c_{r,k} (the probability that draft token x_{r,k}
survives verification given that x_{r,<k} survived), and a profiled step-rate curve SPS(B) (target forward steps per
second when the verify batch holds B tokens), choose how many draft tokens ℓ_r ∈ {0..γ} of each request to verify.
Every request occupies one anchor slot, so a verify batch holds B = R + Σ_r ℓ_r tokens and is expected to commit
τ* = R + Σ_r Σ_{j≤ℓ_r} a_{r,j} tokens, a_{r,j} = Π_{i≤j} c_{r,i} (the survival of the prefix up to j). The
objective is the system throughput Θ = τ* · SPS(B) (expected committed tokens per second).

* :func:`prefix_schedule` — Algorithm 1 exactly: greedy over the pooled (r, j) ranking with an early STOP at the
  first non-improving Θ. The STOP is a correctness requirement (non-anticipation): whether x_{r,k} is verified
  never depends on c_{r,k+1} or later, which may depend on the sampled value of x_{r,k}.
* :func:`budget_from_confidences` + :func:`fill_budget` — the production variant: the verify budget K comes from a
  full search of the Θ(B) curve over the confidences of ``lag`` rounds earlier, and the K slots are filled by the
  current round's ranking (the state is kept by the ``lagged`` :class:`dspark.generation.policies.PolicyRun`).

Ordering rule used everywhere: a_{r,j} descending, ties broken by smaller j first, then smaller r. Since a_{r,j} is
non-increasing in j, every prefix of this order is prefix-closed per request (a valid ℓ vector) and, for its size,
value-maximal. The pool holds every (r, j), including a_{r,j} = 0; with a non-increasing SPS(B) a zero-value entry
can never raise Θ.

Pure python/torch; no model imports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import torch

__all__ = [
    "ScheduleResult",
    "SPSLike",
    "ConfidencesLike",
    "survival",
    "prefix_schedule",
    "prefix_schedule_detailed",
    "greedy_prefix",
    "budget_from_confidences",
    "fill_budget",
    "fill",
]

SPSLike = Union[Mapping[int, float], Callable[[int], float]]
"""SPS(B): verify batch size B (tokens, one slot per request included) ->
target forward steps per second. A table (Mapping[int, float]) or a
callable."""

ConfidencesLike = Union[torch.Tensor, Sequence[Sequence[float]]]
"""R sequences of γ calibrated confidences c_{r,k} ∈ [0, 1]: an [R, γ]
tensor (any float dtype, any device) or a list of R lists of length γ."""


@dataclass(frozen=True)
class ScheduleResult:
    """Outcome of one scheduling decision.

    Attributes:
        lengths: ℓ_r per request (R ints in 0..γ), the number of draft
            tokens of request r to verify (the anchor slot is not counted).
        theta: Θ = expected_tokens · SPS(batch_tokens), in committed tokens
            per second.
        batch_tokens: B = R + Σ ℓ_r, tokens in the verify batch.
        expected_tokens: τ* = R + Σ_r Σ_{j≤ℓ_r} a_{r,j}, expected tokens
            committed this round (accepted + one resampled/bonus each).
    """

    lengths: list[int]
    theta: float
    batch_tokens: int
    expected_tokens: float


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------
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


def _ranked_entries(a: torch.Tensor, limits) -> list[tuple[int, int, float]]:
    """Pool E = {(r, j) : j ≤ limits[r]} (j 1-based) sorted by a_{r,j} desc, then j asc, then r asc.

    ``a`` is ``[R, W]`` float64 survivals; entries past a row's limit (not drafted yet, or beyond its budget) are
    not in the pool. The pool holds at most R·γ entries, so one Python sort of the table's values is cheaper than
    a chain of tensor operations.
    """
    entries = [(r, j + 1, v) for r, (row, n) in enumerate(zip(a.tolist(), limits)) for j, v in enumerate(row[:n])]
    entries.sort(key=lambda e: (-e[2], e[1], e[0]))
    return entries


def fill(a: torch.Tensor, limits, budget: int) -> list[int]:
    """ℓ_r from the top ``budget`` entries of the pooled order over survivals ``a`` ``[R, W]`` float64, row r's
    first ``limits[r]`` entries in the pool (not validated: the run's own values; :func:`fill_budget` is the checked
    entry point). Returns R ints, prefix-closed per request, summing to min(budget, Σ limits)."""
    lengths = [0] * a.shape[0]
    for r, j, _ in _ranked_entries(a, limits)[:budget]:
        lengths[r] = j  # entries of one request arrive in increasing j
    return lengths


class MissingSPSEntry(ValueError):
    """An SPS(B) table has no entry for the verify batch size B that was asked for."""


class _SPSLookup:
    """Validated, cached SPS(B) lookups (steps/s)."""

    def __init__(self, sps: SPSLike):
        if isinstance(sps, Mapping):
            self._table: Mapping[int, float] | None = sps
            self._fn: Callable[[int], float] | None = None
        elif callable(sps):
            self._table = None
            self._fn = sps
        else:
            raise TypeError(
                f"sps must be a Mapping[int, float] table or a callable B -> steps/s; got {type(sps).__name__}"
            )
        self._cache: dict[int, float] = {}

    def __call__(self, batch_tokens: int) -> float:
        if batch_tokens in self._cache:
            return self._cache[batch_tokens]
        if self._table is not None:
            if batch_tokens not in self._table:
                known = sorted(self._table)
                span = f"{known[0]}..{known[-1]}" if known else "empty"
                raise MissingSPSEntry(
                    f"SPS table has no entry for verify batch size B = {batch_tokens} (table covers {span})"
                )
            raw = self._table[batch_tokens]
        else:
            raw = self._fn(batch_tokens)  # type: ignore[misc]
        try:
            value = float(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"SPS({batch_tokens}) = {raw!r} is not a number (steps/s)") from exc
        if not math.isfinite(value) or value <= 0.0:
            raise ValueError(f"SPS({batch_tokens}) = {raw!r} must be a finite positive rate in steps/s")
        self._cache[batch_tokens] = value
        return value


def _as_lookup(sps: SPSLike | _SPSLookup) -> _SPSLookup:
    return sps if isinstance(sps, _SPSLookup) else _SPSLookup(sps)


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------
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


def greedy_prefix(a: torch.Tensor, limits, seconds: Callable[[int], float], *, base_tokens: int,
                  base_expected: float, stop: bool = True) -> ScheduleResult:
    """The greedy of Algorithm 1 over valid survival rows, with the round's cost as a function of B.

    Entries (r, j) are admitted in the pooled order (module doc); admitting one adds a verify token and its
    survival a_{r,j} to the expected tokens. Θ(B) = τ*(B) / seconds(B) (committed tokens per second). With
    ``seconds(B) = 1 / SPS(B)``, ``base_tokens = R`` and ``base_expected = R`` this is Algorithm 1 exactly
    (Θ = τ* · SPS(B)).

    Args:
        a: ``[R, W]`` float64 survivals a_{r,j} ∈ [0, 1], non-increasing along j (not validated here: the
            public functions below do it where values are handed in).
        limits: per request the entries of its row in the pool (j ≤ limits[r]; the rest are unknown or past its
            budget).
        seconds: B -> the round's time (any unit) for a verify batch of B tokens (drafting included, if sunk).
        base_tokens, base_expected: B and τ* before any entry is admitted (the anchors, fixed chains).
        stop: STOP at the first entry that does not raise Θ (Algorithm 1, non-anticipating); False searches
            every prefix of the order (only for values fixed before the round: planned or lagged).

    Returns:
        :class:`ScheduleResult` of the best prefix (``lengths`` ℓ_r, Θ, B, τ*).
    """
    lengths = [0] * a.shape[0]
    batch, expected = base_tokens, float(base_expected)
    best = ScheduleResult(list(lengths), expected / seconds(batch), batch, expected)
    for r, j, a_rj in _ranked_entries(a, limits):
        lengths[r] = j
        batch += 1
        expected += a_rj
        theta = expected / seconds(batch)
        if theta > best.theta:
            best = ScheduleResult(list(lengths), theta, batch, expected)
        elif stop:
            break  # STOP: never look at entries whose value may depend on already-admitted tokens
    return best


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
