"""Other implementations' drafter checkpoints: detect the format, convert to and from DSpark's own.

Formats (``config.json`` decides; docs/serving.md shows where each is used):

- ``"dspark"``: this library's own (``model_type: "dspark"``).
- ``"deepspec"``: DeepSpec's ``Qwen3DSparkModel`` ("DeepSpec-flat"; what vLLM ``"method": "dspark"`` and SGLang
  ``DSPARK`` load): the target's config with ``block_size`` (γ, every slot predicts), ``mask_token_id``,
  ``target_layer_ids``, ``markov_rank`` / ``markov_head_type``, ``enable_confidence_head`` /
  ``confidence_head_with_markov``; the drafter's own frozen copies ``embed_tokens`` / ``lm_head``.
- ``"dflash"``: z-lab DFlash (``DFlashDraftModel`` + ``dflash_config``): ``block_size`` B slots, the anchor's slot
  predicts nothing (γ = B − 1), no sequential or confidence head, the target's embedding and LM head.
- ``"specforge"``: SpecForge DSpark (``dflash_config.projector_type: "dspark"``): DFlash's slot convention plus
  ``markov_head`` / ``confidence_head``; never a scaled block input or soft-capped logits (so Gemma targets,
  whose embedding layer SpecForge calls, are refused when the target is given).
- ``"speculators"``: vLLM speculators (``speculators_model_type: "dspark" | "dflash"``): a nested
  ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` (= layer id + 1), ``sample_from_anchor`` (True =
  every slot predicts), a reduced draft vocabulary as ``d2t`` (target id = draft id + d2t[draft id]) / ``t2d``.

Tensor names map one to one (``layers.*``, ``fc``, ``hidden_norm``, ``norm``, ``confidence_head.proj``); the
sequential head is ``markov_head.{markov_w1, markov_w2, gate_proj, joint_proj}`` there and
``sequential_head.{embed, out, gate_proj, gates}`` here. Every conversion either reproduces the source drafter's
drafts exactly or raises ``ValueError`` naming what the target format cannot hold, before anything is written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from transformers import AutoConfig

from .configuration_dspark import DEFAULT_MARKOV_RANK, DSparkConfig

FORMATS = ("dspark", "deepspec", "dflash", "specforge", "speculators")
EXPORT_FORMATS = ("deepspec", "speculators", "dflash")
SGLANG_STS_FILE = "sglang_sts.json"  # written next to a DeepSpec export whose STS has temperatures only

# DeepSpec / SpecForge / speculators `markov_head_type` <-> DSparkConfig.sequential_head
_HEAD_TYPES = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}
_HEAD_NAMES = {v: k for k, v in _HEAD_TYPES.items()}
# their sequential-head tensor names <-> ours (prefix of everything else is shared)
_HEAD_TENSORS = {
    "markov_head.markov_w1.": "sequential_head.embed.",
    "markov_head.markov_w2.": "sequential_head.out.",
    "markov_head.gate_proj.": "sequential_head.gate_proj.",
    "markov_head.joint_proj.": "sequential_head.gates.",
}


# ---------------------------------------------------------------------------------------------------- detection
def detect_format(config: dict) -> str:
    """The format of a drafter's ``config.json`` (a dict): one of :data:`FORMATS`.

    Raises:
        ValueError: the config matches no supported format, or a known variant this library cannot run
            (Gemma-4 DeepSpec layers, DFlash2, other speculators algorithms), naming the keys it read.
    """
    if not isinstance(config, dict):
        raise ValueError(f"a drafter config must be a JSON object, got {type(config).__name__}")
    archs = list(config.get("architectures") or [])
    if config.get("model_type") == "dspark":
        return "dspark"
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind not in ("dspark", "dflash"):
            raise ValueError(
                f"speculators_model_type={kind!r}: only the speculators 'dspark' and 'dflash' drafters load here"
            )
        return "speculators"
    if "Gemma4DSparkModel" in archs:
        raise ValueError(
            "architectures=['Gemma4DSparkModel']: DeepSpec's Gemma-4 draft layers (Gemma-4 attention, not "
            "Qwen3-style) are not supported; Qwen3DSparkModel checkpoints are"
        )
    if "Qwen3DSparkModel" in archs:
        return "deepspec"
    if "DFlash2DraftModel" in archs:
        raise ValueError(
            "architectures=['DFlash2DraftModel']: DFlash2 (convolutions, candidate selector) is not supported"
        )
    dflash_config = config.get("dflash_config")
    if isinstance(dflash_config, dict):
        return "specforge" if dflash_config.get("projector_type") == "dspark" else "dflash"
    if "DFlashDraftModel" in archs:
        return "dflash"
    raise ValueError(
        "unrecognised drafter config: expected model_type 'dspark', speculators_model_type, architectures "
        f"['Qwen3DSparkModel'] or ['DFlashDraftModel'], or a dflash_config; got model_type="
        f"{config.get('model_type')!r}, architectures={archs}"
    )


def read_json(file: str | os.PathLike) -> dict:
    """The JSON object in ``file`` (a drafter's ``config.json`` or a sharded weights index).

    Raises:
        OSError: ``file`` is not valid JSON or not a JSON object (the message names the file and the position).
    """
    file = Path(file)
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise OSError(f"{str(file)!r} is not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise OSError(f"{str(file)!r} holds a JSON {type(obj).__name__}, expected an object")
    return obj


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` file(s) in directory ``path`` (a sharded index is followed).

    Raises:
        OSError: no safetensors weights in ``path`` (a ``pytorch_model.bin`` is named as such), or a corrupt file.
    """
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
    else:
        files = sorted(f.name for f in path.glob("*.safetensors"))
    if not files:
        bins = sorted(f.name for f in path.glob("*.bin"))
        extra = f" (found {bins}: convert them to safetensors)" if bins else ""
        raise OSError(f"no safetensors weights in drafter directory {str(path)!r}{extra}")
    state = {}
    for name in files:
        try:
            state.update(load_file(str(path / name)))
        except Exception as err:  # safetensors raises its own error type for a corrupt header / body
            raise OSError(f"corrupt safetensors file {str(path / name)!r}: {type(err).__name__}: {err}") from err
    return state


def load_config_and_state(path: str | os.PathLike, target_config=None) -> tuple[DSparkConfig, dict]:
    """Read a local drafter directory of any format in :data:`FORMATS` as DSpark's config and state dict.

    Args:
        path: a directory with ``config.json`` and safetensors weights.
        target_config: optional config of the target the drafter will draft for. It names the target family
            (DFlash, SpecForge and speculators configs say ``"qwen3"`` whatever the target) and is checked
            against the drafter (vocabulary size, number of layers).

    Returns:
        ``(config, state_dict)``; the state dict's keys are exactly those of
        :class:`~modeling_dspark.modeling_dspark.DSparkDraftModel` for ``config``.

    Raises:
        OSError: no ``config.json`` or no weights. ValueError: an unsupported format or convention (named).
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise OSError(f"no config.json in drafter directory {str(path)!r}")
    config = read_json(cfg_file)
    fmt = detect_format(config)
    state = read_state_dict(path)
    if fmt == "dspark":
        return DSparkConfig.from_pretrained(str(path)), state
    return convert_to_dspark(fmt, config, state, target_config)


# ---------------------------------------------------------------------------------------------------- import
def _layer_fields(layer_config: dict, where: str) -> dict:
    """DSparkConfig's draft-layer fields from a Qwen3-style layer config dict (RoPE keys normalised by
    transformers). Raises ValueError for sliding-window or causal draft layers."""
    model_type = layer_config.get("model_type") or "qwen3"
    # speculators copies the verifier's layer_types (one per TARGET layer) next to the draft's num_hidden_layers
    types = set(layer_config.get("layer_types") or ["full_attention"])
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in layer_config.items()
                                              if k not in ("model_type", "layer_types")})
    if types != {"full_attention"} or layer_config.get("is_causal"):
        raise ValueError(
            f"{where}: draft layers with layer_types={sorted(types)} / is_causal={layer_config.get('is_causal')} "
            "are not supported (only bidirectional full-attention blocks)"
        )
    rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4})
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        hidden_act=getattr(cfg, "hidden_act", "silu"),
        rms_norm_eps=cfg.rms_norm_eps,
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        mlp_bias=False,  # Qwen3's MLP has no bias
        rope_parameters=rope,
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 8192),
        num_draft_layers=cfg.num_hidden_layers,
        target_model_type=model_type,
        draft_layer_style="qwen3",
    )


def _dflash_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default ``target_layer_ids`` when a config has none (z-lab's and SpecForge's rule)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _heads(markov_rank, head_type, confidence, with_markov, where: str) -> dict:
    rank = int(markov_rank or 0)
    if rank > 0 and str(head_type).lower() not in _HEAD_TYPES:
        raise ValueError(f"{where}: markov_head_type={head_type!r} is not one of {sorted(_HEAD_TYPES)}")
    if confidence and with_markov and rank == 0:
        raise ValueError(f"{where}: confidence_head_with_markov needs markov_rank > 0")
    return dict(
        sequential_head=_HEAD_TYPES[str(head_type).lower()] if rank > 0 else "none",
        markov_rank=rank if rank > 0 else DEFAULT_MARKOV_RANK,
        use_confidence_head=bool(confidence),
        confidence_head_with_markov=bool(confidence and with_markov),
    )


def _sts(config: dict, block_size: int, where: str) -> dict:
    """STS temperatures / offsets carried as extra config keys (written by :func:`export_drafter`).

    Raises:
        ValueError: a key present that is not a list of ``block_size`` numbers (one per drafted position).
    """
    out = {}
    for key in ("sts_temperatures", "sts_biases"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) != block_size:
            raise ValueError(f"{where}: {key} must be a list of {block_size} numbers (one per drafted position), "
                             f"got {value!r}")
        out[key] = [float(x) for x in value]
    return out


def _rename_in(state: dict, where: str) -> dict:
    """Their tensor names -> ours: the sequential head's; a uniform ``model.`` prefix and SpecForge's legacy
    ``logit_head.`` container are dropped."""
    if state and all(k.startswith("model.") for k in state):
        state = {k[len("model."):]: v for k, v in state.items()}
    out = {}
    for key, value in state.items():
        if key.startswith("logit_head."):
            key = key[len("logit_head."):]
        if key.startswith(("prefix_gru.", "embed_proj.")):
            raise ValueError(f"{where}: tensor {key!r} belongs to a Domino head, which is not supported")
        for theirs, ours in _HEAD_TENSORS.items():
            if key.startswith(theirs):
                key = ours + key[len(theirs):]
                break
        out[key] = value
    return out


def convert_to_dspark(fmt: str, config: dict, state: dict, target_config=None) -> tuple[DSparkConfig, dict]:
    """Convert a ``fmt`` checkpoint (its ``config.json`` dict and state dict) to DSpark's config and state dict.

    The result drafts exactly what the source implementation drafts: slot convention, mask token, layer ids,
    heads and vocabulary are carried over field by field (see the module doc).

    Raises:
        ValueError: an unknown ``fmt``, a convention DSpark cannot reproduce, or a mismatch with ``target_config``.
    """
    where = f"{fmt} drafter config"
    if fmt == "deepspec":
        fields = _layer_fields(config, where)
        gamma = int(config["block_size"])
        confidence = bool(config.get("enable_confidence_head", False))
        fields.update(
            _heads(config.get("markov_rank", 0), config.get("markov_head_type", "vanilla"), confidence,
                   config.get("confidence_head_with_markov", False), where),
            block_size=gamma,
            anchor_predicts=True,
            mask_token_id=int(config["mask_token_id"]),
            target_layer_ids=[int(i) for i in config["target_layer_ids"]],
            target_num_hidden_layers=int(config["num_target_layers"]),
            # DeepSpec saves frozen copies of the target's table and head; vLLM also loads files without them
            own_embeddings="embed_tokens.weight" in state and "lm_head.weight" in state,
            final_logit_softcapping=None,  # Qwen3DSparkModel.compute_logits never soft-caps
            **_sts(config, gamma, where),
        )
        if config.get("draft_vocab_size") not in (None, fields["vocab_size"]):
            # vLLM's extension of the layout: lm_head / markov_w2 over the draft vocabulary, d2t as a tensor
            fields["draft_vocab_size"] = int(config["draft_vocab_size"])
    elif fmt in ("dflash", "specforge"):
        dc = dict(config.get("dflash_config") or {})
        fields = _layer_fields({k: v for k, v in config.items() if k != "dflash_config"}, where)
        if float(dc.get("output_multiplier", config.get("output_multiplier", 1.0))) != 1.0:
            raise ValueError(f"{where}: output_multiplier != 1 is not supported")
        if int(dc.get("pure_draft_prefix_len", 0) or 0) != 0 or dc.get("shift_label") or dc.get("causal"):
            raise ValueError(
                f"{where}: pure_draft_prefix_len / shift_label / causal draft blocks are not supported "
                f"(got {[k for k in ('pure_draft_prefix_len', 'shift_label', 'causal') if dc.get(k)]})"
            )
        slots = int(dc.get("block_size", config.get("block_size", 16)))
        if slots < 2:
            raise ValueError(f"{where}: block_size={slots} leaves no draft slot (the anchor's slot predicts nothing)")
        if fmt == "dflash":  # z-lab DFlash reads these from dflash_config, else from the top level
            dc.update({k: dc.get(k, config.get(k)) for k in ("mask_token_id", "target_layer_ids")})
        if dc.get("mask_token_id") is None:
            raise ValueError(f"{where}: no mask_token_id (dflash_config or, for DFlash, the top level)")
        n_layers = fields["num_draft_layers"]
        layer_ids = dc.get("target_layer_ids") or _dflash_layer_ids(int(config["num_target_layers"]), n_layers)
        if fmt == "specforge":
            confidence = dc.get("enable_confidence_head",
                                dc.get("use_confidence_head", float(dc.get("confidence_head_alpha", 0) or 0) > 0))
            heads = _heads(dc.get("markov_rank", 0), dc.get("markov_head_type", "vanilla"), confidence,
                           dc.get("confidence_head_with_markov", False), where)
        else:
            heads = _heads(0, "vanilla", False, False, where)
        # DFlash scales the block inputs and soft-caps as its config says; SpecForge never does either
        cap = dc.get("final_logit_softcapping", config.get("final_logit_softcapping")) if fmt == "dflash" else None
        scale = dc.get("input_embedding_scale", config.get("input_embedding_scale", 1.0)) if fmt == "dflash" else 1.0
        fields.update(
            heads,
            block_size=slots - 1,
            anchor_predicts=False,
            mask_token_id=int(dc["mask_token_id"]),
            target_layer_ids=[int(i) for i in layer_ids],
            target_num_hidden_layers=int(config["num_target_layers"]),
            own_embeddings=False,
            embedding_scale=float(scale),
            final_logit_softcapping=None if cap is None or float(cap) <= 0 else float(cap),
            **_sts(config, slots - 1, where),
        )
    elif fmt == "speculators":
        kind = config["speculators_model_type"]
        fields = _layer_fields(dict(config["transformer_layer_config"]), where)
        anchor = bool(config.get("sample_from_anchor", kind == "dspark"))
        slots = int(config.get("block_size", 8))
        gamma = slots if anchor else slots - 1
        if config.get("sliding_window_non_causal"):
            raise ValueError(f"{where}: sliding_window_non_causal is not supported")
        if config.get("target_hidden_size") not in (None, fields["hidden_size"]):
            raise ValueError(f"{where}: target_hidden_size != the draft hidden size is not supported")
        if config.get("mask_token_id") is None:
            raise ValueError(f"{where}: no mask_token_id")
        if kind == "dspark" and not anchor and int(config.get("markov_rank", 256) or 0) > 0 \
                and config.get("markov_head_type") == "rnn":
            raise ValueError(
                f"{where}: an RNN head with sample_from_anchor=false is not supported (speculators runs its state "
                "through the anchor's slot, which predicts nothing; dspark's and SpecForge's state starts at slot 1)"
            )
        if kind == "dspark":
            heads = _heads(config.get("markov_rank", 256), config.get("markov_head_type", "vanilla"),
                           config.get("enable_confidence_head", True),
                           config.get("confidence_head_with_markov", True), where)
        else:
            heads = _heads(0, "vanilla", False, False, where)
        n_draft = int(config.get("draft_vocab_size") or fields["vocab_size"])
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
        fields.update(
            heads,
            block_size=gamma,
            anchor_predicts=anchor,
            mask_token_id=int(config["mask_token_id"]),
            target_layer_ids=[int(i) - 1 for i in config["aux_hidden_state_layer_ids"]],
            own_embeddings=False,
            draft_vocab_size=n_draft if n_draft != fields["vocab_size"] else None,
            target_name_or_path=verifier,
            **_sts(config, gamma, where),
        )
        if "num_target_layers" in config:
            fields["target_num_hidden_layers"] = int(config["num_target_layers"])
    else:
        raise ValueError(f"cannot convert format {fmt!r}; one of {FORMATS[1:]}")

    if target_config is not None:
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        if tc.vocab_size != fields["vocab_size"]:
            raise ValueError(
                f"{where}: the drafter's vocabulary has {fields['vocab_size']} ids, the target's {tc.vocab_size}"
            )
        if "target_num_hidden_layers" in fields and fields["target_num_hidden_layers"] != tc.num_hidden_layers:
            raise ValueError(
                f"{where}: the drafter was made for a target with {fields['target_num_hidden_layers']} layers, "
                f"this target has {tc.num_hidden_layers}"
            )
        fields["target_num_hidden_layers"] = tc.num_hidden_layers
        fields["target_model_type"] = tc.model_type
        fields["target_name_or_path"] = fields.get("target_name_or_path") or getattr(tc, "_name_or_path", "")
    elif "target_num_hidden_layers" not in fields:
        raise ValueError(f"{where}: the number of target layers is not in the config; pass target_config")
    dspark_config = DSparkConfig(**fields, source_format=fmt)
    return dspark_config, _state_to_dspark(fmt, config, state, dspark_config, where)


def _state_to_dspark(fmt: str, config: dict, state: dict, dc: DSparkConfig, where: str) -> dict:
    state = _rename_in(state, where)
    drop = ("rotary_emb.", "verifier_lm_head.", "verifier_norm.", "t2d", "mask_embedding")
    if not dc.own_embeddings:  # the target's table and head (a reduced-vocabulary lm_head holds the target's rows)
        drop = drop + ("embed_tokens.", "lm_head.")
    if fmt == "speculators" or (fmt == "deepspec" and dc.draft_vocab_size):
        d2t = state.pop("d2t", None)
        if dc.draft_vocab_size:
            if d2t is None or d2t.numel() != dc.draft_vocab_size:
                raise ValueError(f"{where}: draft_vocab_size={dc.draft_vocab_size} needs a d2t tensor of that size")
            # d2t holds offsets: target id = draft id + d2t[draft id]
            state["draft_vocab_ids"] = torch.arange(dc.draft_vocab_size, dtype=torch.long) + d2t.long()
    return {k: v for k, v in state.items() if not k.startswith(drop)}


# ---------------------------------------------------------------------------------------------------- export
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
    problems = []
    if verifier_name is not None and fmt != "speculators":
        problems.append(f"a verifier name is written by the speculators format only; {fmt!r} records no verifier")
    if fmt == "speculators":
        try:
            portable_verifier_name(verifier_name or c.target_name_or_path)
        except ValueError as err:
            problems.append(str(err))
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
    if fmt == "dflash":
        if c.anchor_predicts:
            problems.append("every slot predicts (anchor_predicts=True); DFlash's anchor slot predicts nothing")
        if c.sequential_head != "none" or c.use_confidence_head:
            problems.append(
                f"it has a {c.sequential_head!r} sequential head / confidence head={c.use_confidence_head}; DFlash "
                "has neither (use --format deepspec or speculators)"
            )
        if c.draft_vocab_size:
            problems.append("it drafts over a reduced vocabulary; DFlash has none (use --format speculators)")
    else:
        if c.sequential_head in ("gated", "rnn"):
            problems.append(
                f"its sequential head is {c.sequential_head!r}; vLLM (which serves this format) has only the vanilla "
                "Markov head"
            )
        if c.sequential_head == "none" and fmt == "deepspec":
            problems.append("it has no Markov head; vLLM and SGLang DSpark need markov_rank > 0 (use --format dflash)")
        if c.use_confidence_head and c.confidence_head_with_markov and c.sequential_head == "none":
            problems.append("its confidence head reads the target embedding of x_{k-1}; no format has that input")
    bound = getattr(drafter, "_target", None)
    if need_target and not bound and export_needs_target(c, fmt):
        if c.own_embeddings:
            why = "it drops the drafter's own embedding / LM-head copies for the target's, which must be equal"
        elif c.source_format == "specforge":
            why = "a SpecForge conversion is written only for a target family it supports (checked when bound)"
        elif fmt == "deepspec":
            why = "DeepSpec checkpoints hold the target's embedding and LM head"
        else:
            why = "a reduced-vocabulary speculators checkpoint holds the target's LM-head rows"
        problems.append(f"{why}: load the drafter with target=... (or bind_target) first")
    if fmt == "deepspec":
        if not c.anchor_predicts:
            problems.append("its anchor slot predicts nothing; DeepSpec's every slot predicts (use --format dflash "
                            "or speculators)")
        if c.draft_vocab_size:
            problems.append("it drafts over a reduced vocabulary; SGLang and DeepSpec load the full vocabulary only "
                            "(use --format speculators)")
    if fmt != "deepspec" and c.own_embeddings and bound:
        # the format drops the drafter's copies and uses the target's table and head: they must be the same
        head = bound["lm_head"].weight
        if drafter.draft_vocab_ids is not None:
            head = head[drafter.draft_vocab_ids.to(head.device)]
        if not (torch.equal(drafter.embed_tokens.weight, bound["embed"].weight.to(drafter.embed_tokens.weight))
                and torch.equal(drafter.lm_head.weight, head.to(drafter.lm_head.weight))):
            problems.append("its own embedding / LM-head copies differ from the target's, which this format uses")
    if problems:
        raise ValueError(f"cannot export this drafter as {fmt!r}: " + "; ".join(problems))


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
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    vocab_ids = state.pop("draft_vocab_ids", None)
    for key in [k for k in state if k.startswith(("embed_tokens.", "lm_head."))]:
        del state[key]  # re-added below where the format holds them
    out = {}
    for key, value in state.items():
        for theirs, ours in _HEAD_TENSORS.items():
            if key.startswith(ours):
                key = theirs + key[len(ours):]
                break
        out[key] = value
    layer = _qwen3_layer_config(c)
    sts = {"sts_temperatures": list(c.sts_temperatures), "sts_biases": list(c.sts_biases)}
    if fmt == "deepspec":
        embed = drafter.embed_tokens if c.own_embeddings else drafter.target_embeddings
        head = drafter.lm_head if c.own_embeddings else drafter.target_lm_head
        out["embed_tokens.weight"] = embed.weight.detach().cpu().contiguous()
        # a copy: with tied word embeddings (SmolLM2, Gemma) the head is the table, and safetensors refuses to
        # write two names for one storage
        out["lm_head.weight"] = head.weight.detach().cpu().clone()
        config = {
            **layer,
            "architectures": ["Qwen3DSparkModel"],
            "num_target_layers": c.target_num_hidden_layers,
            "block_size": c.block_size,
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": list(c.target_layer_ids),
            "num_anchors": 512,  # a training setting of DeepSpec's (anchors per sequence); unused at inference
            **_heads_out(c),
            **sts,
        }
        return config, out
    if fmt == "dflash":
        dflash_config = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                         "block_size": c.block_size + 1}
        if c.embedding_scale != 1.0:
            dflash_config["input_embedding_scale"] = c.embedding_scale
        if c.final_logit_softcapping is not None:
            dflash_config["final_logit_softcapping"] = c.final_logit_softcapping
        config = {**layer, "architectures": ["DFlashDraftModel"], "block_size": c.block_size + 1,
                  "num_target_layers": c.target_num_hidden_layers, "dflash_config": dflash_config}
        return config, out
    # speculators
    kind = "dflash" if c.sequential_head == "none" and not c.use_confidence_head else "dspark"
    n_draft = c.draft_vocab_size or c.vocab_size
    if vocab_ids is not None:
        ids = vocab_ids.long()
        out["d2t"] = ids - torch.arange(n_draft, dtype=torch.long)  # target id = draft id + d2t[draft id]
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
        head = drafter.lm_head if c.own_embeddings else drafter.target_lm_head
        weight = head.weight.detach().cpu()
        out["lm_head.weight"] = (weight if c.own_embeddings else weight[ids]).contiguous()
    config = {
        "speculators_model_type": kind,
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": n_draft,
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
        **sts,
    }
    if kind == "dspark":
        config.update(_heads_out(c))
        config.setdefault("markov_head_type", "vanilla")
        config.setdefault("confidence_head_with_markov", False)
    return config, out


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
