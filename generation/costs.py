"""What a round costs on this machine and what each proposer is expected to yield, learned from the rounds.

The scheduler prices every round (Algorithm 1 with a drafting-cost term, docs/method.md §4): a verify of B tokens costs
``Prices.verify_s(B)`` seconds and a drafting round ``Prices.draft_s(n)`` seconds; a proposer's chain is expected to
survive to position j with probability p^j, p from its :class:`AcceptanceRecord`. All three are measured by the rounds
themselves (every round already times its verify and its drafting), so they follow the machine as it is, a busy one
included, and nothing is stored: a new process starts from the priors. They decide how many tokens are verified, never
the output.

* verify: per request count R, a plain step (B = R: the anchors alone) is priced by a running average of plain steps,
  and a verify of more tokens by a least-squares line t(B) = t_0 + b·B through the recent such rounds' (B, seconds),
  each weighted by :data:`VERIFY_DECAY` ^ age, never below the plain step. An R without a line takes the nearest R's
  line at the same B − R, shifted by the two plain steps' difference (a plain step not seen: that line at B = R). One
  line for all R priced 16 requests' first extra token as the engine's few-request rounds taught it: free, against 55
  ms measured. Two prices, since a one-token step and a multi-token forward take different kernels: across CPUs a
  9-token verify measured 1.1 to 6.7 steps (docs/benchmarks.md). The slope is shrunk toward the prior
  :data:`PRIOR_SLOPE` until the rounds' B values spread enough to measure it. An explicit SPS(B) table
  (``dspark_options(sps=...)``, ``dspark profile``) replaces the line.
* drafting: per number of drafting requests n, an exponential average of drafting rounds that caught up on at most one
  round of committed positions (a round after skipped rounds ingests more, which is not the price of drafting every
  round: it may only lower it); a count not timed yet takes the nearest timed count's price. One price for every n would
  misprice the engine: on the Xeon with AMX a drafting round of 16 requests took twice one of a few.
* the scheduler, not an estimator, decides when to measure an untaken action again (:class:`~.policies.Exploration`).
* acceptance: per proposer, decayed counts of accepted and tried chain positions with a prior of :data:`PRIOR_STRENGTH`
  pseudo-trials at :data:`PRIOR_ACCEPT`; the counts decay every round, also when the proposer did not run, so a proposer
  priced out of the rounds drifts back to the prior and is tried again. A drafting round whose policy verified nothing
  counts as a chain rejected at its first position: otherwise a drafter whose confidences keep refusing every slot would
  keep its record at the prior and be run, and paid for, every round."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .scheduler import _SPSLookup
from .tunables import (ACCEPT_DECAY, DRAFT_DECAY, MIN_VERIFY_S, PLAIN_DECAY, PRIOR_ACCEPT, PRIOR_SLOPE,  # noqa: F401
                       PRIOR_STRENGTH, PRIOR_WEIGHT, VERIFY_DECAY)

__all__ = ["AcceptanceRecord", "Prices"]


def _nearest(counts, requests: int) -> int:
    """The request count among ``counts`` (those with a price) nearest ``requests``, the larger on a tie."""
    return min(counts, key=lambda n: (abs(n - requests), -n))


@dataclass
class AcceptanceRecord:
    """A proposer's acceptance record: p = P(position j survives | j − 1 did), from decayed counts and a prior.

    Attributes:
        accepted: decayed count of accepted chain positions.
        tried: decayed count of positions tried: the accepted ones and the first rejected one of each chain.
    """

    accepted: float = 0.0
    tried: float = 0.0

    @property
    def p(self) -> float:
        """The per-position acceptance, in [0, 1]."""
        return (self.accepted + PRIOR_ACCEPT * PRIOR_STRENGTH) / (self.tried + PRIOR_STRENGTH)

    def survival(self, length: int) -> list[float]:
        """Expected survivals a_j = p^j, j = 1..length."""
        p = self.p
        return [p ** j for j in range(1, length + 1)]

    def update(self, verified: int | None, accepted: int = 0) -> None:
        """One round: decay the counts, then add the chain's outcome (``verified`` None: the proposer did not run)."""
        self.accepted *= ACCEPT_DECAY
        self.tried *= ACCEPT_DECAY
        if verified:
            self.accepted += accepted
            self.tried += accepted + (accepted < verified)


