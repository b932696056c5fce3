"""The draft gate of `generate(assistant_model=dspark)` with the DSpark scheduler (one request, R = 1).

Algorithm 1 (SPEC §4) prices only the verify batch: it decides how many drafted tokens to verify once they are
drafted, so the drafter's own forward is paid every round. Where a verify batch of a few tokens costs much more
than a one-token step (2 CPU cores with AVX2 only: SmolLM2-135M in bf16 verifies 2 tokens at 20 steps/s against 28
for one, ``benchmarks/results/profile-avx2``) and the drafter's yield is modest, drafting every round makes
`generate()` slower than plain decoding even when the scheduler then verifies nothing. :class:`DraftGate` decides
BEFORE drafting, from past rounds only, whether drafting this round is expected to pay, as the serving engine's gate
does (:mod:`generation.engine`, "Draft gate" and "Drafting veto"; not in the paper):

* **Model.** Decayed means (:attr:`DraftGate.YIELD_DECAY` per drafted round) of the draft tokens the scheduler
  verified and the target accepted in the rounds that drafted, and of the drafter's time per round, go into
  :func:`generation.scheduler.yield_gate`: drafting pays iff (1 + accepted) / (1/SPS(1 + verified) + t_draft) beats
  SPS(1).
* **Veto.** :class:`generation.round_rates.RoundRates` compares the measured committed tokens per wall second of
  drafting and non-drafting rounds, paired in time; while drafting rounds are the slower ones with a standard error
  to spare, nothing is drafted even if the model says it pays. A window of drafting rounds only gets one
  non-drafting round (``"pair"``) so that the comparison stays paired.
* **Probes.** After 1, 2, 4, … up to :attr:`DraftGate.PROBE_MAX_INTERVAL` consecutive skipped rounds (gated or
  vetoed), a round drafts anyway, so the estimates follow the text (a new passage the drafter knows well); the
  back-off restarts at 1 whenever a round drafts or pairs on the model's word (not when the veto overrides it). A
  probe drafts :attr:`DraftGate.PROBE_ROUNDS` rounds in a row: the first pays the drafter's catch-up on the skipped
  positions, so its time goes into neither the drafter-time average nor the veto's rates (the candidate generator
  calls a drafting round steady when it ingested the features of at most one skipped round, e.g. a pairing round).

The first :attr:`DraftGate.WARMUP_ROUNDS` rounds always draft. What a gate learned carries over to the next
`generate()` call with the same drafter, target, block size and SPS(B) table (:func:`gate_for`: the next call starts
from a copy of the last call's gate, as the serving engine's state persists across requests; prompts whose context
buckets read different tables warm up separate gates), so only the first call pays the warm-up and the early,
frequent probes. :func:`reset_gates` forgets them. A round the gate skips verifies the anchor token only
(ℓ = 0, exactly one plain decoding step); its target features wait and are ingested into the drafter's context at
the next drafting round. No decision reads this round's confidences or draft tokens, so the output is exactly
what it would be without the gate (greedy: token for token; sampling: the same distribution).
"""

from __future__ import annotations

import copy
import time
import weakref
from collections.abc import Callable, Mapping

from .round_rates import RoundRates
from .scheduler import yield_gate

__all__ = ["DraftGate", "SKIP_REASONS", "gate_for", "reset_gates"]

SKIP_REASONS = frozenset({"gated", "veto", "pair"})
"""The :meth:`DraftGate.decide` reasons of a round that does not draft."""


