"""Other implementations' drafter checkpoints: detect the format and convert one to DSpark's own (the other way:
:mod:`modeling_dspark.export`).

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
import os
from pathlib import Path

import torch
from transformers import AutoConfig

from .configuration_dspark import DEFAULT_MARKOV_RANK, DSparkConfig

FORMATS = ("dspark", "deepspec", "dflash", "specforge", "speculators")

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
def from_other_format(cls, path, target=None, *args, dtype=None, torch_dtype=None,
                      attn_implementation: str | None = None, device_map=None, **kwargs):
    """``cls`` (:class:`~modeling_dspark.DSparkDraftModel`) from a DeepSpec / DFlash / SpecForge / speculators
    checkpoint in directory ``path``, converted by :func:`load_config_and_state`, bound to ``target`` if given (what
    ``DSparkDraftModel.from_pretrained`` returns for such a directory).

    Args:
        dtype (or ``torch_dtype``): a torch dtype; None or "auto": the checkpoint's.
        attn_implementation: as in ``from_pretrained`` ("eager", "sdpa", ...).
        device_map: one device (``"cpu"``, ``"cuda:0"``, an index or a ``torch.device``); default the target's
            device, else the CPU.

    Raises:
        OSError: no weights, corrupt weights, or tensors missing/unexpected after conversion.
        ValueError: a convention the conversion cannot reproduce, a drafter that does not fit ``target``, a
            ``device_map`` other than one device (or not the target's), or any other ``from_pretrained`` option
            (named; they do not apply to a converted checkpoint).
    """
    if args or kwargs:
        raise ValueError(
            f"from_pretrained options {[*map(repr, args), *sorted(kwargs)]} do not apply to a drafter converted "
            f"from another format ({str(path)!r}); it takes dtype, attn_implementation and device_map"
        )
    device = None
    if device_map is not None:
        try:
            device = torch.device(device_map)
        except (RuntimeError, TypeError):
            raise ValueError(f"device_map={device_map!r}: a converted drafter goes to one device (e.g. 'cpu', "
                             "'cuda:0')") from None
        if target is not None and device != target.device:
            raise ValueError(f"device_map={device_map!r} differs from the target's device {target.device}")
    config, state = load_config_and_state(path, target.config if target is not None else None)
    model = cls(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise OSError(f"incomplete or incompatible drafter checkpoint in {str(path)!r}: "
                      f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    dtype = dtype if dtype is not None else torch_dtype
    if dtype in (None, "auto"):
        dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    model.to(dtype=dtype).eval()
    if target is not None:
        model.bind_target(target)  # on the target's device
    elif device is not None:
        model.to(device)
    return model


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
    """STS temperatures / offsets carried as extra config keys (written by
    :func:`modeling_dspark.export.export_drafter`).

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
        fields = _deepspec_fields(config, state, where)
    elif fmt in ("dflash", "specforge"):
        fields = _dflash_fields(fmt, config, where)
    elif fmt == "speculators":
        fields = _speculators_fields(config, where)
    else:
        raise ValueError(f"cannot convert format {fmt!r}; one of {FORMATS[1:]}")
    _match_target(fields, target_config, where)
    dspark_config = DSparkConfig(**fields, source_format=fmt)
    return dspark_config, _state_to_dspark(fmt, config, state, dspark_config, where)


def _deepspec_fields(config: dict, state: dict, where: str) -> dict:
    """DSparkConfig fields of a DeepSpec ``Qwen3DSparkModel`` config: every slot predicts (γ = ``block_size``),
    own embeddings when ``state`` holds both ``embed_tokens.weight`` and ``lm_head.weight``, never soft-capped."""
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
    return fields


def _dflash_fields(fmt: str, config: dict, where: str) -> dict:
    """DSparkConfig fields of a z-lab DFlash or SpecForge (``fmt``) config: B = ``block_size`` slots, the anchor's
    predicts nothing (γ = B − 1); SpecForge adds the heads, DFlash the block-input scale and logit cap.

    Raises:
        ValueError: an output multiplier, a draft prefix / shifted labels / causal blocks, B < 2, no mask token.
    """
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
    heads = _specforge_heads(dc, where) if fmt == "specforge" else _heads(0, "vanilla", False, False, where)
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
    return fields


def _specforge_heads(dc: dict, where: str) -> dict:
    """The sequential and confidence heads of a SpecForge ``dflash_config`` ``dc`` (the confidence head exists when
    enabled by either key, else when its loss weight ``confidence_head_alpha`` is > 0)."""
    confidence = dc.get("enable_confidence_head",
                        dc.get("use_confidence_head", float(dc.get("confidence_head_alpha", 0) or 0) > 0))
    return _heads(dc.get("markov_rank", 0), dc.get("markov_head_type", "vanilla"), confidence,
                  dc.get("confidence_head_with_markov", False), where)


def _speculators_fields(config: dict, where: str) -> dict:
    """DSparkConfig fields of a vLLM speculators config: ``sample_from_anchor`` picks the slot convention, layer ids
    are ``aux_hidden_state_layer_ids`` − 1, a ``draft_vocab_size`` below V is a reduced vocabulary.

    Raises:
        ValueError: a non-causal sliding window, a target hidden size other than the draft's, no mask token, or an
            RNN head whose anchor slot predicts nothing.
    """
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
    return fields


def _match_target(fields: dict, target_config, where: str) -> None:
    """Check the converted ``fields`` against ``target_config`` (vocabulary size, number of layers) and fill in the
    target's family, layer count and name; without a target the config must give the number of target layers.

    Raises:
        ValueError: a vocabulary or layer-count mismatch, or no layer count at all.
    """
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