class Prices:
    """The round's prices on this machine (module doc): verify seconds by batch tokens B, drafting seconds.

    Args:
        sps: an explicit SPS(B): ``{B: steps/s}``, a callable or an :class:`~dspark.evaluation.profiling.SPSProfile`
            (steps/s; its curve for the round's R and mean context is used); None: the line is learned from the rounds.
    """

    def __init__(self, sps=None):
        self.sps = sps
        self._curves: dict = {}
        self._sums: dict[int, list[float]] = {}  # R -> decayed Σw, Σw·B, Σw·B², Σw·t, Σw·B·t
        self._first: dict[int, tuple[int, float]] = {}  # R -> its first multi-token verify: (B, seconds)
        self.plain: dict[int, float] = {}  # R -> seconds of a plain step of R requests (B = R), running average
        self.draft: dict[int, float] = {}  # n drafting requests -> seconds of a drafting round, running average

    @property
    def verified_several(self) -> bool:
        """Whether a verify of more than the anchors has been observed (the line has a point of its own)."""
        return bool(self._first)

    @property
    def known(self) -> bool:
        """Whether a verify price exists (a table, or at least one observed round)."""
        return self.sps is not None or bool(self._first) or bool(self.plain)

    def verify_s(self, batch_tokens: int, requests: int = 1, context_len: float | None = None) -> float:
        """Seconds of a verify forward over B = ``batch_tokens`` tokens (R = ``requests``; mean context, tokens).

        Raises:
            RuntimeError: nothing is known yet (:attr:`known` is False).
            ValueError: an explicit table that does not cover B (its message names B).
        """
        if self.sps is not None:
            return 1.0 / self._curve(requests, context_len)(batch_tokens)
        plain = self.plain.get(requests)
        if batch_tokens == requests and plain is not None:
            return plain
        if not self._first:  # no multi-token verify seen yet: the prior line through the plain step
            if not self.plain:
                raise RuntimeError("no verify price yet: observe a round first")
            plain = self.plain[_nearest(self.plain, requests)] if plain is None else plain  # R unseen: nearest
            return plain * (1 + PRIOR_SLOPE * (batch_tokens - requests))
        r = _nearest(self._first, requests)  # R's line, else the nearest R's, shifted
        n, sb, sbb, st, sbt = self._sums[r]
        mean_b, mean_t = sb / n, st / n
        b0, t0 = self._first[r]  # the prior line t(B) = t_R · (1 + PRIOR_SLOPE · (B − R)) through the first verify
        prior = PRIOR_SLOPE * t0 / (1 + PRIOR_SLOPE * (b0 - r))
        sxx, sxy = sbb - n * mean_b**2, sbt - n * mean_b * mean_t  # weighted spread of B, co-spread with t
        slope = max(0.0, (sxy + PRIOR_WEIGHT * prior) / (sxx + PRIOR_WEIGHT))  # least squares shrunk to the prior
        base = self.plain.get(r, mean_t + slope * (r - mean_b))  # r's plain step, else its line at B = r
        own = base if plain is None else plain
        return max(MIN_VERIFY_S, mean_t + slope * (batch_tokens - requests + r - mean_b) + (own - base), own)

    def _curve(self, requests: int, context_len: float | None) -> Callable[[int], float]:
        sps = self.sps
        if not hasattr(sps, "curve"):  # one table or callable for every round: validated lookups
            if None not in self._curves:
                self._curves[None] = _SPSLookup(sps)
            return self._curves[None]
        key = (requests, sps.context_bucket(context_len))
        if key not in self._curves:
            self._curves[key] = sps.curve(requests=requests, context_len=context_len)
        return self._curves[key]

    def observe_verify(self, batch_tokens: int, seconds: float, requests: int = 1) -> None:
        """Fold one round's verify time (forward and acceptance, seconds) for B tokens of R requests into the line;
        with an explicit table there is nothing to learn."""
        if self.sps is not None or not (math.isfinite(seconds) and seconds > 0):
            return
        if batch_tokens == requests:
            last = self.plain.get(requests)
            self.plain[requests] = seconds if last is None else PLAIN_DECAY * last + (1 - PLAIN_DECAY) * seconds
            return
        self._first.setdefault(requests, (batch_tokens, seconds))
        b, sums = float(batch_tokens), self._sums.get(requests, [0.0] * 5)
        self._sums[requests] = [VERIFY_DECAY * s + x for s, x in zip(sums, (1.0, b, b * b, seconds, b * seconds))]

    def draft_s(self, requests: int = 1) -> float | None:
        """Seconds of a drafting round of ``requests`` drafting requests: their running average, else the nearest
        timed count's (the larger on a tie); None before any drafting round was timed."""
        return self.draft[_nearest(self.draft, requests)] if self.draft else None

    def observe_draft(self, seconds: float, requests: int = 1, steady: bool = True) -> None:
        """Fold one drafting round's time (seconds) of ``requests`` drafting requests into its price; a round that
        first caught up on skipped rounds (not ``steady``) may only lower it: its time over-states a steady round's."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        last = self.draft.get(requests)
        if last is None or (not steady and seconds < last):
            self.draft[requests] = seconds
        elif steady:
            self.draft[requests] = DRAFT_DECAY * last + (1 - DRAFT_DECAY) * seconds
