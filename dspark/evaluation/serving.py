"""Serving benchmark of batched speculative decoding (:class:`dspark.generation.engine.DSparkEngine`) and its
statistics.

:func:`bench_serve` serves the same held-out prompts (:func:`prompt_pool`) for every concurrency R and verify policy
with at most R requests in flight (continuous batching; at least max(``waves`` × R, ``min_requests``) requests per R,
all queued at the start), greedy, and measures total throughput (generated tokens / wall second), steady-state
throughput (the same over the loaded phase only: until the queue is empty and fewer than R requests run; a closed
batch ends in a drain where speculation makes requests finish at different times, so the last rounds run below R)
and per-user speed (mean over requests of tokens / seconds from admission to finish).

Steady state: each policy has ONE engine for the whole benchmark (its ``max_batch_size`` set to R per cell), as a
long-running server would (the ``lagged`` budgets carry over from cell to cell);
``warmup_repeats`` untimed repetitions of every cell come first, serving the next prompts of the pool, not the
timed ones.

Noise control: every (R, policy) cell is served ``repeats`` times, interleaved: repetition after repetition, and
within one repetition all policies at one R back to back, in an order rotated each repetition, so slow drift of the
machine hits every policy alike. Each cell holds the median over repetitions and the min / max as its noise
estimate (:func:`aggregate_reps`); :func:`comparisons` sets every dynamic policy against the best static one with
the ratio of medians, the combined relative half-range, the paired per-repetition ratios and a one-sided sign test
(:func:`sign_test_p`): "strictly faster" needs the paired repetitions to agree, e.g. 10 of 10 (p = 0.001) or 9 of
10 (p = 0.011), not a median alone. :func:`markdown_table` renders the results (``dspark bench serve`` also plots
them).
"""

from __future__ import annotations

import math
import statistics
import time

__all__ = ["policy_label", "prompt_pool", "sps_context", "serving_engine", "serve", "bench_serve", "aggregate_reps",
           "sign_test_p", "compare_cells", "comparisons", "markdown_table"]

STATIC_POLICIES = ("none", "fixed", "full", "threshold")
POLICY_LABELS = {
    "none": "no speculation",
    "fixed:1": "static ℓ=1 (MTP-1)",
    "full": "static full block",
    "scheduler": "DSpark scheduler",
    "lagged:2": "DSpark, 2-round lag",
}


def policy_label(policy: str) -> str:
    """Human-readable name of an engine policy for tables and plots."""
    if policy in POLICY_LABELS:
        return POLICY_LABELS[policy]
    name, _, arg = policy.partition(":")
    if name == "fixed":
        return f"static ℓ={arg}"
    if name == "threshold":
        return f"confidence threshold {arg or 0.5}"
    if name == "lagged":
        return f"DSpark, {arg}-round lag"
    return policy


def prompt_pool(tok, datasets, limit: int) -> list[dict]:
    """The first ``limit`` prompts of each eval set in ``datasets`` (:func:`dspark.training.prompts.load_eval_prompts`),
    interleaved set by set, then the longer sets' rest: ``[{"id", "ids": chat-templated token ids}]``.

    Raises:
        ValueError: an unknown set; dspark.training.prompts.DataPackageMissing: its data package is not installed.
    """
    from modeling_dspark.target import apply_chat_template
    from dspark.training.prompts import load_eval_prompts

    per_set = [[{"id": r["id"], "ids": apply_chat_template(tok, r["prompt"])} for r in load_eval_prompts(name, limit)]
               for name in datasets]
    pool = [rec for group in zip(*per_set) for rec in group]
    for group in per_set:
        pool += group[min(len(g) for g in per_set):]
    return pool


def sps_context(prompts: list[dict], max_new_tokens: int) -> int:
    """The context length the SPS(B) profile of a run is measured at: the power of 2 (at least 16) nearest to the
    mean prompt length plus half the new tokens."""
    mean_prompt = statistics.fmean(len(p["ids"]) for p in prompts)
    return 2 ** max(4, round(math.log2(mean_prompt + max_new_tokens / 2)))


