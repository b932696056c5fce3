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

A :class:`Policy` is the parsed spec, checked once where the user hands it over (``dspark_options``, the engine,
the CLI); :meth:`Policy.start` gives the :class:`PolicyRun` one run uses (a class per rule), with the run's
:class:`~dspark.generation.costs.Prices`.

A round asks the run (:mod:`dspark.generation.round`):

1. :meth:`PolicyRun.plan`, before anything is drafted: ``fixed`` caps the budgets at N; ``scheduler`` and ``lagged``
   price the lookup chains (their tokens are known; survival p^j from the lookup's
   :class:`~dspark.generation.costs.Record`) and then whether drafting pays at all: the best Θ with the drafter's
   expected survivals and the drafting time against Θ without drafting (ℓ = 0 everywhere: plain steps, and the drafter
   does not run);
2. :meth:`PolicyRun.lengths`, in the drafting round before sampling slot k, on the ``[R, γ']`` confidence table with
   c_{r,1..k} known: ``scheduler`` runs Algorithm 1 with its early STOP over the known entries, pricing a verify of B
   tokens at the learned verify time plus the (now spent) drafting time, so whether x_{r,k} is verified never
   depends on x_{r,k} itself (non-anticipation, docs/method.md §4): the output stays lossless whatever the policy;
3. :meth:`PolicyRun.end_round`, after drafting: ``lagged`` turns this round's confidences into the verify budget
   of LAG rounds later.

Θ(B) = τ*(B) / seconds(B), committed tokens per second (Algorithm 1's τ* · SPS(B) with seconds = 1 / SPS).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .costs import Prices
from .scheduler import fill, greedy_prefix

__all__ = ["POLICY_NAMES", "Policy", "PolicyRun", "default_policy", "parse_policy"]

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
    lag: int = 2

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

    def start(self, sps=None, *, prices: Prices | None = None) -> PolicyRun:
        """The :class:`PolicyRun` of one run (a `generate()` call, an engine) with its prices: ``prices``, or new ones
        with an explicit SPS(B) ``sps`` (None: learned from the rounds); unpriced policies keep none."""
        if self.priced and prices is None:
            prices = Prices(sps)
        return _RUNS[self.kind](self, prices if self.priced else None)


class PolicyRun:
    """The policy of one run: ``full`` as is (every budgeted slot verified, every lookup match whole), the base of
    the others.

    Attributes:
        spec: the :class:`Policy`.
        prices: the run's :class:`~dspark.generation.costs.Prices` (priced policies), else None.
    """

    def __init__(self, spec: Policy, prices: Prices | None = None):
        self.spec, self.prices = spec, prices

    @property
    def drafts(self) -> bool:
        """:attr:`Policy.drafts` of the spec."""
        return self.spec.drafts

    @property
    def name(self) -> str:
        """:attr:`Policy.name` of the spec."""
        return self.spec.name

    def plan(self, states, budgets: list[int], lookups: list[list[int]], context_len: float) -> tuple[list, list]:
        """Step 1 of the module doc: the lookup chains' lengths and the drafting budgets of this round.

        Args:
            states: per request its :class:`~dspark.generation.round.RequestState` (its acceptance records).
            budgets: per request the most draft tokens it may verify (0: it cannot draft).
            lookups: per request the lookup's proposed tokens (empty: no match).
            context_len: mean committed tokens per request.

        Returns:
            ``(lookup_lengths, budgets)``: a request verifying a lookup chain (length > 0) does not draft. Here
            (unpriced) every lookup match is verified whole and every other request drafts.
        """
        lookup_lengths = [len(t) for t in lookups]
        return lookup_lengths, [0 if n else b for n, b in zip(lookup_lengths, budgets)]

    def lengths(self, conf: torch.Tensor, budgets: list[int], known: list[int] | None = None) -> list[int]:
        """ℓ_r for every request from the confidences known so far (step 2 of the module doc).

        Args:
            conf: ``[R, W]`` float64 calibrated c_{r,k} (the run's own values, not validated); entries past
                ``known[r]`` are not drafted yet and are not read.
            budgets: per request, the most draft tokens it may verify this round (0 = it does not draft).
            known: per request the confidences known (default: all W).

        Returns:
            R ints, 0 ≤ ℓ_r ≤ budgets[r]: here every budget.
        """
        return list(budgets)

    def end_round(self, confidences: list[list[float]], budgets: list[int]) -> None:
        """After the drafting round, with per request the confidences its slots reached (``lagged`` folds them into
        a later round's budget)."""


def _limits(conf: torch.Tensor, budgets: list[int], known: list[int] | None) -> list[int]:
    """Per request the entries of its row the policy may read: known and within its budget."""
    known = [conf.shape[1]] * conf.shape[0] if known is None else known
    return [min(k, b) for k, b in zip(known, budgets)]


class _None(PolicyRun):
    """``none``: no drafter; every lookup match verified whole."""

    def lengths(self, conf, budgets, known=None):
        return [0] * len(budgets)


class _Fixed(PolicyRun):
    """``fixed:N``: the budgets are capped at N in the plan (so the drafter drafts no more), then verified whole."""

    def plan(self, states, budgets, lookups, context_len):
        return super().plan(states, [min(self.spec.length, b) for b in budgets], lookups, context_len)

    def lengths(self, conf, budgets, known=None):
        return [min(self.spec.length, b) for b in budgets]


class _Threshold(PolicyRun):
    """``threshold:P``: the longest prefix with survival a_k = Π_{j≤k} c_j ≥ P (docs/method.md eq. 9)."""

    def lengths(self, conf, budgets, known=None):
        limits = _limits(conf, budgets, known)
        above = (conf.cumprod(dim=1) >= self.spec.threshold).sum(dim=1).tolist()  # a is non-increasing: a prefix
        return [min(n, lim) for n, lim in zip(above, limits)]


class _Scheduler(PolicyRun):
    """``scheduler``: every round priced (module doc): the plan prices lookups and drafting; in the drafting round
    Algorithm 1 with its early STOP over the known confidences."""

    def __init__(self, spec: Policy, prices: Prices | None = None):
        super().__init__(spec, prices)
        self._round = (1, 1.0, 0.0, None)  # base B, base τ*, drafting seconds, mean context length
        self._probe = False  # this round verifies one draft token per request, unpriced (dspark.generation.costs)

    def _seconds(self, requests: int, context_len: float | None, extra: float = 0.0):
        return lambda b: self.prices.verify_s(b, requests, context_len) + extra

    def plan(self, states, budgets, lookups, context_len):
        num = len(states)
        self._round, self._probe = (num, float(num), 0.0, context_len), False
        if not self.prices.known:
            return super().plan(states, budgets, lookups, context_len)
        if self.prices.wants_plain_step:  # measure t(R) now and then (dspark.generation.costs.PLAIN_EVERY)
            return [0] * num, [0] * num
        seconds = self._seconds(num, context_len)
        rows = [s.lookup_record.survival(len(t)) if t else [] for s, t in zip(states, lookups)]
        plain = greedy_prefix(*_table(rows), seconds, base_tokens=num, base_expected=num, stop=False)
        budgets = [0 if n else b for n, b in zip(plain.lengths, budgets)]
        draft_s = self.prices.draft_s(sum(b > 0 for b in budgets)) or 0.0  # unknown: free, so it is timed
        self._round = (plain.batch_tokens, plain.expected_tokens, draft_s, context_len)
        if self.prices.wants_probe and any(budgets):  # measure drafting and a verify again (dspark.generation.costs)
            self._probe = True
            return plain.lengths, [min(1, b) for b in budgets]
        rows = [s.draft_record.survival(b) for s, b in zip(states, budgets)]
        drafting = greedy_prefix(*_table(rows), self._seconds(num, context_len, draft_s),
                                 base_tokens=plain.batch_tokens, base_expected=plain.expected_tokens, stop=False)
        if drafting.theta > plain.theta:  # the drafting price of the requests that do draft, for Algorithm 1
            budgets = [b if n else 0 for n, b in zip(drafting.lengths, budgets)]
            self._round = self._round[:2] + (self.prices.draft_s(sum(b > 0 for b in budgets)) or 0.0, context_len)
        else:
            budgets = [0] * num
        return plain.lengths, budgets

    def _best(self, conf, limits, stop: bool):
        base_tokens, base_expected, draft_s, context = self._round
        return greedy_prefix(conf.cumprod(dim=1), limits, self._seconds(conf.shape[0], context, draft_s),
                             base_tokens=base_tokens, base_expected=base_expected, stop=stop)

    def lengths(self, conf, budgets, known=None):
        if self._probe or not self.prices.known:
            return list(budgets)
        return self._best(conf, _limits(conf, budgets, known), stop=True).lengths


class _Lagged(_Scheduler):
    """``lagged:LAG``: the verify budget K from the confidences of LAG rounds earlier (a full Θ(B) search without
    early stop over the priced round), filled by the current round's a_{r,j} ranking
    (:func:`dspark.generation.scheduler.fill`). K never depends on the round it is spent on."""

    def __init__(self, spec: Policy, prices: Prices | None = None):
        super().__init__(spec, prices)
        self._budgets: deque = deque()  # K of later rounds
        self._budget = 0  # this round's K

    def plan(self, states, budgets, lookups, context_len):
        self._budget = self._budgets.popleft() if len(self._budgets) >= self.spec.lag else len(states)
        return super().plan(states, budgets, lookups, context_len)

    def lengths(self, conf, budgets, known=None):
        limits = _limits(conf, budgets, known)
        width = max(limits, default=0) or 1  # entries not known yet count as c = 0 within the widest row
        a = conf[:, :width].masked_fill(torch.arange(width)[None, :] >= torch.tensor(limits)[:, None], 0.0)
        return fill(a.cumprod(dim=1), [width] * len(limits), self._budget)

    def end_round(self, confidences, budgets):
        if not self.prices.known or not any(budgets):
            self._budgets.append(sum(budgets) if not self.prices.known else 0)
            return
        conf, known = _table(confidences)
        best = self._best(conf, _limits(conf, budgets, known), stop=False)
        self._budgets.append(best.batch_tokens - self._round[0])


_RUNS = {"none": _None, "full": PolicyRun, "fixed": _Fixed, "threshold": _Threshold, "scheduler": _Scheduler,
         "lagged": _Lagged}


def _table(rows: list[list[float]]) -> tuple[torch.Tensor, list[int]]:
    """Ragged rows (survivals, confidences) as a float64 ``[R, W]`` table (0 past each row's end) and their
    lengths."""
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
    return Policy("lagged", lag=int(arg) if sep else 2)
