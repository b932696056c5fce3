"""DSpark Algorithm 1 and the lagged fill (docs/method.md §4): the pure functions the verify policies run.

Given R active requests, each with calibrated confidences c_{r,k} (the probability that draft token x_{r,k}
survives verification given that x_{r,<k} survived), choose how many draft tokens ℓ_r of each request to verify.
Every request occupies one anchor slot, so a verify batch holds B = R + Σ_r ℓ_r tokens and is expected to commit
τ* = R + Σ_r Σ_{j≤ℓ_r} a_{r,j} tokens, a_{r,j} = Π_{i≤j} c_{r,i} (the survival of the prefix up to j). The
objective is the system throughput Θ = τ* / seconds(B) (Algorithm 1's τ* · SPS(B) with seconds = 1 / SPS).

* :func:`greedy_prefix` — Algorithm 1's greedy over the pooled (r, j) ranking, with its early STOP at the first
  non-improving Θ (a correctness requirement, non-anticipation: whether x_{r,k} is verified never depends on
  c_{r,k+1} or later, which may depend on the sampled value of x_{r,k}), or a full search of every prefix for values
  fixed before the round (a plan's expected survivals, lagged confidences);
* :func:`fill` — the lagged policy's fill of a budget K by the current round's ranking;
* :class:`_SPSLookup` — validated lookups of an explicit SPS(B) table or callable.

The policies (:mod:`dspark.generation.policies`) call these with the run's own values; the checked, table-taking
forms of Algorithm 1 that the paper states (``prefix_schedule``, ``budget_from_confidences``, ``fill_budget``) live
with the tests that compare against them (tests/algorithm1.py).

Ordering rule used everywhere: a_{r,j} descending, ties broken by smaller j first, then smaller r. Since a_{r,j} is
non-increasing in j, every prefix of this order is prefix-closed per request (a valid ℓ vector) and, for its size,
value-maximal. The pool holds every (r, j), including a_{r,j} = 0; with a non-increasing SPS(B) a zero-value entry
can never raise Θ."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["ScheduleResult", "SPSLike", "MissingSPSEntry", "greedy_prefix", "fill"]

SPSLike = Union[Mapping[int, float], Callable[[int], float]]
"""SPS(B), a table or a callable: verify batch size B (tokens, one slot per request included) -> target steps/s."""

@dataclass(frozen=True)
class ScheduleResult:
    """Outcome of one scheduling decision.

    Attributes:
        lengths: ℓ_r per request (R ints in 0..γ), draft tokens of request r to verify (the anchor slot not counted).
        theta: Θ = expected_tokens · SPS(batch_tokens), in committed tokens per second.
        batch_tokens: B = R + Σ ℓ_r, tokens in the verify batch.
        expected_tokens: τ* = R + Σ_r Σ_{j≤ℓ_r} a_{r,j}, tokens expected to commit (accepted + a resampled/bonus each).
    """

    lengths: list[int]
    theta: float
    batch_tokens: int
    expected_tokens: float


def _ranked_entries(a: torch.Tensor, limits) -> list[tuple[int, int, float]]:
    """Pool E = {(r, j) : j ≤ limits[r]} (j 1-based) of ``[R, W]`` float64 survivals ``a`` in the module doc's order;
    entries past a row's limit (not drafted yet, or beyond its budget) are left out. The pool holds at most R·γ entries,
    so one Python sort of the table's values is cheaper than a chain of tensor operations."""
    entries = [(r, j + 1, v) for r, (row, n) in enumerate(zip(a.tolist(), limits)) for j, v in enumerate(row[:n])]
    entries.sort(key=lambda e: (-e[2], e[1], e[0]))
    return entries


def fill(a: torch.Tensor, limits, budget: int) -> list[int]:
    """ℓ_r from the top ``budget`` entries of the pooled order over survivals ``a`` ``[R, W]`` float64, row r's
    first ``limits[r]`` entries in the pool (not validated: the run's own values). Returns R ints, prefix-closed per
    request, summing to min(budget, Σ limits)."""
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


def greedy_prefix(a: torch.Tensor, limits, seconds: Callable[[int], float], *, base_tokens: int,
                  base_expected: float, stop: bool = True) -> ScheduleResult:
    """The greedy of Algorithm 1 over valid survival rows, with the round's cost as a function of B; returns the
    :class:`ScheduleResult` of the best prefix (``lengths`` ℓ_r, Θ, B, τ*).

    Entries (r, j) are admitted in the pooled order (module doc); admitting one adds a verify token and its
    survival a_{r,j} to the expected tokens. Θ(B) = τ*(B) / seconds(B), committed tokens per second; with
    ``seconds(B) = 1 / SPS(B)`` and ``base_tokens = base_expected = R`` this is Algorithm 1 exactly.

    Args:
        a: ``[R, W]`` float64 survivals a_{r,j} ∈ [0, 1], non-increasing along j (not validated here: the
            run's own values).
        limits: per request the entries of its row in the pool (j ≤ limits[r]; the rest are unknown or past its budget).
        seconds: B -> the round's time (any unit) for a verify batch of B tokens (drafting included, if sunk).
        base_tokens, base_expected: B and τ* before any entry is admitted (the anchors, fixed chains).
        stop: STOP at the first entry that does not raise Θ (Algorithm 1, non-anticipating); False searches
            every prefix of the order (only for values fixed before the round: planned or lagged).
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