def serving_engine(target, drafter, policy: str, block_size: int, sps, lookup: bool = True):
    """The engine of one policy, kept for the whole benchmark (steady state, see the module doc): a
    :class:`dspark.generation.engine.DSparkEngine` with these arguments; ``none`` is plain decoding (no drafter, no
    lookup)."""
    from dspark.generation.engine import DSparkEngine

    plain = policy == "none"
    return DSparkEngine(target, None if plain else drafter, policy, block_size=block_size, sps=sps,
                        lookup=lookup and not plain)


def _committed(engine) -> int:
    return sum(sum(r.committed) for r in engine.stats.rounds)


def serve(engine, prompts: list[dict], num_requests: int, concurrency: int, max_new: int, first: int = 0):
    """Serve ``num_requests`` prompts of the pool (from index ``first`` on, wrapping), all queued at once, at most
    ``concurrency`` in flight, ``max_new`` tokens each; the engine's statistics are reset first.

    Returns:
        ``(cell, outputs)``: the cell's numbers (``throughput_tok_s``, ``steady_tok_s``, ``per_user_tok_s`` in
        tokens per second, ``tokens``, ``wall_s`` in seconds, and the engine's round statistics) and the output ids
        per request, in request order. ``steady_tok_s`` counts only the loaded phase: from the start until the
        queue is empty and fewer than R requests run (the drain, where a closed batch no longer has R requests to
        serve, is left out).
    """
    from dspark.generation.engine import EngineStats

    engine.max_batch_size = concurrency
    engine.stats = EngineStats()
    for i in range(num_requests):
        engine.add_request(prompts[(first + i) % len(prompts)]["ids"], max_new)
    t0 = time.perf_counter()
    outs, steady = [], None
    while engine.has_unfinished():
        outs += engine.step()
        if steady is None and engine.num_waiting == 0 and engine.num_running < concurrency:
            # every request admitted so far got its first token from its prefill, the rest from rounds
            steady = (_committed(engine) + num_requests, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    outs.sort(key=lambda o: o.request_id)
    tokens = sum(o.num_tokens for o in outs)
    summ = engine.stats.summary()
    keys = ("rounds", "tau", "mean_verified", "mean_accepted", "mean_batch_tokens", "t_draft_ms", "t_verify_ms",
            "skipped_draft_rounds", "lookup_request_rounds")
    return {"throughput_tok_s": tokens / wall, "steady_tok_s": steady[0] / steady[1], "steady_tokens": steady[0],
            "per_user_tok_s": statistics.fmean(o.tokens_per_s for o in outs), "tokens": tokens, "wall_s": wall,
            **{k: summ[k] for k in keys}}, [o.output_ids for o in outs]


def bench_serve(engines: dict, prompts: list[dict], levels: list[int], *, waves: int, min_requests: int,
                max_new_tokens: int, repeats: int, warmup_repeats: int, log=lambda line: None) -> list[dict]:
    """Serve every (R, policy) cell ``repeats`` times after ``warmup_repeats`` untimed repetitions, interleaved as
    the module doc says.

    Args:
        engines: ``{policy: engine}`` (:func:`serving_engine`), in the order the policies are listed.
        prompts: the pool (:func:`prompt_pool`); levels: the concurrencies R, ascending.
        waves, min_requests: a cell serves max(``waves`` × R, ``min_requests``) requests.
        max_new_tokens: per request.
        log: called with a progress line (str) per served cell.

    Returns:
        one row per (R, policy), R-major: ``{"R", "policy", "requests", **aggregate_reps(...),
        "agreement_with_none"}``, the last the share of requests whose output equals the ``none`` policy's (None
        without a ``none`` engine).
    """
    policies = list(engines)
    reps: dict[tuple[int, str], list[dict]] = {}
    outputs = {}
    for rep in range(-warmup_repeats, repeats):
        for li, R in enumerate(levels):
            n = max(waves * R, min_requests)
            shift = (rep + li) % len(policies)
            for pol in policies[shift:] + policies[:shift]:
                res, outs = serve(engines[pol], prompts, n, R, max_new_tokens, first=n if rep < 0 else 0)
                if rep < 0:
                    log(f"warm-up R={R:<3} {pol:<14} {res['throughput_tok_s']:7.1f} tok/s total")
                    continue
                outputs.setdefault((R, pol), outs)
                reps.setdefault((R, pol), []).append(res)
                log(f"rep {rep + 1}/{repeats} R={R:<3} {pol:<14} {res['throughput_tok_s']:7.1f} tok/s total  "
                    f"{res['per_user_tok_s']:6.1f} tok/s/user  tau {res['tau']:.2f}  verified "
                    f"{res['mean_verified']:.2f}  B {res['mean_batch_tokens']:.1f}  skipped-draft rounds "
                    f"{res['skipped_draft_rounds']}/{res['rounds']}")
    results = []
    for R in levels:
        for pol in policies:
            res = aggregate_reps(reps[(R, pol)])
            base, outs = outputs.get((R, "none")), outputs[(R, pol)]
            res["agreement_with_none"] = (sum(a == b for a, b in zip(outs, base)) / len(outs)) if base else None
            results.append({"R": R, "policy": pol, "requests": max(waves * R, min_requests), **res})
    return results


def _half_range(r: dict, key: str = "throughput_tok_s") -> float:
    """Half the min-max spread of a cell over its repetitions (0 without repetitions)."""
    lo, hi = r.get(key.replace("_tok_s", "_min")), r.get(key.replace("_tok_s", "_max"))
    return 0.0 if lo is None or hi is None else (hi - lo) / 2


def aggregate_reps(reps: list[dict]) -> dict:
    """One cell from its repetitions (:func:`serve`'s dicts, in the order they ran): the median of every number, and
    min / max and the per-repetition list of the throughput, per-user and steady speeds."""
    out = {}
    for key, value in reps[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in reps)
        else:
            out[key] = value
    for key in ("throughput", "per_user", "steady"):
        vals = [r[f"{key}_tok_s"] for r in reps]
        out[f"{key}_reps"] = vals
        out[f"{key}_min"], out[f"{key}_max"] = min(vals), max(vals)
    out["repeats"] = len(reps)
    return out


def sign_test_p(faster: int, n: int) -> float:
    """One-sided sign test: P(at least ``faster`` of ``n`` fair coin flips come up heads), the chance that a policy
    no faster than its rival wins ``faster`` of ``n`` paired repetitions or more (ties count as losses). The
    smallest possible value is 2^-n (e.g. 0.125 for 3 repetitions, 0.001 for 10).

    Raises:
        ValueError: unless 0 <= faster <= n.
    """
    if not 0 <= faster <= n:
        raise ValueError(f"need 0 <= faster <= n, got faster={faster}, n={n}")
    return sum(math.comb(n, i) for i in range(faster, n + 1)) / 2 ** n


def compare_cells(mine: dict, best: dict, key: str = "throughput_tok_s") -> dict:
    """``mine`` against ``best`` on ``key``: the ratio of medians, the combined relative half-range of the two cells
    (``noise``) and the paired per-repetition ratios (repetition i of both cells ran back to back, so drift of the
    machine common to both cancels; repetitions are stored in the order they ran), how many of them exceed 1
    (``faster``) and the one-sided sign test's p-value for "no faster" (:func:`sign_test_p`). ``paired``,
    ``faster`` and ``sign_p`` are None unless both cells hold the same number (> 1) of repetitions."""
    out = {"vs": best["policy"], "ratio": mine[key] / best[key],
           "noise": _half_range(mine, key) / mine[key] + _half_range(best, key) / best[key],
           "paired": None, "faster": None, "sign_p": None}
    reps_key = key.replace("_tok_s", "_reps")
    mine_reps, best_reps = mine.get(reps_key) or (), best.get(reps_key) or ()
    if len(mine_reps) > 1 and len(mine_reps) == len(best_reps):
        paired = [a / b for a, b in zip(mine_reps, best_reps)]
        faster = sum(r > 1 for r in paired)
        out.update(paired=paired, faster=faster, sign_p=sign_test_p(faster, len(paired)))
    return out


def _ratio_cell(c: dict) -> str:
    """A :func:`compare_cells` result as ``"1.02x vs POLICY (±noise; per rep lo–hi, faster in k/n, sign test p)"``."""
    text = f"{c['ratio']:.2f}x vs {c['vs']}"
    if c["paired"] is not None:
        return text + (f" (±{c['noise']:.0%}; per rep {min(c['paired']):.2f}–{max(c['paired']):.2f}, "
                       f"faster in {c['faster']}/{len(c['paired'])}, sign test p={c['sign_p']:.2g})")
    return text + (f" (±{c['noise']:.0%})" if c["noise"] else "")


def markdown_table(results: list[dict], policies: list[str], levels: list[int]) -> str:
    """Rows: policies; columns: R; cells: ``throughput ±half-range / per-user`` tok/s (medians over repetitions);
    plus, per dynamic policy, its median throughput over the best static policy's, ± their combined relative
    half-range (the noise) and the range of the per-repetition ratios (repetition i of every cell ran back to back,
    so drift of the machine common to both cancels), for the whole run ("total") and for the loaded phase
    ("steady", ``steady_tok_s``)."""
    cell = {(r["policy"], r["R"]): r for r in results}
    lines = ["| policy | " + " | ".join(f"R={R} (total / per-user tok/s)" for R in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for pol in policies:
        vals = []
        for R in levels:
            r = cell.get((pol, R))
            if r is None:
                vals.append("–")
            else:
                noise = _half_range(r)
                vals.append(f"{r['throughput_tok_s']:.1f}" + (f" ±{noise:.1f}" if noise else "")
                            + f" / {r['per_user_tok_s']:.1f}")
        lines.append(f"| {policy_label(pol)} | " + " | ".join(vals) + " |")
    compared = {(c["key"], c["policy"], c["R"]): c for c in comparisons(results, policies, levels)}
    for key, what in (("throughput_tok_s", "total"), ("steady_tok_s", "steady")):
        for dyn in _dynamic(policies):
            vals = [_ratio_cell(compared[(key, dyn, R)]) if (key, dyn, R) in compared else "–" for R in levels]
            lines.append(f"| {policy_label(dyn)} / best static, {what} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def _dynamic(policies: list[str]) -> list[str]:
    """The policies that choose verify lengths per round (scheduler, lagged), in the given order."""
    return [p for p in policies if p.partition(":")[0] in ("scheduler", "lagged")]


def _best_static(cell: dict, policies: list[str], R: int, key: str) -> dict | None:
    """The static policy's cell with the highest median ``key`` at R (None if no static policy ran)."""
    statics = [p for p in policies if p.partition(":")[0] in STATIC_POLICIES]
    return max((cell[(p, R)] for p in statics if (p, R) in cell and key in cell[(p, R)]),
               key=lambda r: r[key], default=None)


def comparisons(results: list[dict], policies: list[str], levels: list[int]) -> list[dict]:
    """Every dynamic policy (scheduler, lagged) against the best static policy at each R, for total and steady
    throughput: :func:`compare_cells`' numbers with ``R``, ``policy`` and ``key`` (the JSON's ``comparisons``)."""
    cell = {(r["policy"], r["R"]): r for r in results}
    out = []
    for key in ("throughput_tok_s", "steady_tok_s"):
        for dyn in _dynamic(policies):
            for R in levels:
                best, mine = _best_static(cell, policies, R, key), cell.get((dyn, R))
                if best is not None and mine is not None and key in mine:
                    out.append({"R": R, "policy": dyn, "key": key, **compare_cells(mine, best, key)})
    return out
