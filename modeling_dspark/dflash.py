"""A DSpark drafter in transformers' own DFlash loop: ``generate(..., speculation_type="dflash")``.

transformers ships a DFlash candidate generator (`DFlashTokenCandidateGenerator`): every round it calls its assistant
with the embeddings of the anchor and ``block_size − 1`` mask tokens (``noise_embeds``), the target's hidden states at
``config.target_layer_ids`` for the newly committed positions (``context_hidden_states``), their positions followed by
the block's (``position_ids``), the attention mask and a `DFlashCache`; it applies the target's LM head to
``last_hidden_state[:, 1:]`` and verifies all ``block_size − 1`` drafts. No scheduling, no lookup, no sequential
head: the loop reads the parallel backbone alone (eqs. 2–4). :class:`DFlashAssistant` exposes a DSpark drafter's
backbone behind that interface, so the same weights run in transformers' loop, with no dspark code deciding anything::

    assistant = DFlashAssistant(drafter)                     # drafter bound to target
    out = target.generate(ids, assistant_model=assistant, speculation_type="dflash", max_new_tokens=64)

What differs from dspark's own `generate(assistant_model=drafter)`: the drafts are the argmax (or a sample) of the
backbone's logits U_k over the full vocabulary (no Markov correction B_k, no reduced draft vocabulary), and the whole
block is verified every round. The output is the target's either way (transformers verifies every draft).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutput

__all__ = ["DFlashAssistant"]


class DFlashAssistant(nn.Module):
    """A bound :class:`~modeling_dspark.DSparkDraftModel` with the assistant interface transformers' DFlash loop calls.

    ``config`` carries what the loop reads: ``target_layer_ids``, ``block_size`` (γ + 1: the anchor's slot and γ
    drafts) and ``mask_token_id``; it describes no cache layers, so the loop's `DFlashCache` stays empty and its
    per-round crop of the block is a no-op. The drafter's context K/V live in a `DynamicCache` of this object per
    `DFlashCache` (one per `generate()` call), appended to each round and never cropped: the context rows a round
    adds are committed tokens only.

    Args:
        drafter: a DSpark drafter bound to its target (:meth:`DSparkDraftModel.bind_target`).
        block_size: γ' drafts per round (default the drafter's γ).

    Raises:
        ValueError: the drafter is not bound to a target, has its own LM head (transformers applies the target's),
            or ``block_size`` is outside [1, γ].
    """

    def __init__(self, drafter, block_size: int | None = None):
        super().__init__()
        cfg = drafter.config
        if drafter.bound_target is None:
            raise ValueError("DFlashAssistant needs a drafter bound to its target: "
                             "DSparkDraftModel.from_pretrained(path, target=target)")
        if drafter.lm_head is not None:
            raise ValueError("this drafter has its own LM head; transformers' DFlash loop applies the target's LM head "
                             "to the assistant's hidden states, so it would draft from other logits")
        gamma = cfg.block_size if block_size is None else block_size
        if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= cfg.block_size:
            raise ValueError(f"block_size must be an int in [1, {cfg.block_size}] for this drafter; got {block_size!r}")
        self.drafter = drafter
        self.gamma = gamma
        # any id embeds the mask slots: the backbone's own mask inputs replace them (_block_embeds)
        mask_token_id = cfg.mask_token_id if cfg.mask_token_id is not None else 0
        self.config = PretrainedConfig(target_layer_ids=list(cfg.target_layer_ids), block_size=gamma + 1,
                                       mask_token_id=mask_token_id, num_hidden_layers=0)
        self._context_kv: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    def _block_embeds(self, noise_embeds: torch.Tensor) -> torch.Tensor:
        """The backbone's block inputs ``[1, 1, L, H]`` (L = ``block_slots(γ')``): the loop's anchor embedding E[x_0]
        (row 0 of ``noise_embeds``), then the drafter's own mask slots (E[mask_token_id] or the learned mask)."""
        drafter = self.drafter
        slots = drafter.block_slots(self.gamma)
        anchor = noise_embeds[:, :1].to(drafter.fc.weight.dtype)
        if drafter.mask_embedding is None:
            mask_ids = torch.full((1, slots - 1), drafter.config.mask_token_id, device=anchor.device)
            masks = drafter.embed(mask_ids)
        else:
            masks = drafter.mask_embedding.to(anchor.dtype).expand(1, slots - 1, -1)
        return torch.cat([anchor, masks], dim=1)[:, None]

    @torch.no_grad()
    def forward(self, noise_embeds: torch.Tensor, context_hidden_states: torch.Tensor, position_ids: torch.LongTensor,
                attention_mask: torch.Tensor | None = None, cache=None, **kwargs) -> BaseModelOutput:
        """One DFlash round.

        Args:
            noise_embeds: ``[1, γ'+1, H]`` embeddings of the anchor x_0 and γ' mask tokens (only row 0 is read).
            context_hidden_states: ``[1, S, m·H]`` target features (eq. 2) of the S newly committed positions.
            position_ids: ``[1, S + γ' + 1]`` their positions, then the block's (the anchor's first).
            attention_mask: the loop's 2-D mask; the drafter reads every committed position (padding in it can change
                which drafts are proposed, never the output).
            cache: the loop's `DFlashCache`, the key of this call's context K/V.

        Returns:
            `BaseModelOutput` with ``last_hidden_state [1, γ'+1, H]`` in the embeddings' dtype: a placeholder row, then
            h_1..h_γ' (the loop drops row 0 and applies the target's LM head to the rest).
        """
        num_context = context_hidden_states.shape[1]
        if cache is None:
            kv = DynamicCache()
        else:
            kv = self._context_kv.get(cache)
            if kv is None:
                kv = self._context_kv[cache] = DynamicCache()
        out = self.drafter(anchor_ids=None, anchor_positions=position_ids[:, num_context : num_context + 1],
                           context_features=context_hidden_states, context_positions=position_ids[:, :num_context],
                           cache=kv, num_slots=self.gamma, return_logits=False,
                           block_embeds=self._block_embeds(noise_embeds))
        hidden = out.hidden_states[:, 0].to(noise_embeds.dtype)  # [1, γ', H]
        return BaseModelOutput(last_hidden_state=torch.cat([hidden[:, :1], hidden], dim=1))
