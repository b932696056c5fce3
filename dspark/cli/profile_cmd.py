"""`dspark profile`: measure the target's verify step rate SPS(B) on this machine and cache it for the scheduler.

    dspark profile                                   # quick: R=1, B=1..17, context 256, current threads (~20 s)
    dspark profile --dtype bfloat16 --requests 1 2 4 8 16 --contexts 256 1024
    dspark profile --show                            # print the cached tables

The table lands in the profile cache (``$DSPARK_PROFILE_DIR`` or ``$DSPARK_CACHE/profiles`` or
``~/.cache/dspark/profiles``, file ``sps.json``) keyed by model, dtype, threads, context bucket and R, where
``dspark bench serve`` finds it (``generate()`` learns its prices from its own rounds, or takes a table given as
``dspark_options(sps=...)``); a PNG of the curves is written next to it.

Exit codes: 0 success, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .common import (
    CLIError,
    add_model_options,
    add_progress_option,
    add_target_option,
    check_min,
    check_target,
    pyplot,
    reports_cli_errors,
    resolve_device,
    resolve_dtype,
    save_figure,
    shipped_drafter_for,
)



def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile",
        help="measure the target's verify step rate SPS(B) (for the DSpark scheduler)",
        description=(
            "Time the target's verify forward for B = R x q tokens (R requests, q new tokens each, on KV caches "
            "of the given context length), with warm-up and medians, and cache the table for the scheduler."
        ),
    )
    add_target_option(p, "SmolLM2-135M-Instruct")
    add_model_options(p)
    p.add_argument("--contexts", type=int, nargs="+", default=[256], metavar="N",
                   help="context lengths in the KV cache (default: 256)")
    p.add_argument("--requests", type=int, nargs="+", default=[1], metavar="R",
                   help="concurrent requests R (default: 1)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, metavar="Q",
                   help="new tokens per request q (default: 1..17 for R=1, 1 2 3 5 9 17 for R>1)")
    p.add_argument("--warmup", type=int, default=1, help="discarded passes (default: 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes; the median is kept (default: 5)")
    p.add_argument("--out", default=None, metavar="FILE.json",
                   help="profile file to merge into (default: the profile cache)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot of the curves (default: next to the profile file)")
    p.add_argument("--no-plot", action="store_true", help="do not write a plot (default: write one)")
    p.add_argument("--show", action="store_true",
                   help="print the cached tables for this target / dtype / threads; measure nothing (default: measure)")
    p.add_argument("--json", action="store_true", help="print the tables as JSON (default: text)")
    add_progress_option(p)
    return p


def _print_tables(prof, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"model": prof.model, "dtype": prof.dtype, "threads": prof.threads,
                          "tables": prof.to_dict()}, indent=1))
        return
    print(f"SPS(B) for {prof.model}, {prof.dtype}, {prof.threads} threads (target verify steps per second)")
    for ctx in prof.contexts:
        for r in prof.requests(ctx):
            row = "  ".join(f"B={b}:{s:.1f}" for b, s in sorted(prof.tables[ctx][r].items()))
            print(f"  context {ctx:>5}  R={r:<3} {row}")


@reports_cli_errors("dspark profile")
def run(args) -> int:
    check_min(args, {"warmup": 0, "repeats": 1})
    if min(args.contexts) < 0 or min(args.requests) < 1 or (args.tokens and min(args.tokens) < 1):
        raise CLIError("--contexts must be >= 0, --requests and --tokens >= 1")

    import torch

    from dspark.evaluation import profiling
    from modeling_dspark.target import load_target

    threads = args.threads or torch.get_num_threads()
    check_target(args.target)
    device = resolve_device(args.device)
    # auto: the dtype `dspark generate` picks for this target by default (with the shipped drafter on the default
    # target), since that is the job the SPS(B) table serves
    args.dtype = resolve_dtype(args.dtype, device, announce=None if args.show else "dspark profile",
                               target=args.target, drafter=shipped_drafter_for(args.target))
    try:
        target, _ = load_target(args.target, dtype=getattr(torch, args.dtype), device=device)
    except (FileNotFoundError, OSError) as err:
        raise CLIError(f"could not load target: {err}") from None
    name = profiling.target_name(target)
    path = Path(args.out) if args.out else profiling.default_profile_path()
    if args.show:
        try:
            prof = profiling.load_profile(name, args.dtype, threads, path, device=target.device)
        except (FileNotFoundError, ValueError) as err:
            raise CLIError(str(err)) from None
        _print_tables(prof, args.json)
        return 0

    log = (lambda *a, **k: None) if args.no_progress else print
    log(f"profiling {name} ({args.dtype}, {threads} threads): contexts {args.contexts}, R {args.requests}",
        file=sys.stderr)
    try:
        result = profiling.profile_target(
            target, contexts=args.contexts, requests=args.requests, tokens=args.tokens, threads=threads,
            warmup=args.warmup, repeats=args.repeats, progress=lambda s: log("  " + s, file=sys.stderr),
        )
        for ctx, per_r in result["problems"].items():  # saved all the same: measuring was asked for
            for r, reason in per_r.items():
                print(f"dspark profile: warning: context {ctx}, R={r}: {reason}; the machine was probably busy, "
                      "measure again when it is quiet", file=sys.stderr)
        profiling.save_profile(result, path)
        prof = profiling.load_profile(name, args.dtype, threads, path, device=target.device)
    except ValueError as err:
        raise CLIError(str(err)) from None
    print(f"saved to {path} ({result['meta']['seconds']} s)", file=sys.stderr)
    if not args.no_plot:
        png = Path(args.plot) if args.plot else path.with_name(f"{name}-{args.dtype}-t{threads}.png")
        plot_profile(prof, png)
        print(f"plot: {png}", file=sys.stderr)
    _print_tables(prof, args.json)
    return 0


def plot_profile(profile, out_png: str | os.PathLike, title: str | None = None) -> Path:
    """Plot SPS(B) and the step time for every (context, R) curve of ``profile`` into a PNG."""
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    for ctx in profile.contexts:
        for r in profile.requests(ctx):
            pts = sorted(profile.tables[ctx][r].items())
            bs = [b for b, _ in pts]
            ax1.plot(bs, [s for _, s in pts], marker="o", ms=3, label=f"ctx {ctx}, R={r}")
            ax2.plot(bs, [1e3 / s for _, s in pts], marker="o", ms=3, label=f"ctx {ctx}, R={r}")
    ax1.set(xlabel="verify batch B (tokens)", ylabel="SPS(B)  (target steps / s)")
    ax2.set(xlabel="verify batch B (tokens)", ylabel="step time (ms)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or f"{profile.model}  {profile.dtype}  {profile.threads} threads")
    save_figure(fig, out_png, 110)
    return Path(out_png)
