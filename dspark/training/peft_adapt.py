"""LoRA adaptation of an existing DSpark drafter to a new domain (🤗 ``peft``), through
:class:`~dspark.training.trainer.DSparkTrainer`.

A trained drafter is wrapped with LoRA adapters on its draft layers (attention q/k/v/o and MLP gate/up/down
projections by default); every other drafter weight is frozen. The wrapped model goes to the same
:class:`~dspark.training.trainer.DSparkTrainer` as full training (same loss, same online target features, same
checkpointing — the Trainer saves only the adapter for a ``PeftModel``)::

    drafter = DSparkDraftModel.from_pretrained(path, target=target)
    model = add_lora(drafter, r=8)
    DSparkTrainer(model=model, target=target, args=..., train_dataset=..., data_collator=...).train()
    save_adapter(model, "runs/adapter")               # adapter_model.safetensors + adapter_config.json
    merged = merge_lora(model)                        # a plain DSparkDraftModel (LoRA folded in)

    # later: the adapter on top of the same base drafter
    model = load_adapter(DSparkDraftModel.from_pretrained(path, target=target), "runs/adapter")

``peft`` wraps the drafter in place: after :func:`add_lora` the *base* drafter object holds LoRA layers (active),
so :func:`base_drafter` of the wrapped model is a ``DSparkDraftModel`` that already drafts with the adapter —
that is what ``target.generate(assistant_model=…)`` needs (it checks ``isinstance(…, DSparkDraftModel)``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch

from modeling_dspark.modeling_dspark import DSparkDraftModel

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "HEAD_MODULES",
    "add_lora",
    "base_drafter",
    "is_peft_model",
    "merge_lora",
    "save_adapter",
    "load_adapter",
    "trainable_parameter_summary",
    "greedy_tau",
]

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD_MODULES = ("sequential_head", "confidence_head")
ADAPTER_INFO_FILE = "dspark_adapter.json"


def _require_peft():
    try:
        import peft  # noqa: F401
    except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "LoRA adaptation needs the `peft` package: pip install 'dspark[train]' (or pip install peft)"
        ) from err
    return peft


def is_peft_model(model) -> bool:
    """True for a ``peft.PeftModel`` (or ``PeftMixedModel``)."""
    try:
        from peft import PeftMixedModel, PeftModel
    except ModuleNotFoundError:
        return False
    return isinstance(model, (PeftModel, PeftMixedModel))


def base_drafter(model) -> DSparkDraftModel:
    """The :class:`DSparkDraftModel` inside ``model`` (a drafter, a ``PeftModel``, or a DDP/compile wrapper of one).

    For a ``PeftModel`` this is the base drafter *with its LoRA layers in place* (active unless disabled), i.e. the
    object whose ``correction_logits`` / ``confidence_logits`` / ``config`` the trainer and generation use.

    Raises:
        TypeError: nothing in ``model`` is a DSparkDraftModel.
    """
    seen = 0
    while not isinstance(model, DSparkDraftModel) and seen < 8:
        seen += 1
        if is_peft_model(model):
            model = model.get_base_model()
        elif hasattr(model, "module"):  # DDP / DataParallel
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        else:
            break
    if not isinstance(model, DSparkDraftModel):
        raise TypeError(f"expected a DSparkDraftModel or a PeftModel of one, got {type(model).__name__}")
    return model


def add_lora(
    drafter: DSparkDraftModel,
    r: int = 8,
    alpha: int | float = 16,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str = DEFAULT_TARGET_MODULES,
    train_heads: bool = False,
    layers: Iterable[int] | None = None,
    adapter_name: str = "default",
):
    """Wrap ``drafter`` with LoRA adapters (``peft.get_peft_model``); only the adapters (and optionally the heads)
    train.

    Args:
        drafter: a (trained) :class:`DSparkDraftModel`; it is modified in place (LoRA layers injected) and becomes
            the ``PeftModel``'s base model. Its target binding (shared embedding / LM head) is kept.
        r, alpha, dropout: LoRA rank, scaling numerator (scale = alpha / r) and dropout.
        target_modules: module-name suffixes to adapt (default: all attention and MLP projections of the draft
            layers). Add ``"fc"`` to adapt W_c (eq. 2) too.
        train_heads: also train full copies of the sequential and confidence heads (``modules_to_save``; saved
            with the adapter, the base heads stay untouched).
        layers: only adapt these draft-layer indices (default all).
        adapter_name: the peft adapter name.

    Returns:
        the ``peft.PeftModel``. Pass it as ``model=`` to :class:`~dspark.training.trainer.DSparkTrainer`.

    Raises:
        TypeError: ``drafter`` is not a DSparkDraftModel.
        ValueError: ``r`` < 1, or no module of the drafter matches ``target_modules``.
    """
    _require_peft()
    from peft import get_peft_model

    if not isinstance(drafter, DSparkDraftModel):
        raise TypeError(f"add_lora expects a DSparkDraftModel, got {type(drafter).__name__}")
    if int(r) < 1:
        raise ValueError(f"LoRA rank r must be >= 1, got {r}")
    if isinstance(target_modules, str):
        target_modules = [t.strip() for t in target_modules.split(",") if t.strip()]
    target_modules = list(target_modules)
    names = [n for n, _ in drafter.named_modules()]
    if not any(n.split(".")[-1] in target_modules for n in names):
        raise ValueError(f"no drafter module matches target_modules={target_modules}")
    config = _lora_config(drafter, r, alpha, dropout, target_modules, train_heads, layers)
    # the target's shared embedding / LM head are not submodules of the drafter (held in a plain dict), so peft
    # never sees or wraps them; get_peft_model freezes every base parameter and marks the adapters trainable
    model = get_peft_model(drafter, config, adapter_name=adapter_name)
    return model


def _lora_config(drafter: DSparkDraftModel, r: int, alpha: float, dropout: float, target_modules: list[str],
                 train_heads: bool, layers: Iterable[int] | None):
    """The ``peft.LoraConfig`` of :func:`add_lora` (arguments as there, already checked): adapters on
    ``target_modules`` of the draft layers ``layers`` (all when None), full copies of the drafter's sequential and
    confidence heads with ``train_heads``, no bias, and the drafter's ``name_or_path`` as the base model."""
    from peft import LoraConfig

    modules_to_save = None
    if train_heads:
        modules_to_save = [h for h in HEAD_MODULES if getattr(drafter, h, None) is not None] or None
    layers_to_transform = sorted(int(i) for i in layers) if layers is not None else None
    config = LoraConfig(
        r=int(r),
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=target_modules,
        modules_to_save=modules_to_save,
        layers_to_transform=layers_to_transform,
        layers_pattern="layers" if layers_to_transform is not None else None,
        bias="none",
        task_type=None,  # a custom model: plain PeftModel (forward passes keyword arguments straight through)
    )
    config.base_model_name_or_path = getattr(drafter, "name_or_path", None) or None
    return config


