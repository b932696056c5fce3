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

:func:`verify_lengths` turns the confidences known so far into ℓ_r. The drafting round
(:func:`generation.drafting.draft_round`) asks it before sampling slot k, with c_{r,1..k} known and later
confidences unknown (0), so whether x_{r,k} is verified never depends on x_{r,k} itself (non-anticipation,
docs/method.md §4): the output stays lossless whatever the policy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .scheduler import SPSLike, budget_from_confidences, fill_budget, prefix_schedule, survival_row

__all__ = ["POLICY_NAMES", "Policy", "parse_policy", "verify_lengths", "LaggedBudget"]

POLICY_NAMES = ("none", "full", "fixed:N", "threshold:P", "scheduler", "lagged[:LAG]")
"""The policy vocabulary, as the CLI's help text shows it."""

_KINDS = ("none", "full", "fixed", "threshold", "scheduler", "lagged")


@dataclass(frozen=True)
class Policy:
    """A parsed verify policy (see the module doc). Build it with :func:`parse_policy`.

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
    def needs_sps(self) -> bool:
        """Whether the policy reads an SPS(B) table (profiled on first use where none is cached)."""
        return self.kind in ("scheduler", "lagged")

    def __str__(self) -> str:
        return self.name


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


def verify_lengths(policy: Policy, confidences: list[list[float]], budgets: list[int], sps: SPSLike | None = None,
                   lag_budget: int | None = None) -> list[int]:
    """ℓ_r for every request from the confidences known so far.

    Args:
        policy: a :class:`Policy`.
        confidences: R rows of calibrated c_{r,k} (any length; a slot not drafted yet, or beyond the row's budget,
            counts as 0). Ignored by ``none``, ``full`` and ``fixed``.
        budgets: per request, the most draft tokens it may verify this round (0 = it does not draft).
        sps: SPS(B) in steps/s for ``scheduler`` and ``lagged`` (table or callable).
        lag_budget: K, the extra verify slots of a ``lagged`` round (:class:`LaggedBudget`).

    Returns:
        R ints, 0 ≤ ℓ_r ≤ budgets[r]. ``threshold``: the longest prefix with a_k ≥ P (docs/method.md eq. 9);
        ``scheduler``: Algorithm 1 with its early stop (:func:`generation.scheduler.prefix_schedule`);
        ``lagged``: the top-K pooled a_{r,j} (:func:`generation.scheduler.fill_budget`).

    Raises:
        ValueError: ``scheduler`` / ``lagged`` without ``sps`` (or ``lagged`` without ``lag_budget``), or an SPS
            table that lacks a batch size B the scan reaches.
    """
    kind = policy.kind
    if kind == "none":
        return [0] * len(budgets)
    if kind == "full":
        return list(budgets)
    if kind == "fixed":
        return [min(policy.length, b) for b in budgets]
    width = max(budgets, default=0)
    rows = [[(row[k] if k < len(row) and k < b else 0.0) for k in range(width)] for row, b in zip(confidences, budgets)]
    if width == 0:
        return [0] * len(budgets)
    if kind == "threshold":
        return [sum(a >= policy.threshold for a in survival_row(row)[:b]) for row, b in zip(rows, budgets)]
    if sps is None:
        raise ValueError(f"verify policy {policy.name!r} needs an SPS(B) table (generation.profiling)")
    if kind == "scheduler":
        lengths = prefix_schedule(rows, sps)
    else:
        if lag_budget is None:
            raise ValueError("verify policy 'lagged' needs this round's budget K (LaggedBudget.take)")
        lengths = fill_budget(rows, lag_budget)
    return [min(ell, b) for ell, b in zip(lengths, budgets)]


class LaggedBudget:
    """The ``lagged`` policy's state: verify budgets K computed from the confidences of earlier rounds.

    Each round takes the budget computed ``lag`` rounds earlier (:meth:`take`), then pushes the budget that this
    round's confidences give (:meth:`push`, a full Θ(B) search without early stop,
    :func:`generation.scheduler.budget_from_confidences`). K never depends on the current round's draft tokens.
    Until ``lag`` budgets are known the budget is ``default`` (R, one draft token per request, when None).
    """

    def __init__(self, lag: int, default: int | None = None):
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be an int >= 1 (a budget may not use the current round); got {lag!r}")
        if default is not None and (isinstance(default, bool) or not isinstance(default, int) or default < 0):
            raise ValueError(f"default_budget must be None or an int >= 0; got {default!r}")
        self.lag, self.default = lag, default
        self._pending: deque[int] = deque()

    def take(self, num_requests: int) -> int:
        """K for this round (extra verify slots beyond the R anchors)."""
        if len(self._pending) >= self.lag:
            return self._pending.popleft()
        return num_requests if self.default is None else self.default

    def push(self, confidences: list[list[float]], budgets: list[int], sps: SPSLike) -> None:
        """Fold in this round's confidences (slots beyond a request's budget count as 0)."""
        width = max(budgets, default=0)
        if width == 0:
            self._pending.append(0)
            return
        rows = [[(row[k] if k < len(row) and k < b else 0.0) for k in range(width)]
                for row, b in zip(confidences, budgets)]
        self._pending.append(budget_from_confidences(rows, sps))

