"""The n-gram lookup proposer and the online estimate of its acceptance (a second candidate chain, issue 22).

Lookup proposes, at no model cost, the text that followed the most recent earlier occurrence of the last n
committed tokens (prompt and generated text alike), as transformers' ``PromptLookupCandidateGenerator`` does; it
wins where the answer copies the prompt or itself (code, restated questions), the drafter where it must predict new
text. The confidence scheduler chooses between the two chains each round by expected committed tokens per second
(:func:`choose_chain`, Algorithm 1 of docs/method.md §4 with two candidate chains), and needs
for the lookup chain a survival a_k like the drafter's calibrated one (eq. 9); :class:`AcceptanceEstimator` gives
it from the rounds seen so far.

* :class:`NGramLookup` — the matcher. The n-grams (n = 1..max_ngram) of the committed text are indexed as the text
  grows (O(new tokens · max_ngram) dict updates per round, never a rescan of the prefix), each mapped to where its
  most recent occurrence ends.
* :class:`AcceptanceEstimator` — decayed counts, per key (the lookup's match length n, or the drafter) and per
  continuation position k, of how often token k of a proposal was reached and accepted; the conditional rate
  c_k is shrunk towards the key's pooled rate and that towards a prior, and a_k = Π_{j≤k} c_j (eq. 9).
* :func:`choose_chain` — what a round verifies: a prefix of the drafter's block, of the lookup continuation, or the
  anchor only, by expected committed tokens per second (:func:`best_prefix` walks one chain).

A lookup proposal is a point mass (its tokens are a function of the committed text), so verifying it is lossless:
greedy accepts a token while it equals the target's argmax; sampling accepts token k with probability p_t^k(x_k)
(transformers' rejection rule with one-hot candidate logits, or equivalently its match rule with candidate logits
None: a target sample is drawn at every position and the candidate kept while they agree), and a rejected position
commits a token drawn from the target's distribution without x_k.

Pure Python (torch only to read tensors of token ids); no model imports.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["LookupProposal", "NGramLookup", "AcceptanceEstimator", "DRAFT", "ChainChoice", "best_prefix", "choose_chain"]

DRAFT = "draft"
"""The :class:`AcceptanceEstimator` key of the drafter's chain (the lookup's keys are its match lengths n ≥ 1)."""


def _as_int_list(ids) -> list[int]:
    """Token ids as Python ints: a list/tuple of ints, a 1-D tensor, or a ``[1, L]`` tensor (one sequence)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"token ids must be 1-D or [1, L]; got a tensor of shape {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.is_complex():
            raise ValueError(f"token ids must be an integer tensor; got dtype {ids.dtype}")
        return ids.tolist()
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"token ids must be ints; entry {i} is {t!r}")
        out.append(t)
    return out


@dataclass(frozen=True)
class LookupProposal:
    """One lookup proposal.

    Attributes:
        tokens: the proposed continuation x_1..x_K' (K' ≤ the K asked for; empty when nothing matched).
        match_length: n of the matched suffix (0 when nothing matched); the :class:`AcceptanceEstimator` key.
        start: index in the committed text where the copied continuation starts (-1 when nothing matched).
    """

    tokens: list[int]
    match_length: int
    start: int = -1


