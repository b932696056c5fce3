"""Measured speed of drafting vs non-drafting rounds, per concurrency R: the serving engine's drafting veto.

The draft gate of :class:`generation.engine.DSparkEngine` decides from a cost MODEL (the SPS(B) table corrected by
measured verify times, the measured drafting time, the draft excess, the requests' realized yields). Every part
is measured, but apart, and a drafting round can still cost more than the parts add up to (catch-up of a request's
drafter context after gated rounds, a verify batch that holds draft tokens at all, cache effects of running the
drafter between two target forwards). On SmolLM2-135M at R = 4 (bf16, 2 CPU threads) the model-gated scheduler
drafted in 37 of 69 rounds and lost 6 % to no speculation (``dspark bench serve``; README).

:class:`RoundRates` measures the question directly: per R, decayed sums of wall seconds and committed tokens of the
rounds that drafted and of those that did not (:attr:`RoundRates.DECAY` per round of the same kind). When the
drafting rounds at this R committed fewer tokens per second than the rounds without drafting, the engine skips
drafting at this R (re-probing with the gate's back-off, which keeps the drafting rate up to date); "slower" means
by more than :attr:`RoundRates.MARGIN`. The veto uses past rounds only (it never sees the current round's
confidences or draft tokens), so it cannot change an output.

Known limit: while vetoed, only the re-probes refresh the drafting rate, and a re-probe drafts one request that
first catches up on the positions it skipped, so it measures slow. With the back-off at 32 rounds, a veto can take
hundreds of rounds to lift after the workload changes to one where drafting pays.
"""

from __future__ import annotations

__all__ = ["RoundRates"]


class RoundRates:
    """Decayed committed tokens per wall second of drafting and non-drafting rounds, per number of requests R.

    Example::

        rates = RoundRates()
        rates.record(4, drafted=False, seconds=0.042, tokens=4)   # one round: R = 4, nothing drafted, 42 ms
        rates.rate(4, drafted=False)                              # None until MIN_ROUNDS rounds of that kind
        rates.drafting_loses(4)                                   # True when drafting rounds were slower

    Units: seconds in, tokens per second out.
    """

    DECAY = 0.97
    """Per-round decay (rounds of the same R and kind): about the last 33 rounds count. Acceptance is bursty (a
    drafting round commits anywhere from 1 to γ + 1 tokens per request), so a short window swings the veto on and off
    even where drafting pays on average."""
    MIN_ROUNDS = 5
    """Rounds of a kind at an R before its rate is trusted."""
    MARGIN = 0.03
    """The veto needs the drafting rounds to be this much slower (relative), not just slower: where the two rates are
    close (SmolLM2-135M at R = 2) the 33-round estimate of the drafting rate swings by more than the gap, and a veto
    set by a low swing lasts, because while vetoed only the re-probes refresh it."""
    STALL_FACTOR = 3.0
    """A round counts at most this many times its kind's current mean round time (a stall from another process
    moves the rate less)."""

    def __init__(self):
        self._sums: dict[tuple[int, bool], list[float]] = {}  # (R, drafted) -> [rounds, weight, seconds, tokens]

    def record(self, num_requests: int, drafted: bool, seconds: float, tokens: int) -> None:
        """Fold one round in: ``num_requests`` requests verified, ``drafted`` whether the drafter ran, its wall time
        (``seconds``, gate + draft + verify + bookkeeping) and the tokens it committed (all requests).

        Raises:
            ValueError: ``seconds`` not > 0, ``tokens`` < 0, ``num_requests`` < 1.
        """
        if num_requests < 1 or not seconds > 0 or tokens < 0:
            raise ValueError(f"bad round: num_requests={num_requests}, seconds={seconds}, tokens={tokens}")
        key = (int(num_requests), bool(drafted))
        count, w, sec, tok = self._sums.get(key, (0, 0.0, 0.0, 0.0))
        if count >= self.MIN_ROUNDS:
            seconds = min(seconds, self.STALL_FACTOR * sec / w)
        d = self.DECAY
        self._sums[key] = [count + 1, d * w + 1.0, d * sec + seconds, d * tok + tokens]

    def rate(self, num_requests: int, drafted: bool) -> float | None:
        """Committed tokens per second of the rounds of this kind at R = ``num_requests``; None before
        :attr:`MIN_ROUNDS` of them."""
        sums = self._sums.get((int(num_requests), bool(drafted)))
        if sums is None or sums[0] < self.MIN_ROUNDS:
            return None
        return sums[3] / sums[2]

    def rounds(self, num_requests: int, drafted: bool) -> int:
        """How many rounds of this kind were recorded at R = ``num_requests``."""
        sums = self._sums.get((int(num_requests), bool(drafted)))
        return 0 if sums is None else int(sums[0])

    def drafting_loses(self, num_requests: int, plain_estimate: float | None = None) -> bool:
        """Whether drafting rounds at R = ``num_requests`` committed fewer tokens per second than rounds without
        drafting, by more than :attr:`MARGIN`. ``plain_estimate`` (tokens/s, e.g. R·SPS'(R) from the corrected
        table) stands in for the non-drafting rate before :attr:`MIN_ROUNDS` such rounds were measured; False while
        either rate is unknown."""
        drafting = self.rate(num_requests, True)
        plain = self.rate(num_requests, False)
        if plain is None:
            plain = plain_estimate
        return drafting is not None and plain is not None and drafting < (1.0 - self.MARGIN) * plain
