"""Measured speed of drafting vs non-drafting rounds, per concurrency R, compared within short windows: the
serving engine's drafting veto.

The draft gate of :class:`generation.engine.DSparkEngine` decides from a cost MODEL (the SPS(B) table corrected by
measured verify times, the measured drafting time, the draft excess, the requests' realized yields). Every part
is measured, but apart, and a drafting round can still cost more than the parts add up to (a verify batch that
holds draft tokens at all, cache effects of running the drafter between two target forwards, bookkeeping). On
SmolLM2-135M at R = 4 (bf16, 2 CPU threads) the model-gated scheduler drafted in 37 of 69 rounds and lost 6 % to
no speculation (``dspark bench serve``; README).

:class:`RoundRates` measures the question directly: the committed tokens per wall second of the rounds that drafted
over that of the rounds that did not. The machine's speed drifts (another process, thermal state: the same
benchmark cell measured 17 % apart minutes later), so two rates measured minutes apart say nothing about each
other; the comparison is PAIRED IN TIME instead. Rounds at one R fall into windows of at least :attr:`RoundRates.WINDOW_S`
seconds; a window holding rounds of both kinds gives one sample, the log of its drafting rate over its
non-drafting rate, weighted by n_d·n_p / (n_d + n_p) (its rounds of each kind), and :meth:`RoundRates.ratio` is
the decayed weighted mean of those samples (:attr:`RoundRates.DECAY` per paired window), exponentiated. Drift common to
the two kinds within a second cancels. The veto fires when even the ratio's upper confidence bound
(:meth:`RoundRates.ratio_upper`) is below 1 − :attr:`RoundRates.MARGIN`.

The engine keeps both kinds present: when a window is half over with drafting rounds only
(:meth:`RoundRates.plain_round_due`) it skips drafting for one round (at most one such round per window; a window
spans at least :attr:`RoundRates.WINDOW_ROUNDS` mean rounds, so slow rounds do not make it a large share), and
while vetoed it re-probes drafting with the gate's back-off. A round whose drafters first catch up on more than two
rounds' worth of skipped positions is not recorded (it costs what the next drafting round will not). The veto and
these exploration rounds use past rounds only (never the current round's confidences or draft tokens), so they
cannot change an output.

Known limits: while vetoed, only the re-probes refresh the ratio (one paired sample per probe), so with the
back-off at 32 rounds a veto takes tens of probes, hundreds of rounds, to lift after the workload changes to one
where drafting pays. A probe drafts one request (cheap), so while vetoed the ratio measures whether drafting one
request of R pays, not whether the gate's own choice would.
"""

from __future__ import annotations

import math
import time

__all__ = ["RoundRates"]


