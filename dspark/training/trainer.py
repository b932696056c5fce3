"""Training a DSpark drafter with 🤗 ``Trainer`` (docs/method.md §5).

* :class:`DSparkCollator` pads target-generated sequences and samples several random anchors per sequence (in the
  response part only, never at the last token), deterministically for ``(seed, epoch, example)``.
* :class:`DSparkTrainer` holds the frozen target *outside* the trained model (so it is neither optimised nor
  saved), computes the target's context features and block logits online under ``no_grad`` with the same
  :func:`dspark.generation.features.context_features` used at inference (or reads them from a
  :class:`~dspark.training.feature_cache.FeatureCache` when the batch carries them), runs the drafter on all anchors of
  a batch at once with :func:`modeling_dspark.common.block_attention_mask`, adds the teacher-forced sequential
  correction and the confidence logits, and optimises :func:`dspark.training.losses.dspark_loss` (eqs. 11–14). ce / tv /
  conf / loss are logged separately. Checkpoints hold only the drafter (``model.safetensors`` + ``config.json``).
* :func:`init_from_target` copies target decoder layers into the draft layers where shapes match.
* :func:`init_from_drafter` starts a new drafter from a trained one (e.g. to give it Qwen3-style layers and a mask
  token id, which export needs, without training from scratch).

Alignment (docs/method.md §2): a block whose anchor x_0 is at position p has slots at positions p..p+γ−1; slot i
predicts the token at position p+i+1, so its label is ``input_ids[p+i+1]``, its target distribution is the target's
logit at position p+i, and its teacher-forced previous token is ``input_ids[p+i]``. Slots with p+i+1 ≥ length are
masked out of the loss.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from modeling_dspark.common import block_attention_mask, block_positions, gather_slots, softcap
from modeling_dspark.configuration_dspark import logit_transform
from .losses import dspark_loss, position_weights
from dspark.generation.features import context_features, hidden_state_indices
from modeling_dspark.target import decoder_of

__all__ = ["DSparkCollator", "DSparkTrainer", "init_from_target", "init_from_drafter", "default_init_layer_ids",
           "prepare_dataset"]


# --------------------------------------------------------------------------- data collation
def anchor_range(prompt_len: int, length: int) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of legal anchor positions: response tokens with at least one token after them.

    ``lo = max(prompt_len, 1)`` (the anchor is a committed *response* token; at inference the first anchor is the
    target's first generated token, with the prompt as context), ``hi = length − 1`` (anchor < length − 1, so slot 0
    always has a label). Empty when the response has fewer than 2 tokens.
    """
    return max(int(prompt_len), 1), int(length) - 1


