"""`dspark adapt`: LoRA-adapt an existing DSpark drafter to a new domain through `DSparkTrainer` (peft).

Build the new domain's data with the target first (e.g. ``dspark data build --out-dir data/math --sources gsm_symbolic
--per-source 2000``), then::

    dspark adapt --drafter smollm2-135m-dspark --data data/math --out-dir runs/adapt-math --max-steps 300 --merge

Only the LoRA adapters (rank ``--lora-r`` on the draft layers' q/k/v/o and gate/up/down projections; optionally
full copies of the heads with ``--train-heads``) are trained, with the same loss, online target features and
checkpointing as ``dspark train``. ``--eval-prompts N`` rows of the domain data (or of ``--eval-data``) are held out
of training and used to measure greedy τ (``target.generate(assistant_model=…)``, full-block verification) before
and after adaptation. Outputs in ``--out-dir``: ``adapter_model.safetensors`` + ``adapter_config.json`` (the
adapter; load it with :func:`dspark.training.peft_adapt.load_adapter`), ``dspark_adapter.json``,
``adapt_manifest.json`` (τ before/after, steps, wall time, trainable parameters, command) and, with ``--merge``,
``merged/``: a plain drafter with the LoRA folded in (``DSparkDraftModel.from_pretrained``). The STS temperatures
and offsets are copied unchanged; re-run ``dspark calibrate`` on the merged drafter for calibrated confidences.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import (
    CLIError,
    add_hidden_alias,
    add_out_dir_option,
    add_run_options,
    add_trainer_machine_options,
    check_made_for_target,
    check_min,
    check_out_dir,
    check_target,
    drafter_dir,
    load_data_dir,
    load_target_checked,
    reports_cli_errors,
    require_out_dir,
    resolve_device,
    resolve_dtype,
    set_threads,
    silence_progress,
    standalone_main,
    target_for_drafter,
)

DEFAULT_MODULES = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, metavar="PATH|HUB_ID",
                   help="directory (or Hub repository id) of the trained drafter to adapt (required)")
    p.add_argument("--data", required=True, metavar="DIR",
                   help="new-domain data: a directory written by `dspark data build` (required)")
    add_out_dir_option(p, None, "checkpoints, the adapter, the manifest (and merged/); a new run needs a new or "
                                "empty OUT_DIR, a non-empty one is refused unless --resume is given")
    add_hidden_alias(p, "--output-dir", "out_dir")
    p.add_argument("--target", default=None, metavar="NAME|PATH",
                   help="packaged target name or local target directory (default: the drafter's target if it is a "
                        "packaged target or a local directory, else SmolLM2-135M-Instruct)")
    lo = p.add_argument_group("LoRA")
    lo.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default: 8)")
    lo.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 × rank)")
    lo.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout (default: 0.0)")
    lo.add_argument("--target-modules", default=DEFAULT_MODULES,
                    help=f"comma-separated module names to adapt; add fc for W_c (default: {DEFAULT_MODULES})")
    lo.add_argument("--train-heads", action="store_true",
                    help="also train full copies of the sequential and confidence heads, saved with the adapter "
                         "(default: frozen)")
    lo.add_argument("--merge", action="store_true",
                    help="also save the merged drafter to OUT_DIR/merged (default: adapter only)")
    t = p.add_argument_group("training")
    t.add_argument("--max-steps", type=int, default=300, help="optimizer steps (default: 300)")
    t.add_argument("--lr", type=float, default=5e-4, help="peak learning rate, cosine schedule (default: 5e-4)")
    t.add_argument("--warmup-steps", type=int, default=None, help="learning-rate warm-up (default: 3%% of max-steps)")
    t.add_argument("--batch-size", type=int, default=8, help="sequences per device per step (default: 8)")
    t.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default: 1)")
    t.add_argument("--anchors-per-seq", type=int, default=8, help="random anchors (blocks) per sequence (default: 8)")
    t.add_argument("--max-length", type=int, default=2048,
                   help="truncate sequences to this many tokens (default: 2048)")
    add_run_options(t, "LoRA initialisation and data-order", save_steps=100, keep=2)
    e = p.add_argument_group("τ before / after")
    e.add_argument("--eval-prompts", type=int, default=16,
                   help="held-out domain prompts for greedy τ before and after, 0 = skip (default: 16)")
    e.add_argument("--eval-data", default=None, metavar="DIR",
                   help="take the τ prompts from this data directory (default: held out of --data)")
    e.add_argument("--eval-max-new-tokens", type=int, default=64,
                   help="new tokens per τ prompt (default: 64)")
    e.add_argument("--eval-block-size", type=int, default=None,
                   help="γ' for the τ measurement (default: the drafter's block size)")
    add_trainer_machine_options(p)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``adapt`` on an argparse sub-parser collection."""
    p = subparsers.add_parser("adapt", help="LoRA-adapt a trained drafter to a new domain (peft)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def split_eval(data, n: int, seed: int, eval_data=None):
    """(train rows, held-out eval rows): ``n`` rows of ``eval_data`` if given, else ``n`` rows held out of ``data``.

    The held-out rows are chosen by a seeded permutation and removed from the training set.

    Raises:
        CLIError: ``n`` rows held out of ``data`` would leave none to train on.
    """
    import numpy as np

    if n <= 0:
        return data, None
    if eval_data is not None:
        order = np.random.default_rng(seed).permutation(len(eval_data))[:n]
        return data, eval_data.select(sorted(order.tolist()))
    if n >= len(data):
        raise CLIError(f"--eval-prompts {n} leaves no training rows (--data has {len(data)} rows)")
    order = np.random.default_rng(seed).permutation(len(data))
    held = sorted(order[:n].tolist())
    keep = sorted(order[n:].tolist())
    return data.select(keep), data.select(held)


def _check_args(args):
    """The options that need no model, checked before any is loaded; returns the drafter's local directory and the
    target to load (:func:`~dspark.cli.common.target_for_drafter`).

    Raises:
        CLIError: a value out of its range, no --target-modules, a missing --target, a non-empty --out-dir without
            --resume, a missing or unreadable drafter, an --eval-block-size above the drafter's block size, a
            drafter or data made with another packaged target than the one this run loads.
    """
    from modeling_dspark import DSparkConfig
    from modeling_dspark.target import DEFAULT_TARGET

    check_min(args, {"lora_r": 1, "lora_dropout": 0, "max_steps": 1, "warmup_steps": 0, "batch_size": 1,
                     "grad_accum": 1, "anchors_per_seq": 1, "max_length": 2, "seed": 0, "save_steps": 1,
                     "save_total_limit": 1, "logging_steps": 1, "num_workers": 0, "eval_prompts": 0,
                     "eval_max_new_tokens": 1, "eval_block_size": 1})
    check_min(args, {"lora_alpha": 0, "lr": 0}, strict=True)
    if args.lora_dropout >= 1:
        raise CLIError(f"--lora-dropout must be < 1, got {args.lora_dropout}")
    if not [m for m in args.target_modules.split(",") if m.strip()]:
        raise CLIError("--target-modules is empty: name at least one module to adapt")
    check_target(args.target)
    check_out_dir(args.out_dir, args.resume)
    base_dir = drafter_dir(args.drafter)
    try:
        base_cfg = DSparkConfig.from_pretrained(base_dir)
    except (OSError, ValueError) as err:
        raise CLIError(f"could not read drafter {args.drafter!r}: {err}") from None
    if args.eval_block_size is not None and args.eval_block_size > base_cfg.block_size:
        raise CLIError(f"--eval-block-size must be in [1, {base_cfg.block_size}] for this drafter, "
                       f"got {args.eval_block_size}")
    target = target_for_drafter(args.target, base_dir, shown=args.drafter)
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path:  # the drafter's target is this run's: the data must be built with it
            check_made_for_target(target, flag, path, fix=f"build it with --target {target or DEFAULT_TARGET}")
    return base_dir, target


def _load_models(args, base_dir: str, target_spec, device: str):
    """The target (in the training dtype, on ``device``), its tokenizer and the drafter to adapt, seeded first; a
    drafter that does not load for this target is a :class:`CLIError`."""
    import torch
    import transformers

    from modeling_dspark import DSparkDraftModel

    transformers.set_seed(args.seed)
    target, tok = load_target_checked(target_spec, dtype=torch.bfloat16 if args.bf16 else torch.float32, device=device)
    try:
        drafter = DSparkDraftModel.from_pretrained(base_dir, target=target)
    except (OSError, ValueError) as err:
        raise CLIError(f"could not load drafter {args.drafter!r} for this target: {err}") from None
    return target, tok, drafter


def _held_out_tau(target, model, prompts: list, args) -> dict | None:
    """Greedy τ of ``model`` on the held-out prompts, with its wall time (None without prompts)."""
    import time

    from dspark.training.peft_adapt import greedy_tau

    if not prompts:
        return None
    t0 = time.time()
    res = greedy_tau(target, model, prompts, max_new_tokens=args.eval_max_new_tokens, block_size=args.eval_block_size)
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def _save_merged(model, dtype, out_dir: str) -> Path:
    """Fold the LoRA into the drafter and save it, in ``dtype``, to ``OUT_DIR/merged`` (returned)."""
    from dspark.training.peft_adapt import merge_lora

    merged = merge_lora(model)
    merged.to(dtype)
    merged_dir = Path(out_dir) / "merged"
    merged.save_pretrained(merged_dir)
    print(f"merged drafter saved to {merged_dir}")
    return merged_dir


def _write_manifest(args, drafter, run_, train_rows, eval_rows, params: dict, resume, tau_before, tau_after,
                    merged_dir) -> None:
    """Write ``dspark_adapter.json`` and ``adapt_manifest.json`` into ``--out-dir``; print the run's summary."""
    from dspark.training.peft_adapt import write_adapter_info

    logs = run_.logs()
    manifest = {
        "command": "dspark " + " ".join(sys.argv[1:]) if sys.argv else None,
        "args": dict(vars(args)),
        "base_drafter": str(args.drafter),
        "target": drafter.config.target_name_or_path,
        "data": str(args.data),
        "train_sequences": len(train_rows),
        "eval_source": str(args.eval_data or args.data),
        "eval_ids": None if eval_rows is None or "id" not in eval_rows.column_names else list(eval_rows["id"]),
        "lora": {"r": args.lora_r, "alpha": args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r,
                 "dropout": args.lora_dropout, "target_modules": args.target_modules,
                 "train_heads": args.train_heads, "trainable_params": params["trainable"],
                 "total_params": params["total"]},
        "resumed_from": resume,
        "global_step": run_.trainer.state.global_step,
        "wall_s_this_run": round(run_.wall_s, 1),
        "train_metrics": run_.result.metrics,
        "first_log": logs[0] if logs else None,
        "last_log": logs[-1] if logs else None,
        "tau_before": tau_before,
        "tau_after": tau_after,
        "merged": str(merged_dir) if merged_dir else None,
    }
    write_adapter_info(args.output_dir, drafter, str(args.drafter),
                       tau_before=tau_before and tau_before["tau"], tau_after=tau_after and tau_after["tau"])
    (Path(args.output_dir) / "adapt_manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    print(json.dumps({k: manifest[k] for k in ("global_step", "wall_s_this_run", "last_log")}
                     | {"tau_before": tau_before and tau_before["tau"], "tau_after": tau_after and tau_after["tau"]},
                     indent=2, default=str))


