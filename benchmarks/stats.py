"""The statistics of the benchmark scripts: paired comparisons, the sign test, means of ratios and rates.

A benchmark here pairs two arms on the same unit (a prompt, a repetition, an evaluation batch) run back to back, so
drift of the machine falls on both alike, and asks in how many pairs one arm won: the sign test of that count
(``scipy.stats.binomtest``, p = 0.5), two-sided unless a script says otherwise.

Rules, the same in every script:

- **ties and missing values**: a pair where the two values are equal is dropped before the test (it favours neither
  side); a pair with a NaN on either side is dropped everywhere (a prompt without a round has no τ);
- **the empty case**: a test or a mean over no values is NaN (there is nothing to measure: neither "no difference",
  1.0, nor an error). JSON written by ``json.dumps`` holds it as ``NaN``, which ``json.loads`` reads back.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

NAN = float("nan")


def sign_test(wins: int, n: int, alternative: str = "two-sided") -> float:
    """The sign test's p-value for ``wins`` of ``n`` pairs favouring one side (ties already dropped).

    ``alternative``: ``"two-sided"`` (default), or ``"greater"`` (the chance of ``wins`` or more under a fair coin:
    the one-sided test "the first side is no faster"), or ``"less"``, as in ``scipy.stats.binomtest``. NaN for
    ``n == 0``.

    Raises:
        ValueError: unless 0 <= wins <= n.
    """
    if not 0 <= wins <= n:
        raise ValueError(f"need 0 <= wins <= n, got wins={wins}, n={n}")
    if n == 0:
        return NAN
    from scipy.stats import binomtest

    return float(binomtest(wins, n, 0.5, alternative=alternative).pvalue)


def _pairs(new: Sequence[float], base: Sequence[float]) -> list[tuple[float, float]]:
    if len(new) != len(base):
        raise ValueError(f"paired values differ in number: {len(new)} and {len(base)}")
    return [(a, b) for a, b in zip(new, base) if not (math.isnan(a) or math.isnan(b))]


def paired_ratios(base: Sequence[float], new: Sequence[float]) -> list[float]:
    """``new[i] / base[i]`` for every pair (NaN pairs dropped), in order."""
    return [a / b for a, b in _pairs(new, base)]


def paired(new: Sequence[float], base: Sequence[float], alternative: str = "two-sided") -> dict:
    """``new`` against ``base``, pair by pair (``new[i]`` with ``base[i]``; NaN pairs dropped).

    Returns ``pairs`` (pairs counted), ``won`` (new > base), ``lost`` (new < base), ``ties``, ``mean_delta`` (the
    mean of new − base over the pairs) and ``p`` (:func:`sign_test` of ``won`` of ``won + lost``); ``mean_delta``
    and ``p`` are NaN where there is no pair, ``p`` also where every pair ties.
    """
    pairs = _pairs(new, base)
    won = sum(a > b for a, b in pairs)
    lost = sum(a < b for a, b in pairs)
    return {"pairs": len(pairs), "won": won, "lost": lost, "ties": len(pairs) - won - lost,
            "mean_delta": statistics.fmean(a - b for a, b in pairs) if pairs else NAN,
            "p": sign_test(won, won + lost, alternative)}


def geometric_mean(values: Iterable[float]) -> float:
    """The geometric mean (of ratios: the mean that treats 2× and 0.5× alike); NaN for no values."""
    values = list(values)
    return statistics.geometric_mean(values) if values else NAN


def harmonic_mean(values: Iterable[float], weights: Iterable[float] | None = None) -> float:
    """The harmonic mean (of rates: with ``weights`` = the work of each, e.g. tokens, it is the total work over the
    total time, what "total tokens / total seconds" computes); NaN for no values."""
    values = list(values)
    if not values:
        return NAN
    return statistics.harmonic_mean(values, None if weights is None else list(weights))