class RoundRates:
    """Drafting / non-drafting speed ratio per number of requests R, from time-paired windows of rounds.

    Example::

        rates = RoundRates()
        rates.record(4, drafted=False, seconds=0.042, tokens=4)   # one round: R = 4, nothing drafted, 42 ms
        rates.ratio(4)                                            # None until MIN_WINDOWS windows held both kinds
        rates.drafting_loses(4)  # True when even the ratio's upper confidence bound is below 1 - MARGIN

    Units: seconds in (``now`` on the :func:`time.perf_counter` clock), a dimensionless ratio out.
    """

    WINDOW_S = 1.0
    """Seconds a window spans at least, from its first round: short enough that the machine's speed is the same for
    all its rounds, long enough to hold several rounds (about 20 at R = 4 on SmolLM2-135M, bf16, 2 threads)."""
    WINDOW_ROUNDS = 16
    """A window spans at least this many mean rounds (of the slower kind at this R): with slow rounds (a large
    target on a CPU) a one-second window would hold so few rounds that the one non-drafting round per window that
    :meth:`plain_round_due` asks for became a large share."""
    DECAY = 0.95
    """Decay of the samples per paired window (windows with one kind only leave them as they are): about the last
    20 paired windows count. Acceptance is bursty (a drafting
    round commits anywhere from R to R·(γ + 1) tokens), so one window's sample is noisy."""
    MIN_WINDOWS = 3
    """Paired windows at an R before its ratio is trusted."""
    MARGIN = 0.0
    """The veto needs the drafting rounds to be slower by more than this (relative) ..."""
    CONFIDENCE_Z = 1.0
    """... even after adding this many standard errors of the mean log ratio. Where the two rates are close
    (SmolLM2-135M at R = 2, drafting about 3 % faster) a noisy estimate dips under 1 now and then, and a veto set
    by a dip lasts, because while vetoed only the re-probes refresh it; a fixed margin instead (3 % before) let the
    gate's own drafting at R = 4 lose 4–7 % to no speculation without a veto, the loss being within the margin plus
    the noise (``dspark bench serve``, README)."""
    STALL_FACTOR = 3.0
    """A round counts at most this many times its kind's decayed mean round time at this R (a stall from another
    process moves a window less)."""
    MEAN_DECAY = 0.97
    """Per-round decay of the mean round time per R and kind that :attr:`STALL_FACTOR` caps against."""

    def __init__(self):
        self._windows: dict[int, dict] = {}  # R -> {"start", "sums": {drafted: [seconds, tokens, rounds]}}
        self._paired: dict[int, list[float]] = {}  # R -> decayed [Σ w, Σ w·x, Σ w·x², Σ w²], windows; x = log ratio
        self._mean: dict[tuple[int, bool], list[float]] = {}  # (R, drafted) -> [rounds, Σ weight, Σ seconds]

    def record(self, num_requests: int, drafted: bool, seconds: float, tokens: int, now: float | None = None) -> None:
        """Fold one round in: ``num_requests`` requests verified, ``drafted`` whether the drafter ran, its wall time
        (``seconds``, gate + draft + verify + bookkeeping), the tokens it committed (all requests) and when it ended
        (``now``, :func:`time.perf_counter` seconds; default: now).

        Raises:
            ValueError: ``seconds`` not > 0, ``tokens`` < 0, ``num_requests`` < 1.
        """
        if num_requests < 1 or not seconds > 0 or tokens < 0:
            raise ValueError(f"bad round: num_requests={num_requests}, seconds={seconds}, tokens={tokens}")
        now = time.perf_counter() if now is None else float(now)
        num, drafted = int(num_requests), bool(drafted)
        count, w, sec = self._mean.get((num, drafted), (0, 0.0, 0.0))
        if count >= 1:
            seconds = min(seconds, self.STALL_FACTOR * sec / w)
        d = self.MEAN_DECAY
        self._mean[(num, drafted)] = [count + 1, d * w + 1.0, d * sec + seconds]
        window = self._windows.get(num)
        if window is None or now - window["start"] > self._span(num):
            if window is not None:
                self._close(num, window)
            window = self._windows[num] = {"start": now - seconds, "sums": {True: [0.0, 0, 0], False: [0.0, 0, 0]}}
        sums = window["sums"][drafted]
        sums[0] += seconds
        sums[1] += tokens
        sums[2] += 1

    def _span(self, num: int) -> float:
        """Seconds a window at R = ``num`` spans: :attr:`WINDOW_S`, or :attr:`WINDOW_ROUNDS` mean rounds of the slower
        kind when that is longer."""
        means = [m[2] / m[1] for m in (self._mean.get((num, True)), self._mean.get((num, False))) if m]
        return max([self.WINDOW_S] + [self.WINDOW_ROUNDS * m for m in means])

    def _close(self, num: int, window: dict) -> None:
        (sec_d, tok_d, n_d), (sec_p, tok_p, n_p) = window["sums"][True], window["sums"][False]
        if n_d == 0 or n_p == 0 or tok_d == 0 or tok_p == 0:
            return
        x = math.log((tok_d / sec_d) / (tok_p / sec_p))
        w = n_d * n_p / (n_d + n_p)
        s0, s1, s2, q, k = self._paired.get(num, (0.0, 0.0, 0.0, 0.0, 0))
        d = self.DECAY
        self._paired[num] = [d * s0 + w, d * s1 + w * x, d * s2 + w * x * x, d * d * q + w * w, k + 1]

    def _trusted(self, num_requests: int) -> list[float] | None:
        """The paired sums at this R once :attr:`MIN_WINDOWS` windows went into them, else None."""
        paired = self._paired.get(int(num_requests))
        return paired if paired is not None and paired[4] >= self.MIN_WINDOWS else None

    def ratio(self, num_requests: int) -> float | None:
        """Drafting rounds' committed tokens per second over non-drafting rounds', at R = ``num_requests``, from the
        closed windows that held both kinds; None before :attr:`MIN_WINDOWS` of them."""
        paired = self._trusted(num_requests)
        return None if paired is None else math.exp(paired[1] / paired[0])

    def ratio_upper(self, num_requests: int) -> float | None:
        """:meth:`ratio` times exp(:attr:`CONFIDENCE_Z` standard errors) of the weighted mean log ratio (unbiased
        weighted variance, Σ w (x − m)² / (Σ w − Σ w² / Σ w), over the effective number of windows,
        (Σ w)² / Σ w²); None when :meth:`ratio` is."""
        paired = self._trusted(num_requests)
        if paired is None:
            return None
        s0, s1, s2, q, _ = paired
        mean = s1 / s0
        dof = s0 - q / s0  # Σw - Σw²/Σw: the unbiased weighted variance's denominator (> 0 for 2+ windows)
        var = max(s2 - s1 * s1 / s0, 0.0) / dof if dof > 1e-12 else float("inf")
        return math.exp(mean + self.CONFIDENCE_Z * math.sqrt(var * q) / s0)

    def paired_windows(self, num_requests: int) -> int:
        """How many closed windows at R = ``num_requests`` held rounds of both kinds."""
        paired = self._paired.get(int(num_requests))
        return 0 if paired is None else int(paired[4])

    def plain_round_due(self, num_requests: int, now: float | None = None) -> bool:
        """Whether the open window at R = ``num_requests`` is half over (and not yet over) with drafting rounds but
        none without: the engine then skips drafting for one round so that the window pairs (at most one such round
        per window)."""
        num = int(num_requests)
        window = self._windows.get(num)
        if window is None:
            return False
        now = time.perf_counter() if now is None else float(now)
        span = self._span(num)
        return (window["sums"][True][2] > 0 and window["sums"][False][2] == 0
                and 0.5 * span <= now - window["start"] <= span)

    def drafting_loses(self, num_requests: int) -> bool:
        """Whether drafting rounds at R = ``num_requests`` committed fewer tokens per second than rounds without
        drafting, by more than :attr:`MARGIN` with :attr:`CONFIDENCE_Z` standard errors to spare
        (:meth:`ratio_upper`). At an R without a trusted ratio the largest smaller R with one stands in (drafting
        pays less the more requests share a verify forward, so a loss at a smaller R implies one here, not the
        reverse); False when there is none."""
        num = int(num_requests)
        known = [n for n in self._paired if n <= num and self.ratio(n) is not None]
        if not known:
            return False
        return self.ratio_upper(max(known)) < 1.0 - self.MARGIN
