"""Verify policies: how many proposed tokens ℓ_r of each request are sent to the target in a round.

One vocabulary, one parser (:func:`parse_policy`), used by `generate()`, the batched engine, the CLI and the app:

==================  =====================================================================================
``none``            no drafter: every round verifies the anchor only (one plain step), or the lookup chain
``full``            verify every drafted slot (γ' tokens; plain DFlash) and every lookup match
``fixed:N``         verify the first N drafted tokens (``fixed:1`` is the MTP-1 analogue)
``threshold:P``     verify while the survival a_k = Π_{j≤k} c_j stays ≥ P (DeepSpec style)
``scheduler``       the default: every round priced on this machine (Algorithm 1 with a drafting-cost term)
``lagged[:LAG]``    the production variant: verify budget K from the confidences of LAG (default 2) rounds
                    earlier, filled by the current round's a_{r,j} ranking
==================  =====================================================================================

A :class:`Policy` is parsed and checked once, where the user hands it over (``dspark_options``, the engine, the
CLI); :meth:`Policy.start` gives the object one run uses, with the run's :class:`~generation.costs.Prices`.

A round asks the policy twice (:mod:`generation.round`):

1. :meth:`Policy.plan`, before anything is drafted: ``scheduler`` and ``lagged`` price the lookup chains (their
   tokens are known; survival p^j from the lookup's :class:`~generation.costs.Record`) and then whether drafting
   pays at all: the best Θ with the drafter's expected survivals and the drafting time against Θ without drafting
   (ℓ = 0 everywhere: plain steps, and the drafter does not run);
2. :meth:`Policy.lengths`, in the drafting round before sampling slot k, with c_{r,1..k} known and later
   confidences unknown (0): ``scheduler`` runs Algorithm 1 with its early STOP, pricing a verify of B tokens at
   the learned verify time plus the (now spent) drafting time, so whether x_{r,k} is verified never depends on
   x_{r,k} itself (non-anticipation, docs/method.md §4): the output stays lossless whatever the policy.

Θ(B) = τ*(B) / seconds(B), committed tokens per second (Algorithm 1's τ* · SPS(B) with seconds = 1 / SPS).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from .costs import Prices
from .scheduler import fill_budget, greedy_prefix, survival_row

__all__ = ["POLICY_NAMES", "Policy", "default_policy", "parse_policy"]

POLICY_NAMES = ("none", "full", "fixed:N", "threshold:P", "scheduler", "lagged[:LAG]")
"""The policy vocabulary, as the CLI's help text shows it."""

_KINDS = ("none", "full", "fixed", "threshold", "scheduler", "lagged")


