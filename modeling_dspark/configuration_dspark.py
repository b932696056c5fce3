"""`DSparkConfig`: every hyper-parameter of a DSpark draft model, with documented defaults (docs/method.md §2–§5)."""

from __future__ import annotations

import math

from transformers import PretrainedConfig

SEQUENTIAL_HEADS = ("markov", "rnn", "none")
SUPPORTED_TARGET_FAMILIES = ("llama", "qwen2")


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

    The drafter's decoder layers have the target's shape (hidden size, heads, head dim, RoPE) because it reads
    the target's embedding table and LM head (shared and frozen) and attends to the target's features.

    Args:
        vocab_size (`int`): the target's vocabulary size V.
        hidden_size (`int`): the target's hidden size H (also the drafter's).
        intermediate_size (`int`): MLP width of a draft layer (default: the target's).
        num_attention_heads, num_key_value_heads, head_dim (`int`): attention shape (the target's).
        hidden_act (`str`), rms_norm_eps (`float`), attention_bias, mlp_bias (`bool`), rope_parameters (`dict`),
        max_position_embeddings (`int`): as in the target's config.
        target_model_type (`str`): architecture family of the target, one of `SUPPORTED_TARGET_FAMILIES`;
            selects the transformers building blocks (RMSNorm, MLP, RoPE) the draft layers reuse.
        target_name_or_path (`str`): name of the target the drafter was trained for (informational).
        target_num_hidden_layers (`int`): number of decoder layers L of the target.
        target_layer_ids (`list[int]`): decoder layers l_1..l_m whose raw outputs form the context
            features (eq. 2). Each must be in [0, L−2]: transformers returns the final *normed* state for
            layer L−1, which is not a raw decoder-layer output.
        block_size (`int`): γ, the number of draft slots per round (anchor + γ−1 mask slots; every slot
            predicts one token, so γ draft tokens per round).
        num_draft_layers (`int`): number of draft decoder layers.
        mask_token_id (`None`): DSpark uses a *learned mask embedding* (one H-vector) for the γ−1 mask
            slots instead of an existing token id: the default targets (SmolLM2, Qwen2.5) have no mask token,
            and reusing a real token would tie the mask slot to that token's embedding row. Kept as a field
            for DFlash-format compatibility; must be `None`.
        sequential_head (`str`): "markov" (eq. 5, default), "rnn" (eq. 6) or "none" (plain DFlash, the
            ablation baseline; the very same code path with no correction term).
        markov_rank (`int`): r, rank of W_1 ∈ R^{V×r}, W_2 ∈ R^{r×V} (eq. 5); also the RNN state width.
        use_confidence_head (`bool`): whether the confidence head c_k (eq. 7) exists.
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
            `training.calibration.fit_sts_bias`); default all 0.0 (the paper's STS).
        ce_weight, tv_weight, conf_weight (`float`): loss weights of eq. 14 (0.1, 0.9, 1.0).
        loss_decay (`float`, optional): decay of the position weights w_k = exp(−(k−1)/decay); `None` = γ.
        initializer_range (`float`): std of the normal init of new weights.

    Raises:
        ValueError: unknown `sequential_head`, unsupported `target_model_type`, bad `target_layer_ids`,
            `block_size` < 1, a non-`None` `mask_token_id`, or a wrong number of STS temperatures (finite, > 0) or
            offsets (finite).
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
        mask_token_id: int | None = None,
        sequential_head: str = "markov",
        markov_rank: int = 64,
        use_confidence_head: bool = True,
        draft_vocab_size: int | None = None,
        sts_temperatures: list[float] | None = None,
        sts_biases: list[float] | None = None,
        ce_weight: float = 0.1,
        tv_weight: float = 0.9,
        conf_weight: float = 1.0,
        loss_decay: float | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        kwargs.pop("num_hidden_layers", None)
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
        self.target_model_type = target_model_type
        self.target_name_or_path = target_name_or_path
        self.target_num_hidden_layers = target_num_hidden_layers
        self.target_layer_ids = (
            list(target_layer_ids)
            if target_layer_ids is not None
            else default_target_layer_ids(target_num_hidden_layers)
        )
        self.block_size = block_size
        self.num_draft_layers = num_draft_layers
        self.mask_token_id = mask_token_id
        self.sequential_head = sequential_head
        self.markov_rank = markov_rank
        self.use_confidence_head = use_confidence_head
        self.draft_vocab_size = draft_vocab_size
        self.sts_temperatures = list(sts_temperatures) if sts_temperatures is not None else [1.0] * block_size
        self.sts_biases = list(sts_biases) if sts_biases is not None else [0.0] * block_size
        self.ce_weight = ce_weight
        self.tv_weight = tv_weight
        self.conf_weight = conf_weight
        self.loss_decay = loss_decay
        self.initializer_range = initializer_range
        super().__init__(**kwargs)
        self.validate_fields()

    @property
    def num_hidden_layers(self) -> int:
        """Alias of `num_draft_layers` (transformers utilities look for this name)."""
        return self.num_draft_layers

    def validate_fields(self) -> None:
        """Check field values; raise `ValueError` naming the bad field and value."""
        if self.sequential_head not in SEQUENTIAL_HEADS:
            raise ValueError(f"sequential_head={self.sequential_head!r} is not one of {SEQUENTIAL_HEADS}")
        if self.target_model_type not in SUPPORTED_TARGET_FAMILIES:
            raise ValueError(
                f"target_model_type={self.target_model_type!r} is not supported; supported families: "
                f"{SUPPORTED_TARGET_FAMILIES}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size (γ) must be >= 1, got {self.block_size}")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if self.mask_token_id is not None:
            raise ValueError(
                f"mask_token_id={self.mask_token_id}: DSpark uses a learned mask embedding; set mask_token_id=None"
            )
        ids = self.target_layer_ids
        top = self.target_num_hidden_layers - 2
        if not ids or any((not isinstance(i, int)) or i < 0 or i > top for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(
                f"target_layer_ids={ids} must be distinct ints in [0, {top}] for a target with "
                f"{self.target_num_hidden_layers} layers (the last layer's hidden state is the final normed state)"
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

        Any DSpark field (block_size, target_layer_ids, markov_rank, …) may be given in `kwargs`.

        Raises:
            ValueError: the target's family is not supported, or a field is invalid.
        """
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        facts = dict(
            vocab_size=tc.vocab_size,
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            hidden_act=getattr(tc, "hidden_act", "silu"),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            attention_bias=bool(getattr(tc, "attention_bias", tc.model_type == "qwen2")),
            mlp_bias=bool(getattr(tc, "mlp_bias", False)),
            rope_parameters=dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4}),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
            target_model_type=tc.model_type,
            target_name_or_path=getattr(tc, "name_or_path", "") or getattr(tc, "_name_or_path", ""),
            target_num_hidden_layers=tc.num_hidden_layers,
        )
        facts.update(kwargs)
        return cls(**facts)
