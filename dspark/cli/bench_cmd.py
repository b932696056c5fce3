"""`dspark bench serve`: serving benchmark of batched speculative decoding
(:class:`dspark.generation.engine.DSparkEngine`).

    dspark bench serve                      # R = 1 2 4 8 16, six policies, 3 repeats, auto dtype, mtbench + gsm8k
    dspark bench serve --requests 1 4 --max-new-tokens 16 --limit 2 --repeats 2 --out-dir runs/bench-small

For every concurrency R and verify policy it serves the same held-out prompts (MT-Bench first turns and GSM8K, chat
template applied) with at most R requests in flight, greedy, ``--repeats`` times interleaved, and reports total
throughput, steady-state throughput and per-user speed; what is served, in which order, and the statistics (medians,
half-ranges, paired ratios, sign test): :mod:`dspark.evaluation.serving`. Policies: no speculation; static verify length
1 (the MTP-1 analogue); static full block; DeepSpec-style confidence threshold; the DSpark scheduler (Algorithm 1 over
all running requests); the two-round-lag budget variant. Every policy but no speculation (plain decoding) runs the
n-gram lookup proposer beside the drafter, as the engine does by default (``--no-lookup``: without it). The
scheduler's SPS(B) table is profiled on first use for this target / dtype / thread count and cached (see ``dspark
profile``).

Writes ``serve.json`` and a Pareto plot ``serve.png`` (throughput vs per-user speed) into ``--out-dir`` (default
``runs/bench-serve``; ``--out`` and ``--plot`` name the files instead) and prints a markdown table.
Exit codes: 0 success, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .common import (
    CLIError,
    add_device_option,
    add_dtype_option,
    add_out_dir_option,
    add_progress_option,
    add_target_option,
    add_threads_option,
    check_eval_sets,
    check_policy,
    check_target,
    drafter_or_shipped,
    load_models,
    pyplot,
    reports_cli_errors,
    resolve_device,
    resolve_dtype,
    save_figure,
    set_threads,
    target_for_drafter,
)

DEFAULT_POLICIES = ["none", "fixed:1", "full", "threshold:0.5", "scheduler", "lagged:2"]


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
    add_target_option(s)
    s.add_argument("--drafter", default=None, metavar="PATH|HUB_ID|random",
                   help="DSpark drafter directory or Hugging Face Hub id (default: the target's shipped drafter, "
                        "e.g. smollm2-135m-dspark, if present, else a random drafter, with a "
                        "warning)")
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
                   help="price the scheduler with the SPS(B) tables of this profile file (`dspark profile --out`) "
                        "instead of the verify times learned from the rounds (default: none, learned)")
    return p


# ---------------------------------------------------------------------------------------------- main
def _check_args(args) -> None:
    """Refuse values out of range, unknown policies and eval sets, and a missing --target, before any model loads."""
    if (min(args.requests) < 1 or args.limit < 1 or args.max_new_tokens < 1 or args.min_requests < 1
            or args.repeats < 1 or args.waves < 1):
        raise CLIError("--requests, --limit, --min-requests, --waves, --max-new-tokens and --repeats must be >= 1")
    if args.warmup_repeats < 0:
        raise CLIError("--warmup-repeats must be >= 0")
    for pol in args.policies:
        check_policy(pol, None)
    check_eval_sets("--datasets", args.datasets)
    check_target(args.target)


def _profile_sps(args, target, threads: int):
    """The SPS(B) tables of ``--profile`` for this target, dtype and thread count (None without ``--profile``),
    which price the scheduler instead of the learned prices; a missing or unfit table is a :class:`CLIError`."""
    from dspark.evaluation import profiling

    if args.profile is None:
        return None
    try:
        return profiling.load_profile(profiling.target_name(target), args.dtype, threads, args.profile,
                                      device=target.device)
    except (FileNotFoundError, ValueError) as err:
        raise CLIError(str(err)) from None


def _report_config(args, target, threads: int, drafter_spec: str, gamma: int, n_prompts: int, levels: list[int],
                   context) -> dict:
    """The ``config`` of ``serve.json``: what was served, how, and on what."""
    import torch

    from dspark.evaluation import profiling

    return {
        "target": profiling.target_name(target), "dtype": args.dtype, "threads": threads,
        "drafter": drafter_spec, "block_size": gamma, "datasets": args.datasets, "limit": args.limit,
        "num_prompts": n_prompts, "min_requests": args.min_requests, "waves": args.waves,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "warmup_repeats": args.warmup_repeats,
        "engines": "one per policy for the whole run (steady state)",
        "order": "interleaved: repeat > R > policies (rotated per repeat)",
        "requests": levels, "policies": args.policies, "sps_context": context,
        "lookup": not args.no_lookup,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
        "processor": profiling.device_model(target.device),
    }


@reports_cli_errors("dspark bench serve")
def run(args) -> int:
    if getattr(args, "bench_command", None) != "serve":
        print("dspark bench: error: choose a benchmark: `dspark bench serve`", file=sys.stderr)
        return 2
    _check_args(args)

    import torch

    from dspark.evaluation import serving

    set_threads(args.threads)
    threads = torch.get_num_threads()
    args.device = resolve_device(args.device)
    drafter_spec, drafter_path = drafter_or_shipped(args.drafter, args.target)  # checked before the target loads
    args.target = target_for_drafter(args.target, drafter_path)
    args.dtype = resolve_dtype(args.dtype, args.device, announce="dspark bench serve", target=args.target,
                               drafter=None if drafter_path == "random" else drafter_path)
    log = (lambda *a, **k: None) if args.no_progress else (lambda *a: print(*a, file=sys.stderr))
    target, tok, drafter = load_models(args.target, drafter_path, args.dtype, args.device)
    if drafter_spec == "random":
        print("dspark bench serve: WARNING: using a random (untrained) drafter: outputs are exact but few drafts are "
              "accepted, so speculation cannot pay off; pass --drafter PATH for meaningful numbers", file=sys.stderr)
    gamma = args.block_size or drafter.config.block_size
    if not 1 <= gamma <= drafter.config.block_size:
        raise CLIError(f"--block-size must be in [1, {drafter.config.block_size}]")
    try:
        prompts = serving.prompt_pool(tok, args.datasets, args.limit)
    except ImportError as err:  # a missing data package
        raise CLIError(f"could not load eval prompts: {err}") from None
    if not prompts:
        raise CLIError("no prompts (check --datasets / --limit)")
    levels = sorted(set(args.requests))
    context = serving.sps_context(prompts, args.max_new_tokens)
    sps = _profile_sps(args, target, threads)
    engines = {pol: serving.serving_engine(target, drafter, pol, gamma, sps, not args.no_lookup)
               for pol in args.policies}
    results = serving.bench_serve(engines, prompts, levels, waves=args.waves, min_requests=args.min_requests,
                                  max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                                  warmup_repeats=args.warmup_repeats, log=log)

    table = serving.markdown_table(results, args.policies, levels)
    out = Path(args.out) if args.out else Path(args.out_dir) / "serve.json"
    report = {
        "config": _report_config(args, target, threads, drafter_spec, gamma, len(prompts), levels, context),
        "sps_profile": sps.to_dict() if sps is not None else None,
        "results": results,
        "comparisons": serving.comparisons(results, args.policies, levels),
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


def pareto_plot(results: list[dict], policies: list[str], out_png: Path, title: str) -> Path:
    """Write ``out_png`` (returned): total throughput against per-user speed, one line per policy through its R
    values. matplotlib's Agg backend."""
    from dspark.evaluation.serving import policy_label

    fig, ax = pyplot().subplots(figsize=(7.5, 5))
    for pol in policies:
        pts = sorted((r for r in results if r["policy"] == pol), key=lambda r: r["R"])
        if not pts:
            continue
        xs, ys = [r["per_user_tok_s"] for r in pts], [r["throughput_tok_s"] for r in pts]
        ax.plot(xs, ys, marker="o", label=policy_label(pol))
        for r, x, y in zip(pts, xs, ys):
            ax.annotate(f"R={r['R']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="per-user speed (tokens/s)", ylabel="total throughput (tokens/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out_png, 110)
    return out_png