@dataclass
class DSparkCollator:
    """Pad sequences (right padding) and sample ``anchors_per_seq`` random anchors per sequence.

    Each feature is a dict with ``input_ids`` (prompt + response), ``prompt_len`` and optionally ``idx`` (a stable
    example index; otherwise a CRC of the tokens is used). Anchors are drawn without replacement from
    :func:`anchor_range` by ``numpy.random.default_rng([seed, epoch, idx])``, so they depend only on the seed, the
    epoch and the example — not on batch composition, worker count or resumption. Sequences with fewer legal
    anchors than ``anchors_per_seq`` get the rest as invalid anchors (``anchor_valid`` False, masked out).

    Returns a dict of tensors: ``input_ids [B, L]``, ``attention_mask [B, L]``, ``anchor_positions [B, n]`` (sorted),
    ``anchor_valid [B, n]`` bool.
    """

    block_size: int
    anchors_per_seq: int = 8
    pad_token_id: int = 0
    seed: int = 0
    max_length: int | None = None
    epoch: int = 0

    def _rng(self, feature: dict, ids: Sequence[int]) -> np.random.Generator:
        key = feature.get("idx")
        if key is None:
            key = zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes())
        return np.random.default_rng([int(self.seed), int(self.epoch), int(key)])

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = []
        for f in features:
            ids = f["input_ids"]
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            if self.max_length is not None:
                ids = ids[: self.max_length]
            seqs.append(ids)
        bsz, n = len(seqs), int(self.anchors_per_seq)
        anchors = torch.zeros((bsz, n), dtype=torch.long)
        valid = torch.zeros((bsz, n), dtype=torch.bool)
        for b, (f, ids) in enumerate(zip(features, seqs)):
            lo, hi = anchor_range(int(f["prompt_len"]), len(ids))
            count = hi - lo
            if count <= 0:
                seqs[b] = ids[:2]
                continue
            k = min(n, count)
            pick = np.sort(self._rng(f, ids).choice(count, size=k, replace=False)) + lo
            anchors[b, :k] = torch.from_numpy(pick)
            valid[b, :k] = True
            # tokens after the last block's last label are never used (causal target): drop them
            seqs[b] = ids[: int(pick[-1]) + self.block_size + 1]
        width = max(2, max(len(s) for s in seqs))
        input_ids = torch.full((bsz, width), int(self.pad_token_id), dtype=torch.long)
        attention_mask = torch.zeros((bsz, width), dtype=torch.long)
        for b, ids in enumerate(seqs):
            input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[b, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "anchor_positions": anchors,
                "anchor_valid": valid}


def prepare_dataset(dataset, min_response_tokens: int = 2):
    """Add a stable ``idx`` column (deterministic anchors) and a ``length`` column, drop rows with no legal anchor."""
    if "idx" not in dataset.column_names:
        dataset = dataset.add_column("idx", list(range(len(dataset))))
    if "length" not in dataset.column_names:  # for TrainingArguments(group_by_length=True)
        dataset = dataset.add_column("length", [len(x) for x in dataset["input_ids"]])
    return dataset.filter(
        lambda ids, pl: len(ids) - max(pl, 1) >= min_response_tokens, input_columns=["input_ids", "prompt_len"]
    )


