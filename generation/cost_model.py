"""The cost model a round is priced with, shared by `generate()` (R = 1) and the batched engine (R ≥ 1).

Algorithm 1 (docs/method.md §4) prices the verify batch only: Θ = τ* · SPS(B). This object adds the
"Drafting cost" of docs/method.md §4, Θ = τ* / (1/SPS(B) + T_draft(n)). :class:`CostModel` holds what the
machine measured beside it:

* **SPS(B)**: the profiled table (``dspark profile``; a fixed table, a callable, or an
  :class:`~generation.profiling.SPSProfile`, whose curve for the round's R and mean context is used).
* **Draft-time term**: t_draft(n), the drafter's measured time per round where n requests draft (a moving average
  per n, linear in between measured n). A round that drafts lasts 1/SPS(B) + t_draft(n), so the policies are fed
  SPS_eff(B) = 1 / (1/SPS(B) + t_draft(n)) (:func:`generation.scheduler.effective_sps`): Algorithm 1 then
  maximises the committed tokens per second of the whole round.
* **Draft gate** (optional): decides BEFORE drafting, from past rounds only, whether drafting is expected to pay at
  all. The realized yield of past drafted rounds (decayed means of the draft tokens verified and accepted per
  drafting request, per R) goes into :func:`generation.scheduler.yield_gate`, which drafts the n requests (those
  skipped longest first) whose Θ_n = (R + n·accepted) / (1/SPS(R + n·verified) + t_draft(n)) beats the
  no-drafting R·SPS(R); the yields of the nearest R measured stand in for an R not yet measured. When nothing pays,
  a probe still drafts one request after 1, 2, 4, … up to :attr:`CostModel.PROBE_MAX_INTERVAL` skipped rounds (one
  back-off for every R, reset when drafting pays), so that the estimates follow the text. Where drafting does
  not pay (a CPU where verifying a few tokens costs much more than one), the gate keeps speculative decoding from
  running slower than plain decoding (docs/benchmarks.md, "Engine cost-model ablation").

Nothing here reads the current round's confidences or draft tokens, so no decision can change an output (greedy:
token for token; sampling: the same distribution). Units: seconds, steps per second.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from .scheduler import SPSLike, effective_sps, yield_gate

__all__ = ["CostModel", "cost_model_for", "reset_cost_models"]


class CostModel:
    """SPS(B), the measured drafting time and the draft gate (module doc).

    Example (one round)::

        cost = CostModel(sps)
        budgets, reason = cost.plan([8, 8], skipped=[0, 3])    # before drafting: which requests draft
        sps_eff = cost.round_sps(2, context_len=300, rows=2)    # what Algorithm 1 schedules with
        cost.observe(2, yields=[(2, 3), (0, 1)], draft_seconds=0.012, ingested=[3, 2], num_slots=8)

    Args:
        sps: SPS(B) in steps/s: a table ``{B: steps/s}``, a callable, or an ``SPSProfile``.
        draft_gate: decide before drafting whether it pays (module doc); False drafts every round.
        draft_cost_ms: how t_draft(n) is known: ``"auto"`` (measured), a fixed number of milliseconds, or None
            (not priced: SPS(B) alone, as Algorithm 1 in the paper).

    Raises:
        ValueError: a bad ``draft_gate`` or ``draft_cost_ms``.
    """

    YIELD_DECAY = 0.8
    """Per-drafted-round decay of the yield sums: about the last 5 drafted request-rounds count."""
    DRAFT_TIME_EMA = 0.3
    """Weight of the newest steady drafting round in the drafting-time average."""
    WARMUP_ROUNDS = 3
    """Drafted request-rounds (any R) before the gate may skip drafting (the yield and the drafting time are unknown)."""
    PROBE_MAX_INTERVAL = 32
    """Longest run of skipped rounds before a probe drafts anyway."""

    def __init__(self, sps: SPSLike | object, *, draft_gate: bool = True, draft_cost_ms: str | float | None = "auto"):
        if not isinstance(draft_gate, bool):
            raise ValueError(f"draft_gate must be True or False; got {draft_gate!r}")
        if draft_cost_ms is not None and draft_cost_ms != "auto":
            ok = isinstance(draft_cost_ms, (int, float)) and not isinstance(draft_cost_ms, bool)
            if not ok or not 0.0 <= float(draft_cost_ms) < float("inf"):
                raise ValueError(
                    f"draft_cost_ms must be 'auto', None or a finite number of milliseconds >= 0; got {draft_cost_ms!r}"
                )
        self.sps = sps
        self.draft_gate = draft_gate
        self.draft_cost_ms = draft_cost_ms
        self._draft_ms: dict[int, float] = {}  # n drafting requests -> moving average of measured ms
        self._draft_seen: dict[int, int] = {}  # n -> steady rounds measured
        self._yield: dict[int, list[float]] = {}  # R -> decayed [accepted, verified, request-rounds]
        self._drafted = 0  # drafted request-rounds, any R (not decayed: the warm-up count)
        self._probe = [1, 0]  # [probe interval, rounds skipped since the last drafting round]
        self._curves: dict = {}

    # ------------------------------------------------------------------ prices
    def curve(self, num_requests: int, context_len: float | None = None) -> SPSLike:
        """SPS(B) for a round of R = ``num_requests`` requests at mean context ``context_len`` (tokens)."""
        sps = self.sps
        if not hasattr(sps, "curve"):
            return sps
        key = (num_requests, sps.context_bucket(context_len) if hasattr(sps, "context_bucket") else None)
        if key not in self._curves:
            self._curves[key] = sps.curve(requests=num_requests, context_len=context_len)
        return self._curves[key]

    def draft_seconds(self, rows: int) -> float:
        """t_draft(n) in seconds for a round where ``rows`` requests draft (0 when unpriced or not yet measured)."""
        if self.draft_cost_ms is None or rows <= 0:
            return 0.0
        if self.draft_cost_ms != "auto":
            return float(self.draft_cost_ms) / 1e3
        if not self._draft_ms:
            return 0.0
        xs = sorted(self._draft_ms)
        return float(np.interp(rows, xs, [self._draft_ms[x] for x in xs])) / 1e3

    def round_sps(self, num_requests: int, context_len: float | None, rows: int) -> SPSLike:
        """SPS_eff(B) = 1 / (1/SPS(B) + t_draft(rows)): the rate Algorithm 1 and the lagged budget schedule with."""
        t = self.draft_seconds(rows)
        curve = self.curve(num_requests, context_len)
        return curve if t == 0.0 else effective_sps(curve, t)

    # ------------------------------------------------------------------ the draft gate
    def plan(self, budgets: Sequence[int], skipped: Sequence[int], context_len: float | None = None
             ) -> tuple[list[int], str]:
        """Which requests draft this round, before drafting (module doc, "Draft gate").

        Args:
            budgets: per request the most draft tokens it may verify (0: it cannot draft).
            skipped: per request the consecutive rounds the gate skipped it (who drafts first).
            context_len: mean context of the round (tokens), for a profile's curve.

        Returns:
            ``(budgets, reason)``: the budgets with 0 for the requests that do not draft; reason ``""`` (no gate),
            ``"warmup"``, ``"model"`` or ``"probe"`` (something drafts) or ``"gated"`` (nothing does).
        """
        budgets = list(budgets)
        num = len(budgets)
        if not self.draft_gate or not any(budgets):
            return budgets, ""
        near = self._nearest(num)
        if near is None or self._drafted < self.WARMUP_ROUNDS or self.draft_seconds(1) == 0.0:
            return budgets, "warmup"
        acc, ver, n = self._yield[near]
        order = sorted(range(num), key=lambda i: (-skipped[i], i))  # the request skipped longest drafts first
        result = yield_gate([acc / n] * num, [ver / n] * num, self.curve(num, context_len), self.draft_seconds,
                            max_lengths=[budgets[i] for i in order])
        chosen = {order[j] for j, drafts in enumerate(result.draft) if drafts}
        probe = self._probe
        if chosen:
            probe[:] = [1, 0]
            return [b if i in chosen else 0 for i, b in enumerate(budgets)], "model"
        probe[1] += 1
        if probe[1] > probe[0]:
            probe[:] = [min(2 * probe[0], self.PROBE_MAX_INTERVAL), 0]
            first = next(i for i in order if budgets[i] > 0)
            return [b if i == first else 0 for i, b in enumerate(budgets)], "probe"
        return [0] * num, "gated"

    def observe(self, num_requests: int, yields: Sequence[tuple[int, int]], draft_seconds: float,
                ingested: Sequence[int], num_slots: int) -> None:
        """Fold in a round that drafted.

        Args:
            num_requests: R of the round.
            yields: per drafting request, (accepted, verified) draft tokens.
            draft_seconds: the drafter's wall time this round.
            ingested: per drafting request, the target positions it ingested first; the time is measured only when
                each is at most γ' + 1 (a steady round: a catch-up on a prompt or on skipped rounds is paid once,
                whenever the request drafts, so it is not a cost of drafting now).
            num_slots: γ'.
        """
        rows = len(yields)
        if rows == 0:
            return
        d = self.YIELD_DECAY
        sums = self._yield.setdefault(num_requests, [0.0, 0.0, 0.0])
        for accepted, verified in yields:
            sums[:] = [d * sums[0] + accepted, d * sums[1] + verified, d * sums[2] + 1.0]
        self._drafted += rows
        if self.draft_cost_ms == "auto" and max(ingested, default=0) <= num_slots + 1 and draft_seconds > 0:
            ms, prev = draft_seconds * 1e3, self._draft_ms.get(rows)
            seen = self._draft_seen[rows] = self._draft_seen.get(rows, 0) + 1
            if prev is None:
                self._draft_ms[rows] = ms
            elif seen == 2:  # the first call of a shape often stalls (allocation): keep the faster of two
                self._draft_ms[rows] = min(prev, ms)
            else:  # one stall (another process) moves the average by at most 3x
                self._draft_ms[rows] = (1 - self.DRAFT_TIME_EMA) * prev + self.DRAFT_TIME_EMA * min(ms, 3 * prev)

    def _nearest(self, num_requests: int) -> int | None:
        """The R with yield data nearest to ``num_requests`` (ties: the smaller), or None."""
        if not self._yield:
            return None
        return min(self._yield, key=lambda n: (abs(n - num_requests), n))


_LAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cost_model_for(drafter, target, block_size: int, sps, draft_gate: bool = True) -> CostModel:
    """The cost model of a new `generate()` call: a copy of the last call's for this drafter, target, block size and
    SPS(B) values (B = 1..γ'+1), so only the first call pays the warm-up; or a new one. Each call owns its copy
    (concurrent calls never share one); weak references only."""
    lookup = sps.get if isinstance(sps, Mapping) else sps

    def value(b: int):
        try:
            return round(float(lookup(b)), 9)
        except (KeyError, ValueError, TypeError):
            return None

    key = (int(block_size), draft_gate, tuple(value(b) for b in range(1, block_size + 2)))
    models = _LAST.setdefault(drafter, weakref.WeakKeyDictionary()).setdefault(target, {})
    last = models.get(key)
    model = CostModel(sps, draft_gate=draft_gate)
    if last is not None:
        for name in ("_draft_ms", "_draft_seen", "_yield", "_drafted", "_probe"):
            setattr(model, name, copy.deepcopy(getattr(last, name)))
    models[key] = model
    return model


def reset_cost_models() -> None:
    """Forget what earlier `generate()` calls measured (the next call of each drafter starts with a warm-up)."""
    _LAST.clear()
