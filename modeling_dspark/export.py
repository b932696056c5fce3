"""Write a DSpark drafter in another implementation's checkpoint format (DeepSpec, speculators, DFlash; the formats
are described in :mod:`modeling_dspark.formats`): :func:`check_exportable` says what a format cannot hold before
anything is written, :func:`convert_from_dspark` converts, :func:`export_drafter` writes the directory.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .configuration_dspark import DSparkConfig
from .formats import _HEAD_NAMES, _HEAD_TENSORS

EXPORT_FORMATS = ("deepspec", "speculators", "dflash")
SGLANG_STS_FILE = "sglang_sts.json"  # written next to a DeepSpec export whose STS has temperatures only


def portable_verifier_name(name: str | os.PathLike | None) -> str | None:
    """The verifier (target) name an export writes: a Hub id or a relative path, never this machine's absolute path.

    ``None`` / ``""`` -> ``None``; a packaged target (its name, or the local copy
    :func:`modeling_dspark.target.packaged_target_path` makes) -> its Hub id, e.g.
    ``HuggingFaceTB/SmolLM2-135M-Instruct``;
    a snapshot in a Hugging Face Hub cache (``.../models--ORG--NAME/snapshots/REV``) -> ``ORG/NAME``; any other Hub
    id or relative path is kept as it is.

    Raises:
        ValueError: ``name`` is another absolute (or ``~``) path; the message says to name the verifier instead.
    """
    from .target import PACKAGED_TARGETS, packaged_target_name

    if name is None or str(name) == "":
        return None
    packaged = packaged_target_name(name)
    if packaged is not None:
        return PACKAGED_TARGETS[packaged].hub_id
    name = str(name)
    path = Path(name).expanduser()
    parts = path.parts
    if path.is_absolute() and len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    if path.is_absolute():
        raise ValueError(
            f"the verifier {name!r} is an absolute path of this machine; an export names its verifier by a Hub id "
            "or a relative path: pass verifier_name= (dspark export --verifier-name)"
        )
    return name


def check_exportable(drafter, fmt: str, need_target: bool = True, verifier_name: str | None = None) -> None:
    """Raise ``ValueError`` listing every reason ``drafter`` cannot be written as ``fmt`` (nothing is written).

    A format must reproduce the drafter's drafts exactly in the engine that loads it: Qwen3-style draft layers,
    a real mask token, its slot convention, its heads (vLLM has only the vanilla Markov head) and vocabulary.
    ``need_target=False`` leaves out the checks a bound target answers (:func:`export_needs_target`), so a command
    can refuse before it loads the target. ``verifier_name`` (speculators only, the only format that names its
    verifier; default: the drafter's ``target_name_or_path``) must be portable (:func:`portable_verifier_name`).
    A drafter with its own copies (imported from DeepSpec) written as speculators or DFlash drops them for the
    target's: it must be bound, and the copies must equal the target's.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format={fmt!r} is not one of {EXPORT_FORMATS}")
    c = drafter.config
    bound = getattr(drafter, "_target", None)
    problems = _verifier_problems(c, fmt, verifier_name) + _draft_block_problems(c, fmt)
    problems += _dflash_problems(c) if fmt == "dflash" else _markov_head_problems(c, fmt)
    if need_target and not bound and export_needs_target(c, fmt):
        problems.append(f"{_why_target_needed(c, fmt)}: load the drafter with target=... (or bind_target) first")
    if fmt == "deepspec":
        problems += _deepspec_problems(c)
    if fmt != "deepspec" and c.own_embeddings and bound and not _own_copies_equal_target(drafter, bound):
        # the format drops the drafter's copies and uses the target's table and head: they must be the same
        problems.append("its own embedding / LM-head copies differ from the target's, which this format uses")
    if problems:
        raise ValueError(f"cannot export this drafter as {fmt!r}: " + "; ".join(problems))


def _verifier_problems(c: DSparkConfig, fmt: str, verifier_name: str | None) -> list[str]:
    """Why the verifier name cannot be written: only speculators records one, and it must be portable."""
    problems = []
    if verifier_name is not None and fmt != "speculators":
        problems.append(f"a verifier name is written by the speculators format only; {fmt!r} records no verifier")
    if fmt == "speculators":
        try:
            portable_verifier_name(verifier_name or c.target_name_or_path)
        except ValueError as err:
            problems.append(str(err))
    return problems


def _draft_block_problems(c: DSparkConfig, fmt: str) -> list[str]:
    """What no format (or, for Gemma-style scaling and soft-capping, every format but DFlash) holds: non-Qwen3 draft
    layers, a learned mask embedding, a block-input ``embedding_scale``, ``final_logit_softcapping`` and a
    ``logit_scale``."""
    problems = []
    if c.draft_layer_style != "qwen3":
        problems.append(
            f"its draft layers are {c.draft_layer_style!r}-style (no q/k RMSNorm); every serving format has "
            "Qwen3-style layers (retrain with draft_layer_style='qwen3', the default for new drafters)"
        )
    if c.mask_token_id is None:
        problems.append("it uses a learned mask embedding; the format needs a real mask token id (mask_token_id)")
    if c.embedding_scale != 1.0 and fmt != "dflash":
        problems.append(f"embedding_scale={c.embedding_scale} (Gemma-style scaled block inputs) has no key there")
    if c.final_logit_softcapping is not None and fmt != "dflash":
        problems.append("final_logit_softcapping (Gemma) has no place in this format's Qwen3 drafter")
    if c.logit_scale != 1.0:
        problems.append(f"logit_scale={c.logit_scale} (Granite, Cohere) has no key in any other format")
    return problems


def _dflash_problems(c: DSparkConfig) -> list[str]:
    """What DFlash cannot hold: a predicting anchor slot, a sequential or confidence head, a reduced vocabulary."""
    problems = []
    if c.anchor_predicts:
        problems.append("every slot predicts (anchor_predicts=True); DFlash's anchor slot predicts nothing")
    if c.sequential_head != "none" or c.use_confidence_head:
        problems.append(
            f"it has a {c.sequential_head!r} sequential head / confidence head={c.use_confidence_head}; DFlash "
            "has neither (use --format deepspec or speculators)"
        )
    if c.draft_vocab_size:
        problems.append("it drafts over a reduced vocabulary; DFlash has none (use --format speculators)")
    return problems


def _markov_head_problems(c: DSparkConfig, fmt: str) -> list[str]:
    """What the DeepSpec and speculators formats' heads cannot be (vLLM serves both): a gated or RNN sequential
    head, no Markov head (DeepSpec), or a confidence head that reads the target embedding of x_{k-1}."""
    problems = []
    if c.sequential_head in ("gated", "rnn"):
        problems.append(
            f"its sequential head is {c.sequential_head!r}; vLLM (which serves this format) has only the vanilla "
            "Markov head"
        )
    if c.sequential_head == "none" and fmt == "deepspec":
        problems.append("it has no Markov head; vLLM and SGLang DSpark need markov_rank > 0 (use --format dflash)")
    if c.use_confidence_head and c.confidence_head_with_markov and c.sequential_head == "none":
        problems.append("its confidence head reads the target embedding of x_{k-1}; no format has that input")
    return problems


def _why_target_needed(c: DSparkConfig, fmt: str) -> str:
    """Why writing ``c`` as ``fmt`` needs the target bound (where :func:`export_needs_target` says it does)."""
    if c.own_embeddings:
        return "it drops the drafter's own embedding / LM-head copies for the target's, which must be equal"
    if c.source_format == "specforge":
        return "a SpecForge conversion is written only for a target family it supports (checked when bound)"
    if fmt == "deepspec":
        return "DeepSpec checkpoints hold the target's embedding and LM head"
    return "a reduced-vocabulary speculators checkpoint holds the target's LM-head rows"


def _deepspec_problems(c: DSparkConfig) -> list[str]:
    """What DeepSpec cannot hold: an anchor slot that predicts nothing, a reduced vocabulary."""
    problems = []
    if not c.anchor_predicts:
        problems.append("its anchor slot predicts nothing; DeepSpec's every slot predicts (use --format dflash "
                        "or speculators)")
    if c.draft_vocab_size:
        problems.append("it drafts over a reduced vocabulary; SGLang and DeepSpec load the full vocabulary only "
                        "(use --format speculators)")
    return problems


def _own_copies_equal_target(drafter, bound: dict) -> bool:
    """Whether the drafter's own ``embed_tokens`` [V, H] and ``lm_head`` [N, H] equal the bound target's table and
    LM head (its rows ``draft_vocab_ids`` for a reduced vocabulary), compared in the copies' dtype and device."""
    head = bound["lm_head"].weight
    if drafter.draft_vocab_ids is not None:
        head = head[drafter.draft_vocab_ids.to(head.device)]
    return (torch.equal(drafter.embed_tokens.weight, bound["embed"].weight.to(drafter.embed_tokens.weight))
            and torch.equal(drafter.lm_head.weight, head.to(drafter.lm_head.weight)))


def export_needs_target(config: DSparkConfig, fmt: str) -> bool:
    """Whether writing a drafter with ``config`` as ``fmt`` needs its target bound: a DeepSpec file holds the
    target's embedding and LM head, a reduced-vocabulary speculators file the LM head's rows, and a drafter with its
    own copies written as speculators or DFlash must have copies equal to the target's (those formats use the
    target's). A SpecForge conversion always does: binding checks its target family (SpecForge drafters for Gemma
    targets are refused), which the written file no longer records."""
    if config.own_embeddings:
        return fmt != "deepspec"
    if config.source_format == "specforge":
        return True
    return fmt == "deepspec" or (fmt == "speculators" and bool(config.draft_vocab_size))


def _qwen3_layer_config(c: DSparkConfig) -> dict:
    """The draft layers as a Qwen3 config dict (what every serving format's layers are built from)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_draft_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act=c.hidden_act,
        rms_norm_eps=c.rms_norm_eps,
        attention_bias=c.attention_bias,
        rope_parameters=dict(c.rope_parameters),
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * c.num_draft_layers,
    ).to_dict()


def _heads_out(c: DSparkConfig) -> dict:
    rank = c.markov_rank if c.sequential_head != "none" else 0
    out = {"markov_rank": rank, "enable_confidence_head": bool(c.use_confidence_head)}
    if rank:
        out["markov_head_type"] = _HEAD_NAMES[c.sequential_head]
    if c.use_confidence_head:
        out["confidence_head_with_markov"] = bool(c.confidence_head_with_markov and rank)
    return out


def convert_from_dspark(drafter, fmt: str, verifier_name: str | None = None) -> tuple[dict, dict]:
    """``(config_dict, state_dict)`` of ``drafter`` in format ``fmt`` (see :func:`check_exportable`).

    ``verifier_name``: the speculators format's ``verifier.name_or_path`` (default: the drafter's
    ``target_name_or_path``, made portable by :func:`portable_verifier_name`).

    Raises:
        ValueError: the format cannot hold this drafter (every reason listed).
    """
    check_exportable(drafter, fmt, verifier_name=verifier_name)
    c = drafter.config
    tensors, vocab_ids = _draft_tensors(drafter)
    layer = _qwen3_layer_config(c)
    if fmt == "deepspec":
        tensors.update(_deepspec_embeddings(drafter))
        return _deepspec_config(c, layer), tensors
    if fmt == "dflash":
        return _dflash_config(c, layer), tensors
    if vocab_ids is not None:  # speculators, with a reduced draft vocabulary
        tensors.update(_speculators_vocab_tensors(drafter, vocab_ids))
    return _speculators_config(c, layer, verifier_name), tensors


def _draft_tensors(drafter) -> tuple[dict, torch.Tensor | None]:
    """``(tensors, draft_vocab_ids)``: the drafter's state dict on the CPU under the formats' names (the sequential
    head's renamed; the embedding table, LM head and ``draft_vocab_ids`` left out, each format adds what it holds),
    and its ``draft_vocab_ids`` buffer (int64 [N]) or ``None`` for the full vocabulary."""
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    vocab_ids = state.pop("draft_vocab_ids", None)
    for key in [k for k in state if k.startswith(("embed_tokens.", "lm_head."))]:
        del state[key]
    out = {}
    for key, value in state.items():
        for theirs, ours in _HEAD_TENSORS.items():
            if key.startswith(ours):
                key = theirs + key[len(ours):]
                break
        out[key] = value
    return out, vocab_ids


def _sts_out(c: DSparkConfig) -> dict:
    """The STS temperatures and offsets, as the extra config keys :func:`modeling_dspark.formats.convert_to_dspark`
    reads back."""
    return {"sts_temperatures": list(c.sts_temperatures), "sts_biases": list(c.sts_biases)}


def _deepspec_config(c: DSparkConfig, layer: dict) -> dict:
    """A DeepSpec ``Qwen3DSparkModel`` config: the Qwen3 ``layer`` config plus γ, mask token, layer ids and heads."""
    return {
        **layer,
        "architectures": ["Qwen3DSparkModel"],
        "num_target_layers": c.target_num_hidden_layers,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "target_layer_ids": list(c.target_layer_ids),
        "num_anchors": 512,  # a training setting of DeepSpec's (anchors per sequence); unused at inference
        **_heads_out(c),
        **_sts_out(c),
    }


def _deepspec_embeddings(drafter) -> dict:
    """``embed_tokens.weight`` [V, H] and ``lm_head.weight`` (CPU) a DeepSpec file holds: the drafter's own copies,
    else the bound target's."""
    own = drafter.config.own_embeddings
    embed = drafter.embed_tokens if own else drafter.target_embeddings
    head = drafter.lm_head if own else drafter.target_lm_head
    # the head is copied: with tied word embeddings (SmolLM2, Gemma) it is the table, and safetensors refuses to
    # write two names for one storage
    return {"embed_tokens.weight": embed.weight.detach().cpu().contiguous(),
            "lm_head.weight": head.weight.detach().cpu().clone()}


def _dflash_config(c: DSparkConfig, layer: dict) -> dict:
    """A z-lab ``DFlashDraftModel`` config: B = γ + 1 block slots (the anchor's predicts nothing), and the Gemma
    block-input scale and logit cap where the drafter has them."""
    dflash_config = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                     "block_size": c.block_size + 1}
    if c.embedding_scale != 1.0:
        dflash_config["input_embedding_scale"] = c.embedding_scale
    if c.final_logit_softcapping is not None:
        dflash_config["final_logit_softcapping"] = c.final_logit_softcapping
    return {**layer, "architectures": ["DFlashDraftModel"], "block_size": c.block_size + 1,
            "num_target_layers": c.target_num_hidden_layers, "dflash_config": dflash_config}