class _EpochCallback(TrainerCallback):
    def __init__(self, collator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.collator is not None and hasattr(self.collator, "epoch"):
            self.collator.epoch = int(state.epoch or 0)


# --------------------------------------------------------------------------- trainer
def _check_inputs(model, target, call: dict) -> None:
    """:class:`DSparkTrainer`'s checks of the ``Trainer`` arguments ``call`` (bound by name), and the default
    ``data_collator`` (set in ``call``)."""
    gamma = model.config.block_size
    collator = call.get("data_collator")
    if collator is None:
        text = target.config.get_text_config()
        pad = text.pad_token_id if text.pad_token_id is not None else text.eos_token_id
        collator = call["data_collator"] = DSparkCollator(gamma, pad_token_id=pad if isinstance(pad, int) else 0)
    if not isinstance(collator, DSparkCollator):  # the caller's own collator reads what it reads
        return
    if collator.block_size != gamma:
        raise ValueError(f"data_collator has block_size {collator.block_size}, the drafter {gamma}: its blocks would "
                         "be cut short; give DSparkCollator the drafter's block_size")
    for split in ("train_dataset", "eval_dataset"):
        sets = call.get(split)
        for name, data in (sets.items() if isinstance(sets, dict) else [(split, sets)]):
            columns = getattr(data, "column_names", None)
            if columns is not None and not {"input_ids", "prompt_len"} <= set(columns):
                raise ValueError(f"{name} needs the columns input_ids and prompt_len (prompt + response token ids, "
                                 f"the prompt's length) for DSparkCollator; it has {columns}")


class DSparkTrainer(Trainer):
    """``transformers.Trainer`` for a :class:`~modeling_dspark.DSparkDraftModel` against a frozen target.

    Args:
        model: the drafter (its parameters are the only trainable ones).
        target: the frozen target causal LM. It is put in eval mode, its parameters get ``requires_grad=False``,
            it is moved to ``args.device`` and bound to the drafter (shared embedding / LM head); it is *not* a
            submodule of ``model`` (not optimised, not saved).
        *args, **kwargs: as for ``Trainer`` (``args``, ``train_dataset``, ``data_collator`` …).
            ``args.remove_unused_columns`` is forced to False (the batch is not the drafter's forward signature), and
            ``args.ddp_find_unused_parameters`` defaults to False (the heads run outside the DDP-wrapped forward).
            ``data_collator`` defaults to a :class:`DSparkCollator` of the drafter's block size (pad id: the target's
            pad token, else its EOS token, else 0); its data sets' rows hold ``input_ids`` and ``prompt_len``
            (:func:`prepare_dataset`).

    Raises:
        ValueError: no target; a :class:`DSparkCollator` whose block size differs from the drafter's (its blocks
            would be cut short), or data sets for it without the ``input_ids`` and ``prompt_len`` columns.
    """

    def __init__(self, model=None, *args, target=None, **kwargs):
        if target is None:
            raise ValueError("DSparkTrainer needs the frozen target: DSparkTrainer(model=drafter, target=target, ...)")
        call = inspect.signature(Trainer.__init__).bind(self, model, *args, **kwargs)
        _check_inputs(model, target, call.arguments)
        training_args = call.arguments.get("args")
        if training_args is not None:
            training_args.remove_unused_columns = False
            # the sequential / confidence heads run outside the drafter's forward (on its outputs); with DDP's
            # find_unused_parameters they would be marked ready twice. Every drafter parameter gets a gradient
            # each step, so the static setting is correct.
            if training_args.ddp_find_unused_parameters is None:
                training_args.ddp_find_unused_parameters = False
        target.eval()
        target.requires_grad_(False)
        model.bind_target(target)
        super().__init__(*call.args[1:], **call.kwargs)
        self.target = target.to(self.args.device)
        self._sums: dict[str, dict[str, list[torch.Tensor]]] = {"train": {}, "eval": {}}  # per key [value, weight]s
        self._last_log_time = time.perf_counter()
        self._blocks_since_log = 0
        self.add_callback(_EpochCallback(self.data_collator))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``; a new run (not resumed: a checkpoint restores ``draft_vocab_ids``) warns where a reduced
        draft vocabulary was never chosen from data (still token ids 0..N-1, as initialised)."""
        ids = getattr(self.model, "draft_vocab_ids", None)
        if not resume_from_checkpoint and ids is not None and torch.equal(ids.cpu(), torch.arange(len(ids))):
            warnings.warn(f"the drafter's {len(ids)}-token draft vocabulary is token ids 0..{len(ids) - 1}, as "
                          "initialised: choose it from the data first (drafter.draft_vocab_ids.copy_("
                          "select_draft_vocab(dataset, size)))", stacklevel=2)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ---------------------------------------------------------------- target side (no grad)
    @torch.no_grad()
    def _decoder_pass(self, input_ids, attention_mask, layer_ids):
        """One frozen target forward: context features ``[B, L, m·H]`` and the final (normed) hidden ``[B, L, H]``."""
        target = self.target
        out = decoder_of(target)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=hidden_state_indices(layer_ids),
            use_cache=False,
        )
        return context_features(out.hidden_states, layer_ids), out.last_hidden_state

    @torch.no_grad()
    def target_outputs(self, input_ids, attention_mask, anchor_positions, layer_ids, block_size):
        """Context features ``[B, L, m·H]`` and the target's full logits at the block slots ``[B, n, γ, V]``."""
        feats, last = self._decoder_pass(input_ids, attention_mask, layer_ids)
        logits = self.target.get_output_embeddings()(gather_slots(last, anchor_positions, block_size))
        scale, cap = self._logit_transform
        return feats, softcap(logits, cap, scale)

    @functools.cached_property
    def _logit_transform(self) -> tuple[float, float | None]:
        """The target's logit scale (Granite, Cohere) and soft-capping (Gemma), applied to its LM head's output as
        its own forward does (:func:`~modeling_dspark.configuration_dspark.logit_transform`)."""
        return logit_transform(self.target.config)

    @torch.no_grad()
    def slot_targets(self, drafter, slot_hidden, slot_lse=None):
        """The target's distribution at the block slots, in the drafter's vocabulary.

        Args:
            slot_hidden: ``[B, n, γ, H]`` the target's final normed hidden states at the slots.
            slot_lse: optional ``[B, n, γ]`` logsumexp of the target's full-vocabulary logits there (from a
                :class:`~dspark.training.feature_cache.FeatureCache`); computed here when None.

        Returns:
            ``(logits, lse)``: without a draft vocabulary the full ``[B, n, γ, V]`` logits and None; with one the
            ``[B, n, γ, N]`` logits of the draft columns only and the full-vocabulary ``lse [B, n, γ]`` float32,
            which :func:`~dspark.training.losses.dspark_loss` needs to add the target mass outside them (exact).
        """
        head, (scale, cap) = self.target.get_output_embeddings(), self._logit_transform
        if drafter.draft_vocab_ids is None:
            return softcap(head(slot_hidden.to(head.weight.dtype)), cap, scale), None
        if slot_lse is None:
            full = softcap(head(slot_hidden.to(head.weight.dtype)), cap, scale)
            lse = torch.logsumexp(full.float(), dim=-1)
            return full[..., drafter.draft_vocab_ids.to(full.device)], lse
        weight = drafter._draft_head_weight(head)
        return softcap(torch.nn.functional.linear(slot_hidden.to(weight.dtype), weight), cap, scale), slot_lse.float()

    # ---------------------------------------------------------------- loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The DSpark loss (eqs. 11–14) of the drafter on every anchor block of a :class:`DSparkCollator` batch.

        ce / tv / conf, the top-1 accuracy of slot 1 and the greedy τ on the data are summed for :meth:`log`.

        Raises:
            ValueError: the batch's feature cache holds no target logsumexp at a block slot (other prompt lengths).
        """
        drafter = self.accelerator.unwrap_model(model)
        cfg = drafter.config
        gamma = cfg.block_size
        feats, t_logits, t_lse = self._slot_target_logits(drafter, inputs)
        prev, labels, loss_mask = _block_labels(inputs["input_ids"], inputs["attention_mask"],
                                               inputs["anchor_positions"], inputs["anchor_valid"], gamma)
        if "context_features" in inputs and t_lse is not None and not torch.isfinite(t_lse[loss_mask]).all():
            raise ValueError("the feature cache has no target logsumexp at a block slot of this batch: its rows "
                             "were built with other prompt lengths; rebuild the cache for this data")
        out, draft, conf = _draft_block_logits(model, drafter, inputs, feats, prev)
        target_labels, ce_mask = _draft_vocab_labels(drafter, labels)
        vocab = draft.shape[-1]
        terms = dspark_loss(
            draft.reshape(-1, gamma, vocab),
            t_logits.reshape(-1, gamma, vocab),
            target_labels.reshape(-1, gamma),
            None if conf is None else conf.reshape(-1, gamma),
            position_weights(gamma, cfg.loss_decay, device=draft.device),
            loss_mask.reshape(-1, gamma),
            cfg.ce_weight,
            cfg.tv_weight,
            cfg.conf_weight,
            ce_mask=ce_mask,
            target_lse=None if t_lse is None else t_lse.reshape(-1, gamma),
        )
        stats = _greedy_stats(terms, draft, target_labels, loss_mask, ce_mask, per_position=not model.training)
        self._add_stats(stats, model.training, inputs["anchor_valid"])
        return (terms["loss"], out) if return_outputs else terms["loss"]

    def _slot_target_logits(self, drafter, inputs):
        """The target side of a batch: ``(context features [B, L, m·H], slot logits, lse)`` as
        :meth:`slot_targets` gives them, read from the batch's feature cache (``context_features``, ``slot_hidden``,
        ``slot_lse``) when it carries one, else from a target forward."""
        if "context_features" in inputs:  # from a FeatureCache (CachedFeatureCollator): no target forward
            t_logits, t_lse = self.slot_targets(drafter, inputs["slot_hidden"], inputs["slot_lse"])
            return inputs["context_features"], t_logits, t_lse
        cfg = drafter.config
        feats, last = self._decoder_pass(inputs["input_ids"], inputs["attention_mask"], cfg.target_layer_ids)
        t_logits, t_lse = self.slot_targets(drafter, gather_slots(last, inputs["anchor_positions"], cfg.block_size))
        return feats, t_logits, t_lse

    def _add_stats(self, stats: dict[str, tuple[torch.Tensor, torch.Tensor]], training: bool,
                   anchor_valid: torch.Tensor) -> None:
        """Keep one batch's ``stats`` (:func:`_greedy_stats`) for :meth:`log`, and in training count its valid anchor
        blocks; on the device (a host copy per step would stall a GPU)."""
        acc = self._sums["train" if training else "eval"]
        for k, (value, weight) in stats.items():
            acc.setdefault(k, []).append(torch.stack([value, weight]))
        if training:
            self._blocks_since_log = self._blocks_since_log + anchor_valid.sum()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the mean ce / tv / conf / loss terms (and blocks/s) since the last log to ``logs``."""
        is_eval = any(k.startswith("eval_") for k in logs)
        mode = "eval" if is_eval else "train"
        prefix = "eval_" if is_eval else ""
        kept = self._sums[mode]
        if kept:  # one device-to-host copy of every batch's (value, weight); the weighted means in float64
            rows = iter(torch.cat([torch.stack(v) for v in kept.values()]).tolist())
            for k, batches in kept.items():
                pairs = [next(rows) for _ in batches]
                weight = sum(w for _, w in pairs)
                if weight > 0:  # τ and a_k: only where some batch had a whole block
                    logs[prefix + k] = round(sum(v * w for v, w in pairs) / weight, 5)
        self._sums[mode] = {}
        if not is_eval and "loss" in logs:
            blocks = float(self._blocks_since_log)  # the host copy before the clock is read
            now = time.perf_counter()
            logs["blocks_per_s"] = round(blocks / max(now - self._last_log_time, 1e-9), 2)
            self._blocks_since_log = 0
            self._last_log_time = now
        super().log(logs, start_time)