def trainable_parameter_summary(model) -> dict:
    """``{"trainable": n, "total": n, "fraction": f, "names": [...]}`` over the parameters of ``model``."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for p in model.parameters())
    n_tr = sum(p.numel() for _, p in trainable)
    return {"trainable": n_tr, "total": total, "fraction": n_tr / max(total, 1), "names": [n for n, _ in trainable]}


def merge_lora(model, safe_merge: bool = True) -> DSparkDraftModel:
    """Fold the LoRA weights into the base drafter and drop the peft wrappers (``merge_and_unload``).

    Returns a plain :class:`DSparkDraftModel` (same object as the base drafter, still bound to its target) whose
    outputs equal the ``PeftModel``'s; it saves and loads like any drafter (``save_pretrained`` /
    ``DSparkDraftModel.from_pretrained``). With ``train_heads`` the trained head copies replace the base heads.
    """
    if not is_peft_model(model):
        raise TypeError(f"merge_lora expects a peft PeftModel, got {type(model).__name__}")
    merged = model.merge_and_unload(safe_merge=safe_merge)
    merged = base_drafter(merged)
    # peft leaves its config dict on the unwrapped model; a merged drafter is a plain drafter again
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in merged.__dict__:
            delattr(merged, attr)
    for p in merged.parameters():
        p.requires_grad_(True)
    return merged


def save_adapter(model, path: str | os.PathLike, base_drafter_path: str | os.PathLike | None = None) -> Path:
    """Save only the adapter: ``adapter_model.safetensors`` + ``adapter_config.json`` (+ ``dspark_adapter.json``).

    ``dspark_adapter.json`` records the base drafter (``base_drafter_path`` or the drafter's ``name_or_path``), its
    target and block size, so the adapter can be matched to its base later.
    """
    if not is_peft_model(model):
        raise TypeError(f"save_adapter expects a peft PeftModel, got {type(model).__name__}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = base_drafter(model)
    base_path = str(base_drafter_path) if base_drafter_path is not None else (getattr(base, "name_or_path", "") or None)
    for cfg in model.peft_config.values():
        if base_path:
            cfg.base_model_name_or_path = base_path
    model.save_pretrained(str(path), safe_serialization=True)
    write_adapter_info(path, base, base_path)
    return path


def write_adapter_info(path: str | os.PathLike, drafter: DSparkDraftModel, base_path: str | None, **extra) -> None:
    """Write ``dspark_adapter.json`` (base drafter path, target, block size, extra fields) into ``path``."""
    info = {
        "base_drafter": base_path,
        "target_name_or_path": drafter.config.target_name_or_path,
        "block_size": drafter.config.block_size,
        "sequential_head": drafter.config.sequential_head,
        **extra,
    }
    (Path(path) / ADAPTER_INFO_FILE).write_text(json.dumps(info, indent=2, default=str))


def read_adapter_info(path: str | os.PathLike) -> dict:
    """``dspark_adapter.json`` of an adapter directory ({} when absent)."""
    f = Path(path) / ADAPTER_INFO_FILE
    return json.loads(f.read_text()) if f.exists() else {}


def load_adapter(
    drafter: DSparkDraftModel, path: str | os.PathLike, is_trainable: bool = False, adapter_name: str = "default"
):
    """Put a saved adapter on a base drafter: ``peft.PeftModel.from_pretrained(drafter, path)``.

    ``drafter`` must be the base the adapter was trained on (same architecture; normally the same weights).
    Returns the ``PeftModel`` (use :func:`base_drafter` for generation or :func:`merge_lora` for a plain drafter).

    Raises:
        FileNotFoundError: no ``adapter_config.json`` in ``path``.
        TypeError: ``drafter`` is not a DSparkDraftModel.
    """
    _require_peft()
    from peft import PeftModel

    if not isinstance(drafter, DSparkDraftModel):
        raise TypeError(f"load_adapter expects a DSparkDraftModel base, got {type(drafter).__name__}")
    if not (Path(path) / "adapter_config.json").exists():
        raise FileNotFoundError(f"no adapter_config.json in {str(path)!r} (not a peft adapter directory)")
    return PeftModel.from_pretrained(drafter, str(path), adapter_name=adapter_name, is_trainable=is_trainable)


# --------------------------------------------------------------------------- τ on a domain
@torch.no_grad()
def greedy_tau(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    block_size: int | None = None,
    policy: str = "full",
) -> dict:
    """Acceptance length τ (tokens committed per round) of greedy ``target.generate(assistant_model=drafter)``.

    Args:
        target: the target causal LM (DSpark generation is enabled on it here).
        drafter: a DSparkDraftModel or a PeftModel of one (its LoRA layers are active when drafting).
        prompts: prompt token-id lists (e.g. ``input_ids[:prompt_len]`` of held-out domain rows).
        max_new_tokens: generation length per prompt.
        block_size: γ' (default the drafter's block size).
        policy: verify policy (default ``"full"``: the whole block is verified, so τ measures the drafter alone).

    Returns:
        ``{"tau", "rounds", "tokens", "prompts", "per_position_acceptance": [P(slot k accepted | k−1 accepted)]}``
        pooled over all prompts.
    """
    from dspark.generation import collect_stats, dspark_options

    d = base_drafter(drafter)
    was_training = d.training
    d.eval()
    gamma = block_size or d.config.block_size
    reached = [0] * gamma  # rounds in which slot k was drafted and all earlier slots accepted
    accepted = [0] * gamma
    committed = rounds = 0
    device = next(target.parameters()).device
    try:
        for ids in prompts:
            x = torch.tensor([list(ids)], dtype=torch.long, device=device)
            with dspark_options(policy=policy, block_size=gamma, lookup=False), collect_stats() as runs:
                target.generate(x, attention_mask=torch.ones_like(x), assistant_model=d,
                                max_new_tokens=max_new_tokens, do_sample=False)
            for run in runs:
                for rs in run.rounds:
                    rounds += 1
                    committed += rs.committed
                    for k in range(min(rs.drafted, gamma)):
                        reached[k] += 1
                        if k < rs.accepted:
                            accepted[k] += 1
                        else:
                            break
    finally:
        d.train(was_training)
    return {
        "tau": committed / max(rounds, 1),
        "rounds": rounds,
        "tokens": committed,
        "prompts": len(prompts),
        "block_size": gamma,
        "per_position_acceptance": [a / r if r else None for a, r in zip(accepted, reached)],
    }
