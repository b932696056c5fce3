"""`DSparkDraftModel`: the parallel backbone (eqs. 2–4) with the sequential and confidence heads (eqs. 5–7).

One forward turns an anchor token x_0 plus γ−1 learned mask slots into γ hidden states h_k and base logits U_k.
The draft layers reuse the target family's transformers building blocks (RMSNorm, MLP, rotary embedding, attention
functions); the embedding table and LM head are the target's, shared by reference and frozen (never saved with
the drafter, never duplicated in memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput

from .common import block_positions
from .configuration_dspark import DSparkConfig
from .heads import ConfidenceHead, MarkovHead, RNNHead


def _family_blocks(model_type: str):
    """(RMSNorm, MLP, RotaryEmbedding, apply_rotary_pos_emb) of a target family, from transformers."""
    if model_type == "llama":
        from transformers.models.llama import modeling_llama as m

        return m.LlamaRMSNorm, m.LlamaMLP, m.LlamaRotaryEmbedding, m.apply_rotary_pos_emb, m.eager_attention_forward
    if model_type == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as m

        return m.Qwen2RMSNorm, m.Qwen2MLP, m.Qwen2RotaryEmbedding, m.apply_rotary_pos_emb, m.eager_attention_forward
    raise ValueError(f"unsupported target family {model_type!r}")


class DSparkAttention(nn.Module):
    """Block attention with the context as extra K/V (eq. 3): K = [W^K H_ctx; W^K H_d], V likewise, RoPE on both."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = 0.0
        self.is_causal = False  # bidirectional inside the block
        h, nh, nkv, hd, bias = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.attention_bias,
        )
        self.q_proj = nn.Linear(h, nh * hd, bias=bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.apply_rope = _family_blocks(config.target_model_type)[3]
        self._eager = _family_blocks(config.target_model_type)[4]

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        shape = (*x.shape[:-1], -1, self.head_dim)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        k, _ = self.apply_rope(k, k, cos, sin)
        return k, v

    def forward(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        context: torch.Tensor | None,
        context_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        cache: DynamicCache | None,
    ) -> torch.Tensor:
        """``hidden [B, q, H]`` block states; ``context [B, c, H]`` new H_ctx rows (may be None with a cache)."""
        bsz, q_len, _ = hidden.shape
        cos, sin = position_embeddings
        q = self.q_proj(hidden).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        q, _ = self.apply_rope(q, q, cos, sin)
        k_blk, v_blk = self._kv(hidden, cos, sin)
        if context is not None:
            k_ctx, v_ctx = self._kv(context, *context_embeddings)
            if cache is not None:
                k_ctx, v_ctx = cache.update(k_ctx, v_ctx, self.layer_idx)
        else:
            k_ctx, v_ctx = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        impl = self.config._attn_implementation
        attn = self._eager if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]
        if attention_mask is not None and attention_mask.dtype == torch.bool and attn is self._eager:
            # eager attention adds the mask to the scores: turn "True = attend" into 0 / -inf-like
            attention_mask = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~attention_mask, torch.finfo(q.dtype).min
            )
        out, _ = attn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, is_causal=False)
        return self.o_proj(out.reshape(bsz, q_len, -1))