def _speculators_config(c: DSparkConfig, layer: dict, verifier_name: str | None) -> dict:
    """A vLLM speculators config: a ``"dspark"`` drafter, or ``"dflash"`` for one with neither sequential nor
    confidence head; aux hidden-state ids are layer ids + 1, the verifier is named portably."""
    kind = "dflash" if c.sequential_head == "none" and not c.use_confidence_head else "dspark"
    config = {
        "speculators_model_type": kind,
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
        "block_size": c.block_size if c.anchor_predicts else c.block_size + 1,
        "target_hidden_size": c.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sample_from_anchor": bool(c.anchor_predicts),
        "num_target_layers": c.target_num_hidden_layers,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": portable_verifier_name(verifier_name or c.target_name_or_path),
                         "architectures": []},
        },
        **_sts_out(c),
    }
    if kind == "dspark":
        config.update(_heads_out(c))
        config.setdefault("markov_head_type", "vanilla")
        config.setdefault("confidence_head_with_markov", False)
    return config


def _speculators_vocab_tensors(drafter, vocab_ids: torch.Tensor) -> dict:
    """A reduced draft vocabulary as speculators stores it: ``d2t`` (int64 [N], target id = draft id + d2t[draft
    id]), ``t2d`` (bool [V], the drafted target ids) and ``lm_head.weight`` [N, H] (the own copy, or the target's
    rows ``vocab_ids``)."""
    c = drafter.config
    ids = vocab_ids.long()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head = drafter.lm_head if c.own_embeddings else drafter.target_lm_head
    weight = head.weight.detach().cpu()
    return {"d2t": ids - torch.arange(c.draft_vocab_size or c.vocab_size, dtype=torch.long),
            "t2d": t2d,
            "lm_head.weight": (weight if c.own_embeddings else weight[ids]).contiguous()}


