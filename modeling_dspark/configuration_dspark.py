"""`DSparkConfig`: every hyper-parameter of a DSpark draft model, with documented defaults (docs/method.md §2–§5)."""

from __future__ import annotations

import math

from transformers import PretrainedConfig

# special token ids copied from the target (transformers' pipeline compares them with the target's)
SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SEQUENTIAL_HEADS = ("markov", "gated", "rnn", "none")
DRAFT_LAYER_STYLES = ("qwen3", "target")
DEFAULT_MARKOV_RANK = 64  # r of W_1 / W_2 (eq. 5)
# text-model families whose decoder hidden states, embedding table and LM head dspark reads, whose embedding output
# and logits the drafter reproduces from them, and whose assisted decoding in transformers is tested token for token
# against plain greedy generate() (tests/test_families.py)
SUPPORTED_TARGET_FAMILIES = ("llama", "mistral", "mixtral", "ministral", "ministral3", "phi3", "qwen2", "qwen2_moe",
                             "qwen3", "qwen3_moe", "olmo2", "olmo3", "smollm3", "gpt_oss", "gemma", "gemma2",
                             "gemma3_text", "gemma4_text", "glm4", "glm4_moe", "ernie4_5", "ernie4_5_moe", "exaone4",
                             "seed_oss", "hunyuan_v1_dense", "apertus", "helium", "cwm", "granite", "granitemoe",
                             "granitemoeshared", "cohere", "cohere2")
# families whose embedding layer multiplies by √H (and whose norms store the scale − 1, Gemma 1–3)
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text", "gemma4_text")
# formats a drafter can be converted from (modeling_dspark.formats); None = a native dspark checkpoint
SOURCE_FORMATS = (None, "deepspec", "dflash", "specforge", "speculators")
# why a family is refused, where there is a reason more specific than "untested"
_UNSUPPORTED_REASONS = {
    "gpt2": "GPT-2 has learned absolute position embeddings and no RMSNorm / RoPE / intermediate_size",
    "granitemoehybrid": "its Mamba layers keep a state that transformers' assisted decoding cannot roll back",
}