@dataclass
class Policy:
    """A verify policy (see the module doc). Build it with :func:`parse_policy`; bind it to one run with
    :meth:`start`. Two policies are equal when their specs are (the run state is not compared).

    Attributes:
        kind: ``none``, ``full``, ``fixed``, ``threshold``, ``scheduler`` or ``lagged``.
        length: N of ``fixed:N`` (draft tokens verified per round, ≥ 0).
        threshold: P of ``threshold:P`` (a survival in [0, 1]).
        lag: LAG of ``lagged:LAG`` (rounds, ≥ 1).
        prices: the run's :class:`~generation.costs.Prices` (``scheduler`` / ``lagged``).
    """

    kind: str
    length: int = 0
    threshold: float = 0.0
    lag: int = 2
    prices: Prices | None = field(default=None, compare=False, repr=False)
    _round: tuple = field(default=(1, 1.0, 0.0, None), compare=False, repr=False)  # base B, base τ*, draft s, ctx
    _probe: bool = field(default=False, compare=False, repr=False)  # this round verifies one draft token, unpriced
    _budgets: deque = field(default_factory=deque, compare=False, repr=False)  # lagged: K of later rounds
    _budget: int = field(default=0, compare=False, repr=False)  # lagged: this round's K

    @property
    def name(self) -> str:
        """The canonical spec string, e.g. ``"fixed:3"``; ``parse_policy(p.name) == p``."""
        if self.kind == "fixed":
            return f"fixed:{self.length}"
        if self.kind == "threshold":
            return f"threshold:{self.threshold:g}"
        if self.kind == "lagged":
            return f"lagged:{self.lag}"
        return self.kind

    @property
    def drafts(self) -> bool:
        """Whether the policy runs the drafter at all (False for ``none`` and ``fixed:0``)."""
        return self.kind != "none" and not (self.kind == "fixed" and self.length == 0)

    @property
    def needs_confidence(self) -> bool:
        """Whether the policy reads the calibrated confidences c_k (the drafter needs a confidence head)."""
        return self.kind in ("threshold", "scheduler", "lagged")

    @property
    def priced(self) -> bool:
        """Whether the policy prices rounds (``scheduler``, ``lagged``)."""
        return self.kind in ("scheduler", "lagged")

    def __str__(self) -> str:
        return self.name

    # ------------------------------------------------------------------ one run
    def start(self, sps=None, *, prices: Prices | None = None) -> Policy:
        """A fresh copy of this policy for one run (a `generate()` call, an engine) with its prices: ``prices``, or
        new ones with an explicit SPS(B) ``sps`` (None: learned from the rounds)."""
        if self.priced and prices is None:
            prices = Prices(sps)
        return dataclasses.replace(self, prices=prices if self.priced else None, _round=(1, 1.0, 0.0, None),
                                   _probe=False, _budgets=deque(), _budget=0)

    def _seconds(self, requests: int, context_len: float | None, extra: float = 0.0):
        return lambda b: self.prices.verify_s(b, requests, context_len) + extra

    def plan(self, states, budgets: list[int], lookups: list[list[int]], context_len: float) -> tuple[list, list]:
        """Step 1 of the module doc: the lookup chains' lengths and the drafting budgets of this round.

        Args:
            states: per request its :class:`~generation.round.RequestState` (its acceptance records).
            budgets: per request the most draft tokens it may verify (0: it cannot draft).
            lookups: per request the lookup's proposed tokens (empty: no match).
            context_len: mean committed tokens per request.

        Returns:
            ``(lookup_lengths, budgets)``: a request verifying a lookup chain (length > 0) does not draft; without
            prices (unpriced policies, or a run that has not timed a round yet) every lookup match is verified whole
            and every other request drafts.
        """
        num = len(states)
        self._round, self._probe = (num, float(num), 0.0, context_len), False
        if self.kind == "lagged":
            self._budget = self._budgets.popleft() if len(self._budgets) >= self.lag else num
        if not self.priced or not self.prices.known:
            lookup_lengths = [len(t) for t in lookups]
            return lookup_lengths, [0 if n else b for n, b in zip(lookup_lengths, budgets)]
        if self.prices.wants_plain_step:  # measure t(R) now and then (generation.costs.PLAIN_EVERY)
            return [0] * num, [0] * num
        seconds = self._seconds(num, context_len)
        rows = [s.lookup_record.survival(len(t)) if t else [] for s, t in zip(states, lookups)]
        plain = greedy_prefix(rows, seconds, base_tokens=num, base_expected=num, stop=False)
        budgets = [0 if n else b for n, b in zip(plain.lengths, budgets)]
        draft_s = self.prices.draft_s(sum(b > 0 for b in budgets)) or 0.0  # unknown: free, so it is timed
        self._round = (plain.batch_tokens, plain.expected_tokens, draft_s, context_len)
        if self.prices.wants_probe and any(budgets):  # measure drafting and a verify again (generation.costs)
            self._probe = True
            return plain.lengths, [min(1, b) for b in budgets]
        rows = [s.draft_record.survival(b) for s, b in zip(states, budgets)]
        drafting = greedy_prefix(rows, self._seconds(num, context_len, draft_s), base_tokens=plain.batch_tokens,
                                 base_expected=plain.expected_tokens, stop=False)
        if drafting.theta > plain.theta:  # the drafting price of the requests that do draft, for Algorithm 1
            budgets = [b if n else 0 for n, b in zip(drafting.lengths, budgets)]
            self._round = self._round[:2] + (self.prices.draft_s(sum(b > 0 for b in budgets)) or 0.0, context_len)
        else:
            budgets = [0] * num
        return plain.lengths, budgets

    def lengths(self, confidences: list[list[float]], budgets: list[int]) -> list[int]:
        """ℓ_r for every drafting request from the confidences known so far (step 2 of the module doc).

        Args:
            confidences: R rows of calibrated c_{r,k} (any length; a slot not drafted yet, or beyond the row's
                budget, counts as 0). Ignored by ``none``, ``full`` and ``fixed``.
            budgets: per request, the most draft tokens it may verify this round (0 = it does not draft).

        Returns:
            R ints, 0 ≤ ℓ_r ≤ budgets[r]. ``threshold``: the longest prefix with a_k ≥ P (docs/method.md eq. 9);
            ``scheduler``: Algorithm 1 with its early stop, priced (module doc; every budget while nothing is
            timed yet); ``lagged``: the top-K pooled a_{r,j} (:func:`generation.scheduler.fill_budget`).
        """
        kind = self.kind
        if kind == "none":
            return [0] * len(budgets)
        if kind == "full" or (kind == "scheduler" and (self._probe or not self.prices.known)):
            return list(budgets)
        if kind == "fixed":
            return [min(self.length, b) for b in budgets]
        if kind == "lagged":
            return fill_budget(_pad([row[:b] for row, b in zip(confidences, budgets)]), self._budget)
        rows = [survival_row(row[:b]) for row, b in zip(confidences, budgets)]
        if kind == "threshold":
            return [sum(a >= self.threshold for a in row) for row in rows]
        base_tokens, base_expected, draft_s, context = self._round
        best = greedy_prefix(rows, self._seconds(len(rows), context, draft_s), base_tokens=base_tokens,
                             base_expected=base_expected)
        return best.lengths

    def end_round(self, confidences: list[list[float]], budgets: list[int]) -> None:
        """``lagged``: fold this round's confidences into the budget of LAG rounds ahead (a full Θ(B) search
        without early stop over the priced round). K never depends on the round it is spent on."""
        if self.kind != "lagged":
            return
        if not self.prices.known or not any(budgets):
            self._budgets.append(sum(budgets) if not self.prices.known else 0)
            return
        rows = [survival_row(row[:b]) for row, b in zip(confidences, budgets)]
        base_tokens, base_expected, draft_s, context = self._round
        best = greedy_prefix(rows, self._seconds(len(rows), context, draft_s), base_tokens=base_tokens,
                             base_expected=base_expected, stop=False)
        self._budgets.append(best.batch_tokens - base_tokens)