def check_output_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` as a Path if it is free to write an export into (absent or an empty directory).

    Raises:
        ValueError: ``out_dir`` exists and is not an empty directory.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output {str(out)!r} exists and is not an empty directory")
    return out


def export_drafter(drafter, out_dir: str | os.PathLike, format: str = "deepspec",  # noqa: A002
                   verifier_name: str | None = None) -> Path:
    """Write ``drafter`` to ``out_dir`` as ``config.json`` + ``model.safetensors`` in ``format``.

    ``format``: ``"deepspec"`` (DeepSpec-flat: vLLM ``"method": "dspark"``, SGLang ``DSPARK``),
    ``"speculators"`` (vLLM serves the directory directly) or ``"dflash"`` (z-lab DFlash; vLLM ``"dflash"``).
    STS temperatures and offsets travel as extra config keys (``sts_temperatures``, ``sts_biases``); a DeepSpec
    export whose offsets are all 0 also gets ``sglang_sts.json`` for SGLang's
    ``--speculative-dspark-confidence-sts-path``.
    A reduced draft vocabulary travels as ``d2t`` / ``t2d`` (speculators).
    No config holds an absolute path of this machine: the speculators format names its verifier by
    ``verifier_name`` or the drafter's ``target_name_or_path`` (:func:`portable_verifier_name`).

    A failed export removes the files it wrote (and ``out_dir`` if it created it), so a rerun is not blocked.

    Raises:
        ValueError: the format cannot hold this drafter (every reason listed; nothing written), or ``out_dir``
            exists and is not an empty directory.
        OSError: a file could not be written.
    """
    from safetensors.torch import save_file

    out = check_output_dir(out_dir)
    config, state = convert_from_dspark(drafter, format, verifier_name=verifier_name)
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"config key {key}={value} is not finite")
    c = drafter.config
    files = {"config.json": lambda f: f.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"),
             "model.safetensors": lambda f: save_file(state, str(f), metadata={"format": "pt"})}
    if format == "deepspec" and c.use_confidence_head and any(t != 1.0 for t in c.sts_temperatures) \
            and not any(c.sts_biases):
        # SGLang's --speculative-dspark-confidence-sts-path file (temperatures only: it has no offsets)
        files[SGLANG_STS_FILE] = lambda f: f.write_text(json.dumps({"temperatures": list(c.sts_temperatures)}) + "\n")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        for name, write in files.items():
            write(out / name)
    except BaseException:
        for name in files:
            (out / name).unlink(missing_ok=True)
        if created:
            out.rmdir()
        raise
    return out