def logit_transform(target_config) -> tuple[float, float | None]:
    """``(scale, cap)``: how the target family turns its LM head's output U into logits, c·tanh(s·U / c)
    (:func:`modeling_dspark.common.softcap`): s = 1 / ``logits_scaling`` (Granite), ``logit_scale`` (Cohere), else 1;
    c = ``final_logit_softcapping`` (Gemma 2–4), else None. ``target_config``: a config or its ``to_dict()``."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    t = tc if isinstance(tc, dict) else tc.to_dict() if hasattr(tc, "to_dict") else dict(vars(tc))
    family, scale = t.get("model_type") or "", 1.0
    if family.startswith("granite"):  # GraniteForCausalLM: logits / logits_scaling
        scale = 1.0 / (t.get("logits_scaling") or 1.0)
    elif family.startswith("cohere"):  # CohereForCausalLM: logits * logit_scale
        scale = float(t.get("logit_scale") or 1.0)
    return scale, t.get("final_logit_softcapping")


def check_target_family(model_type: str, source_format: str | None = None) -> None:
    """Raise `ValueError` naming ``model_type`` and the reason when dspark cannot draft for that target family, or
    a drafter converted from ``source_format`` cannot (a SpecForge drafter for a Gemma target: SpecForge embeds the
    block through the target's √H-scaled embedding layer and never soft-caps the draft logits)."""
    if model_type in SUPPORTED_TARGET_FAMILIES:
        if source_format == "specforge" and model_type in GEMMA_FAMILIES:
            raise ValueError(
                f"SpecForge drafters for Gemma targets ({model_type!r}) are not supported: SpecForge embeds the block "
                "through the target's scaled embedding layer and never soft-caps the draft logits, which dspark does "
                "not reproduce for Gemma"
            )
        return
    reason = _UNSUPPORTED_REASONS.get(
        model_type, "its hidden states, embeddings and assisted decoding are not tested with dspark"
    )
    raise ValueError(
        f"target family {model_type!r} is not supported: {reason}. Supported families: "
        f"{', '.join(SUPPORTED_TARGET_FAMILIES)}"
    )


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Evenly spaced decoder layers between layer 1 and layer L−3 (DFlash's choice), never the last layer.

    >>> default_target_layer_ids(30, 5)
    [1, 7, 14, 20, 27]
    """
    if num_target_layers < 4:
        return list(range(max(1, num_target_layers - 1)))[:num_features] or [0]
    start, end = 1, num_target_layers - 3
    if num_features == 1:
        return [(start + end) // 2]
    span = end - start
    return sorted({start + round(i * span / (num_features - 1)) for i in range(num_features)})


class DSparkConfig(PretrainedConfig):
    r"""Configuration of a [`DSparkDraftModel`].

    The drafter's decoder layers have the target's hidden size (they read the target's embedding table and LM head
    and attend to its features); their attention shape and RoPE default to the target's. One forward path serves
    every convention below; imported drafters (DeepSpec, DFlash, SpecForge, speculators) set the fields that
    describe them.

    Args:
        vocab_size (`int`): the target's vocabulary size V.
        hidden_size (`int`): the target's hidden size H (also the drafter's).
        intermediate_size (`int`): MLP width of a draft layer (default: the target's).
        num_attention_heads, num_key_value_heads, head_dim (`int`): attention shape (the target's).
        hidden_act (`str`), rms_norm_eps (`float`), attention_bias, mlp_bias (`bool`), rope_parameters (`dict`),
        max_position_embeddings (`int`): as in the target's config.
        target_model_type (`str`): text-model family of the target (``config.get_text_config().model_type``), one
            of `SUPPORTED_TARGET_FAMILIES`.
        target_name_or_path (`str`): name of the target the drafter was trained for (informational).
        target_num_hidden_layers (`int`): number of decoder layers L of the target.
        target_layer_ids (`list[int]`): decoder layers l_1..l_m whose raw outputs form the context
            features (eq. 2); id i reads ``hidden_states[i + 1]``, and −1 is the embedding output
            (``hidden_states[0]``). Distinct, each in [−1, L−2]: transformers returns the final *normed* state
            for layer L−1, which is not a raw decoder-layer output.
        block_size (`int`): γ, the number of draft tokens per round (see `anchor_predicts` for the number of
            block slots).
        num_draft_layers (`int`): number of draft decoder layers.
        draft_layer_style (`str`): "qwen3" (default for new drafters): Qwen3 decoder layers, RMSNorm on every
            query and key head (``q_norm``, ``k_norm``; the same ``k_proj``/``k_norm`` for context and block keys)
            and an ``o_proj`` bias when ``attention_bias`` (DeepSpec / DFlash / SpecForge layers), for any target
            family. "target": the layers of drafters saved before this option (no q/k norm, no ``o_proj`` bias);
            a saved config without this key loads as "target".
        mask_token_id (`int`, optional): `None` (default): the mask slots read a *learned mask embedding* (one
            H-vector, ``mask_embedding``). An int: a real token id embedded like the anchor, by the embedding
            table (DeepSpec, DFlash: e.g. 151669 for Qwen3).
        anchor_predicts (`bool`): True (default; DeepSpec, speculators ``sample_from_anchor``): the block is
            [anchor, mask × (γ−1)] and slot k predicts the token k+1 places after the anchor, so all γ slots
            draft. False (DFlash, SpecForge): the block is [anchor, mask × γ], the anchor's slot predicts nothing
            and slot k ≥ 1 predicts the token k places after the anchor (a DFlash ``block_size`` B is γ = B − 1).
        own_embeddings (`bool`): False (default; DFlash): the embedding table and LM head are the target's, shared
            by reference and never saved. True (DeepSpec): the drafter holds frozen copies ``embed_tokens``
            [V, H] and ``lm_head`` [N, H] (N = draft vocabulary size or V), saved with it.
        embedding_scale (`float`): block inputs are E[x]·scale read from the raw embedding table (the target's
            or the drafter's own): √H for Gemma targets (their embedding layer multiplies by √H), else 1.0
            (DFlash ``input_embedding_scale``).
        final_logit_softcapping (`float`, optional): base logits U = c·tanh(LM_head(h)/c), as the target computes
            its own (Gemma); `None` = no capping.
        logit_scale (`float`): base logits U = LM_head(h)·s before any capping, as the target scales its own:
            1 / ``logits_scaling`` for Granite, ``logit_scale`` for Cohere, else 1.0.
        sequential_head (`str`): "markov" (eq. 5, default; DeepSpec ``markov_head_type="vanilla"``), "gated"
            (DeepSpec "gated": B = W_2ᵀ(σ(W_g[h_k; W_1[x_{k−1}]] + b_g) ⊙ W_1[x_{k−1}])), "rnn" (eq. 6; DeepSpec
            "rnn") or "none" (plain DFlash, the ablation baseline; DeepSpec ``markov_rank=0``; the very same code
            path with no correction term).
        markov_rank (`int`): r, rank of W_1 ∈ R^{V×r}, W_2 ∈ R^{r×N} (eq. 5); also the gate / RNN state width.
        use_confidence_head (`bool`): whether the confidence head c_k (eq. 7) exists.
        confidence_head_with_markov (`bool`): True (default): the confidence head reads [h_k; W_1[x_{k−1}]] (eq. 7;
            with ``sequential_head="none"``, which has no W_1, it reads [h_k; E[x_{k−1}]], as drafters saved before
            this option did). False: h_k alone (DeepSpec ``confidence_head_with_markov=false``).
        draft_vocab_size (`int`, optional): N < V to draft only over the N token ids stored in the drafter's
            ``draft_vocab_ids`` buffer (chosen by frequency in the training data). The drafter's LM-head product
            and the sequential head's output then cost N/V of the full vocabulary (on CPU the full 49k-row LM
            head is the drafter's largest cost). Tokens outside the set get probability 0 in the draft
            distribution; verification stays exact (rejection sampling accepts with min(1, p_t/p_d) and resamples
            from the residual, so the output is still the target's). `None` = the full vocabulary.
        sts_temperatures (`list[float]`): per-position STS temperatures T_1..T_γ (docs/method.md §3), applied to the
            confidence logit; default all 1.0 (uncalibrated).
        sts_biases (`list[float]`): per-position logit offsets b_k added after the temperature,
            c_k = σ(logit_k / T_k + b_k) (`dspark calibrate --bias`, an extension of STS:
            `dspark.training.calibration.fit_sts_bias`); default all 0.0 (the paper's STS).
        ce_weight, tv_weight, conf_weight (`float`): loss weights of eq. 14 (0.1, 0.9, 1.0).
        loss_decay (`float`, optional): decay of the position weights w_k = exp(−(k−1)/decay); `None` = γ.
        initializer_range (`float`): std of the normal init of new weights.
        source_format (`str`, optional): the format this drafter was converted from ("deepspec", "dflash",
            "specforge", "speculators"; :mod:`modeling_dspark.formats`), `None` for a native dspark checkpoint.
            `DSparkDraftModel.bind_target` refuses a SpecForge drafter for a Gemma target.
        bos_token_id, eos_token_id, pad_token_id (`int | list[int]`, optional): the target's special tokens
            (`from_target_config` and `DSparkDraftModel.bind_target` copy them; the drafter shares the target's
            tokenizer). `pipeline(..., assistant_model=drafter)` compares them with the target's.

    Raises:
        ValueError: unknown `sequential_head` or `draft_layer_style`, unsupported `target_model_type`, bad
            `target_layer_ids`, `block_size` < 1, a negative `mask_token_id` or one outside the vocabulary, a
            non-positive `embedding_scale`, `logit_scale` or `final_logit_softcapping`, a wrong number of STS
            temperatures (finite, > 0) or offsets (finite), or a `source_format` not in `SOURCE_FORMATS`.
    """

    model_type = "dspark"

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-5,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 8192,
        target_model_type: str = "llama",
        target_name_or_path: str = "",
        target_num_hidden_layers: int = 30,
        target_layer_ids: list[int] | None = None,
        block_size: int = 8,
        num_draft_layers: int = 2,
        draft_layer_style: str = "qwen3",
        mask_token_id: int | None = None,
        anchor_predicts: bool = True,
        own_embeddings: bool = False,
        embedding_scale: float = 1.0,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        sequential_head: str = "markov",
        markov_rank: int = DEFAULT_MARKOV_RANK,
        use_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        draft_vocab_size: int | None = None,
        sts_temperatures: list[float] | None = None,
        sts_biases: list[float] | None = None,
        ce_weight: float = 0.1,
        tv_weight: float = 0.9,
        conf_weight: float = 1.0,
        loss_decay: float | None = None,
        initializer_range: float = 0.02,
        source_format: str | None = None,
        **kwargs,
    ):
        kwargs.pop("num_hidden_layers", None)  # a read-only alias of num_draft_layers here
        self._set_layer_shape(vocab_size, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
                              head_dim, hidden_act, rms_norm_eps, attention_bias, mlp_bias, rope_parameters,
                              max_position_embeddings)
        self._set_target(target_model_type, target_name_or_path, target_num_hidden_layers, target_layer_ids)
        self._set_draft_block(block_size, num_draft_layers, draft_layer_style, mask_token_id, anchor_predicts,
                              own_embeddings, embedding_scale, final_logit_softcapping, logit_scale)
        self._set_heads(sequential_head, markov_rank, use_confidence_head, confidence_head_with_markov,
                        draft_vocab_size, sts_temperatures, sts_biases)
        self._set_training(ce_weight, tv_weight, conf_weight, loss_decay, initializer_range)
        self.source_format = source_format
        for name in SPECIAL_TOKEN_FIELDS:  # the target's: the drafter shares its tokenizer (read by pipeline())
            kwargs.setdefault(name, None)
        super().__init__(**kwargs)
        self.validate_fields()

    # Each `_set_*` helper stores one group of the `__init__` arguments (documented in the class docstring), with
    # the defaults that depend on other fields filled in, in the order the arguments are declared.
    def _set_layer_shape(self, vocab_size, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
                         head_dim, hidden_act, rms_norm_eps, attention_bias, mlp_bias, rope_parameters,
                         max_position_embeddings) -> None:
        """The draft layers' shape (the target's): ``head_dim`` defaults to H / heads, RoPE to the default type with
        θ = 10000."""
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.max_position_embeddings = max_position_embeddings

    def _set_target(self, target_model_type, target_name_or_path, target_num_hidden_layers, target_layer_ids) -> None:
        """The target's facts: ``target_layer_ids`` defaults to `default_target_layer_ids` of its L layers."""
        self.target_model_type = target_model_type
        self.target_name_or_path = target_name_or_path
        self.target_num_hidden_layers = target_num_hidden_layers
        self.target_layer_ids = (
            list(target_layer_ids)
            if target_layer_ids is not None
            else default_target_layer_ids(target_num_hidden_layers)
        )

    def _set_draft_block(self, block_size, num_draft_layers, draft_layer_style, mask_token_id, anchor_predicts,
                         own_embeddings, embedding_scale, final_logit_softcapping, logit_scale) -> None:
        """γ, the draft layers' number and style, and how the block is embedded (mask token, slot convention,
        embedding table, scale) and its logits scaled and capped; flags are stored as `bool`, scales and cap as
        `float`."""
        self.block_size = block_size
        self.num_draft_layers = num_draft_layers
        self.draft_layer_style = draft_layer_style
        self.mask_token_id = mask_token_id
        self.anchor_predicts = bool(anchor_predicts)
        self.own_embeddings = bool(own_embeddings)
        self.embedding_scale = float(embedding_scale)
        self.final_logit_softcapping = None if final_logit_softcapping is None else float(final_logit_softcapping)
        self.logit_scale = float(logit_scale)

    def _set_heads(self, sequential_head, markov_rank, use_confidence_head, confidence_head_with_markov,
                   draft_vocab_size, sts_temperatures, sts_biases) -> None:
        """The sequential head, the confidence head with its STS calibration, and the draft vocabulary. Needs
        ``self.block_size`` (set by `_set_draft_block`): the STS defaults are T_k = 1 and b_k = 0 for each of γ
        positions."""
        self.sequential_head = sequential_head
        self.markov_rank = markov_rank
        self.use_confidence_head = use_confidence_head
        self.confidence_head_with_markov = bool(confidence_head_with_markov)
        self.draft_vocab_size = draft_vocab_size
        self.sts_temperatures = list(sts_temperatures) if sts_temperatures is not None else [1.0] * self.block_size
        self.sts_biases = list(sts_biases) if sts_biases is not None else [0.0] * self.block_size

    def _set_training(self, ce_weight, tv_weight, conf_weight, loss_decay, initializer_range) -> None:
        """The loss weights of eq. 14, the position-weight decay, and the init std of new weights."""
        self.ce_weight = ce_weight
        self.tv_weight = tv_weight
        self.conf_weight = conf_weight
        self.loss_decay = loss_decay
        self.initializer_range = initializer_range

    @property
    def num_hidden_layers(self) -> int:
        """Alias of `num_draft_layers` (transformers utilities look for this name)."""
        return self.num_draft_layers

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """`PretrainedConfig.from_dict`; a config saved before `draft_layer_style` existed means "target" layers."""
        if "draft_layer_style" not in config_dict and "draft_layer_style" not in kwargs:
            config_dict = {**config_dict, "draft_layer_style": "target"}
        return super().from_dict(config_dict, **kwargs)

    def validate_fields(self) -> None:
        """Check field values; raise `ValueError` naming the bad field and value."""
        if self.sequential_head not in SEQUENTIAL_HEADS:
            raise ValueError(f"sequential_head={self.sequential_head!r} is not one of {SEQUENTIAL_HEADS}")
        if self.draft_layer_style not in DRAFT_LAYER_STYLES:
            raise ValueError(f"draft_layer_style={self.draft_layer_style!r} is not one of {DRAFT_LAYER_STYLES}")
        check_target_family(self.target_model_type, self.source_format)
        if self.block_size < 1:
            raise ValueError(f"block_size (γ) must be >= 1, got {self.block_size}")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if self.mask_token_id is not None and (
            isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int)
            or not 0 <= self.mask_token_id < self.vocab_size
        ):
            raise ValueError(
                f"mask_token_id={self.mask_token_id!r} must be None (learned mask embedding) or a token id in "
                f"[0, {self.vocab_size})"
            )
        if self.source_format not in SOURCE_FORMATS:
            raise ValueError(f"source_format={self.source_format!r} must be one of {SOURCE_FORMATS}")
        for name in ("embedding_scale", "logit_scale"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        cap = self.final_logit_softcapping
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"final_logit_softcapping must be None or a finite number > 0, got {cap}")
        ids = self.target_layer_ids
        top = self.target_num_hidden_layers - 2
        if (not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < -1 or i > top for i in ids)
                or len(set(ids)) != len(ids)):
            raise ValueError(
                f"target_layer_ids={ids} must be distinct ints in [-1, {top}] for a target with "
                f"{self.target_num_hidden_layers} layers (-1 = the embedding output; the last layer's hidden state "
                "is the final normed state)"
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if self.sequential_head != "none" and self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1 with sequential_head={self.sequential_head!r}")
        def number(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if len(self.sts_temperatures) != self.block_size or not all(number(t) and t > 0 for t in self.sts_temperatures):
            raise ValueError(
                f"sts_temperatures must be {self.block_size} finite positive numbers (one per position), "
                f"got {self.sts_temperatures}"
            )
        if len(self.sts_biases) != self.block_size or not all(number(b) for b in self.sts_biases):
            raise ValueError(
                f"sts_biases must be {self.block_size} finite numbers (one per position), got {self.sts_biases}"
            )

    @classmethod
    def from_target_config(cls, target_config, **kwargs) -> DSparkConfig:
        """Build a config whose shape facts are read from a target's config (e.g. `model.config`).

        Any DSpark field (block_size, target_layer_ids, markov_rank, …) may be given in `kwargs`. New drafters get
        Qwen3-style draft layers (``draft_layer_style="qwen3"``, no attention biases) whatever the target family;
        Gemma targets also set ``embedding_scale`` = √H, Granite targets their ``embedding_multiplier``, and every
        target its logits' scale and cap (:func:`logit_transform`). For a target whose
        RoPE differs per layer type (Gemma), the draft layers use its full-attention RoPE; for one that rotates part
        of each head (``partial_rotary_factor`` < 1), plain RoPE with its θ over whole heads.

        Raises:
            ValueError: the target's family is not supported, or its config lacks a field the drafter needs (both
                named), or a field is invalid.
        """
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        # read the stored values: per-layer attributes of heterogeneous configs (Gemma 4) refuse global access
        t = tc.to_dict() if hasattr(tc, "to_dict") else dict(vars(tc))
        family = t.get("model_type") or getattr(tc, "model_type", None) or type(tc).__name__
        check_target_family(family)
        needed = ["vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers"]
        if "intermediate_size" not in kwargs:
            needed.append("intermediate_size")
        missing = [f for f in needed if t.get(f) is None]
        if missing:
            raise ValueError(f"target config of family {family!r} has no {', '.join(missing)}: the drafter needs it")
        rope = dict(t.get("rope_parameters") or {"rope_type": "default", "rope_theta": 1e4})
        if isinstance(rope.get("full_attention"), dict):  # RoPE per layer type: draft layers are full attention
            rope = dict(rope["full_attention"])
        if rope.get("partial_rotary_factor") not in (None, 1.0):  # Phi-4-mini: draft layers rotate whole heads
            rope = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 1e4)}
        style = kwargs.get("draft_layer_style", "qwen3")
        gemma = family in GEMMA_FAMILIES
        hidden, heads = t["hidden_size"], t["num_attention_heads"]
        scale, cap = logit_transform(t)
        facts = dict(
            vocab_size=t["vocab_size"],
            hidden_size=hidden,
            intermediate_size=t.get("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=t.get("num_key_value_heads") or heads,
            head_dim=t.get("head_dim") or hidden // heads,
            hidden_act=t.get("hidden_act") or t.get("hidden_activation") or "silu",
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            attention_bias=style == "target" and bool(t.get("attention_bias", t.get("qkv_bias", family == "qwen2"))),
            mlp_bias=style == "target" and bool(t.get("mlp_bias", False)),
            rope_parameters=rope,
            max_position_embeddings=t.get("max_position_embeddings") or 8192,
            target_model_type=family,
            target_name_or_path=getattr(tc, "name_or_path", "") or t.get("_name_or_path", ""),
            target_num_hidden_layers=t["num_hidden_layers"],
            embedding_scale=math.sqrt(hidden) if gemma else float(t.get("embedding_multiplier") or 1.0),
            final_logit_softcapping=cap,
            logit_scale=scale,
            **{name: t.get(name) for name in SPECIAL_TOKEN_FIELDS},
        )
        facts.update(kwargs)
        return cls(**facts)
