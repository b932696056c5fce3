"""`dspark eval`: acceptance length, per-position acceptance and wall-clock speedup on held-out eval sets.

    dspark eval                                              # shipped drafter, gsm8k,humaneval,mtbench, all prompts
    dspark eval --limit 10 --max-new-tokens 64 --sets gsm8k --modes greedy
    dspark eval --drafter DIR --dtype float32 --out-dir runs/eval-fp32    # also checks greedy losslessness

What is run and measured: :mod:`dspark.evaluation.eval_sets` (greedy and T = 1 DSpark calls with the full-block verify
policy unless ``--policy``; unless ``--no-speed``, plain ``generate()`` and prompt lookup on the same prompts,
interleaved). In float32 greedy DSpark output must equal plain output token for token (exit code 1 otherwise); in
bfloat16 the number of identical outputs is reported.

Writes ``eval.json``, ``eval.md`` (markdown tables) and ``tau_per_position.png`` into ``--out-dir``.
Exit codes: 0 success, 1 a float32 greedy output differed from plain generate(), 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from .common import (
    CLIError,
    add_model_options,
    add_out_dir_option,
    add_progress_option,
    add_target_option,
    check_eval_sets,
    check_min,
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

DEFAULT_SETS = "gsm8k,humaneval,mtbench"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="acceptance length, per-position acceptance and speedup on held-out eval sets",
        description=(
            "Evaluate a DSpark drafter on held-out eval sets: acceptance length tau (greedy and T=1), per-position "
            "conditional acceptance, wall-clock speedup over plain generate() and a prompt-lookup peer row. "
            "Writes eval.json, eval.md and tau_per_position.png."
        ),
    )
    p.add_argument("--drafter", default=None, metavar="PATH|HUB_ID|random",
                   help="DSpark drafter directory, Hugging Face Hub id or 'random' (default: the target's shipped "
                        "drafter, e.g. smollm2-135m-dspark, if present, else random)")
    add_target_option(p)
    p.add_argument("--sets", default=DEFAULT_SETS,
                   help=f"comma-separated eval sets among gsm8k, humaneval, mtbench, alpaca, arena-hard "
                        f"(default: {DEFAULT_SETS})")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set (default: all)")
    p.add_argument("--block-size", type=int, default=None,
                   help="draft slots per round, 1..the drafter's block size (default: the drafter's)")
    p.add_argument("--policy", default="full", metavar="POLICY",
                   help="verify policy: none, full, fixed:N, threshold:P, scheduler or lagged[:LAG]; scheduler "
                        "profiles SPS(B) on first use (default: full)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most new tokens per prompt (default: 128)")
    p.add_argument("--modes", default="greedy,sample", help="comma-separated: greedy, sample (default: both)")
    add_model_options(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: seed + index; default: 0)")
    p.add_argument("--pld-num-tokens", type=int, default=10,
                   help="prompt_lookup_num_tokens of the prompt-lookup peer row (default: 10)")
    p.add_argument("--no-pld", action="store_true", help="skip the prompt-lookup peer row")
    p.add_argument("--no-speed", action="store_true",
                   help="skip plain generate() and prompt lookup (tau only; no speedup, no identity check)")
    add_out_dir_option(p, "runs/eval", "where eval.json, eval.md and the plot are written")
    add_progress_option(p)
    return p


def _check_args(args) -> tuple[list[str], list[str]]:
    from dspark.evaluation.eval_sets import MODES
    sets = check_eval_sets("--sets", [s.strip() for s in args.sets.split(",") if s.strip()])
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise CLIError(f"--modes must be a comma-separated subset of {', '.join(MODES)}, got {args.modes!r}")
    check_min(args, {"max_new_tokens": 1, "pld_num_tokens": 1, "limit": 1, "block_size": 1})
    check_target(args.target)
    args.policy = check_policy(args.policy)
    return sets, modes


@reports_cli_errors("dspark eval")
def run(args) -> int:
    sets, modes = _check_args(args)
    _, drafter_spec = drafter_or_shipped(args.drafter, args.target)
    args.target = target_for_drafter(args.target, drafter_spec)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    from dspark.evaluation.eval_sets import evaluate, markdown
    from dspark.evaluation.profiling import cpu_model

    hf_logging.disable_progress_bar()
    set_threads(args.threads)
    device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, device, announce="dspark eval", target=args.target,
                               drafter=None if drafter_spec == "random" else drafter_spec)
    target, tok, drafter = load_models(args.target, drafter_spec, args.dtype, device)
    gamma = drafter.config.block_size
    if args.block_size is not None and args.block_size > gamma:
        raise CLIError(f"--block-size must be in [1, {gamma}] for this drafter, got {args.block_size}")
    if drafter_spec == "random":
        print("dspark eval: using a random (untrained) drafter: tau will be near 1", file=sys.stderr)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    speed = not args.no_speed
    t0 = time.perf_counter()
    body = evaluate(target, tok, drafter, sets, modes, limit=args.limit, block_size=args.block_size,
                    policy=args.policy, max_new_tokens=args.max_new_tokens, seed=args.seed, speed=speed,
                    pld=speed and not args.no_pld, pld_num_tokens=args.pld_num_tokens, progress=not args.no_progress)
    config = {
        "drafter": args.drafter if args.drafter is not None else drafter_spec,
        "target": str(args.target or "SmolLM2-135M-Instruct"), "sets": sets, "modes": modes,
        "limit": args.limit, "block_size": args.block_size or gamma, "policy": args.policy,
        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "device": device, "seed": args.seed,
        "speed": speed, "prompt_lookup_num_tokens": args.pld_num_tokens if speed and not args.no_pld else None,
        "sts_temperatures": list(drafter.config.sts_temperatures),
        "sts_biases": list(drafter.config.sts_biases),
        "command": "dspark " + " ".join(sys.argv[1:]) if "eval" in sys.argv[1:2] else " ".join(sys.argv),
        "seconds": time.perf_counter() - t0,
        "machine": {"platform": platform.platform(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
                    "torch": torch.__version__, "transformers": transformers.__version__},
    }
    report = {"config": config, **body}
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2))
    md = markdown(report)
    (out_dir / "eval.md").write_text(md)
    plot_eval(report, out_dir / "tau_per_position.png")
    print(md)
    print(f"[dspark] wrote {out_dir / 'eval.json'}, {out_dir / 'eval.md'}, {out_dir / 'tau_per_position.png'}")
    summ = body["summary"]
    if speed and "greedy" in modes and args.dtype == "float32" and summ.get("n_identical") != summ.get("n_compared"):
        print(f"dspark eval: LOSSLESS CHECK FAILED: {summ['n_compared'] - summ['n_identical']} float32 greedy "
              "outputs differ from plain generate()", file=sys.stderr)
        return 1
    return 0


def plot_eval(report: dict, path: Path) -> Path:
    """Write a PNG of an eval report to ``path`` (returned): conditional acceptance rate per position, and the
    implied τ for block size k. matplotlib's Agg backend."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, r) in enumerate(report["results"].items()):
        for mode, ls in (("greedy", "-"), ("sample", "--")):
            if mode not in r:
                continue
            pp, tau = r[mode]["per_position"], r[mode]["tau"]
            ks = list(range(1, len(pp["survival"]) + 1))
            cond = [v if v is not None else float("nan") for v in pp["conditional_accept_rate"]]
            c, label = colors[i % len(colors)], f"{name} ({'T=1' if mode == 'sample' else mode})"
            ax1.plot(ks, cond, ls, marker="o", ms=3, color=c, label=label)
            ax2.plot([0] + ks, [1.0] + pp["implied_tau_at_block_size"], ls, marker="o", ms=3, color=c,
                     label=f"{label}, τ={'–' if tau is None else f'{tau:.2f}'}")
    ax1.set(xlabel="draft position k", ylabel="P(x_k accepted | x_<k accepted)", ylim=(0, 1),
            title="conditional acceptance rate")
    ax2.set(xlabel="block size k", ylabel="τ(k) = 1 + Σ(j≤k) P(x_1..x_j accepted)",
            title="acceptance length per position")
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"dspark eval: {Path(report['config']['drafter']).name}", fontsize=10)
    save_figure(fig, path, 120)
    return path
