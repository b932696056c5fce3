"""One training run of a drafter, as ``dspark train`` and ``dspark adapt`` both run it: the Trainer's arguments, the
collator (the target run online, or its outputs read from a feature cache), training, and saving."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class TrainingRun:
    """What :func:`train_drafter` leaves behind.

    Attributes:
        trainer: the :class:`dspark.training.trainer.DSparkTrainer` (its ``state`` holds the step count and the log).
        result: ``trainer.train()``'s ``TrainOutput`` (``metrics``).
        wall_s: seconds the training loop took (this run; a resumed run counts from the resume).
        feature_cache_wall_s: seconds spent building the feature cache (rounded to 0.1 s), None without one.
    """

    trainer: Any
    result: Any
    wall_s: float
    feature_cache_wall_s: float | None

    def logs(self) -> list[dict]:
        """The trainer's log entries that carry a training loss, in order."""
        return [h for h in self.trainer.state.log_history if "loss" in h]


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint a ``resume`` option names: None for None, the latest ``checkpoint-N`` in ``output_dir`` for
    ``"latest"`` (None, with a message, when there is none), else ``resume`` as given."""
    if resume != "latest":
        return resume or None
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if found is None:
        print(f"no checkpoint in {output_dir}: starting from scratch")
    return found


RESUME_FIELDS = ("hidden_size", "vocab_size", "block_size", "num_draft_layers", "draft_layer_style", "mask_token_id",
                 "sequential_head", "markov_rank", "use_confidence_head", "draft_vocab_size", "target_layer_ids")
"""Drafter fields a checkpoint's weights depend on: resuming with other values would load it partly (the Trainer
loads non-strictly) and train a different drafter without an error."""


def check_resume_config(checkpoint: str | None, cfg) -> None:
    """Refuse to resume ``checkpoint`` (None: no resume, nothing to check) with a drafter config whose
    :data:`RESUME_FIELDS` differ from its own.

    Raises:
        ValueError: the checkpoint has no config.json, or names every differing field with both values.
    """
    if checkpoint is None:
        return
    path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(path):
        raise ValueError("no config.json there (not a dspark train checkpoint)")
    with open(path) as f:
        saved = json.load(f)
    diff = [f"{k}: checkpoint {saved.get(k)!r}, now {getattr(cfg, k)!r}" for k in RESUME_FIELDS
            if saved.get(k) != getattr(cfg, k)]
    if diff:
        raise ValueError("the drafter options differ from the checkpoint's (" + "; ".join(diff)
                         + "); pass the options it was trained with")


def train_drafter(model, target, data, *, output_dir: str, block_size: int, anchors_per_seq: int, pad_id: int,
                  max_length: int | None, seed: int, max_steps: int, lr: float, warmup_steps: int | None,
                  batch_size: int, grad_accum: int, bf16: bool, use_cpu: bool, save_steps: int,
                  save_total_limit: int, logging_steps: int, num_workers: int, progress: bool = True,
                  weight_decay: float | None = None, sampling: str | None = None, feature_cache: str | None = None,
                  target_layer_ids=None, resume: str | None = None) -> TrainingRun:
    """Train ``model`` (a drafter, or a PEFT model of one) on ``data`` against ``target`` and save it to
    ``output_dir``.

    Args:
        model, target: the model to train and the frozen target it drafts for.
        data: the prepared training rows (:func:`dspark.training.trainer.prepare_dataset`).
        block_size, anchors_per_seq, pad_id, max_length, seed: the collator's
            (:class:`dspark.training.trainer.DSparkCollator`).
        max_steps, lr, warmup_steps (None: 3 % of the steps), batch_size, grad_accum, bf16, use_cpu, save_steps,
            save_total_limit, logging_steps, num_workers, weight_decay, sampling (``train_sampling_strategy``):
            ``transformers.TrainingArguments`` (cosine schedule, gradient norm clipped at 1; weight_decay and sampling
            None: the Trainer's defaults).
        progress: show the Trainer's progress bar (and the feature cache's).
        feature_cache: a directory for the target's outputs at ``target_layer_ids``: built (or extended) first by the
            main process, then read instead of running the target every step.
        resume: a checkpoint directory to resume from, or None.

    Returns:
        :class:`TrainingRun`.
    """
    from transformers import TrainingArguments

    from dspark.training.trainer import DSparkCollator, DSparkTrainer

    optional = {"weight_decay": weight_decay, "train_sampling_strategy": sampling}
    targs = TrainingArguments(
        disable_tqdm=not progress,
        output_dir=output_dir, max_steps=max_steps, learning_rate=lr,
        warmup_steps=warmup_steps if warmup_steps is not None else int(0.03 * max_steps),
        lr_scheduler_type="cosine", per_device_train_batch_size=batch_size, gradient_accumulation_steps=grad_accum,
        bf16=bf16, seed=seed, data_seed=seed, save_strategy="steps", save_steps=save_steps,
        save_total_limit=save_total_limit, logging_steps=logging_steps, report_to="none",
        dataloader_num_workers=num_workers, remove_unused_columns=False, use_cpu=use_cpu, max_grad_norm=1.0,
        **{k: v for k, v in optional.items() if v is not None},
    )
    collator = DSparkCollator(block_size, anchors_per_seq, pad_id, seed, max_length)
    cache_wall = None
    if feature_cache:
        from dspark.training.feature_cache import CachedFeatureCollator

        cache, cache_wall = _open_feature_cache(targs, target, data, feature_cache, target_layer_ids, batch_size,
                                                max_length, progress)
        collator = CachedFeatureCollator(block_size, anchors_per_seq, pad_id, seed, max_length, cache=cache)
    trainer = DSparkTrainer(model=model, target=target, args=targs, train_dataset=data, data_collator=collator)
    t0 = time.time()
    result = trainer.train(resume_from_checkpoint=resume)
    wall = time.time() - t0
    trainer.save_model(output_dir)
    return TrainingRun(trainer, result, wall, cache_wall)


def _open_feature_cache(targs, target, data, feature_cache: str, target_layer_ids, batch_size: int,
                        max_length: int | None, progress: bool):
    """Build (or resume, or extend) the feature cache of ``target`` at ``target_layer_ids`` for ``data`` in the
    directory ``feature_cache`` — on the main process (``targs.process_index == 0``, target moved to ``targs.device``)
    while the others wait — then open it.

    Returns:
        ``(cache, wall_s)``: the :class:`dspark.training.feature_cache.FeatureCache`, checked against the target, and
        the seconds the build step took (rounded to 0.1 s).
    """
    from dspark.training.feature_cache import FeatureCache, build_feature_cache

    t_cache = time.time()
    with targs.main_process_first(desc="feature cache"):
        if targs.process_index == 0:
            target.to(targs.device)
            build_feature_cache(data, target, target_layer_ids, feature_cache, batch_size=batch_size,
                                max_length=max_length, progress=progress)
    cache_wall = round(time.time() - t_cache, 1)
    cache = FeatureCache(feature_cache, target_layer_ids, target.config.hidden_size, target=target)
    return cache, cache_wall
