"""Verify-length policies: how many drafted tokens are sent to the target each round.

A policy is asked *before* token x_k is sampled whether x_k will be verified (`admit(k, confidence)`), and sees
only the calibrated confidence c_k, which depends on x_<k but not on x_k. So no policy can look at x_k before
deciding to verify it: non-anticipation (SPEC §4) holds by construction, and the output stays lossless whatever
the policy returns. A policy returning False ends the round's drafting (later slots are not sampled either).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping


class VerifyPolicy:
    """Base class. Subclasses implement :meth:`admit`; :meth:`start_round` resets per-round state."""

    name = "policy"
    needs_confidence = False  # True: admit() reads c_k, so the drafter must have a confidence head

    def start_round(self, max_tokens: int) -> None:
        """Called once per round with the most tokens this round may draft (block size, length budget)."""
        self.max_tokens = max_tokens

    def admit(self, k: int, confidence: float | None) -> bool:
        """Whether draft position ``k`` (1-based) is verified; ``confidence`` is c_k in [0, 1] or None."""
        raise NotImplementedError


class FullBlock(VerifyPolicy):
    """Verify every drafted slot (γ tokens per round; plain DFlash behaviour)."""

    name = "full"

    def admit(self, k: int, confidence: float | None) -> bool:
        return True


class FixedLength(VerifyPolicy):
    """Verify the first ``length`` drafted tokens (``length=1`` is the MTP-1 analogue)."""

    name = "fixed"

    def __init__(self, length: int):
        if length < 0:
            raise ValueError(f"FixedLength needs length >= 0, got {length}")
        self.length = length

    def admit(self, k: int, confidence: float | None) -> bool:
        return k <= self.length


class ConfidenceThreshold(VerifyPolicy):
    """DeepSpec-style: verify while the survival a_k = Π_{i≤k} c_i stays ≥ ``threshold``."""

    name = "threshold"
    needs_confidence = True

    def __init__(self, threshold: float = 0.5):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def start_round(self, max_tokens: int) -> None:
        super().start_round(max_tokens)
        self.survival = 1.0

    def admit(self, k: int, confidence: float | None) -> bool:
        if confidence is None:
            raise ValueError("ConfidenceThreshold needs a drafter with a confidence head")
        self.survival *= confidence
        return self.survival >= self.threshold


class PrefixScheduler(VerifyPolicy):
    """Algorithm 1 of DSpark for one request (R = 1), evaluated incrementally with its early stop.

    For R = 1 the pool sorted by a_j descending (ties: smaller j first) is j = 1, 2, … because a_j is
    non-increasing, so Algorithm 1 admits x_k iff Θ(k) = (1 + Σ_{j≤k} a_j) · SPS(1 + k) beats the best Θ so far,
    and stops at the first k that does not. The decision for x_k uses a_1..a_k only (non-anticipation).

    Args:
        sps: steps per second of a target verify forward holding B tokens, as a mapping ``{B: steps/s}`` or a
            callable ``B -> steps/s`` (from :mod:`generation.profiling`).
    """

    name = "scheduler"
    needs_confidence = True

    def __init__(self, sps: Mapping[int, float] | Callable[[int], float]):
        self.sps = sps.__getitem__ if isinstance(sps, Mapping) else sps

    def start_round(self, max_tokens: int) -> None:
        super().start_round(max_tokens)
        self.survival, self.tau, self.stopped = 1.0, 1.0, False
        self.best = self._rate(1)

    def _rate(self, batch_tokens: int) -> float:
        try:
            return float(self.sps(batch_tokens))
        except KeyError:
            raise ValueError(
                f"the SPS(B) table has no entry for B={batch_tokens}; it must cover B = 1..γ+1 (run `dspark profile`)"
            ) from None

    def admit(self, k: int, confidence: float | None) -> bool:
        if confidence is None:
            raise ValueError("the DSpark scheduler needs a drafter with a confidence head")
        if self.stopped:
            return False
        self.survival *= confidence
        self.tau += self.survival
        theta = self.tau * self._rate(1 + k)
        if theta > self.best:
            self.best = theta
            return True
        self.stopped = True
        return False


def make_policy(spec: str | VerifyPolicy | None, sps=None) -> VerifyPolicy:
    """Parse ``"full"``, ``"fixed:N"``, ``"threshold:P"`` or ``"scheduler"`` (needs ``sps``) into a policy.

    Raises:
        ValueError: unknown spec, or ``"scheduler"`` without a step-rate table.
    """
    if spec is None:
        return FullBlock()
    if isinstance(spec, VerifyPolicy):
        return copy.copy(spec)  # per-call state (survival, Θ) is never shared between concurrent generate() calls
    name, _, arg = spec.partition(":")
    if name == "full":
        return FullBlock()
    if name == "fixed":
        return FixedLength(int(arg or 1))
    if name == "threshold":
        return ConfidenceThreshold(float(arg or 0.5))
    if name == "scheduler":
        if sps is None:
            raise ValueError("policy 'scheduler' needs an SPS(B) table (run `dspark profile`)")
        return PrefixScheduler(sps)
    raise ValueError(f"unknown verify policy {spec!r}; use full, fixed:N, threshold:P or scheduler")