def _pad(rows: list[list[float]]) -> list[list[float]]:
    """Ragged confidence rows as a rectangle (0 past each row's end)."""
    width = max((len(r) for r in rows), default=0) or 1
    return [r + [0.0] * (width - len(r)) for r in rows]


def default_policy(drafter) -> Policy:
    """The policy a run gets when none is asked for: ``scheduler`` for a drafter with a confidence head, ``full`` for
    one without, ``none`` without a drafter (`generate()` and the engine alike)."""
    if drafter is None:
        return Policy("none")
    return Policy("scheduler" if getattr(drafter, "confidence_head", None) is not None else "full")


def parse_policy(spec: str | Policy | None) -> Policy:
    """Parse a policy spec (module doc) into a :class:`Policy`; None means ``full``; a Policy is returned as is.

    Raises:
        ValueError: an unknown name, a missing or malformed argument (``fixed:x``, ``threshold:2``, ``lagged:0``)
            or an argument to a policy that takes none (``full:3``); the message lists the vocabulary.
    """
    if spec is None:
        return Policy("full")
    if isinstance(spec, Policy):
        return spec
    vocabulary = ", ".join(POLICY_NAMES)
    if not isinstance(spec, str):
        raise ValueError(f"a verify policy is a string ({vocabulary}); got {spec!r}")
    name, sep, arg = spec.strip().partition(":")
    if name not in _KINDS:
        raise ValueError(f"unknown verify policy {spec!r}; use one of {vocabulary}")
    if name in ("none", "full", "scheduler"):
        if sep:
            raise ValueError(f"verify policy {name!r} takes no argument; got {spec!r}")
        return Policy(name)
    if name == "fixed":
        if not arg.isdigit():
            raise ValueError(f"verify policy 'fixed:N' needs an integer N >= 0 (draft tokens per round); got {spec!r}")
        return Policy("fixed", length=int(arg))
    if name == "threshold":
        try:
            p = float(arg)
        except ValueError:
            p = float("nan")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"verify policy 'threshold:P' needs a survival P in [0, 1]; got {spec!r}")
        return Policy("threshold", threshold=p)
    if sep and not (arg.isdigit() and int(arg) >= 1):
        raise ValueError(f"verify policy 'lagged:LAG' needs an integer LAG >= 1 (rounds); got {spec!r}")
    return Policy("lagged", lag=int(arg) if sep else 2)