# --------------------------------------------------------------------------- loss inputs
def _block_labels(input_ids, attention_mask, anchor_positions, anchor_valid, block_size: int):
    """Teacher-forced inputs and labels of every block (alignment in the module docstring).

    Args:
        input_ids, attention_mask: ``[B, L]`` (right padding); anchor_positions, anchor_valid: ``[B, n]``.
        block_size: γ.

    Returns:
        ``(prev, labels, loss_mask)``, each ``[B, n, γ]``: ``prev`` the token before each slot (x_0..x_{γ−1}),
        ``labels`` the token the slot predicts (``input_ids[p+i+1]``, clamped to the row), ``loss_mask`` True where
        that label lies inside the row and the anchor is valid.
    """
    bsz, length = input_ids.shape
    n = anchor_positions.shape[1]
    slot_pos = block_positions(anchor_positions, block_size)  # [B, n, γ]: positions p..p+γ−1
    prev = input_ids.gather(1, slot_pos.clamp(max=length - 1).reshape(bsz, -1)).reshape(bsz, n, block_size)
    labels = input_ids.gather(1, (slot_pos + 1).clamp(max=length - 1).reshape(bsz, -1)).reshape(bsz, n, block_size)
    loss_mask = (slot_pos + 1 < attention_mask.sum(-1)[:, None, None]) & anchor_valid[..., None]
    return prev, labels, loss_mask


