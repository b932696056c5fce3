"""`DSparkDraftModel`: the parallel backbone (eqs. 2–4) with the sequential and confidence heads (eqs. 5–7).

One forward turns an anchor token x_0 plus mask slots into hidden states h_k and base logits U_k, one per drafted
token. The draft layers are built from transformers' Llama building blocks (RMSNorm, MLP, rotary embedding,
attention functions; the Qwen2 and Qwen3 ones compute the same), in one of two styles (``draft_layer_style``):
Qwen3-style layers with RMSNorm on queries and keys (the layers DeepSpec, DFlash and SpecForge drafters use), or
the layers of older dspark drafters. By default the embedding table and LM head are the target's, shared by
reference and frozen (never saved with the drafter, never duplicated in memory); a drafter with
``own_embeddings`` holds frozen copies (as DeepSpec checkpoints do).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils import ModelOutput

from .common import block_positions, softcap
from .configuration_dspark import SPECIAL_TOKEN_FIELDS, DSparkConfig, check_target_family
from .heads import ConfidenceHead, GatedMarkovHead, MarkovHead, RNNHead

_BINDING = threading.RLock()  # a drafter's binding and its holders (DSparkDraftModel.drafting_for) change under it


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [B, heads, T, d]`` with ``cos``/``sin [B, T, d]`` (transformers' ``apply_rotary_pos_emb``)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DSparkAttention(nn.Module):
    """Block attention with the context as extra K/V (eq. 3): K = [W^K H_ctx; W^K H_d], V likewise, RoPE on both.

    In the "qwen3" style, queries and keys (context and block keys alike) go through a per-head RMSNorm before RoPE,
    as in Qwen3 and in DeepSpec's ``Qwen3DSparkAttention``.
    """

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
        qwen3 = config.draft_layer_style == "qwen3"
        self.q_proj = nn.Linear(h, nh * hd, bias=bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=bias and qwen3)
        self.q_norm = LlamaRMSNorm(hd, eps=config.rms_norm_eps) if qwen3 else None
        self.k_norm = LlamaRMSNorm(hd, eps=config.rms_norm_eps) if qwen3 else None

    def _heads(self, proj: nn.Linear, norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, H]`` → per-head ``[B, heads, T, d]``, RMS-normed per head when ``norm`` is set."""
        y = proj(x).view(*x.shape[:-1], -1, self.head_dim)
        if norm is not None:
            y = norm(y)
        return y.transpose(1, 2)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return _rope(self._heads(self.k_proj, self.k_norm, x), cos, sin), self._heads(self.v_proj, None, x)

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
        q = _rope(self._heads(self.q_proj, self.q_norm, hidden), cos, sin)
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
        attn = eager_attention_forward if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]
        if attention_mask is not None and attention_mask.dtype == torch.bool and attn is eager_attention_forward:
            # eager attention adds the mask to the scores: turn "True = attend" into 0 / -inf-like
            attention_mask = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~attention_mask, torch.finfo(q.dtype).min
            )
        out, _ = attn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, is_causal=False)
        return self.o_proj(out.reshape(bsz, q_len, -1))


