"""The n-gram lookup proposer and the online estimate of its acceptance: a second candidate chain beside the drafter.

Lookup proposes, at no model cost, the text that followed the most recent earlier occurrence of the last n
committed tokens (prompt and generated text alike), as transformers' ``PromptLookupCandidateGenerator`` does; it
wins where the answer copies the prompt or itself (code, restated questions), the drafter where it must predict new
text. The confidence scheduler chooses between the two chains each round by expected committed tokens per second
(:func:`generation.scheduler.choose_chain`, Algorithm 1 of docs/method.md §4 with two candidate chains), and needs
for the lookup chain a survival a_k like the drafter's calibrated one (eq. 9); :class:`AcceptanceEstimator` gives
it from the rounds seen so far.

* :class:`NGramLookup` — the matcher. The n-grams (n = 1..max_ngram) of the committed text are indexed as the text
  grows (O(new tokens · max_ngram) dict updates per round, never a rescan of the prefix), each mapped to where its
  most recent occurrence ends.
* :class:`AcceptanceEstimator` — decayed counts, per key (the lookup's match length n, or the drafter) and per
  continuation position k, of how often token k of a proposal was reached and accepted; the conditional rate
  c_k is shrunk towards the key's pooled rate and that towards a prior, and a_k = Π_{j≤k} c_j (eq. 9).
* :class:`LookupChain` — one sequence's lookup state inside a round (`generate()`, and each request of the batched
  engine): propose, choose the chain to verify (:func:`generation.scheduler.choose_chain`), judge the proposals
  against the committed tokens.
* :class:`MeasuredPrices` — what the chooser prices a round with where no SPS(B) profile is used.

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

from .scheduler import ChainChoice, choose_chain, survival_row

__all__ = [
    "NUM_TOKENS", "LookupProposal", "NGramLookup", "AcceptanceEstimator", "DRAFT", "LookupChain", "MeasuredPrices",
]

NUM_TOKENS = 10
"""K, the most tokens the lookup proposes per round where no drafter sets it to γ'."""

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

    def __init__(self, max_ngram: int = 3, num_tokens: int = NUM_TOKENS):
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
        return survival_row(self.conditional(key, length))

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


