"""`dspark train`: train a DSpark drafter for a frozen target with `DSparkTrainer` (docs/training.md).

Standalone: ``python -m dspark.cli.train_cmd --data data/smollm2 --out-dir runs/dspark --max-steps 2000 --dtype
bfloat16`` (the form `accelerate launch -m dspark.cli.train_cmd` runs).
Runs unchanged on CUDA (bf16) and under ``accelerate launch``. Checkpoints (drafter weights + config + optimizer
state) go to ``OUT_DIR/checkpoint-N``; ``--resume`` continues from the latest one. The final drafter is saved
to ``--out-dir`` with ``training_manifest.json``.
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
    add_target_option,
    add_trainer_machine_options,
    check_made_for_target,
    check_min,
    check_out_dir,
    check_target,
    drafter_dir,
    load_data_dir,
    load_target_checked,
    parse_ints,
    reports_cli_errors,
    require_out_dir,
    resolve_device,
    resolve_dtype,
    set_threads,
    silence_progress,
    standalone_main,
    target_of_data,
)


def _source_manifest(drafter_dir: str | None) -> dict | None:
    """The ``training_manifest.json`` of the drafter ``--init-from-drafter`` started from (None: none, or it has
    none)."""
    path = Path(drafter_dir) / "training_manifest.json" if drafter_dir else None
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="one or more directories written by `dspark data build` (or save_to_disk dirs), "
                        "concatenated in the order given (required)")
    add_out_dir_option(p, None, "checkpoints (OUT_DIR/checkpoint-N) and the final drafter; a new run needs a new or "
                                "empty OUT_DIR, a non-empty one is refused unless --resume is given")
    add_hidden_alias(p, "--output-dir", "out_dir")
    add_target_option(p, "the one --data was built with (packaged or a local directory), else SmolLM2-135M-Instruct")
    g = p.add_argument_group("drafter")
    g.add_argument("--block-size", type=int, default=8, help="block size γ: draft slots per round (default: 8)")
    g.add_argument("--sequential-head", choices=["markov", "rnn", "none"], default="markov",
                   help="sequential correction: Markov (docs/method.md eq. 5), RNN (eq. 6) or none = plain DFlash "
                        "(default: markov)")
    g.add_argument("--markov-rank", type=int, default=64, help="rank r of the Markov/RNN head (default: 64)")
    g.add_argument("--num-draft-layers", type=int, default=2, help="decoder layers of the drafter (default: 2)")
    g.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft over the N most frequent response tokens of the data (default: full vocabulary)")
    g.add_argument("--target-layer-ids", default=None, metavar="L1,L2,...",
                   help="comma-separated target layers for the context features (default: spread over the depth)")
    g.add_argument("--mask-token-id", type=int, default=None, metavar="ID",
                   help="token whose embedding E[ID] fills the mask slots, as DeepSpec, DFlash and speculators "
                        "drafters do; needed for `dspark export` (default: a learned mask embedding)")
    g.add_argument("--no-confidence-head", action="store_true",
                   help="drop the confidence head (plain DFlash: combine with --sequential-head none; default: kept)")
    g.add_argument("--init-from-target", nargs="?", const="last", default=None, metavar="LAYER_IDS",
                   help="initialise the draft layers from target layers; without a value the last "
                        "--num-draft-layers (default: random initialisation)")
    g.add_argument("--init-from-drafter", default=None, metavar="DIR",
                   help="start from a trained drafter's weights wherever names and shapes match, e.g. to give it "
                        "Qwen3-style layers and --mask-token-id for export; pass its --block-size, --markov-rank, "
                        "--num-draft-layers and --draft-vocab-size (default: none)")
    l = p.add_argument_group("loss (docs/method.md eqs. 11-14)")
    l.add_argument("--ce-weight", type=float, default=0.1, help="weight of the cross-entropy term (default: 0.1)")
    l.add_argument("--tv-weight", type=float, default=0.9, help="weight of the L1 (TV) term (default: 0.9)")
    l.add_argument("--conf-weight", type=float, default=1.0, help="weight of the confidence term (default: 1.0)")
    l.add_argument("--loss-decay", type=float, default=None,
                   help="position weights w_k = exp(-(k-1)/decay) (default: γ)")
    t = p.add_argument_group("training")
    t.add_argument("--anchors-per-seq", type=int, default=8, help="random anchors (blocks) per sequence (default: 8)")
    t.add_argument("--max-length", type=int, default=2048,
                   help="truncate sequences to this many tokens (default: 2048)")
    t.add_argument("--max-steps", type=int, default=1000, help="optimizer steps (default: 1000)")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate, cosine schedule (default: 6e-4)")
    t.add_argument("--warmup-steps", type=int, default=None, help="learning-rate warm-up (default: 3%% of max-steps)")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0.0)")
    t.add_argument("--batch-size", type=int, default=8, help="sequences per device per step (default: 8)")
    t.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default: 1)")
    t.add_argument("--sampling", choices=["group_by_length", "random"], default="group_by_length",
                   help="batch sampling: group sequences of similar length (less padding) or random "
                        "(default: group_by_length)")
    add_run_options(t, "initialisation and data-order", save_steps=500, keep=3)
    t.add_argument("--feature-cache", default=None, metavar="DIR",
                   help="run the frozen target once over the data, store its features in DIR (resumable; ~7 KB per "
                        "token for SmolLM2) and train from them: no target forward per step. Under `accelerate "
                        "launch` rank 0 builds it while the others wait (at most ddp_timeout, 30 min): build it with "
                        "one process first (default: run the target online every step)")
    add_trainer_machine_options(p)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``train`` on an argparse sub-parser collection."""
    p = subparsers.add_parser("train", help="train a DSpark drafter for a frozen target",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def _machine() -> dict:
    import os
    import platform

    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def load_training_data(paths):
    """The rows ``dspark train`` trains on: the data directories concatenated in order, through ``prepare_dataset``
    (stable ``idx`` per row — what a feature cache is keyed by).

    Raises:
        CLIError: a directory that is missing or holds no data (:func:`dspark.cli.common.load_data_dir`).
    """
    from dspark.training.trainer import prepare_dataset

    if len(paths) == 1:
        return prepare_dataset(load_data_dir(paths[0]))
    from datasets import concatenate_datasets

    parts = [load_data_dir(d) for d in paths]
    keep = [c for c in parts[0].column_names if all(c in d.column_names for d in parts)]
    return prepare_dataset(concatenate_datasets([d.select_columns(keep) for d in parts]))


def _check_args(args) -> tuple[list[int] | None, list[int] | None]:
    """The option values that need no model, checked before any is loaded; returns the parsed
    ``(--target-layer-ids, --init-from-target)`` layer ids (None: the default).

    Raises:
        CLIError: a value out of its range, unparsable layer ids, --init-from-drafter with --init-from-target, a
            missing --target, --data or --init-from-drafter made with another packaged target, a non-empty
            --out-dir without --resume.
    """
    check_min(args, {"block_size": 1, "markov_rank": 1, "num_draft_layers": 1, "draft_vocab_size": 1,
                     "mask_token_id": 0, "anchors_per_seq": 1, "max_length": 2, "max_steps": 1, "warmup_steps": 0,
                     "batch_size": 1, "grad_accum": 1, "seed": 0, "save_steps": 1, "save_total_limit": 1,
                     "logging_steps": 1, "num_workers": 0, "ce_weight": 0, "tv_weight": 0, "conf_weight": 0,
                     "weight_decay": 0})
    check_min(args, {"lr": 0, "loss_decay": 0}, strict=True)
    if args.ce_weight + args.tv_weight + args.conf_weight == 0:
        raise CLIError("--ce-weight, --tv-weight and --conf-weight are all 0: the loss would be 0")
    layer_ids = parse_ints("--target-layer-ids", args.target_layer_ids) if args.target_layer_ids else None
    init_layers = (None if args.init_from_target in (None, "", "last")
                   else parse_ints("--init-from-target", args.init_from_target))
    if args.init_from_drafter is not None and args.init_from_target is not None:
        raise CLIError("--init-from-drafter and --init-from-target both initialise the draft layers: give one")
    args.target = target_of_data(args.target, args.data)
    check_target(args.target)
    for d in args.data:
        check_made_for_target(args.target, "--data", d)
    if args.init_from_drafter is not None:
        given, args.init_from_drafter = args.init_from_drafter, drafter_dir(args.init_from_drafter)
        check_made_for_target(args.target, "--init-from-drafter", args.init_from_drafter, drafter=True, shown=given)
    check_out_dir(args.out_dir, args.resume)
    return layer_ids, init_layers


def _drafter_config(args, target, layer_ids: list[int] | None):
    """The new drafter's :class:`DSparkConfig` for ``target`` from the drafter and loss options, naming the target as
    the other commands find it; options that do not fit this target are a :class:`CLIError`."""
    from modeling_dspark import DSparkConfig
    from modeling_dspark.target import DEFAULT_TARGET, PACKAGED_TARGETS

    extra = {} if layer_ids is None else {"target_layer_ids": layer_ids}
    try:
        cfg = DSparkConfig.from_target_config(
            target.config,
            block_size=args.block_size, sequential_head=args.sequential_head, markov_rank=args.markov_rank,
            num_draft_layers=args.num_draft_layers, use_confidence_head=not args.no_confidence_head,
            ce_weight=args.ce_weight, tv_weight=args.tv_weight, conf_weight=args.conf_weight,
            loss_decay=args.loss_decay, draft_vocab_size=args.draft_vocab_size, mask_token_id=args.mask_token_id,
            **extra,
        )
    except ValueError as err:  # e.g. --mask-token-id or --target-layer-ids outside this target's range
        raise CLIError(f"the drafter options do not fit this target: {err}") from None
    if not cfg.target_name_or_path or args.target is None or args.target in PACKAGED_TARGETS:
        cfg.target_name_or_path = str(args.target or DEFAULT_TARGET)  # a packaged target by name, not its cache path
    elif Path(args.target).is_dir():
        # a local checkpoint by its absolute path, which the other commands accept from any working directory
        cfg.target_name_or_path = str(Path(args.target).resolve())
    return cfg


def _init_weights(args, drafter, target, init_layers: list[int] | None, resume) -> None:
    """Copy ``--init-from-target`` layers, or (a fresh run only) ``--init-from-drafter`` weights, into the new
    drafter, saying what was copied; a source that does not fit is a :class:`CLIError`."""
    from modeling_dspark import DSparkDraftModel
    from dspark.training.trainer import init_from_drafter, init_from_target

    if args.init_from_target is not None:
        try:
            copied = init_from_target(drafter, target, init_layers)
        except ValueError as err:
            raise CLIError(f"--init-from-target: {err}") from None
        print(f"initialised {len(copied)} drafter tensors from target layers {init_layers or 'last'}")
    if args.init_from_drafter is not None and resume is None:
        try:
            copied, kept, dropped = init_from_drafter(drafter, DSparkDraftModel.from_pretrained(args.init_from_drafter))
        except ValueError as err:
            raise CLIError(f"--init-from-drafter {args.init_from_drafter}: {err}") from None
        print(f"initialised {len(copied)} drafter tensors from {args.init_from_drafter}; left at init: "
              f"{', '.join(kept) or 'none'}; dropped: {', '.join(dropped) or 'none'}")


def _write_manifest(args, cfg, run_, data, resume) -> None:
    """Write ``training_manifest.json`` into ``--out-dir`` and print the run's summary."""
    trainer, logs = run_.trainer, run_.logs()
    bps = [h["blocks_per_s"] for h in logs if "blocks_per_s" in h]
    data_manifests = {d: json.loads((Path(d) / "manifest.json").read_text())
                      for d in args.data if (Path(d) / "manifest.json").exists()}
    manifest = {
        "command": "dspark " + " ".join(sys.argv[1:]) if sys.argv else None,
        "args": dict(vars(args)),
        "target": cfg.target_name_or_path,
        "resumed_from": resume,
        "global_step": trainer.state.global_step,
        "sequences": len(data),
        "blocks_seen_approx": trainer.state.global_step * args.batch_size * args.grad_accum
        * args.anchors_per_seq * trainer.args.world_size,
        "wall_s_this_run": round(run_.wall_s, 1),
        "feature_cache": args.feature_cache,
        "feature_cache_wall_s": run_.feature_cache_wall_s,
        "train_metrics": run_.result.metrics,
        "blocks_per_s_mean": round(sum(bps) / len(bps), 2) if bps else None,
        "last_log": logs[-1] if logs else None,
        "init_from_target": args.init_from_target,
        "init_from_drafter": args.init_from_drafter,
        # the source drafter's own manifest, so a drafter's whole training history stays with it
        "init_from_drafter_manifest": _source_manifest(args.init_from_drafter),
        "machine": _machine(),
        "data_manifest": data_manifests.get(args.data[0]) if len(args.data) == 1 else (data_manifests or None),
    }
    (Path(args.output_dir) / "training_manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    print(json.dumps({k: manifest[k] for k in ("global_step", "wall_s_this_run", "blocks_per_s_mean",
                                                "last_log")}, indent=2, default=str))