class DraftGate:
    """Per-`generate()`-call decision whether to run the drafter this round (R = 1), from past rounds only.

    Example (the candidate generator's use)::

        gate = DraftGate(sps)                     # sps: B -> verify steps/s (the scheduler's SPS(B) table)
        drafts, reason = gate.decide(budget=8)    # before drafting; reason: warmup / model / probe / gated / veto / pair
        gate.record_draft(0.012, verified=2, accepted=1, steady=True)   # after a drafting round's verify
        gate.record_committed(2)                  # after every round: tokens it appended

    Args:
        sps: SPS(B), steps/s of a target verify forward holding B tokens (callable or mapping, as the scheduler).
        veto: compare measured drafting and non-drafting rounds (:class:`RoundRates`) and skip drafting while it
            loses (default True).

    Units: seconds in; tokens/s in the model's comparison.
    """

    YIELD_DECAY = 0.8
    """Per-drafted-round decay of the yield sums (the serving engine's value): about the last 5 drafted rounds."""
    DRAFT_TIME_EMA = 0.3
    """Weight of the newest steady drafting round in the drafter-time average."""
    WARMUP_ROUNDS = 3
    """Rounds that draft unconditionally at the start of a call, to measure the yield and the drafter's time."""
    PROBE_MAX_INTERVAL = 32
    """Longest run of skipped rounds before a probe drafts anyway (the serving engine's ``probe_max_interval``)."""
    PROBE_ROUNDS = 2
    """Consecutive drafting rounds of one probe (the serving engine's ``VETO_PROBE_ROUNDS``)."""

    def __init__(self, sps: Callable[[int], float], veto: bool = True):
        self.sps = sps
        self.rates = RoundRates() if veto else None
        self.yield_sums = [0.0, 0.0, 0.0]  # decayed [accepted, verified, rounds] over drafted rounds
        self.draft_s: float | None = None  # moving average of the drafter's seconds per steady round
        self.drafted_rounds = 0
        self.interval, self.skipped = 1, 0  # probe back-off: current interval, consecutive skipped rounds
        self._probe_left = 0  # rounds of the current probe still to draft
        self._open: list | None = None  # [start (perf_counter s), drafted, committed tokens, steady] of this round

    def decide(self, budget: int, now: float | None = None) -> tuple[bool, str]:
        """Whether this round drafts, and why: ``"warmup"``, ``"model"`` or ``"probe"`` (drafts); ``"gated"``
        (the model says drafting does not pay), ``"veto"`` (measured drafting rounds are slower) or ``"pair"``
        (one non-drafting round to pair a window of drafting rounds) (does not draft).

        Call once per round, before drafting; ``budget`` is the most draft tokens this round may verify (≥ 1);
        ``now`` is the :func:`time.perf_counter` time (default: now). Closes the previous round's timing.
        """
        now = time.perf_counter() if now is None else float(now)
        self._close(now)
        acc, ver, rounds = self.yield_sums
        if self.drafted_rounds < self.WARMUP_ROUNDS or self.draft_s is None:
            return self._open_round(now, True, "warmup")
        # yield_gate caps both yields at the budget (near the end of a call it is below the mean accepted)
        pays = yield_gate([acc / rounds], [ver / rounds], self.sps, self.draft_s, max_lengths=[budget]).draft[0]
        reason = "gated"
        if pays and self.rates is not None and self.rates.drafting_loses(1):
            pays, reason = False, "veto"
        if pays:
            self.interval, self.skipped = 1, 0
            if self.rates is not None and self.rates.plain_round_due(1, now):
                return self._open_round(now, False, "pair")
            self._probe_left = 0
            return self._open_round(now, True, "model")
        if self._probe_left > 0:
            self._probe_left -= 1
            return self._open_round(now, True, "probe")
        self.skipped += 1
        if self.skipped > self.interval:
            self.skipped, self.interval = 0, min(2 * self.interval, self.PROBE_MAX_INTERVAL)
            self._probe_left = self.PROBE_ROUNDS - 1
            return self._open_round(now, True, "probe")
        return self._open_round(now, False, reason)

    def record_draft(self, seconds: float, verified: int, accepted: int, steady: bool = True) -> None:
        """Fold in a drafting round: the drafter's time (``seconds``; used, and the round's rate recorded for the
        veto, only when ``steady``, i.e. the drafter did not first catch up on the context of skipped rounds), the
        draft tokens the scheduler verified and the target accepted."""
        self.drafted_rounds += 1
        if self._open is not None:
            self._open[3] = bool(steady)
        if steady and seconds > 0:
            self.draft_s = seconds if self.draft_s is None else (
                (1 - self.DRAFT_TIME_EMA) * self.draft_s + self.DRAFT_TIME_EMA * seconds)
        d = self.YIELD_DECAY
        self.yield_sums = [d * old + new for old, new in zip(self.yield_sums, (accepted, verified, 1))]

    def record_committed(self, tokens: int) -> None:
        """Tokens the current round appended (accepted + 1), for the measured rates of the veto."""
        if self._open is not None:
            self._open[2] = int(tokens)

    def clone(self, sps: Callable[[int], float]) -> DraftGate:
        """A copy that starts a new call: the learned state (yield and drafter-time averages, probe back-off,
        measured rates), with ``sps`` as its table, no round open and no probe in progress."""
        new = copy.copy(self)
        new.sps, new.rates = sps, copy.deepcopy(self.rates)
        new.yield_sums = list(self.yield_sums)
        new._open, new._probe_left = None, 0
        return new

    def _open_round(self, now: float, drafts: bool, reason: str) -> tuple[bool, str]:
        self._open = [now, drafts, None, True]
        return drafts, reason

    def _close(self, now: float) -> None:
        """Record the previous round (from its decision to this one: drafter, verify and transformers' loop)."""
        if self._open is None or self.rates is None:
            return
        start, drafted, tokens, steady = self._open
        self._open = None
        if steady and tokens and now > start:
            self.rates.record(1, drafted=drafted, seconds=now - start, tokens=tokens, now=now)


# drafter -> {target -> {(block size, veto, SPS values at B = 1..block size + 1): the last call's gate}}
_LAST_GATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gate_for(drafter, target, block_size: int, sps: Callable[[int], float], veto: bool = True) -> DraftGate:
    """The draft gate for a new `generate()` call: a copy of the last call's gate for this drafter, target, block
    size and SPS(B) table (its values at B = 1..block_size + 1), with its yield and drafter-time averages, probe
    back-off and measured rates; or a new gate. Each call owns its copy, so concurrent calls never share one; the
    registry holds weak references to the drafter and the target only.
    """
    lookup = sps.get if isinstance(sps, Mapping) else sps

    def value(b: int):
        try:
            return round(float(lookup(b)), 9)
        except (KeyError, ValueError, TypeError):  # a gap in the table: the scheduler reports it when it reads B
            return None

    key = (int(block_size), bool(veto), tuple(value(b) for b in range(1, block_size + 2)))
    gates = _LAST_GATES.setdefault(drafter, weakref.WeakKeyDictionary()).setdefault(target, {})
    last = gates.get(key)
    try:
        gate = last.clone(sps) if last is not None else DraftGate(sps, veto=veto)
    except RuntimeError:  # the last call's gate changed size mid-copy (a concurrent call): start afresh
        gate = DraftGate(sps, veto=veto)
    gates[key] = gate
    return gate


def reset_gates() -> None:
    """Forget every gate's learned state (the next `generate()` call of each drafter starts with a warm-up)."""
    _LAST_GATES.clear()