# --------------------------------------------------------------------------------------------- one sequence's state
class LookupChain:
    """The lookup proposer beside the drafter for one generated sequence (a `generate()` call, or one request of
    :class:`generation.engine.DSparkEngine`).

    One round, as :class:`generation.candidate_generator.DSparkCandidateGenerator` runs it:

    1. :meth:`propose` — the matcher's continuation of the committed text and its estimated survival a_k;
    2. before drafting, :meth:`before_drafting` — whether the lookup chain beats drafting (then the drafter forward
       is skipped; the features of the positions committed meanwhile are ingested at the next drafting round);
    3. after drafting, :meth:`after_drafting` — which chain to verify; without drafting, :meth:`without_drafter`;
    4. :meth:`verifying` records the chain sent to the target, and :meth:`observe` (after the target's verify)
       judges the lookup proposal and the verified drafts against the committed tokens (:class:`AcceptanceEstimator`).

    Non-anticipation (docs/method.md §4) under sampling: the choice reads the lookup proposal and estimates from
    earlier rounds (functions of the committed text), the drafter's c_1 (computed before x_1 is drawn) and whether
    the verify policy admitted x_1 (decided from c_1), never a drafted token. Under greedy decoding any choice is
    lossless, and the realized survival of the drafted block is used.

    Args:
        num_tokens: K, the most lookup tokens proposed per round.
        max_ngram: longest suffix matched.
        num_positions: positions estimated per chain (≥ K and ≥ the drafter's block size).
    """

    def __init__(self, num_tokens: int = NUM_TOKENS, max_ngram: int = 3, num_positions: int = 16):
        self.matcher = NGramLookup(max_ngram=max_ngram, num_tokens=num_tokens)
        self.acceptance = AcceptanceEstimator(max(num_positions, num_tokens))
        self.proposal = LookupProposal([], 0)
        self.survival: list[float] = []
        self._committed = 0  # committed tokens when the proposal was made
        self._draft_tokens: list[int] = []  # the drafts verified this round (judged by observe)

    def propose(self, input_ids, max_tokens: int) -> LookupProposal:
        """Step 1 for the committed ``input_ids`` (``[1, L]`` tensor or list): the proposal (≤ ``max_tokens``)."""
        self.matcher.update(input_ids)
        self._committed = len(self.matcher)
        self._draft_tokens = []
        self.proposal = self.matcher.propose(max_tokens)
        self.survival = self.acceptance.survival(self.proposal.match_length, len(self.proposal.tokens)) \
            if self.proposal.tokens else []
        return self.proposal

    def predicted_draft_survival(self, length: int, first: float | None = None) -> list[float]:
        """The drafter's a_1..a_length from earlier rounds' verified drafts; ``first`` replaces c_1 when known."""
        c = self.acceptance.conditional(DRAFT, length)
        if first is not None and c:
            c[0] = float(first)
        out, prod = [], 1.0
        for x in c:
            prod *= x
            out.append(prod)
        return out

    def before_drafting(self, budget: int, sps, draft_seconds: float, gate: str = "") -> ChainChoice:
        """Step 2: :func:`choose_chain` with the drafter's predicted survival (``budget`` slots) and its time
        unspent; ``source == "lookup"`` means the drafter forward is skipped this round. ``gate`` is the draft
        gate's reason (:meth:`generation.cost_model.CostModel.plan`): a ``"probe"`` round leaves the lookup out, so
        the probe drafts and keeps the gate's yield estimates current."""
        lookup = None if gate == "probe" else self.survival
        return choose_chain(self.predicted_draft_survival(budget), lookup, sps, draft_seconds=draft_seconds)

    def after_drafting(self, confidences, draft_length: int, budget: int, sps, draft_seconds: float,
                       greedy: bool) -> ChainChoice:
        """Step 3 once the drafter ran (its time spent whatever is verified).

        Args:
            confidences: calibrated c_k of the slots the drafting round reached (may be empty: no confidence head).
            draft_length: ℓ, the drafts the verify policy admitted.
            budget: the most drafts this round could verify (the chain length predicted under sampling).
            greedy: greedy decoding (the realized survival of the ℓ drafts is used) or sampling (a survival that
                does not depend on the drafted tokens: c_1 and earlier rounds; an empty chain when ℓ = 0).
        """
        if greedy:
            if confidences:
                draft = []
                prod = 1.0
                for c in list(confidences)[:draft_length]:
                    prod *= float(c)
                    draft.append(prod)
                if len(draft) < draft_length:  # fewer confidences than drafts: no confidence for the rest
                    draft += self.predicted_draft_survival(draft_length)[len(draft):]
            else:
                draft = self.predicted_draft_survival(draft_length)
            return choose_chain(draft, self.survival, sps, draft_seconds=draft_seconds, drafted=True,
                                draft_length=draft_length)
        draft = [] if draft_length == 0 else self.predicted_draft_survival(
            budget, float(confidences[0]) if len(confidences) else None)
        return choose_chain(draft, self.survival, sps, draft_seconds=draft_seconds, drafted=True)

    def without_drafter(self, sps, draft_seconds: float = 0.0, drafted: bool = False) -> ChainChoice:
        """Step 3 when the drafter does not run (gated, or turned off): the lookup prefix, or the anchor only."""
        return choose_chain(None, self.survival, sps, draft_seconds=draft_seconds, drafted=drafted)

    def verifying(self, source: str, draft_tokens=()) -> None:
        """Step 4a: the chain sent to the target (``"draft"`` with its tokens, ``"lookup"`` or ``"none"``)."""
        self._draft_tokens = [int(t) for t in draft_tokens] if source == "draft" else []

    def observe(self, input_ids) -> None:
        """Step 4b, after the verify: judge the lookup proposal (whichever chain was verified) and the verified
        drafts against the tokens committed since :meth:`propose`."""
        self.matcher.update(input_ids)
        committed = self.matcher.tokens[self._committed:]
        if self.proposal.tokens:
            self.acceptance.observe(self.proposal.match_length, self.proposal.tokens, committed)
        if self._draft_tokens:
            self.acceptance.observe(DRAFT, self._draft_tokens, committed)
        self.proposal, self.survival, self._draft_tokens = LookupProposal([], 0), [], []


# ------------------------------------------------------------------------------------------ prices without a profile
class MeasuredPrices:
    """The chooser's prices where the verify policy has no SPS(B) profile (``full``, ``fixed``, ``threshold``,
    ``none``): SPS(B) flat at the measured mean verify time (B tokens cost one forward, as on memory-bound hardware)
    and the measured mean drafting time per drafting request. Both are exponential moving averages (weight
    :attr:`WEIGHT` on the newest round); before any measurement the verify costs 1 s and drafting 0 s.
    """

    WEIGHT = 0.3

    def __init__(self):
        self.verify_s: float | None = None
        self.draft_s: float | None = None

    @staticmethod
    def _average(mean: float | None, value: float) -> float:
        return value if mean is None else (1.0 - MeasuredPrices.WEIGHT) * mean + MeasuredPrices.WEIGHT * value

    def observe_verify(self, seconds: float) -> None:
        """Fold in one verify forward's time (seconds)."""
        self.verify_s = self._average(self.verify_s, float(seconds))

    def observe_draft(self, seconds: float) -> None:
        """Fold in one steady drafting round's time per drafting request (seconds; no catch-up ingestion)."""
        self.draft_s = self._average(self.draft_s, float(seconds))

    def sps(self):
        """SPS(B) in verify forwards per second, the same for every B."""
        verify = self.verify_s or 1.0
        return lambda batch_tokens: 1.0 / verify

    def draft_seconds(self) -> float:
        """t_draft in seconds per drafting request (0 before any measurement)."""
        return self.draft_s or 0.0