class NGramLookup:
    """n-gram lookup over the committed text (prompt and generated tokens).

    :meth:`propose` matches the last n committed tokens, n from ``max_ngram`` down to 1, against their most recent
    earlier occurrence and proposes the up to K tokens that followed it (fewer when the text ends first; the copy
    never runs past the committed text). The first n that matches wins, so a longer context is preferred.

    The committed text only grows: :meth:`update` takes the whole committed sequence each round (as transformers'
    assisted loop passes ``input_ids``) and indexes only its new tail. A sequence that is not an extension of the
    one seen so far is an error (one ``NGramLookup`` per generated sequence).

    Args:
        max_ngram: longest suffix n matched (≥ 1; transformers' default is 2).
        num_tokens: K, the most tokens proposed per round (≥ 1; transformers' ``prompt_lookup_num_tokens``).

    Raises:
        ValueError: ``max_ngram`` or ``num_tokens`` not a positive int.
    """

    def __init__(self, max_ngram: int = 3, num_tokens: int = 10):
        for name, value in (("max_ngram", max_ngram), ("num_tokens", num_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        self.max_ngram, self.num_tokens = max_ngram, num_tokens
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> index of its most recent (indexed) last token
        self._indexed = 0  # n-grams ending at indexes < _indexed are in _last_end

    def __len__(self) -> int:
        return len(self.tokens)

    def update(self, ids) -> None:
        """Take the committed sequence (list of ints, 1-D or ``[1, L]`` tensor); only its new tail is read.

        Raises:
            ValueError: a shorter sequence than already seen, or one whose token at the last seen index differs
                (a different sequence; checked at that one index only, O(1)).
        """
        seen = len(self.tokens)
        length = ids.shape[-1] if isinstance(ids, torch.Tensor) else len(ids)
        if length < seen:
            raise ValueError(f"committed text shrank from {seen} to {length} tokens; use one NGramLookup per sequence")
        if seen and int(ids[..., seen - 1] if isinstance(ids, torch.Tensor) else ids[seen - 1]) != self.tokens[-1]:
            raise ValueError("committed text is not an extension of the one seen so far; use one NGramLookup per "
                             "sequence")
        tail = ids[..., seen:] if isinstance(ids, torch.Tensor) else ids[seen:]
        self.tokens.extend(_as_int_list(tail))

    def _index(self) -> None:
        """Index the n-grams ending before the last token (those have a continuation to copy)."""
        toks, last = self.tokens, len(self.tokens) - 1
        for end in range(self._indexed, last):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self._last_end[tuple(toks[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, last)

    def propose(self, max_tokens: int | None = None) -> LookupProposal:
        """The continuation of the most recent earlier occurrence of the longest matching suffix.

        Args:
            max_tokens: cap on the proposal's length this round (default K; e.g. the tokens left before
                ``max_length``). 0 proposes nothing.

        Returns:
            :class:`LookupProposal`; ``tokens`` is empty when no suffix of length ≤ max_ngram occurred before.
        """
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        if k <= 0 or len(self.tokens) < 2:
            return LookupProposal([], 0)
        self._index()
        toks, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            end = self._last_end.get(tuple(toks[length - n :]))
            if end is not None:  # end <= length - 2: at least one token follows it
                return LookupProposal(toks[end + 1 : end + 1 + k], n, end + 1)
        return LookupProposal([], 0)


class AcceptanceEstimator:
    """Online estimate of a proposer's survival a_k (docs/method.md eq. 9) from the rounds seen so far.

    Per key (the lookup's match length n, or :data:`DRAFT`) and continuation position k = 1..K it keeps decayed
    counts ``reached[k]`` (rounds whose tokens 1..k−1 were accepted and whose token k was judged) and
    ``accepted[k]``. The conditional acceptance is

        c_k = (accepted[k] + s · m) / (reached[k] + s),   m = (Σ_k accepted[k] + s · prior) / (Σ_k reached[k] + s)

    (m: the key's pooled rate, itself shrunk towards ``prior``; s: ``prior_strength``), and a_k = Π_{j≤k} c_j.
    Each observation first multiplies the key's counts by ``decay``, so about 1/(1 − decay) recent rounds count.

    :meth:`observe` judges a proposal against the tokens the round committed, whichever chain was verified: token k
    counts as accepted when it equals the k-th committed token and all before it did. For a point-mass proposal
    (the lookup) this is exact even when the drafter's chain was verified: under greedy decoding the committed token
    is the target's argmax, under sampling it is a draw from p_t^k, equal to x_k with probability p_t^k(x_k), the
    acceptance probability of x_k. Positions past the committed tokens are not judged.

    Args:
        num_positions: K, the longest chain estimated (≥ 1).
        prior: c_k before any observation, in (0, 1).
        prior_strength: s > 0, the weight of the prior (and of the pooled rate) in pseudo-rounds.
        decay: in (0, 1], the per-observation decay of a key's counts.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, num_positions: int, prior: float = 0.5, prior_strength: float = 2.0, decay: float = 0.9):
        if isinstance(num_positions, bool) or not isinstance(num_positions, int) or num_positions < 1:
            raise ValueError(f"num_positions must be an int >= 1; got {num_positions!r}")
        if not 0.0 < prior < 1.0:
            raise ValueError(f"prior must be in (0, 1); got {prior!r}")
        if not prior_strength > 0.0:
            raise ValueError(f"prior_strength must be > 0; got {prior_strength!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1]; got {decay!r}")
        self.num_positions, self.prior, self.strength, self.decay = num_positions, prior, prior_strength, decay
        self._reached: dict[Hashable, list[float]] = {}
        self._accepted: dict[Hashable, list[float]] = {}

    def conditional(self, key: Hashable, length: int | None = None) -> list[float]:
        """c_1..c_length (default K) for ``key``: floats in (0, 1)."""
        length = self.num_positions if length is None else min(length, self.num_positions)
        reached = self._reached.get(key)
        if reached is None:
            return [self.prior] * length
        accepted, s = self._accepted[key], self.strength
        pooled = (sum(accepted) + s * self.prior) / (sum(reached) + s)
        return [(accepted[k] + s * pooled) / (reached[k] + s) for k in range(length)]

    def survival(self, key: Hashable, length: int | None = None) -> list[float]:
        """a_1..a_length (default K) for ``key``: a_k = Π_{j≤k} c_j, non-increasing (eq. 9)."""
        out, prod = [], 1.0
        for c in self.conditional(key, length):
            prod *= c
            out.append(prod)
        return out

    def observe(self, key: Hashable, proposal: Sequence[int], committed: Sequence[int]) -> int:
        """Judge ``proposal`` (x_1..x_K') against the round's ``committed`` tokens; return how many were accepted.

        Only the first K positions are counted. An empty proposal or an empty ``committed`` changes nothing.
        """
        judged = min(len(proposal), len(committed), self.num_positions)
        if judged == 0:
            return 0
        if key not in self._reached:
            self._reached[key] = [0.0] * self.num_positions
            self._accepted[key] = [0.0] * self.num_positions
        reached, accepted, d = self._reached[key], self._accepted[key], self.decay
        if d < 1.0:
            reached[:] = [d * x for x in reached]
            accepted[:] = [d * x for x in accepted]
        for k in range(judged):
            reached[k] += 1.0
            if int(proposal[k]) != int(committed[k]):
                return k
            accepted[k] += 1.0
        return judged


# --------------------------------------------------------------------------------------------- the chooser
@dataclass(frozen=True)
class ChainChoice:
    """What one round verifies (outcome of :func:`choose_chain`).

    Attributes:
        source: ``"draft"`` (a prefix of the drafter's block), ``"lookup"`` (a prefix of the lookup continuation)
            or ``"none"`` (the anchor only: one plain decoding step).
        length: ℓ, the chain's tokens to verify (0 for ``"none"``).
        theta: Θ, expected committed tokens per second of the round (the drafting time included where charged).
        expected_tokens: τ* = 1 + Σ_{j≤ℓ} a_j, expected tokens committed by the round.
    """

    source: str
    length: int
    theta: float
    expected_tokens: float


def _check_survival(name: str, survival: Sequence[float] | None) -> list[float]:
    values = [float(a) for a in (survival or [])]
    for k, a in enumerate(values):
        if not 0.0 <= a <= 1.0:  # also rejects NaN
            raise ValueError(f"{name}[{k}] = {a!r} is not a survival probability in [0, 1]")
    return values


def _round_theta(sps, batch_tokens: int, expected_tokens: float, seconds: float) -> float | None:
    """τ* / (seconds + 1/SPS(B)), or None where an SPS table has no entry for B (such B are not considered)."""
    from .scheduler import MissingSPSEntry

    try:
        return expected_tokens / (seconds + 1.0 / sps(batch_tokens))
    except MissingSPSEntry:
        return None


def best_prefix(survival: Sequence[float], sps, seconds: float = 0.0) -> tuple[int, float, float]:
    """Algorithm 1 (docs/method.md §4) for one request and one chain, the round's extra time included.

    Walks ℓ = 1, 2, … with Θ(ℓ) = (1 + Σ_{j≤ℓ} a_j) / (seconds + 1/SPS(1 + ℓ)) and stops at the first ℓ that does
    not improve on the best so far (the early stop keeps the choice of x_ℓ independent of anything drawn after
    it), or where an SPS table ends.

    Args:
        survival: a_1..a_m ∈ [0, 1], non-increasing (eq. 9).
        sps: SPS(B) in verify forwards per second (table or callable, :data:`generation.scheduler.SPSLike`).
        seconds: time added to every option of the walk (s ≥ 0), e.g. the drafter's time.

    Returns:
        ``(ℓ, Θ, τ*)``: the chosen length (0 = the anchor only), its rate in tokens/s and its expected tokens.

    Raises:
        ValueError: a survival outside [0, 1]; a bad SPS value; SPS(1) missing from a table.
    """
    from .scheduler import _as_lookup

    values = _check_survival("survival", survival)
    lookup = _as_lookup(sps)
    best = (0, 1.0 / (seconds + 1.0 / lookup(1)), 1.0)
    tokens = 1.0
    for ell, a in enumerate(values, start=1):
        tokens += a
        theta = _round_theta(lookup, 1 + ell, tokens, seconds)
        if theta is None or theta <= best[1]:
            break
        best = (ell, theta, tokens)
    return best


def choose_chain(
    draft_survival: Sequence[float] | None,
    lookup_survival: Sequence[float] | None,
    sps,
    *,
    draft_seconds: float = 0.0,
    drafted: bool = False,
    draft_length: int | None = None,
) -> ChainChoice:
    """Algorithm 1 with two candidate chains (docs/method.md §4): verify a prefix of the drafter's block, a prefix
    of the lookup continuation, or the anchor only — whichever has the largest expected committed tokens per second.

    Each chain's prefix is chosen by :func:`best_prefix` (the early stop of Algorithm 1), priced as one verify
    forward of B = 1 + ℓ tokens, 1/SPS(B) seconds, plus the drafter's time where it applies: a round that has not
    drafted yet (``drafted=False``) pays ``draft_seconds`` only if it verifies the draft chain — choosing the lookup
    or the anchor skips the drafter forward; a round that already drafted (``drafted=True``) pays it whatever it
    verifies. Ties go to the cheaper option (anchor, then lookup).

    Lossless use: under sampling the choice must not depend on the drafter's tokens of this round; pass a draft
    survival that does not (one predicted from earlier rounds and c_1, which is computed before x_1 is drawn). Under
    greedy decoding any choice is lossless, and the realized a_k of the drafted block may be passed.

    Args:
        draft_survival: a_1..a_m of the drafter's chain (calibrated, eq. 9, or predicted); None or empty: no chain.
        lookup_survival: a_1..a_K' estimated for the lookup proposal (:class:`AcceptanceEstimator`); None or
            empty: no proposal.
        sps: SPS(B) in verify forwards per second (table or callable).
        draft_seconds: t_draft ≥ 0, the drafter's time for this round in seconds.
        drafted: whether ``draft_seconds`` is already spent (see above).
        draft_length: verify exactly this many draft tokens (the verify policy's ℓ) instead of walking the chain.

    Returns:
        :class:`ChainChoice`.

    Raises:
        ValueError: a survival outside [0, 1]; ``draft_seconds`` negative or not finite; ``draft_length`` out of
            0..m; a bad SPS value; SPS(1) or SPS(1 + draft_length) missing from a table.
    """
    from .scheduler import _as_lookup

    draft = _check_survival("draft_survival", draft_survival)
    lookup_a = _check_survival("lookup_survival", lookup_survival)
    draft_seconds = float(draft_seconds)
    if not 0.0 <= draft_seconds < float("inf"):
        raise ValueError(f"draft_seconds must be a finite time >= 0 seconds; got {draft_seconds!r}")
    if draft_length is not None and not (isinstance(draft_length, int) and 0 <= draft_length <= len(draft)):
        raise ValueError(f"draft_length must be an int in 0..{len(draft)}; got {draft_length!r}")
    sps = _as_lookup(sps)
    sunk = draft_seconds if drafted else 0.0
    choice = ChainChoice("none", 0, 1.0 / (sunk + 1.0 / sps(1)), 1.0)
    ell, theta, tokens = best_prefix(lookup_a, sps, sunk)
    if ell > 0 and theta > choice.theta:
        choice = ChainChoice("lookup", ell, theta, tokens)
    if draft_length is None:
        ell, theta, tokens = best_prefix(draft, sps, draft_seconds)
    else:
        ell, tokens = draft_length, 1.0 + sum(draft[:draft_length])
        theta = tokens / (draft_seconds + 1.0 / sps(1 + ell))
    if ell > 0 and theta > choice.theta:
        choice = ChainChoice("draft", ell, theta, tokens)
    return choice