@reports_cli_errors("dspark train")
def run(args) -> int:
    require_out_dir(args, "dspark train")
    layer_ids, init_layers = _check_args(args)
    silence_progress(args.no_progress)
    import torch
    import transformers

    from modeling_dspark import DSparkDraftModel
    from dspark.training.pipeline import check_resume_config, resolve_resume, train_drafter

    set_threads(args.threads)
    data = load_training_data(args.data)
    args.output_dir = args.out_dir
    device = resolve_device(args.device)
    if device.startswith("cuda:"):  # Trainer places the model on the process's GPU (accelerate launch, one each)
        raise CLIError(f"--device {device}: dspark train picks the GPU itself; give --device cuda and choose the GPU "
                       "with CUDA_VISIBLE_DEVICES")
    args.cpu = device == "cpu"
    args.bf16 = resolve_dtype(args.dtype, "cpu" if args.cpu else "cuda", announce="dspark train",
                              measure=False) == "bfloat16"
    transformers.set_seed(args.seed)
    target, tok = load_target_checked(args.target, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    cfg = _drafter_config(args, target, layer_ids)
    resume = resolve_resume(args.resume, args.output_dir)
    try:
        check_resume_config(resume, cfg)
    except ValueError as err:
        raise CLIError(f"--resume {resume}: {err}") from None
    drafter = DSparkDraftModel(cfg)
    _init_weights(args, drafter, target, init_layers, resume)
    if args.draft_vocab_size and args.init_from_drafter is None:  # else the source's draft vocabulary is kept
        from dspark.training.trainer import select_draft_vocab

        eos = tok.eos_token_id if isinstance(tok.eos_token_id, int) else 0
        drafter.draft_vocab_ids.copy_(select_draft_vocab(data, args.draft_vocab_size, always=[eos]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    run_ = train_drafter(
        drafter, target, data, output_dir=args.output_dir, block_size=args.block_size,
        anchors_per_seq=args.anchors_per_seq, pad_id=pad, max_length=args.max_length, seed=args.seed,
        max_steps=args.max_steps, lr=args.lr, warmup_steps=args.warmup_steps, batch_size=args.batch_size,
        grad_accum=args.grad_accum, bf16=args.bf16, use_cpu=args.cpu or not torch.cuda.is_available(),
        save_steps=args.save_steps, save_total_limit=args.save_total_limit, logging_steps=args.logging_steps,
        num_workers=args.num_workers, progress=not args.no_progress, weight_decay=args.weight_decay,
        sampling=args.sampling, feature_cache=args.feature_cache, target_layer_ids=cfg.target_layer_ids,
        resume=resume)
    if run_.trainer.is_world_process_zero():
        _write_manifest(args, cfg, run_, data, resume)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # under `accelerate launch`: tear the process group down before exit (left to the interpreter's exit, gloo's
        # threads can abort a rank with "terminate called without an active exception" after a finished run)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def main(argv=None) -> int:
    return standalone_main("dspark train", __doc__, _add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
