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

A :class:`Policy` is the parsed spec, checked once where the user hands it over (``dspark_options``, the engine, the
CLI); :meth:`Policy.start` gives the :class:`PolicyRun` of one run (a class per rule), with its prices. A round asks the
run three things (:mod:`dspark.generation.round` tells the round's steps):

1. :meth:`PolicyRun.plan`, before anything is drafted: the round's :class:`RoundPlan` (a priced round's special
   cases are decided in :meth:`_Scheduler.plan`, one line of reason each; ``lagged``'s in :meth:`_Lagged.plan`);
2. :meth:`PolicyRun.lengths`, in the drafting round before sampling slot k, on the ``[R, γ']`` confidence table with
   c_{r,1..k} known: how many drafts of each request are verified, so whether x_{r,k} is verified never depends on
   x_{r,k} itself (non-anticipation, docs/method.md §4): the output stays lossless whatever the policy;
3. :meth:`PolicyRun.end_round`, after the verify.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .costs import Prices
from .scheduler import fill, greedy_prefix
from .tunables import DEFAULT_LAG, PLAIN_EVERY, PROBE_EVERY, PROBE_TOKENS

__all__ = ["POLICY_NAMES", "Exploration", "Policy", "PolicyRun", "RoundPlan", "default_policy", "parse_policy"]


POLICY_NAMES = ("none", "full", "fixed:N", "threshold:P", "scheduler", "lagged[:LAG]")
"""The policy vocabulary, as the CLI's help text shows it."""

_KINDS = ("none", "full", "fixed", "threshold", "scheduler", "lagged")


@dataclass(frozen=True)
class Policy:
    """A verify policy spec (see the module doc), built by :func:`parse_policy`; :meth:`start` binds it to one run.

    Attributes:
        kind: ``none``, ``full``, ``fixed``, ``threshold``, ``scheduler`` or ``lagged``.
        length: N of ``fixed:N`` (draft tokens verified per round, ≥ 0).
        threshold: P of ``threshold:P`` (a survival in [0, 1]).
        lag: LAG of ``lagged:LAG`` (rounds, ≥ 1).
    """

    kind: str
    length: int = 0
    threshold: float = 0.0
    lag: int = DEFAULT_LAG

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

    def start(self, sps=None, *, prices: Prices | None = None, exploration: Exploration | None = None) -> PolicyRun:
        """The :class:`PolicyRun` of one run (a `generate()` call, an engine) with its prices: ``prices``, or new ones
        with an explicit SPS(B) ``sps`` (None: learned from the rounds), and its :class:`Exploration` (kept with the
        prices when they are shared between runs); unpriced policies keep neither."""
        if not self.priced:
            return _RUNS[self.kind](self)
        return _RUNS[self.kind](self, prices if prices is not None else Prices(sps), exploration or Exploration())


@dataclass(frozen=True)
class RoundPlan:
    """What one round does, fixed before anything is drafted (:meth:`PolicyRun.plan`).

    Attributes:
        lookup_lengths: per request the lookup tokens it verifies (0: none; such a request does not draft).
        budgets: per request the most draft tokens it may verify (0: it does not draft).
        base_tokens: B of the verify before any draft token is admitted (anchors and lookup chains).
        base_expected: τ* before any draft token (one per anchor plus the lookup chains' expected survivals).
        draft_s: the drafting seconds Algorithm 1 charges to the round (0 where unknown or unpriced).
        context_len: mean committed tokens per request (prices may depend on it).
        reason: why the round is what it is: ``"unpriced"`` (every budget verified whole), ``"priced"``,
            ``"plain step"`` or ``"probe"`` (exploration, :class:`Exploration`).
    """

    lookup_lengths: tuple[int, ...]
    budgets: tuple[int, ...]
    base_tokens: int
    base_expected: float
    draft_s: float = 0.0
    context_len: float | None = None
    reason: str = "unpriced"

    @property
    def drafts(self) -> bool:
        """Whether the drafter runs this round (some request has a budget)."""
        return any(self.budgets)

    def without_drafting(self) -> RoundPlan:
        """The same round with no request drafting."""
        return RoundPlan(self.lookup_lengths, (0,) * len(self.budgets), self.base_tokens, self.base_expected, 0.0,
                         self.context_len, self.reason)


@dataclass
class Exploration:
    """When a priced run measures the action it has not been taking (:data:`PLAIN_EVERY`, :data:`PROBE_EVERY`):
    decision state, kept beside the run's prices so that runs sharing the prices share it. Rounds priced by an
    explicit SPS(B) table teach nothing and are not counted.

    Attributes:
        since_plain: rounds since the last plain step (B = R).
        since_verify: rounds since the last verify of more than the anchors (B > R).
    """

    since_plain: int = 0
    since_verify: int = 0

    def observe(self, batch_tokens: int, requests: int) -> None:
        """Count one verified round of B = ``batch_tokens`` tokens for R = ``requests`` requests."""
        self.since_plain = 0 if batch_tokens == requests else self.since_plain + 1
        self.since_verify = 0 if batch_tokens > requests else self.since_verify + 1


class PolicyRun:
    """The policy of one run: ``full`` as is (every budgeted slot verified, every lookup match whole), the others' base.

    Attributes:
        spec: the :class:`Policy`.
        prices: the run's :class:`~dspark.generation.costs.Prices` (priced policies), else None.
    """

    prices: Prices | None = None

    def __init__(self, spec: Policy):
        self.spec = spec

    @property
    def drafts(self) -> bool:
        """:attr:`Policy.drafts` of the spec."""
        return self.spec.drafts

    @property
    def name(self) -> str:
        """:attr:`Policy.name` of the spec."""
        return self.spec.name

    def plan(self, states, budgets: list[int], lookups: list[list[int]], context_len: float) -> RoundPlan:
        """Step 1 of the module doc: the round's :class:`RoundPlan`; here (unpriced) every lookup match is verified
        whole and every other request drafts its budget.

        Args:
            states: per request its :class:`~dspark.generation.round.RequestState` (its acceptance records).
            budgets: per request the most draft tokens it may verify (0: it cannot draft).
            lookups: per request the lookup's proposed tokens (empty: no match).
            context_len: mean committed tokens per request.
        """
        lookup_lengths = tuple(len(t) for t in lookups)
        return RoundPlan(lookup_lengths, tuple(0 if n else b for n, b in zip(lookup_lengths, budgets)),
                         len(states) + sum(lookup_lengths), len(states) + sum(lookup_lengths),
                         context_len=context_len)

    def lengths(self, plan: RoundPlan, conf: torch.Tensor, known: list[int] | None = None) -> list[int]:
        """ℓ_r for every request (R ints, 0 ≤ ℓ_r ≤ ``plan.budgets[r]``; here every budget) from the confidences known
        so far (step 2 of the module doc).

        Args:
            plan: the round's plan.
            conf: ``[R, W]`` float64 calibrated c_{r,k} (the run's own values, not validated); entries past
                ``known[r]`` are not drafted yet and are not read.
            known: per request the confidences known (default: all W).
        """
        return list(plan.budgets)

    def measures(self, plan: RoundPlan) -> bool:
        """Whether the round is taken to time the target, so nothing else may share its verify forward: never here."""
        return False

    def end_round(self, plan: RoundPlan, confidences: list[list[float]], batch_tokens: int, priced=True) -> None:
        """After the verify (step 3 of the module doc), with per request the confidences its slots reached, the
        verify's B and whether its time was a price (a round that was not is not counted by :class:`Exploration`)."""


def _limits(plan: RoundPlan, conf: torch.Tensor, known: list[int] | None) -> list[int]:
    """Per request the entries of its row the policy may read: known and within its budget."""
    known = [conf.shape[1]] * conf.shape[0] if known is None else known
    return [min(k, b) for k, b in zip(known, plan.budgets)]


class _None(PolicyRun):
    """``none``: no drafter; every lookup match verified whole."""

    def lengths(self, plan, conf, known=None):
        return [0] * len(plan.budgets)


class _Fixed(PolicyRun):
    """``fixed:N``: the budgets are capped at N in the plan (so the drafter drafts no more), then verified whole."""

    def plan(self, states, budgets, lookups, context_len):
        return super().plan(states, [min(self.spec.length, b) for b in budgets], lookups, context_len)


class _Threshold(PolicyRun):
    """``threshold:P``: the longest prefix with survival a_k = Π_{j≤k} c_j ≥ P (docs/method.md eq. 9)."""

    def lengths(self, plan, conf, known=None):
        above = (conf.cumprod(dim=1) >= self.spec.threshold).sum(dim=1).tolist()  # a is non-increasing: a prefix
        return [min(n, lim) for n, lim in zip(above, _limits(plan, conf, known))]


class _Scheduler(PolicyRun):
    """``scheduler``: every round priced (:meth:`plan`) by the run's ``prices`` and :class:`Exploration`; in a drafting
    round Algorithm 1 with its early STOP over the known confidences."""

    def __init__(self, spec: Policy, prices: Prices, exploration: Exploration):
        super().__init__(spec)
        self.prices, self.exploration = prices, exploration

    def _seconds(self, requests: int, context_len: float | None, draft_s: float = 0.0):
        return lambda b: self.prices.verify_s(b, requests, context_len) + draft_s

    def plan(self, states, budgets, lookups, context_len):
        """The priced round, its special cases in the order they apply (:mod:`dspark.generation.costs` prices them)."""
        num = len(states)
        unpriced = super().plan(states, budgets, lookups, context_len)
        # nothing measured yet: verify every lookup match and every draft, so the first rounds are timed
        if not self.prices.known:
            return unpriced
        explore = self.prices.sps is None  # an explicit SPS(B) table is never re-measured
        # a plain step now and then: t(R) measured again (PLAIN_EVERY)
        if explore and self.exploration.since_plain >= PLAIN_EVERY:
            return RoundPlan((0,) * num, (0,) * num, num, float(num), 0.0, context_len, "plain step")
        # lookup chains first: their tokens are known, priced with the lookup's acceptance record
        seconds = self._seconds(num, context_len)
        rows = [s.lookup_record.survival(len(t)) if t else [] for s, t in zip(states, lookups)]
        lookup = greedy_prefix(*_table(rows), seconds, base_tokens=num, base_expected=num, stop=False)
        budgets = [0 if n else b for n, b in zip(lookup.lengths, budgets)]  # a request verifying a chain: no draft

        def priced(reason: str, budgets, draft_s: float) -> RoundPlan:
            return RoundPlan(tuple(lookup.lengths), tuple(budgets), lookup.batch_tokens, lookup.expected_tokens,
                             draft_s, context_len, reason)

        # the drafting time of every request that may draft (an untimed drafting round is free, so that it is timed)
        draft_s = self.prices.draft_s(sum(b > 0 for b in budgets)) or 0.0
        # a probe now and then: one draft token per request verified whatever it costs (PROBE_EVERY)
        if explore and self.exploration.since_verify >= PROBE_EVERY and self.prices.verified_several \
                and any(budgets):
            return priced("probe", [min(PROBE_TOKENS, b) for b in budgets], draft_s)
        # drafting against no drafting: the best Θ with the drafter's expected survivals and that drafting time
        rows = [s.draft_record.survival(b) for s, b in zip(states, budgets)]
        drafting = greedy_prefix(*_table(rows), self._seconds(num, context_len, draft_s),
                                 base_tokens=lookup.batch_tokens, base_expected=lookup.expected_tokens, stop=False)
        if drafting.theta <= lookup.theta:  # drafting does not pay: plain steps (and lookup chains) only
            return priced("priced", [0] * num, 0.0)
        # the requests that draft are those whose expected drafts pay; the drafting time is theirs
        budgets = [b if n else 0 for n, b in zip(drafting.lengths, budgets)]
        plan = priced("priced", budgets, self.prices.draft_s(sum(b > 0 for b in budgets)) or 0.0)
        # not even drafts certain to be accepted (every c_k = 1) would be verified: the drafter does not run
        if not any(self.lengths(plan, torch.ones(num, max(budgets), dtype=torch.float64))):
            return plan.without_drafting()
        return plan

    def _best(self, plan: RoundPlan, conf, limits, stop: bool):
        return greedy_prefix(conf.cumprod(dim=1), limits, self._seconds(conf.shape[0], plan.context_len, plan.draft_s),
                             base_tokens=plan.base_tokens, base_expected=plan.base_expected, stop=stop)

    def lengths(self, plan, conf, known=None):
        if plan.reason != "priced":
            return list(plan.budgets)
        return self._best(plan, conf, _limits(plan, conf, known), stop=True).lengths

    def measures(self, plan):
        return plan.reason in ("plain step", "probe") or not self.prices.known  # exploration, or the first rounds

    def end_round(self, plan, confidences, batch_tokens, priced=True):
        if self.prices.sps is None and priced:
            self.exploration.observe(batch_tokens, len(confidences))


class _Lagged(_Scheduler):
    """``lagged:LAG``: the verify budget K from the confidences of LAG rounds earlier (a full Θ(B) search without
    early stop over the priced round), filled by the current round's a_{r,j} ranking
    (:func:`dspark.generation.scheduler.fill`). K never depends on the round it is spent on; until LAG rounds have
    ended, K = R (one draft token per request on average)."""

    def __init__(self, spec: Policy, prices: Prices, exploration: Exploration):
        super().__init__(spec, prices, exploration)
        self._budgets: deque = deque()  # K of later rounds
        self._budget = 0  # this round's K

    def plan(self, states, budgets, lookups, context_len):
        self._budget = self._budgets.popleft() if len(self._budgets) >= self.spec.lag else len(states)
        plan = super().plan(states, budgets, lookups, context_len)
        # K = 0 verifies no draft, whatever the round: the drafter does not run
        if plan.drafts and not any(self.lengths(plan, torch.ones(len(states), max(plan.budgets),
                                                                 dtype=torch.float64))):
            return plan.without_drafting()
        return plan

    def lengths(self, plan, conf, known=None):
        limits = _limits(plan, conf, known)
        width = max(limits, default=0) or 1  # entries not known yet count as c = 0 within the widest row
        a = conf[:, :width].masked_fill(torch.arange(width)[None, :] >= torch.tensor(limits)[:, None], 0.0)
        return fill(a.cumprod(dim=1), [width] * len(limits), self._budget)

    def end_round(self, plan, confidences, batch_tokens, priced=True):
        super().end_round(plan, confidences, batch_tokens, priced)
        if not self.prices.known:  # unpriced: the budgets it drafted
            self._budgets.append(sum(plan.budgets))
            return
        if not plan.drafts:  # no confidences to set a later K: pass on the K it was given (R in place of 0), so a
            self._budgets.append(self._budget or len(plan.budgets))  # plain step leaves no K = 0 recurring every LAG
            return
        conf, known = _table(confidences)
        best = self._best(plan, conf, _limits(plan, conf, known), stop=False)
        self._budgets.append(best.batch_tokens - plan.base_tokens)


_RUNS = {"none": _None, "full": PolicyRun, "fixed": _Fixed, "threshold": _Threshold, "scheduler": _Scheduler,
         "lagged": _Lagged}


def _table(rows: list[list[float]]) -> tuple[torch.Tensor, list[int]]:
    """Ragged rows (survivals, confidences) as a float64 ``[R, W]`` table (0 past each row's end) and their lengths."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64).view(len(rows), width), \
        [len(r) for r in rows]


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
    return Policy("lagged", lag=int(arg) if sep else DEFAULT_LAG)