class DSparkDecoderLayer(nn.Module):
    """Pre-norm decoder layer: RMSNorm → block attention over [context; block] → residual → RMSNorm → MLP."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        rms, mlp, *_ = _family_blocks(config.target_model_type)
        self.input_layernorm = rms(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DSparkAttention(config, layer_idx)
        self.post_attention_layernorm = rms(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = mlp(config)

    def forward(self, hidden, position_embeddings, context, context_embeddings, attention_mask, cache):
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), position_embeddings, context, context_embeddings, attention_mask, cache
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class DSparkOutput(ModelOutput):
    """Output of one drafter forward.

    Attributes:
        hidden_states: h_k, ``[B, n, γ, H]`` (after the final norm).
        base_logits: U_k = LM_head(h_k), ``[B, n, γ, V]`` float32, or None when not requested.
    """

    hidden_states: torch.Tensor | None = None
    base_logits: torch.Tensor | None = None


class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    config: DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "anchor_ids"
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, DSparkDraftModel):
            nn.init.normal_(module.mask_embedding, std=std)
        if isinstance(module, (MarkovHead, RNNHead)):
            nn.init.zeros_(module.out.weight)  # untrained correction = 0: p_k starts as softmax(U_k)


class DSparkDraftModel(DSparkPreTrainedModel):
    r"""The DSpark draft model (docs/method.md §2).

    Parameters owned by the drafter: W_c and its RMSNorm (eq. 2), the learned mask embedding, the draft decoder
    layers (eq. 3), the final norm, the sequential head (eq. 5 Markov / eq. 6 RNN / none) and the confidence head
    (eq. 7). The embedding table and LM head come from the target through :meth:`bind_target`.

    Load for use with ``target.generate(ids, assistant_model=drafter)``::

        drafter = DSparkDraftModel.from_pretrained(path, target=target)

    Raises:
        ValueError: at binding, when the target does not match (hidden size, vocabulary, layer ids, family).
        OSError: corrupt or incomplete checkpoint (missing / unexpected / unreadable tensors).
    """

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        rms, _, rope, *_ = _family_blocks(config.target_model_type)
        h, m = config.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(m * h, h, bias=False)  # W_c of eq. 2
        self.hidden_norm = rms(h, eps=config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.layers = nn.ModuleList([DSparkDecoderLayer(config, i) for i in range(config.num_draft_layers)])
        self.norm = rms(h, eps=config.rms_norm_eps)
        self.rotary_emb = rope(config=config)
        n_out = config.draft_vocab_size or config.vocab_size
        if config.draft_vocab_size:
            # the N token ids the drafter drafts over (set from training-data frequencies; saved with the weights)
            self.register_buffer("draft_vocab_ids", torch.arange(n_out), persistent=True)
        else:
            self.draft_vocab_ids = None
        if config.sequential_head == "markov":
            self.sequential_head = MarkovHead(config.vocab_size, config.markov_rank, n_out)
        elif config.sequential_head == "rnn":
            self.sequential_head = RNNHead(config.vocab_size, config.markov_rank, h, n_out)
        else:
            self.sequential_head = None
        feat = config.markov_rank if self.sequential_head is not None else h
        self.confidence_head = ConfidenceHead(h, feat) if config.use_confidence_head else None
        self._target = {}  # shared, frozen: {"embed": nn.Embedding, "lm_head": nn.Linear, "config": ...}
        self.post_init()

    # ------------------------------------------------------------------ binding to a target
    def bind_target(self, target: PreTrainedModel) -> DSparkDraftModel:
        """Share ``target``'s embedding table and LM head (by reference, frozen) after validating the match.

        Raises:
            ValueError: naming both values, if hidden size, vocabulary size, number of layers (so the layer ids)
                or architecture family differ from what this drafter was built for.
        """
        tc = target.config.get_text_config()
        c = self.config
        checks = [
            ("hidden size", c.hidden_size, tc.hidden_size),
            ("vocab size", c.vocab_size, tc.vocab_size),
            ("number of decoder layers", c.target_num_hidden_layers, tc.num_hidden_layers),
            ("architecture family", c.target_model_type, tc.model_type),
        ]
        for what, mine, theirs in checks:
            if mine != theirs:
                raise ValueError(
                    f"drafter/target mismatch: the drafter was built for a target with {what} {mine!r}, "
                    f"but this target ({getattr(tc, 'name_or_path', '') or tc.model_type}) has {what} {theirs!r}"
                )
        if max(c.target_layer_ids) > tc.num_hidden_layers - 2:
            raise ValueError(
                f"target_layer_ids={c.target_layer_ids} out of range for a target with {tc.num_hidden_layers} layers"
            )
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if lm_head is None:
            raise ValueError(f"target {type(target).__name__} has no LM head (need a *ForCausalLM model)")
        for p in list(embed.parameters()) + list(lm_head.parameters()):
            p.requires_grad_(False)
        self._target = {"embed": embed, "lm_head": lm_head, "model": target}
        return self

    @property
    def target_embeddings(self) -> nn.Embedding:
        if not self._target:
            raise RuntimeError(
                "this drafter is not bound to a target: load it with DSparkDraftModel.from_pretrained(path, "
                "target=model) or call drafter.bind_target(model)"
            )
        return self._target["embed"]

    @property
    def target_lm_head(self) -> nn.Linear:
        self.target_embeddings  # raises if unbound
        return self._target["lm_head"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, target: PreTrainedModel | None = None, **kwargs):
        """`PreTrainedModel.from_pretrained`, strict about the checkpoint, then optionally bound to ``target``.

        With ``target`` given, the target's ``generate()`` is also enabled for DSpark (see
        :func:`generation.integration.enable_dspark`), so ``target.generate(ids, assistant_model=drafter)`` works.

        Raises:
            OSError: the directory has no weights file, or the file is corrupt, or tensors are missing/unexpected.
            ValueError: the drafter does not match ``target``.
        """
        path = str(pretrained_model_name_or_path)
        if os.path.isdir(path) and not any(f.endswith(".safetensors") for f in os.listdir(path)):
            raise OSError(f"no safetensors weights file in drafter directory {path!r}")
        kwargs["output_loading_info"] = True
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except (OSError, ValueError) as err:
            raise OSError(f"could not load DSpark drafter from {path!r}: {err}") from err
        except Exception as err:  # safetensors raises its own error type for a corrupt header / body
            raise OSError(f"corrupt DSpark checkpoint in {path!r}: {type(err).__name__}: {err}") from err
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise OSError(f"incomplete or incompatible DSpark checkpoint in {path!r}: {bad}")
        if target is not None:
            model.bind_target(target)
            model.to(target.device)
            from generation.integration import enable_dspark

            enable_dspark(target)
        return model

    # ------------------------------------------------------------------ eq. 2
    def encode_context(self, features: torch.Tensor) -> torch.Tensor:
        """H_ctx = RMSNorm(W_c [H^(l_1); …; H^(l_m)]) (eq. 2): ``[B, S, m·H] -> [B, S, H]`` in the drafter's dtype."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def embed_block(self, anchor_ids: torch.LongTensor, num_slots: int) -> torch.Tensor:
        """Inputs of the block: E[x_0] then γ−1 learned mask embeddings. ``[B, n] -> [B, n, γ, H]``."""
        anchor = self.target_embeddings(anchor_ids).to(self.mask_embedding.dtype)
        masks = self.mask_embedding.expand(*anchor_ids.shape, num_slots - 1, -1)
        return torch.cat([anchor.unsqueeze(-2), masks], dim=-2)

    # ------------------------------------------------------------------ eqs. 3–4 (parallel part)
    def forward(
        self,
        anchor_ids: torch.LongTensor,
        anchor_positions: torch.LongTensor,
        context_features: torch.Tensor | None = None,
        context_positions: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        num_slots: int | None = None,
        return_logits: bool = True,
    ) -> DSparkOutput:
        """One parallel forward of n blocks per sequence.

        Args:
            anchor_ids: ``[B, n]`` anchor tokens x_0 (the last committed token of each block).
            anchor_positions: ``[B, n]`` absolute positions of the anchors.
            context_features: ``[B, S, m·H]`` raw target features (eq. 2) of the *new* context rows; with a
                ``cache`` these are appended to it (inference), without one they are the whole context (training).
            context_positions: ``[B, S]`` absolute positions of those rows.
            attention_mask: ``[B, 1, n·γ, S_total + n·γ]`` bool (True = attend), e.g. from
                :func:`modeling_dspark.common.block_attention_mask`; None = every block sees all context (n = 1).
            cache: a ``DynamicCache`` holding the context K/V of earlier rounds (inference only).
            num_slots: γ' ≤ γ slots to run (default ``config.block_size``).
            return_logits: also compute U_k through the target's LM head.

        Returns:
            :class:`DSparkOutput` with ``hidden_states [B, n, γ', H]`` and ``base_logits [B, n, γ', V]`` (float32).
        """
        gamma = num_slots or self.config.block_size
        bsz, n = anchor_ids.shape
        hidden = self.embed_block(anchor_ids, gamma).reshape(bsz, n * gamma, -1)
        pos = block_positions(anchor_positions, gamma).reshape(bsz, n * gamma)
        pos_emb = self.rotary_emb(hidden, pos)
        context = ctx_emb = None
        if context_features is not None and context_features.shape[1] > 0:
            context = self.encode_context(context_features)
            ctx_emb = self.rotary_emb(context, context_positions)
        for layer in self.layers:
            hidden = layer(hidden, pos_emb, context, ctx_emb, attention_mask, cache)
        hidden = self.norm(hidden).reshape(bsz, n, gamma, -1)
        logits = self.lm_logits(hidden) if return_logits else None
        return DSparkOutput(hidden_states=hidden, base_logits=logits)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """U = LM_head(h) through the target's (shared, frozen) head: ``[..., H] -> [..., N]`` float32.

        N = V, or the draft vocabulary size when ``config.draft_vocab_size`` is set (then only the rows
        ``draft_vocab_ids`` of the target's head are used; see :meth:`expand_draft_logits`).
        """
        head = self.target_lm_head
        if self.draft_vocab_ids is None:
            return head(hidden.to(head.weight.dtype)).float()
        weight = self._draft_head_weight(head)
        return nn.functional.linear(hidden.to(weight.dtype), weight).float()

    def _draft_head_weight(self, head: nn.Linear) -> torch.Tensor:
        """Rows ``draft_vocab_ids`` of the target's LM head, gathered once per (ids, head) and reused.

        A frozen N×H copy (N/V of the head): gathering the rows every round would cost more than the product.
        """
        key = (self.draft_vocab_ids._version, self.draft_vocab_ids.data_ptr(), head.weight.data_ptr(),
               head.weight.dtype, head.weight.device)
        cached = self._target.get("draft_head")
        if cached is None or cached[0] != key:
            cached = (key, head.weight.detach()[self.draft_vocab_ids.to(head.weight.device)].contiguous())
            self._target["draft_head"] = cached
        return cached[1]

    def draft_vocab_index(self, device=None) -> torch.LongTensor:
        """``[V]`` long map from a token id to its column in the draft vocabulary, −1 outside it (cached).

        Raises:
            ValueError: the drafter has no reduced draft vocabulary.
        """
        if self.draft_vocab_ids is None:
            raise ValueError("draft_vocab_index: this drafter drafts over the full vocabulary (draft_vocab_size=None)")
        ids = self.draft_vocab_ids
        key = (ids._version, ids.data_ptr(), str(device or ids.device))
        cached = self._target.get("draft_index")
        if cached is None or cached[0] != key:
            index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=device or ids.device)
            index[ids.to(index.device)] = torch.arange(ids.numel(), device=index.device)
            cached = (key, index)
            self._target["draft_index"] = cached
        return cached[1]

    def draft_token_ids(self, columns: torch.LongTensor) -> torch.LongTensor:
        """Target token ids of draft-vocabulary columns ``[...]`` long (the identity without a draft vocabulary).

        ``draft_token_ids(logits.argmax(-1))`` equals ``expand_draft_logits(logits).argmax(-1)`` without building a
        ``[..., V]`` tensor; exact ties break alike when ``draft_vocab_ids`` is sorted, as
        :func:`training.trainer.select_draft_vocab` makes it (otherwise a tie may pick another draft token;
        verification, hence the output, is unaffected).
        """
        if self.draft_vocab_ids is None:
            return columns
        return self.draft_vocab_ids.to(columns.device)[columns]

    def expand_draft_logits(self, logits: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """Scatter draft-vocabulary logits ``[..., N]`` into the full vocabulary ``[..., V]`` (``fill`` elsewhere).

        With no draft vocabulary the input is returned unchanged.
        """
        if self.draft_vocab_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), fill)
        full[..., self.draft_vocab_ids.to(logits.device)] = logits
        return full

    # ------------------------------------------------------------------ eqs. 5–7
    def correction_logits(self, prev_tokens: torch.LongTensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """Teacher-forced B_k for a block (eq. 5 or 6): ``prev_tokens [..., γ]`` (x_0..x_{γ−1}), ``hidden [..., γ, H]``.

        Returns ``[..., γ, V]`` float32, or None for ``sequential_head="none"``.
        """
        if self.sequential_head is None:
            return None
        return self.sequential_head(prev_tokens, hidden).float()

    def correction_step(self, prev_token: torch.LongTensor, hidden: torch.Tensor, state=None):
        """One left-to-right step of the sequential head: ``prev_token [B]``, ``hidden [B, H]`` → (B_k [B, V] | None, state)."""
        if self.sequential_head is None:
            return None, None
        bias, state = self.sequential_head.step(prev_token, hidden, state)
        return bias.float(), state

    def token_features(self, prev_tokens: torch.LongTensor) -> torch.Tensor:
        """The x_{k−1} features the confidence head reads: W_1[x_{k−1}] (or the target embedding for "none")."""
        if self.sequential_head is not None:
            return self.sequential_head.token_features(prev_tokens)
        return self.target_embeddings(prev_tokens)

    def confidence_logits(self, prev_tokens: torch.LongTensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """Pre-sigmoid, pre-temperature confidence logits wᵀ[h_k; W_1[x_{k−1}]] (eq. 7): ``[...]`` float32, or None."""
        if self.confidence_head is None:
            return None
        return self.confidence_head(hidden, self.token_features(prev_tokens))

    def calibrated_confidence(self, logits: torch.Tensor, positions) -> torch.Tensor:
        """c_k = σ(logit_k / T_k + b_k) with the STS temperatures (docs/method.md §3) and logit offsets (``sts_biases``, 0
        unless calibrated with ``--bias``) of the config; ``positions`` are 0-based k−1."""
        temps = torch.tensor(self.config.sts_temperatures, dtype=torch.float32, device=logits.device)
        biases = torch.tensor(self.config.sts_biases, dtype=torch.float32, device=logits.device)
        return torch.sigmoid(logits / temps[positions] + biases[positions])

    def new_context_cache(self) -> DynamicCache:
        """An empty cache for the context K/V of every draft layer (one per generation call)."""
        return DynamicCache()