def _draft_block_logits(model, drafter, inputs, feats, prev):
    """One drafter forward over every anchor block of a batch, with the teacher-forced heads.

    Args:
        model: the trained model as the Trainer holds it (a DDP / PEFT wrapper or the drafter); drafter: the
            :class:`~modeling_dspark.DSparkDraftModel` inside it. inputs: the batch; feats: its context features
            ``[B, L, m·H]``; prev: ``[B, n, γ]`` the token before each slot (:func:`_block_labels`).

    Returns:
        ``(out, draft, conf)``: the forward's output, the draft logits U_k + B_k (eq. 4) ``[B, n, γ, V]`` (N columns
        with a draft vocabulary), and the confidence logits c_k (eq. 7) ``[B, n, γ]`` or None without that head.
    """
    ids, attn, anchors = inputs["input_ids"], inputs["attention_mask"], inputs["anchor_positions"]
    gamma = drafter.config.block_size
    bsz, length = ids.shape
    ctx_pos = torch.arange(length, device=ids.device).expand(bsz, length)
    mask = block_attention_mask(anchors, ctx_pos, drafter.block_slots(gamma), attn.bool())
    out = model(
        anchor_ids=ids.gather(1, anchors),
        anchor_positions=anchors,
        context_features=feats,
        context_positions=ctx_pos,
        attention_mask=mask,
        num_slots=gamma,
    )
    hidden = out.hidden_states
    draft = out.base_logits
    corr = drafter.correction_logits(prev, hidden)
    if corr is not None:
        draft = draft + corr
    return out, draft, drafter.confidence_logits(prev, hidden)


