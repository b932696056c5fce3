"""Exact and near-duplicate matching of training prompts against the evaluation sets.

:func:`normalize_prompt` is the exact key (case, punctuation and whitespace folded); :func:`find_overlap` and
:func:`split_overlap` also match near-duplicates by word-shingle Jaccard similarity at a threshold, and, for
code, by the names of the functions a prompt defines (:func:`defined_functions`). Prompts are strings or records
with a ``"prompt"`` field (:data:`Prompt`). The eval sets themselves are not known here:
:func:`dspark.training.prompts.filter_eval_overlap` loads them and calls :func:`split_overlap`.
"""

from __future__ import annotations

import math
import re
import sys
import unicodedata
from functools import lru_cache
from typing import Iterable, Mapping, Union

Prompt = Union[str, Mapping[str, object]]
"""A prompt: its text, or a record with a ``"prompt"`` field."""

_WS = re.compile(r"\s+")


@lru_cache(maxsize=1)
def _punct_table() -> dict[int, str]:
    return {cp: " " for cp in range(sys.maxunicode + 1) if unicodedata.category(chr(cp)).startswith("P")}


def normalize_prompt(text: str) -> str:
    """NFKC, lowercase, punctuation (Unicode categories P*) -> space, collapse whitespace.

    ``normalize_prompt("  Hello,   WORLD!") == "hello world"``.
    """
    text = unicodedata.normalize("NFKC", text).lower().translate(_punct_table())
    return _WS.sub(" ", text).strip()


def _text(p: Prompt) -> str:
    return p if isinstance(p, str) else str(p["prompt"])


_DIGITS = re.compile(r"\d+")


def _shingle(text: str) -> frozenset:
    """Token set of the normalized text with numbers removed (for near-duplicates)."""
    return frozenset(_DIGITS.sub(" ", normalize_prompt(text)).split())


_DEF = re.compile(r"\bdef\s+([A-Za-z_]\w*)\s*\(")


def defined_functions(text: str) -> frozenset:
    """Names of the functions a prompt defines (``def name(``), e.g. a HumanEval stub's entry point and helpers."""
    return frozenset(_DEF.findall(text))


class _Matcher:
    """Exact (normalized) and optional near-duplicate matching against eval prompts.

    Near-duplicate (only with a ``threshold``, whatever its value): token-set
    Jaccard >= ``threshold`` after removing numbers, which catches templated
    rewrites such as GSM-Symbolic variants of GSM8K questions (same wording,
    different names/numbers); or, against HumanEval prompts (records with
    ``source == "humaneval"``, or ``code_prompts``), defining a function of
    the same name as the HumanEval stub does (``fib``,
    ``is_palindrome``, ``remove_duplicates``: the same or a related task
    phrased differently, which word overlap misses).  The name test is
    deliberately broad (``search``, ``add`` also match) and costs a few dozen
    coding prompts.
    """

    def __init__(self, eval_prompts: Iterable[Prompt], threshold: float | None = None,
                 code_prompts: Iterable[Prompt] = ()):
        prompts = list(eval_prompts)
        texts = [_text(p) for p in prompts]
        self.keys = {normalize_prompt(t) for t in texts}
        self.keys.discard("")
        self.threshold = threshold
        self.sets: list[frozenset] = []
        self.index: dict[str, list[int]] = {}
        self.freq: dict[str, int] = {}
        self.functions: frozenset = frozenset()
        if threshold is None:
            return
        if not 0.0 < threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        code = [t for p, t in zip(prompts, texts) if not isinstance(p, str) and p.get("source") == "humaneval"]
        code += [_text(p) for p in code_prompts]
        self.functions = frozenset().union(*map(defined_functions, code))
        self.sets = [sh for sh in map(_shingle, texts) if sh]
        for sh in self.sets:
            for tok in sh:
                self.freq[tok] = self.freq.get(tok, 0) + 1
        # prefix filtering (rarest tokens first): two sets with Jaccard >= t
        # share a token within their first |x| - ceil(t*|x|) + 1 tokens.
        for i, sh in enumerate(self.sets):
            for tok in self._prefix(sh):
                self.index.setdefault(tok, []).append(i)

    def _prefix(self, sh: frozenset) -> list[str]:
        order = sorted(sh, key=lambda tok: (self.freq.get(tok, 0), tok))
        return order[: len(order) - math.ceil(self.threshold * len(order) - 1e-9) + 1]

    def __call__(self, p: Prompt) -> bool:
        text = _text(p)
        key = normalize_prompt(text)
        if not key:
            return False
        if key in self.keys:
            return True
        if self.threshold is None:
            return False
        if self.functions and defined_functions(text) & self.functions:
            return True
        sh = _shingle(text)
        if not sh:
            return False
        seen: set[int] = set()
        for tok in self._prefix(sh):
            for i in self.index.get(tok, ()):
                if i in seen:
                    continue
                seen.add(i)
                other = self.sets[i]
                inter = len(sh & other)
                if inter / (len(sh) + len(other) - inter) >= self.threshold - 1e-12:
                    return True
        return False


def find_overlap(
    train_prompts: Iterable[Prompt], eval_prompts: Iterable[Prompt], threshold: float | None = None
) -> list:
    """Training prompts whose normalized text equals that of some eval prompt.

    Accepts strings or ``{"prompt": ...}`` dicts; returns the matching items of
    ``train_prompts`` (as given, in order).  Empty normalized texts never match.
    With ``threshold`` (e.g. 0.6) also reports near-duplicates: token-set
    Jaccard >= threshold with numbers removed, and prompts that define a
    function named like one in a HumanEval prompt (records with
    ``source == "humaneval"``).
    """
    match = _Matcher(eval_prompts, threshold)
    return [p for p in train_prompts if match(p)]


def split_overlap(
    train: Iterable[Prompt], eval_groups: Mapping[str, Iterable[Prompt]], threshold: float | None = None
) -> tuple[list, int]:
    """``(kept, n_dropped)``: the items of ``train`` (in order) that match no prompt of ``eval_groups`` (name ->
    prompts), and how many did. ``threshold``: also near-duplicates, as in :func:`find_overlap`; the group named
    ``humaneval`` counts as HumanEval prompts for the function-name test even where its items are plain strings."""
    groups = {name: list(g) for name, g in eval_groups.items()}
    match = _Matcher((p for g in groups.values() for p in g), threshold, code_prompts=groups.get("humaneval", ()))
    kept, dropped = [], 0
    for p in train:
        if match(p):
            dropped += 1
        else:
            kept.append(p)
    return kept, dropped
