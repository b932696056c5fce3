"""Per-round statistics of speculative decoding, and a context manager that collects them from `generate()`."""

from __future__ import annotations

import contextvars
from dataclasses import asdict, dataclass, field

from .scoped import ScopedValue


@dataclass
class RoundStats:
    """One speculative round; ``drafted`` counts the drafter's tokens whichever chain was sent (``source``).

    Attributes:
        drafted: draft tokens sampled this round (slots the policy admitted).
        verified: proposed tokens sent to the target: the lookup chain's length in a lookup round, else the drafts
            the policy admitted (= drafted: drafting stops where verification stops).
        accepted: proposed tokens the target accepted (n in the paper).
        committed: tokens appended this round (accepted + the resampled/bonus token; may be cut by EOS/length).
        confidences: calibrated c_k of the verified positions (empty without a confidence head).
        draft_tokens: the proposed token ids: the drafter's drafted ids, or the verified lookup tokens.
        t_draft_ms: this request's share of the round's lookup and drafting time (context ingestion + block forward +
            sequential sampling), ms; the shares of a round's requests sum to its time.
        t_verify_ms: from the end of drafting to the end of the target's verify/accept step, ms (the engine's prefill
            of requests admitted in the same forward included).
        ingested: target positions the drafter ingested into its context this round (0 when it did not run).
        source: the chain verified: ``"draft"`` (the drafter's block), ``"lookup"`` (the n-gram lookup's
            continuation, :mod:`dspark.generation.lookup`; the drafter did not run, ``drafted = 0``) or ``""`` (nothing:
            one plain decoding step).
    """

    drafted: int
    verified: int
    accepted: int = 0
    committed: int = 0
    confidences: list[float] = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)
    t_draft_ms: float = 0.0
    t_verify_ms: float = 0.0
    ingested: int = 0
    source: str = ""


@dataclass
class GenerationStats:
    """All rounds of one `generate()` call (the prefill is not a round), and the verify policy that ran
    (``policy``: its name, with " (default)" when none was asked for)."""

    rounds: list[RoundStats] = field(default_factory=list)
    policy: str = ""

    @property
    def tau(self) -> float:
        """Acceptance length τ: mean tokens committed per round."""
        return sum(r.committed for r in self.rounds) / max(1, len(self.rounds))

    def summary(self) -> dict:
        """Counts and means over ALL rounds, those where the drafter did not run included (``t_draft_ms`` is the
        mean propose time per round; ms)."""
        n = max(1, len(self.rounds))
        return {
            "rounds": len(self.rounds),
            "tau": self.tau,
            "drafted": sum(r.drafted for r in self.rounds),
            "accepted": sum(r.accepted for r in self.rounds),
            "skipped_draft_rounds": sum(r.drafted == 0 for r in self.rounds),
            "lookup_rounds": sum(r.source == "lookup" for r in self.rounds),
            "plain_rounds": sum(r.source == "" for r in self.rounds),
            "policy": self.policy,
            "t_draft_ms": sum(r.t_draft_ms for r in self.rounds) / n,
            "t_verify_ms": sum(r.t_verify_ms for r in self.rounds) / n,
        }

    def to_dict(self) -> dict:
        return {**self.summary(), "per_round": [asdict(r) for r in self.rounds]}


_collector: contextvars.ContextVar[list | None] = contextvars.ContextVar("dspark_stats", default=None)


class collect_stats(ScopedValue):
    """Collect the :class:`GenerationStats` of every DSpark `generate()` call inside a ``with`` block; the block's
    ``as`` target is the list they are appended to, one per call.

    Context-local (per thread / task), so concurrent users never see each other's statistics::

        with collect_stats() as runs:
            target.generate(ids, assistant_model=drafter)
        print(runs[-1].tau)
    """

    def __init__(self):
        self.runs: list[GenerationStats] = []
        super().__init__(_collector, self.runs, "collect_stats()", "collected nothing",
                         "with collect_stats() as runs: target.generate(...)")


def register(stats: GenerationStats) -> None:
    runs = _collector.get()
    if runs is not None:
        runs.append(stats)