class DSparkDecoderLayer(nn.Module):
    """Pre-norm decoder layer: RMSNorm → block attention over [context; block] → residual → RMSNorm → MLP.

    The context rows H_ctx enter the attention as they are (already normed by ``hidden_norm``, eq. 2).
    """

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DSparkAttention(config, layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden, position_embeddings, context, context_embeddings, attention_mask, cache):
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), position_embeddings, context, context_embeddings, attention_mask, cache
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class DSparkOutput(ModelOutput):
    """Output of one drafter forward.

    Attributes:
        hidden_states: h_k, ``[B, n, γ, H]`` (after the final norm); entry k drafts the token k+1 places after the
            anchor, whatever the slot convention (``anchor_predicts``).
        base_logits: U_k = LM_head(h_k), ``[B, n, γ, N]`` float32, or None when not requested.
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
        if isinstance(module, DSparkDraftModel) and module.mask_embedding is not None:
            nn.init.normal_(module.mask_embedding, std=std)
        if isinstance(module, (MarkovHead, GatedMarkovHead, RNNHead)):
            nn.init.zeros_(module.out.weight)  # untrained correction = 0: p_k starts as softmax(U_k)


class DSparkDraftModel(DSparkPreTrainedModel):
    r"""The DSpark draft model (docs/method.md §2).

    Parameters owned by the drafter: W_c and its RMSNorm (eq. 2), the learned mask embedding (when
    ``mask_token_id`` is None), the draft decoder layers (eq. 3), the final norm, the sequential head (eq. 5 Markov,
    gated Markov, eq. 6 RNN, or none) and the confidence head (eq. 7); with ``own_embeddings`` also frozen copies of
    the embedding table and LM head. Otherwise the embedding table and LM head come from the target through
    :meth:`bind_target`.

    Load for use with ``target.generate(ids, assistant_model=drafter)``::

        drafter = DSparkDraftModel.from_pretrained(path, target=target)

    Raises:
        ValueError: at binding, when the target does not match (hidden size, vocabulary, layer ids) or its family
            is not supported.
        OSError: corrupt or incomplete checkpoint (missing / unexpected / unreadable tensors).
    """

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        h, m = config.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(m * h, h, bias=False)  # W_c of eq. 2
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h)) if config.mask_token_id is None else None
        self.layers = nn.ModuleList([DSparkDecoderLayer(config, i) for i in range(config.num_draft_layers)])
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        n_out = config.draft_vocab_size or config.vocab_size
        if config.draft_vocab_size:
            # the N token ids it drafts over (set from token frequencies in the training data; saved with the weights)
            self.register_buffer("draft_vocab_ids", torch.arange(n_out), persistent=True)
        else:
            self.draft_vocab_ids = None
        if config.own_embeddings:  # frozen copies of the target's table and (draft-vocabulary rows of) LM head
            self.embed_tokens = nn.Embedding(config.vocab_size, h).requires_grad_(False)
            self.lm_head = nn.Linear(h, n_out, bias=False).requires_grad_(False)
        else:
            self.embed_tokens = self.lm_head = None
        if config.sequential_head == "markov":
            self.sequential_head = MarkovHead(config.vocab_size, config.markov_rank, n_out)
        elif config.sequential_head == "gated":
            self.sequential_head = GatedMarkovHead(config.vocab_size, config.markov_rank, h, n_out)
        elif config.sequential_head == "rnn":
            self.sequential_head = RNNHead(config.vocab_size, config.markov_rank, h, n_out)
        else:
            self.sequential_head = None
        feat = 0
        if config.confidence_head_with_markov:
            feat = config.markov_rank if self.sequential_head is not None else h
        self.confidence_head = ConfidenceHead(h, feat) if config.use_confidence_head else None
        self._target = {}  # shared, frozen: {"embed": nn.Embedding, "lm_head": nn.Linear, "model": target, ...}
        self._holders = 0  # calls drafting with the bound target now (drafting_for)
        self.post_init()

    # ------------------------------------------------------------------ binding to a target
    def bind_target(self, target: PreTrainedModel) -> DSparkDraftModel:
        """Share ``target``'s embedding table and LM head (by reference, frozen) after validating the match, and move
        the drafter to the target's device; any earlier binding is replaced: a drafter drafts for one target at a
        time, the target of the call using it.

        The draft layers do not depend on the target's family (they are Qwen3-style or, in older drafters, built
        from the config's own fields), so any supported family with the drafter's shapes fits; the config's
        ``target_model_type`` is set to the bound target's.

        Raises:
            ValueError: naming both values, if hidden size, vocabulary size or number of layers (so the layer ids)
                differ from what this drafter was built for, the target's family is not supported, or the drafter
                is a SpecForge conversion and the target a Gemma model; or another target's call (another thread)
                is drafting with this drafter now (:meth:`drafting_for`).
        """
        tc = target.config.get_text_config()
        c = self.config
        check_target_family(tc.model_type, c.source_format)
        checks = [
            ("hidden size", c.hidden_size, tc.hidden_size),
            ("vocab size", c.vocab_size, tc.vocab_size),
            ("number of decoder layers", c.target_num_hidden_layers, tc.num_hidden_layers),
        ]
        built_for = f" ({c.target_name_or_path})" if c.target_name_or_path else ""
        for what, mine, theirs in checks:
            if mine != theirs:
                raise ValueError(
                    f"drafter/target mismatch: the drafter was built for a target{built_for} with {what} {mine!r}, "
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
        with _BINDING:  # the holders checked, the drafter moved and the binding replaced at once
            if self._holders and self.bound_target is not target:
                raise ValueError("this drafter is drafting for another target in a call still running (another "
                                 "thread); it drafts for one target at a time: give each target its own drafter")
            if self.device != target.device and target.device.type != "meta":  # a meta target holds no weights
                self.to(target.device)  # before the binding changes: a failed move leaves the binding as it was
            c.target_model_type = tc.model_type
            for name in SPECIAL_TOKEN_FIELDS:  # the target's tokenizer is the drafter's (pipeline() compares them)
                setattr(c, name, getattr(tc, name, None))
            self._target = {"embed": embed, "lm_head": lm_head, "model": target}
        return self

    @contextlib.contextmanager
    def drafting_for(self, target: PreTrainedModel):
        """Hold the binding to ``target`` while the block runs (one ``generate()`` call, one engine step): bound to
        ``target`` (and moved to its device) first if need be; until every holder has left, :meth:`bind_target`
        refuses any other target, so threads sharing this drafter draft for one target at a time. The request's own
        checks (block size, policy) are the caller's.

        Raises:
            ValueError: what :meth:`bind_target` refuses, a call for another target still running included.
        """
        with _BINDING:
            if self.bound_target is not target or self.device != target.device:  # another target, or it moved
                self.bind_target(target)
            self._holders += 1
        try:
            yield self
        finally:
            with _BINDING:
                self._holders -= 1

    @property
    def bound_target(self) -> PreTrainedModel | None:
        """The target this drafter is bound to (:meth:`bind_target`), or None."""
        return self._target.get("model")

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
        """Load a drafter from a local directory or a Hub repository id, strict about the checkpoint; optionally
        bind it to ``target`` (:meth:`bind_target`) and move it to the target's device.

        A Hub id is fetched with ``huggingface_hub`` (:func:`modeling_dspark.hub.resolve_pretrained_dir`; the
        keyword arguments ``cache_dir``, ``revision``, ``token``, ``force_download``, ``local_files_only`` and
        ``subfolder`` apply); an existing directory is always read as a path. ``AutoModel.from_pretrained`` lands
        here too. Without ``target`` the drafter binds itself to the target of each
        ``target.generate(ids, assistant_model=drafter)`` call.

        Raises:
            FileNotFoundError: neither a local directory nor a Hub repository that could be fetched.
            OSError: the directory has no ``config.json`` (the drafter's settings: block size, target layers,
                calibration; a LoRA adapter's directory is named as one) or an invalid one (the file is named), no
                safetensors weights, the weights are corrupt, or tensors are missing/unexpected.
            ValueError: the drafter does not match ``target``, or the target's family is not supported.
        """
        from .hub import resolve_pretrained_dir

        hub_args = {k: kwargs.pop(k) for k in ("cache_dir", "revision", "token", "force_download", "local_files_only",
                                               "subfolder") if k in kwargs}
        hub_args["subfolder"] = hub_args.get("subfolder") or ""
        path = resolve_pretrained_dir(pretrained_model_name_or_path, **hub_args)
        name = str(pretrained_model_name_or_path)
        if kwargs.get("config") is None:
            config_file = path / "config.json"
            if not config_file.is_file() and (path / "adapter_config.json").is_file():
                raise OSError(f"{str(path)!r} holds a LoRA adapter: dspark.training.peft_adapt.load_adapter loads it")
            if not config_file.is_file():
                raise OSError(
                    f"drafter directory {str(path)!r} has no config.json: it holds the drafter's settings (block "
                    "size, target layers, STS calibration), which defaults would silently replace; save drafters "
                    "with save_pretrained()"
                )
            from . import formats

            if formats.detect_format(formats.read_json(config_file)) != "dspark":  # ValueError if unknown
                kwargs.pop("config", None)  # None here
                return formats.from_other_format(cls, path, target, *args, **kwargs)
        if not any(f.endswith(".safetensors") for f in os.listdir(path)):
            raise OSError(f"no safetensors weights file in drafter directory {str(path)!r}")
        kwargs["output_loading_info"] = True
        try:
            model, info = super().from_pretrained(path, *args, **kwargs)
        except (OSError, ValueError) as err:
            raise OSError(f"could not load DSpark drafter from {name!r}: {err}") from err
        except Exception as err:  # safetensors raises its own error type for a corrupt header / body
            raise OSError(f"corrupt DSpark checkpoint in {name!r}: {type(err).__name__}: {err}") from err
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise OSError(f"incomplete or incompatible DSpark checkpoint in {name!r}: {bad}")
        if target is not None:
            model.bind_target(target)
        return model

    # ------------------------------------------------------------------ eq. 2
    def encode_context(self, features: torch.Tensor) -> torch.Tensor:
        """H_ctx = RMSNorm(W_c [H^(l_1); …; H^(l_m)]) (eq. 2): ``[B, S, m·H] -> [B, S, H]`` in the drafter's dtype."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        """E[x]·``embedding_scale`` from the raw embedding table (own copy or the target's): ``[...] -> [..., H]``.

        Reading the raw table and scaling here (rather than calling the target's embedding layer) gives Gemma
        targets' √H scale exactly as DFlash's ``input_embedding_scale`` does; the result is in the drafter's dtype.
        """
        table = self.embed_tokens if self.embed_tokens is not None else self.target_embeddings
        x = nn.functional.embedding(token_ids, table.weight)
        if self.config.embedding_scale != 1.0:
            x = x * self.config.embedding_scale
        return x.to(self.fc.weight.dtype)

    def block_slots(self, num_slots: int | None = None) -> int:
        """Slots per block for a round of ``num_slots`` draft tokens (default γ): γ', or γ'+1 when the anchor's slot
        predicts nothing (``anchor_predicts=False``). Attention masks for :meth:`forward` are built with this."""
        gamma = num_slots or self.config.block_size
        return gamma + (0 if self.config.anchor_predicts else 1)

    def embed_block(self, anchor_ids: torch.LongTensor, num_slots: int) -> torch.Tensor:
        """Inputs of the block: E[x_0] then ``num_slots`` − 1 mask slots. ``[B, n] -> [B, n, num_slots, H]``.

        A mask slot is the learned mask embedding (``mask_token_id`` None) or E[mask_token_id].
        """
        if self.mask_embedding is None:
            ids = anchor_ids.new_full((*anchor_ids.shape, num_slots), self.config.mask_token_id)
            ids[..., 0] = anchor_ids
            return self.embed(ids)
        anchor = self.embed(anchor_ids).to(self.mask_embedding.dtype)
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
        block_embeds: torch.Tensor | None = None,
    ) -> DSparkOutput:
        """One parallel forward of n blocks per sequence.

        The block of an anchor at position p has ``L = block_slots(γ')`` slots at positions p..p+L−1 (RoPE), the
        context rows sit at their own positions; the outputs are the γ' slots that draft (all of them, or all but
        the anchor's).

        Args:
            anchor_ids: ``[B, n]`` anchor tokens x_0 (the last committed token of each block).
            anchor_positions: ``[B, n]`` absolute positions of the anchors.
            context_features: ``[B, S, m·H]`` raw target features (eq. 2) of the *new* context rows; with a
                ``cache`` these are appended to it (inference), without one they are the whole context (training).
            context_positions: ``[B, S]`` absolute positions of those rows.
            attention_mask: ``[B, 1, n·L, S_total + n·L]`` bool (True = attend) with L = :meth:`block_slots`, e.g.
                from :func:`modeling_dspark.common.block_attention_mask`; None = every block sees all context
                (n = 1).
            cache: a ``DynamicCache`` holding the context K/V of earlier rounds (inference only).
            num_slots: γ' ≤ γ draft tokens to produce (default ``config.block_size``).
            return_logits: also compute U_k through the LM head.
            block_embeds: ``[B, n, L, H]`` the blocks' inputs in place of :meth:`embed_block` of ``anchor_ids``
                (which may then be None): transformers' DFlash loop hands its assistant embeddings, not ids
                (:mod:`modeling_dspark.dflash`).

        Returns:
            :class:`DSparkOutput` with ``hidden_states [B, n, γ', H]`` and ``base_logits [B, n, γ', N]`` (float32).
        """
        gamma = num_slots or self.config.block_size
        slots = self.block_slots(gamma)
        bsz, n = anchor_positions.shape
        if block_embeds is None:
            block_embeds = self.embed_block(anchor_ids, slots)
        hidden = block_embeds.reshape(bsz, n * slots, -1)
        pos = block_positions(anchor_positions, slots).reshape(bsz, n * slots)
        pos_emb = self.rotary_emb(hidden, pos)
        context = ctx_emb = None
        if context_features is not None and context_features.shape[1] > 0:
            context = self.encode_context(context_features)
            ctx_emb = self.rotary_emb(context, context_positions)
        for layer in self.layers:
            hidden = layer(hidden, pos_emb, context, ctx_emb, attention_mask, cache)
        hidden = self.norm(hidden).reshape(bsz, n, slots, -1)[:, :, slots - gamma :]
        logits = self.lm_logits(hidden) if return_logits else None
        return DSparkOutput(hidden_states=hidden, base_logits=logits)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """U = LM_head(h)·``logit_scale``, soft-capped to c·tanh(U/c) when ``final_logit_softcapping`` = c:
        ``[..., H] -> [..., N]`` float32.

        N = V, or the draft vocabulary size when ``config.draft_vocab_size`` is set (then only the rows
        ``draft_vocab_ids`` of the target's head are used, or the drafter's own N-row head; see
        :meth:`expand_draft_logits`).
        """
        head = self.lm_head if self.lm_head is not None else self.target_lm_head
        if self.lm_head is not None or self.draft_vocab_ids is None:
            logits = head(hidden.to(head.weight.dtype)).float()
        else:
            weight = self._draft_head_weight(head)
            logits = nn.functional.linear(hidden.to(weight.dtype), weight).float()
        return softcap(logits, self.config.final_logit_softcapping, self.config.logit_scale)

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
        :func:`dspark.training.trainer.select_draft_vocab` makes it (otherwise a tie may pick another draft token;
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
        """One left-to-right step of the sequential head: ``prev_token [B]``, ``hidden [B, H]`` →
        ``(B_k [B, N] | None, state)``."""
        if self.sequential_head is None:
            return None, None
        bias, state = self.sequential_head.step(prev_token, hidden, state)
        return bias.float(), state

    def token_features(self, prev_tokens: torch.LongTensor) -> torch.Tensor:
        """Features of x_{k−1}: W_1[x_{k−1}] ``[..., r]``, or E[x_{k−1}] ``[..., H]`` without a sequential head."""
        if self.sequential_head is not None:
            return self.sequential_head.token_features(prev_tokens)
        return self.embed(prev_tokens)

    def confidence_logits(self, prev_tokens: torch.LongTensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """Pre-sigmoid, pre-temperature confidence logits (eq. 7): ``[...]`` float32, or None without the head.

        wᵀ[h_k; W_1[x_{k−1}]] + b (``confidence_head_with_markov``, the default), or wᵀh_k + b without the Markov
        features. ``prev_tokens [...]`` are x_{k−1} (the anchor for the first draft token), ``hidden [..., H]`` h_k.
        """
        if self.confidence_head is None:
            return None
        feats = self.token_features(prev_tokens) if self.config.confidence_head_with_markov else None
        return self.confidence_head(hidden, feats)

    def calibrated_confidence(self, logits: torch.Tensor, positions) -> torch.Tensor:
        """c_k = σ(logit_k / T_k + b_k) with the STS temperatures (docs/method.md §3) and logit offsets
        (``sts_biases``, 0 unless calibrated with ``--bias``) of the config; ``positions`` are 0-based k−1."""
        key = (tuple(self.config.sts_temperatures), tuple(self.config.sts_biases), logits.device)
        cached = self._target.get("sts")
        if cached is None or cached[0] != key:  # the config's lists as tensors, made once per setting and device
            cached = (key, torch.tensor(key[0], dtype=torch.float32, device=logits.device),
                      torch.tensor(key[1], dtype=torch.float32, device=logits.device))
            self._target["sts"] = cached
        _, temps, biases = cached
        return torch.sigmoid(logits / temps[positions] + biases[positions])
