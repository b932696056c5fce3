"""`dspark bench serve`: serving benchmark of batched speculative decoding (:class:`generation.engine.DSparkEngine`).

    dspark bench serve                                # R = 1 2 4 8 16, six policies, 3 repeats, auto dtype, mtbench + gsm8k
    dspark bench serve --requests 1 4 --max-new-tokens 16 --limit 2 --repeats 2 --out-dir runs/bench-small

For every concurrency R and verify policy it serves the same held-out prompts (``load_eval_prompts``: MT-Bench first
turns and GSM8K, chat template applied) with at most R requests in flight (continuous batching; at least
max(``--waves`` × R, ``--min-requests``) requests per R, all queued at the start), greedy, and reports total
throughput (generated tokens / wall second), steady-state throughput (the same over the loaded phase only: until
the queue is empty and fewer than R requests run; a closed batch ends in a drain where speculation makes requests
finish at different times, so the last rounds run below R) and per-user speed (mean over requests of tokens /
seconds from admission to finish). Policies: no speculation; static verify length 1 (the MTP-1 analogue); static
full block; DeepSpec-style confidence threshold; the DSpark scheduler (Algorithm 1 over all running requests); the
two-round-lag budget variant. Every policy but no speculation (plain decoding) runs the n-gram lookup proposer
beside the drafter, as the engine does by default (``--no-lookup``: without it). The scheduler's SPS(B) table
is profiled on first use for this target / dtype / thread count and cached (see ``dspark profile``).

Steady state: each policy has ONE engine for the whole benchmark (its ``max_batch_size`` set to R per cell), as a
long-running server would (the ``lagged`` budgets carry over from cell to cell); ``--warmup-repeats`` untimed
repetitions of every cell come first (default 1), so no timed cell pays for a cold
start. The warm-up serves the next prompts of the pool (the same data sets, other prompts), not the timed ones.

Noise control: every (R, policy) cell is served ``--repeats`` times, interleaved: repetition after repetition, and
within one repetition all policies at one R back to back, in an order rotated each repetition, so slow drift of the
machine (other processes, thermal) hits every policy alike. Each cell reports the median over repetitions and the
min / max (``throughput_min`` / ``throughput_max``, ``*_reps`` lists) as its noise estimate; the table prints
``median ±half-range``, and the scheduler-vs-best-static rows the ratio of medians with the combined relative
half-range of the two cells (a ratio within it is a tie), the range of the paired per-repetition ratios, how many
of them exceed 1 and a one-sided sign test's p-value (``comparisons`` in the JSON): "strictly faster" needs the
paired repetitions to agree, e.g. 10 of 10 (p = 0.001) or 9 of 10 (p = 0.011), not a median alone.

Writes ``serve.json`` and a Pareto plot ``serve.png`` (throughput vs per-user speed) into ``--out-dir`` (default
``runs/bench-serve``; ``--out`` and ``--plot`` name the files instead) and prints a markdown table.
Exit codes: 0 success, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from .common import (
    REPO_ROOT,
    SHIPPED_DRAFTER,
    CLIError,
    add_device_option,
    add_dtype_option,
    add_out_dir_option,
    add_progress_option,
    add_threads_option,
    drafter_dir,
    load_drafter,
    check_target,
    load_target_checked,
    reports_cli_errors,
    resolve_device,
    resolve_dtype,
    set_threads,
)

DEFAULT_POLICIES = ["none", "fixed:1", "full", "threshold:0.5", "scheduler", "lagged:2"]
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


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks (serve: batched speculative decoding throughput)",
                              description="Benchmarks.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    s = sub.add_parser(
        "serve",
        help="throughput vs per-user speed of batched speculative decoding for several R and policies",
        description=(
            "For each concurrency R and verify policy, serve held-out prompts with DSparkEngine (greedy, continuous "
            "batching) and report total throughput and per-user tokens/s; JSON + Pareto plot + markdown table."
        ),
    )
    s.add_argument("--target", default=None, metavar="PATH",
                   help="local transformers checkpoint directory (default: SmolLM2-135M-Instruct)")
    s.add_argument("--drafter", default=None, metavar="PATH|HUB_ID|random",
                   help="DSpark drafter directory or Hugging Face Hub id (default: "
                        f"{SHIPPED_DRAFTER.relative_to(REPO_ROOT)} if present, "
                        "else a random drafter, with a warning)")
    add_dtype_option(s)
    add_device_option(s)
    s.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4, 8, 16], metavar="R",
                   help="concurrency levels (default: 1 2 4 8 16)")
    s.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES, metavar="POLICY",
                   help="engine policies: none, fixed:N, full, threshold:P, scheduler, lagged[:LAG] "
                        f"(default: {' '.join(DEFAULT_POLICIES)})")
    s.add_argument("--datasets", nargs="+", default=["mtbench", "gsm8k"],
                   help="eval prompt sets (default: mtbench gsm8k)")
    s.add_argument("--limit", type=int, default=32,
                   help="prompts per dataset (default: 32; the warm-up serves other prompts while the pool is larger "
                        "than a cell's requests)")
    s.add_argument("--min-requests", type=int, default=8,
                   help="requests served per R: max(--waves x R, this) (default: 8)")
    s.add_argument("--waves", type=int, default=2,
                   help="requests per batch slot, so finished requests are replaced from the queue (default: 2)")
    s.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated per request (default: 40)")
    s.add_argument("--repeats", type=int, default=3,
                   help="repetitions of every (R, policy) cell, interleaved; medians and min-max reported; the paired "
                        "sign test's p-value is at least 2^-N (default: 3)")
    s.add_argument("--warmup-repeats", type=int, default=1,
                   help="untimed repetitions of every cell before the timed ones (default: 1)")
    s.add_argument("--block-size", type=int, default=None, help="draft slots per round (default: the drafter's)")
    add_threads_option(s)
    add_out_dir_option(s, "runs/bench-serve", "where serve.json and serve.png are written")
    s.add_argument("--out", default=None, metavar="FILE.json",
                   help="write the JSON here instead of OUT_DIR/serve.json (default: none)")
    s.add_argument("--plot", default=None, metavar="FILE.png",
                   help="Pareto plot file (default: the JSON's path with .png)")
    add_progress_option(s)
    s.add_argument("--no-lookup", action="store_true",
                   help="engines without the n-gram lookup proposer beside the drafter (default: on in every policy "
                        "but none, which stays plain decoding)")
    s.add_argument("--profile", default=None, metavar="FILE.json",
                   help="SPS(B) profile file (default: the profile cache, see `dspark profile`)")
    s.set_defaults(func=run)
    return p


# ---------------------------------------------------------------------------------------------- helpers
def _drafter_spec(args) -> tuple[str, str]:
    """``(spec, path)`` of ``--drafter`` (default: the shipped drafter, else ``"random"``), checked before any
    model loads."""
    spec = args.drafter
    if spec is None:
        spec = str(SHIPPED_DRAFTER) if (SHIPPED_DRAFTER / "config.json").is_file() else "random"
    return spec, (spec if spec == "random" else drafter_dir(spec))


def _load(args, spec: str, path: str):
    """``(target, tokenizer, drafter)`` for the drafter :func:`_drafter_spec` resolved (``spec``, ``path``)."""
    import torch

    target, tok = load_target_checked(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    if spec == "random":
        print("dspark bench serve: WARNING: using a random (untrained) drafter: outputs are exact but few drafts are "
              "accepted, so speculation cannot pay off; pass --drafter PATH for meaningful numbers", file=sys.stderr)
    return target, tok, load_drafter(path, target, target.dtype)


def _prompts(args, tok) -> list[dict]:
    from training.prompts import load_eval_prompts
    from modeling_dspark.target import apply_chat_template

    per_set = []
    for name in args.datasets:
        try:
            recs = load_eval_prompts(name, args.limit)
        except Exception as err:  # missing data package, unknown name
            raise CLIError(f"could not load eval prompts {name!r}: {err}") from None
        per_set.append([{"id": r["id"], "ids": apply_chat_template(tok, r["prompt"])} for r in recs])
    pool = [rec for group in zip(*per_set) for rec in group]  # interleave the sets
    for group in per_set:
        pool += group[min(len(g) for g in per_set):]
    if not pool:
        raise CLIError("no prompts (check --datasets / --limit)")
    return pool


def _engine(target, drafter, policy, block_size, sps, lookup: bool = True):
    """One serving engine per policy, kept for the whole benchmark (steady state, see the module doc); ``none`` is
    plain decoding (no drafter, no lookup)."""
    from generation.engine import DSparkEngine

    plain = policy == "none"
    return DSparkEngine(target, None if plain else drafter, policy, block_size=block_size, sps=sps,
                        lookup=lookup and not plain)


def _committed(engine) -> int:
    return sum(sum(r.committed) for r in engine.stats.rounds)


def _serve(engine, prompts, num_requests, concurrency, max_new, first=0):
    """Serve ``num_requests`` prompts, all queued at once, at most ``concurrency`` in flight; timings in seconds.

    ``steady_tok_s`` counts only the loaded phase: from the start until the queue is empty and fewer than R requests
    run (the drain, where a closed batch no longer has R requests to serve, is left out)."""
    from generation.engine import EngineStats

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
    return {
        "throughput_tok_s": tokens / wall,
        "steady_tok_s": steady[0] / steady[1],
        "steady_tokens": steady[0],
        "per_user_tok_s": statistics.fmean(o.tokens_per_s for o in outs),
        "tokens": tokens,
        "wall_s": wall,
        "rounds": summ["rounds"],
        "tau": summ["tau"],
        "mean_verified": summ["mean_verified"],
        "mean_accepted": summ["mean_accepted"],
        "mean_batch_tokens": summ["mean_batch_tokens"],
        "t_draft_ms": summ["t_draft_ms"],
        "t_verify_ms": summ["t_verify_ms"],
        "skipped_draft_rounds": summ["skipped_draft_rounds"],
        "lookup_request_rounds": summ["lookup_request_rounds"],
    }, [o.output_ids for o in outs]


def _half_range(r: dict, key: str = "throughput_tok_s") -> float:
    """Half the min-max spread of a cell over its repetitions (0 without repetitions)."""
    lo, hi = r.get(key.replace("_tok_s", "_min")), r.get(key.replace("_tok_s", "_max"))
    return 0.0 if lo is None or hi is None else (hi - lo) / 2


def aggregate_reps(reps: list[dict]) -> dict:
    """One cell from its repetitions: medians of every number, min / max and the per-rep lists of the two speeds."""
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


def pareto_plot(results: list[dict], policies: list[str], out_png: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for pol in policies:
        pts = sorted((r for r in results if r["policy"] == pol), key=lambda r: r["R"])
        if not pts:
            continue
        xs = [r["per_user_tok_s"] for r in pts]
        ys = [r["throughput_tok_s"] for r in pts]
        ax.plot(xs, ys, marker="o", label=policy_label(pol))
        for r, x, y in zip(pts, xs, ys):
            ax.annotate(f"R={r['R']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("per-user speed (tokens/s)")
    ax.set_ylabel("total throughput (tokens/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


# ---------------------------------------------------------------------------------------------- main
def run(args) -> int:
    if getattr(args, "bench_command", None) != "serve":
        print("dspark bench: error: choose a benchmark: `dspark bench serve`", file=sys.stderr)
        return 2
    return _serve_command(args)


@reports_cli_errors("dspark bench serve")
def _serve_command(args) -> int:
    from generation.policies import parse_policy

    if (min(args.requests) < 1 or args.limit < 1 or args.max_new_tokens < 1 or args.min_requests < 1
            or args.repeats < 1 or args.waves < 1):
        raise CLIError("--requests, --limit, --min-requests, --waves, --max-new-tokens and --repeats must be >= 1")
    if args.warmup_repeats < 0:
        raise CLIError("--warmup-repeats must be >= 0")
    for pol in args.policies:
        try:
            parse_policy(pol)
        except ValueError as err:
            raise CLIError(str(err)) from None
    check_target(args.target)

    import torch

    from generation import profiling

    set_threads(args.threads)
    threads = torch.get_num_threads()
    args.device = resolve_device(args.device)
    drafter_spec, drafter_path = _drafter_spec(args)  # a wrong --drafter is reported before the target loads
    args.dtype = resolve_dtype(args.dtype, args.device, announce="dspark bench serve", target=args.target,
                               drafter=None if drafter_path == "random" else drafter_path)
    log = (lambda *a, **k: None) if args.no_progress else print
    target, tok, drafter = _load(args, drafter_spec, drafter_path)
    gamma = args.block_size or drafter.config.block_size
    if not 1 <= gamma <= drafter.config.block_size:
        raise CLIError(f"--block-size must be in [1, {drafter.config.block_size}]")
    prompts = _prompts(args, tok)
    levels = sorted(set(args.requests))
    mean_prompt = statistics.fmean(len(p["ids"]) for p in prompts)
    context = 2 ** max(4, round(math.log2(mean_prompt + args.max_new_tokens / 2)))  # power-of-2 bucket
    needs_sps = any(parse_policy(p).needs_sps for p in args.policies)
    sps = None
    if needs_sps:
        tokens = profiling.first_use_tokens(gamma)
        log(f"SPS profile for context {context}, R {levels} (cached after the first run) ...", file=sys.stderr)
        sps = profiling.ensure_profile(
            target, contexts=[context], requests=levels, tokens=tokens, threads=threads, path=args.profile,
            progress=lambda s: log("  " + s, file=sys.stderr),
        )

    engines = {pol: _engine(target, drafter, pol, gamma, sps, not args.no_lookup) for pol in args.policies}
    # interleaved: repetition by repetition; within one, each R's policies back to back in a rotated order; the
    # first --warmup-repeats repetitions are not timed (new shapes' first forwards)
    reps: dict[tuple[int, str], list[dict]] = {}
    outputs = {}
    for rep in range(-args.warmup_repeats, args.repeats):
        for li, R in enumerate(levels):
            n = max(args.waves * R, args.min_requests)
            shift = (rep + li) % len(args.policies)
            for pol in args.policies[shift:] + args.policies[:shift]:
                # warm-up repetitions serve the NEXT prompts of the pool, so no policy learns on the timed trace
                res, outs = _serve(engines[pol], prompts, n, R, args.max_new_tokens, first=n if rep < 0 else 0)
                if rep < 0:
                    log(f"warm-up R={R:<3} {pol:<14} {res['throughput_tok_s']:7.1f} tok/s total", file=sys.stderr)
                    continue
                outputs.setdefault((R, pol), outs)
                reps.setdefault((R, pol), []).append(res)
                log(f"rep {rep + 1}/{args.repeats} R={R:<3} {pol:<14} {res['throughput_tok_s']:7.1f} tok/s total  "
                      f"{res['per_user_tok_s']:6.1f} tok/s/user  tau {res['tau']:.2f}  verified "
                      f"{res['mean_verified']:.2f}  B {res['mean_batch_tokens']:.1f}  skipped-draft rounds "
                      f"{res['skipped_draft_rounds']}/{res['rounds']}", file=sys.stderr)
    results = []
    for R in levels:
        for pol in args.policies:
            res = aggregate_reps(reps[(R, pol)])
            base, outs = outputs.get((R, "none")), outputs[(R, pol)]
            res["agreement_with_none"] = (sum(a == b for a, b in zip(outs, base)) / len(outs)) if base else None
            results.append({"R": R, "policy": pol, "requests": max(args.waves * R, args.min_requests), **res})

    table = markdown_table(results, args.policies, levels)
    out = Path(args.out) if args.out else Path(args.out_dir) / "serve.json"
    report = {
        "config": {
            "target": profiling.target_name(target), "dtype": args.dtype, "threads": threads,
            "drafter": drafter_spec, "block_size": gamma, "datasets": args.datasets, "limit": args.limit,
            "num_prompts": len(prompts), "min_requests": args.min_requests, "waves": args.waves,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "warmup_repeats": args.warmup_repeats,
            "engines": "one per policy for the whole run (steady state)",
            "order": "interleaved: repeat > R > policies (rotated per repeat)",
            "requests": levels, "policies": args.policies, "sps_context": context,
            "lookup": not args.no_lookup,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
            "processor": profiling.device_model(target.device),
        },
        "sps_profile": sps.to_dict() if sps is not None else None,
        "results": results,
        "comparisons": comparisons(results, args.policies, levels),
        "markdown": table,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    pareto_plot(results, args.policies, png,
                f"{report['config']['target']} {args.dtype}, {threads} threads, drafter {Path(drafter_spec).name}")
    print(table)
    print(f"\nJSON: {out}\nplot: {png}", file=sys.stderr)
    return 0
