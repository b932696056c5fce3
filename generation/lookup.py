"""The n-gram lookup proposer: a second candidate chain beside the drafter, at no model cost.

Lookup proposes the text that followed the most recent earlier occurrence of the last n committed tokens (prompt and
generated text alike), as transformers' ``PromptLookupCandidateGenerator`` and vLLM's n-gram proposer do; it wins where
the answer copies the prompt or itself (code, restated questions), the drafter where it must predict new text
(:mod:`dspark.generation.round` tells how a round uses both). The n-grams, min_ngram ≤ n ≤ max_ngram, are indexed as the
text grows (O(new tokens · max_ngram) dict updates per round, never a rescan of the prefix), each mapped to where its
most recent occurrence ends. Pure Python (torch only to read tensors of token ids); no model imports.

A lookup proposal is a point mass (its tokens are a function of the committed text), so verifying it is lossless:
greedy accepts a token while it equals the target's argmax; sampling accepts token k with probability p_t^k(x_k)
(transformers' match rule with candidate logits None: a target sample is drawn at every position and the candidate
kept while they agree), and a rejected position commits a token drawn from the target's distribution without x_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tunables import MAX_NGRAM, MIN_NGRAM, NUM_TOKENS

__all__ = ["NUM_TOKENS", "MIN_NGRAM", "MAX_NGRAM", "LookupProposal", "NGramLookup"]


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
        match_length: n of the matched suffix (0 when nothing matched).
        start: index in the committed text where the copied continuation starts (-1 when nothing matched).
    """

    tokens: list[int]
    match_length: int
    start: int = -1


class NGramLookup:
    """n-gram lookup over the committed text (prompt and generated tokens); one per generated sequence.

    :meth:`propose` tries n from ``max_ngram`` down to ``min_ngram``: the first n whose suffix occurred before wins, so
    a longer context is preferred, and the up to K tokens that followed its most recent earlier occurrence are proposed
    (fewer when the committed text ends first). The committed text only grows: :meth:`update` takes the whole committed
    sequence each round (as transformers' assisted loop passes ``input_ids``) and reads only its new tail.

    Args:
        max_ngram: longest suffix n matched (≥ min_ngram; transformers' default is 2).
        min_ngram: shortest suffix n matched (≥ 1; vLLM's ``prompt_lookup_min``).
        num_tokens: K, the most tokens proposed per round (≥ 1; transformers' ``prompt_lookup_num_tokens``).

    Raises:
        ValueError: ``min_ngram`` or ``num_tokens`` not a positive int, ``max_ngram`` < ``min_ngram``.
    """

    def __init__(self, max_ngram: int = MAX_NGRAM, num_tokens: int = NUM_TOKENS, min_ngram: int = MIN_NGRAM):
        for name, value, low in (("min_ngram", min_ngram, 1), ("max_ngram", max_ngram, min_ngram),
                                 ("num_tokens", num_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
        self.min_ngram, self.max_ngram, self.num_tokens = min_ngram, max_ngram, num_tokens
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
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._last_end[tuple(toks[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, last)

    def propose(self, max_tokens: int | None = None) -> LookupProposal:
        """The :class:`LookupProposal` continuing the most recent earlier occurrence of the longest matching suffix
        (empty when no suffix of length min_ngram..max_ngram occurred before).

        Args:
            max_tokens: cap on this round's proposal (default K, e.g. the tokens left before ``max_length``; 0: none).
        """
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        if k <= 0 or len(self.tokens) < 2:
            return LookupProposal([], 0)
        self._index()
        toks, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self._last_end.get(tuple(toks[length - n :]))
            if end is not None:  # end <= length - 2: at least one token follows it
                return LookupProposal(toks[end + 1 : end + 1 + k], n, end + 1)
        return LookupProposal([], 0)