@reports_cli_errors("dspark adapt")
def run(args) -> int:
    require_out_dir(args, "dspark adapt")
    base_dir, target_spec = _check_args(args)
    silence_progress(args.no_progress)
    import torch

    from dspark.training.peft_adapt import add_lora, trainable_parameter_summary
    from dspark.training.pipeline import resolve_resume, train_drafter
    from dspark.training.trainer import prepare_dataset

    set_threads(args.threads)
    data = prepare_dataset(load_data_dir(args.data))
    eval_src = prepare_dataset(load_data_dir(args.eval_data, "--eval-data")) if args.eval_data else None
    train_rows, eval_rows = split_eval(data, args.eval_prompts, args.seed, eval_src)
    args.output_dir = args.out_dir
    device = resolve_device(args.device)
    use_cpu = device.startswith("cpu")
    args.bf16 = resolve_dtype(args.dtype, device, announce="dspark adapt", measure=False) == "bfloat16"
    target, tok, drafter = _load_models(args, base_dir, target_spec, device)
    saved_dtype = drafter.dtype
    drafter.to(torch.float32)  # LoRA weights and optimizer state in fp32; bf16 via autocast (--bf16)
    gamma = drafter.config.block_size

    prompts = [] if eval_rows is None else [r["input_ids"][: r["prompt_len"]] for r in eval_rows]
    tau_before = _held_out_tau(target, drafter, prompts, args)
    if tau_before is not None:
        print(f"τ before adaptation: {tau_before['tau']:.3f} on {len(prompts)} held-out domain prompts")

    model = add_lora(drafter, r=args.lora_r,
                     alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r,
                     dropout=args.lora_dropout, target_modules=args.target_modules, train_heads=args.train_heads)
    params = trainable_parameter_summary(model)
    print(f"LoRA: {params['trainable']:,} trainable of {params['total']:,} drafter parameters "
          f"({100 * params['fraction']:.2f}%)")

    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    resume = resolve_resume(args.resume, args.output_dir)
    run_ = train_drafter(  # a PeftModel saves adapter_model.safetensors + adapter_config.json only
        model, target, train_rows, output_dir=args.output_dir, block_size=gamma,
        anchors_per_seq=args.anchors_per_seq, pad_id=pad, max_length=args.max_length, seed=args.seed,
        max_steps=args.max_steps, lr=args.lr, warmup_steps=args.warmup_steps, batch_size=args.batch_size,
        grad_accum=args.grad_accum, bf16=args.bf16, use_cpu=use_cpu, save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, logging_steps=args.logging_steps, num_workers=args.num_workers,
        progress=not args.no_progress, resume=resume)

    tau_after = _held_out_tau(target, model, prompts, args)
    if tau_after is not None:
        print(f"τ after adaptation:  {tau_after['tau']:.3f}")
    if run_.trainer.is_world_process_zero():
        merged_dir = _save_merged(model, saved_dtype, args.output_dir) if args.merge else None
        _write_manifest(args, drafter, run_, train_rows, eval_rows, params, resume, tau_before, tau_after, merged_dir)
    return 0


def main(argv=None) -> int:
    return standalone_main("dspark adapt", __doc__, _add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
