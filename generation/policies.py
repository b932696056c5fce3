"""Verify policies: how many drafted tokens ℓ_r of each request are sent to the target in a round.

One vocabulary, one parser (:func:`parse_policy`), used by `generate()`, the batched engine, the CLI and the app:

==================  =====================================================================================
``none``            no speculation: every round verifies the anchor token only (one plain decoding step)
``full``            verify every drafted slot (γ' tokens; plain DFlash)
``fixed:N``         verify the first N drafted tokens (``fixed:1`` is the MTP-1 analogue)
``threshold:P``     verify while the survival a_k = Π_{j≤k} c_j stays ≥ P (DeepSpec style)
``scheduler``       DSpark Algorithm 1 over all running requests (docs/method.md §4)
``lagged[:LAG]``    the production variant: verify budget K from the confidences of LAG (default 2) rounds
                    earlier, filled by the current round's a_{r,j} ranking
==================  =====================================================================================

A :class:`Policy` is parsed and checked once, where the user hands it over (``dspark_options``, the engine, the
CLI); :meth:`Policy.start` gives the object one run uses, which owns the run's state: the SPS(B) table the
``scheduler`` and ``lagged`` rounds are priced with, and the ``lagged`` budgets of earlier rounds.

:meth:`Policy.lengths` turns the confidences known so far into ℓ_r. The drafting round
(:func:`generation.drafting.draft_round`) asks it before sampling slot k, with c_{r,1..k} known and later
confidences unknown (0), so whether x_{r,k} is verified never depends on x_{r,k} itself (non-anticipation,
docs/method.md §4): the output stays lossless whatever the policy.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from .scheduler import budget_from_confidences, fill_budget, prefix_schedule, survival_row

__all__ = ["POLICY_NAMES", "Policy", "parse_policy"]

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
        sps: the run's SPS(B) in steps/s (``scheduler`` / ``lagged``): a table ``{B: steps/s}``, a callable, or an
            :class:`~generation.profiling.SPSProfile` (then the curve for the round's R and mean context is used).
    """

    kind: str
    length: int = 0
    threshold: float = 0.0
    lag: int = 2
    sps: object = field(default=None, compare=False, repr=False)
    _curves: dict = field(default_factory=dict, compare=False, repr=False)  # (R, context bucket) -> SPS curve
    _round_sps: object = field(default=None, compare=False, repr=False)  # this round's SPS(B)
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
    def needs_sps(self) -> bool:
        """Whether the policy reads an SPS(B) table (profiled on first use where none is cached)."""
        return self.kind in ("scheduler", "lagged")

    def __str__(self) -> str:
        return self.name

    # ------------------------------------------------------------------ one run
    def start(self, sps=None) -> Policy:
        """A fresh copy of this policy for one run (a `generate()` call, an engine), with its SPS(B) table.

        Raises:
            ValueError: ``scheduler`` / ``lagged`` without ``sps``.
        """
        if self.needs_sps and sps is None:
            raise ValueError(f"verify policy {self.name!r} needs an SPS(B) table (generation.profiling)")
        return dataclasses.replace(self, sps=sps, _curves={}, _round_sps=None, _budgets=deque(), _budget=0)

    def begin_round(self, num_requests: int, context_len: float) -> None:
        """Set this round's SPS(B) curve (for R = ``num_requests`` at mean context ``context_len`` tokens) and,
        for ``lagged``, take the budget K computed LAG rounds earlier (R, one draft token per request, before)."""
        if not self.needs_sps:
            return
        sps = self.sps
        if hasattr(sps, "curve"):
            key = (num_requests, sps.context_bucket(context_len))
            if key not in self._curves:
                self._curves[key] = sps.curve(requests=num_requests, context_len=context_len)
            sps = self._curves[key]
        self._round_sps = sps
        if self.kind == "lagged":
            self._budget = self._budgets.popleft() if len(self._budgets) >= self.lag else num_requests

    def lengths(self, confidences: list[list[float]], budgets: list[int]) -> list[int]:
        """ℓ_r for every request from the confidences known so far.

        Args:
            confidences: R rows of calibrated c_{r,k} (any length; a slot not drafted yet, or beyond the row's
                budget, counts as 0). Ignored by ``none``, ``full`` and ``fixed``.
            budgets: per request, the most draft tokens it may verify this round (0 = it does not draft).

        Returns:
            R ints, 0 ≤ ℓ_r ≤ budgets[r]. ``threshold``: the longest prefix with a_k ≥ P (docs/method.md eq. 9);
            ``scheduler``: Algorithm 1 with its early stop (:func:`generation.scheduler.prefix_schedule`);
            ``lagged``: the top-K pooled a_{r,j} (:func:`generation.scheduler.fill_budget`).
        """
        kind = self.kind
        if kind == "none":
            return [0] * len(budgets)
        if kind == "full":
            return list(budgets)
        if kind == "fixed":
            return [min(self.length, b) for b in budgets]
        rows = _rows(confidences, budgets)
        if rows is None:
            return [0] * len(budgets)
        if kind == "threshold":
            return [sum(a >= self.threshold for a in survival_row(row)[:b]) for row, b in zip(rows, budgets)]
        assert self._round_sps is not None, "begin_round() sets the SPS(B) curve before lengths()"
        lengths = prefix_schedule(rows, self._round_sps) if kind == "scheduler" else fill_budget(rows, self._budget)
        return [min(ell, b) for ell, b in zip(lengths, budgets)]

    def end_round(self, confidences: list[list[float]], budgets: list[int]) -> None:
        """``lagged``: fold this round's confidences into the budget of LAG rounds ahead (a full Θ(B) search
        without early stop, :func:`generation.scheduler.budget_from_confidences`). K never depends on the round
        it is spent on."""
        if self.kind != "lagged":
            return
        rows = _rows(confidences, budgets)
        self._budgets.append(0 if rows is None else budget_from_confidences(rows, self._round_sps))


def _rows(confidences: list[list[float]], budgets: list[int]) -> list[list[float]] | None:
    """R rows of width max(budgets): c_{r,k} where k < budgets[r] and known, else 0; None when every budget is 0."""
    width = max(budgets, default=0)
    if width == 0:
        return None
    return [[(row[k] if k < len(row) and k < b else 0.0) for k in range(width)] for row, b in zip(confidences, budgets)]


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