def _draft_vocab_labels(drafter, labels):
    """The labels ``[B, n, γ]`` as indices into the drafter's output columns, and the CE mask.

    Without a draft vocabulary: ``(labels, None)``. With one (p_d = 0 outside it) the loss works on the N draft
    columns only; the target mass outside them enters the L1 term through the target's lse (exact, eq. 12) and CE
    skips labels outside the set: ``(column indices, 0 for labels outside, ce_mask [B·n, γ] bool)``.
    """
    if drafter.draft_vocab_ids is None:
        return labels, None
    index = drafter.draft_vocab_index(labels.device)
    target_labels = index[labels]
    ce_mask = (target_labels >= 0).reshape(-1, labels.shape[-1])
    return target_labels.clamp(min=0), ce_mask


@torch.no_grad()
def _greedy_stats(terms, draft, target_labels, loss_mask, ce_mask,
                  per_position: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Logged statistics of one batch: the loss terms ce / tv / conf, ``acc_k1`` (top-1 accuracy of slot 1) and
    greedy acceptance on the data (target-greedy responses), where slot k is accepted when slots 1..k match: over
    blocks with all γ labels, survival a_k = P(first k accepted) and ``tau`` = 1 + Σ_k a_k (the bonus token); with
    ``per_position`` also ``a1..aγ``. ``draft`` ``[B, n, γ, V]``; ``target_labels``, ``loss_mask`` ``[B, n, γ]``.

    Each statistic comes as ``(value, weight)``, float32 0-d tensors on the batch's device, so a training step
    copies nothing to the host: the weight is 1, or for ``tau`` and a_k 0 in a batch without a whole block.
    """
    top1 = (draft.argmax(-1) == target_labels) & loss_mask
    if ce_mask is not None:
        top1 &= ce_mask.reshape(top1.shape)
    first = loss_mask[..., 0]
    one = torch.ones((), dtype=torch.float32, device=draft.device)
    stats = {k: (terms[k].detach().float(), one) for k in ("ce", "tv", "conf")}
    stats["acc_k1"] = ((top1[..., 0].sum() / first.sum().clamp_min(1)).float(), one)
    whole = loss_mask.all(-1)  # [B, n]: blocks with all γ labels
    n_whole = whole.sum()
    survival = (top1.long().cumprod(-1) * whole[..., None]).sum(dim=(0, 1)).float() / n_whole.clamp_min(1)  # [γ]
    has_whole = (n_whole > 0).float()
    stats["tau"] = (1.0 + survival.sum(), has_whole)
    if per_position:
        stats.update({f"a{k + 1}": (a, has_whole) for k, a in enumerate(survival.unbind())})
    return stats


# --------------------------------------------------------------------------- initialisation
def select_draft_vocab(dataset, size: int, always: Sequence[int] = ()) -> torch.LongTensor:
    """The ``size`` most frequent token ids among the *response* tokens of ``dataset`` (plus ``always``, e.g. EOS).

    Used to fill ``drafter.draft_vocab_ids`` for ``config.draft_vocab_size`` (a reduced draft vocabulary).
    Returns a sorted ``[size]`` long tensor. Ties are broken by the smaller id (deterministic).
    """
    counts = torch.zeros(max(size, max(always, default=-1) + 1), dtype=torch.float64)
    for row in dataset:
        c = torch.bincount(torch.as_tensor(row["input_ids"][int(row["prompt_len"]):], dtype=torch.long)).double()
        if c.numel() > counts.numel():
            counts = torch.cat([counts, counts.new_zeros(c.numel() - counts.numel())])
        counts[: c.numel()] += c
    counts[list(always)] = float("inf")
    order = torch.argsort(-counts, stable=True)[:size]  # stable: ties keep the smaller id first
    return order.sort().values


def default_init_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The last ``num_draft_layers`` decoder layers of the target."""
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


@torch.no_grad()
def rmsnorm_scale(norm: torch.nn.Module) -> torch.Tensor:
    """The per-channel scale s of a target RMSNorm written as y = s ⊙ x / rms(x), float32 ``[d]``.

    Most families store s as the weight; Gemma 1–3 store s − 1 (their norm multiplies by 1 + weight). Which one is
    found by running the module on a probe input in its own dtype: the candidate closer to its output is taken,
    if it is within a few roundings of that dtype (``4·finfo(dtype).eps`` relative), so a copied norm computes what
    the target's does in fp32, bf16 and fp16 alike.

    Raises:
        ValueError: neither form reproduces the module (not an RMSNorm).
    """
    dtype = norm.weight.dtype
    w = norm.weight.detach().float().cpu()
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    x = torch.randn(4, w.numel(), generator=torch.Generator().manual_seed(0)).to(dtype)
    y = norm(x.to(norm.weight.device)).float().cpu()
    x = x.float()
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    rtol = max(1e-3, 4 * torch.finfo(dtype).eps)
    errors = {i: ((unit * s - y).abs() / (y.abs() + 1e-5)).max().item() for i, s in enumerate((w, 1.0 + w))}
    best = min(errors, key=errors.get)
    if errors[best] > rtol:
        raise ValueError(f"{type(norm).__name__} is not an RMSNorm with a per-channel scale")
    return (w, 1.0 + w)[best]


@torch.no_grad()
def init_from_target(drafter, target, layer_ids: Sequence[int] | None = None,
                     copy_final_norm: bool = True) -> list[str]:
    """Copy target decoder layer ``layer_ids[i]`` into draft layer i wherever parameter names and shapes match.

    The draft layers have the target's shape (norms, q/k/v/o projections, MLP), so normally every layer parameter
    is copied (a norm as the scale it applies: :func:`rmsnorm_scale`); W_c, the mask embedding and the heads keep
    their fresh init. With ``copy_final_norm`` the target's final RMSNorm initialises the drafter's (the shared LM
    head expects a normed state). A drafter with ``own_embeddings`` gets copies of the target's embedding table and
    LM head (the rows ``draft_vocab_ids`` of it: set those first).

    Args:
        layer_ids: target layers to copy, one per draft layer; default the last ``num_draft_layers`` layers.

    Returns:
        names of the drafter parameters that were overwritten.

    Raises:
        ValueError: wrong number of layer ids or an id out of range.
    """
    decoder = decoder_of(target)
    t_layers = decoder.layers
    if layer_ids is None:
        layer_ids = default_init_layer_ids(len(t_layers), len(drafter.layers))
    layer_ids = [int(i) for i in layer_ids]
    if len(layer_ids) != len(drafter.layers) or any(not 0 <= i < len(t_layers) for i in layer_ids):
        raise ValueError(
            f"layer_ids={layer_ids}: need {len(drafter.layers)} ids in [0, {len(t_layers) - 1}]"
        )
    copied = []
    for i, lid in enumerate(layer_ids):
        src = dict(t_layers[lid].named_parameters())
        modules = dict(t_layers[lid].named_modules())
        for name, p in drafter.layers[i].named_parameters():
            if name in src and src[name].shape == p.shape:
                if name.endswith("norm.weight"):  # the scale the target's norm applies (Gemma stores it − 1)
                    p.copy_(rmsnorm_scale(modules[name.rsplit(".", 1)[0]]).to(p.device, p.dtype))
                else:
                    p.copy_(src[name].to(p.dtype))
                copied.append(f"layers.{i}.{name}")
    if copy_final_norm and hasattr(decoder, "norm") and decoder.norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(rmsnorm_scale(decoder.norm).to(drafter.norm.weight.device, drafter.norm.weight.dtype))
        copied.append("norm.weight")
    if drafter.embed_tokens is not None:  # own_embeddings: frozen copies of the target's table and head rows
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head = target.get_output_embeddings().weight
        rows = drafter.draft_vocab_ids
        drafter.lm_head.weight.copy_(head if rows is None else head[rows.to(head.device)])
        copied += ["embed_tokens.weight", "lm_head.weight"]
    return copied


@torch.no_grad()
def init_from_drafter(drafter, source) -> tuple[list[str], list[str], list[str]]:
    """Copy every tensor of the trained drafter ``source`` into ``drafter`` where names and shapes match.

    For continuing training with a changed layout: ``source`` with "target"-style layers and a learned mask
    embedding can seed a drafter with Qwen3-style layers and a ``mask_token_id`` (the layout every serving format
    needs). The new q/k RMSNorms keep their init (weight 1) and the mask embedding is dropped; everything else,
    the draft vocabulary ``draft_vocab_ids`` included, is copied. The STS calibration (``sts_*``) is not: calibrate
    the trained result again.

    Returns:
        ``(copied, kept_init, dropped)``: names copied, names of ``drafter`` left at their init, names of ``source``
        with no place in ``drafter``.

    Raises:
        ValueError: the two drafters belong to different targets (hidden or vocabulary size, target layers) or a
            tensor both have differs in shape (another block size, rank, draft vocabulary size or layer count).
    """
    a, b = drafter.config, source.config
    for key in ("hidden_size", "vocab_size", "target_layer_ids", "target_num_hidden_layers"):
        if getattr(a, key) != getattr(b, key):
            raise ValueError(f"the source drafter has {key}={getattr(b, key)}, this drafter {getattr(a, key)}: "
                             "it was trained for another target or with other target layers")
    src = {**dict(source.named_parameters()), **dict(source.named_buffers())}
    dst = {**dict(drafter.named_parameters()), **dict(drafter.named_buffers())}
    bad = [f"{n} {tuple(src[n].shape)} vs {tuple(t.shape)}" for n, t in dst.items()
           if n in src and src[n].shape != t.shape]
    if bad:
        raise ValueError("tensor shapes differ (pass the source's --block-size, --markov-rank, --num-draft-layers and "
                         "--draft-vocab-size): " + "; ".join(bad))
    copied = []
    for name, t in dst.items():
        if name in src:
            t.copy_(src[name].to(t.device, t.dtype))
            copied.append(name)
    return copied, sorted(set(dst) - set(src)), sorted(set(src) - set(dst))
