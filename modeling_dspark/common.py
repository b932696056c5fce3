"""Anchors, block positions and the block attention mask (docs/method.md §2), shared by inference and training."""

from __future__ import annotations

import torch


def block_positions(anchor_positions: torch.LongTensor, num_slots: int) -> torch.LongTensor:
    """Positions of the γ slots of each block: anchor position p, then p+1 … p+γ−1.

    ``anchor_positions [B, n] -> [B, n, γ]``. Slot i (position p+i) predicts the token at position p+i+1, i.e. the
    token i+1 places after the anchor (docs/method.md §2: all γ slots predict).
    """
    return anchor_positions.unsqueeze(-1) + torch.arange(num_slots, device=anchor_positions.device)


def block_attention_mask(
    anchor_positions: torch.LongTensor,
    context_positions: torch.LongTensor,
    num_slots: int,
    context_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean attention mask for n packed blocks attending to ``[context; all blocks]`` (True = attend).

    A block sees the target context strictly before its anchor (the anchor itself has not been processed by the
    target at inference time) and itself bidirectionally; it never sees another block.

    Args:
        anchor_positions: ``[B, n]`` absolute position p of each block's anchor.
        context_positions: ``[B, S]`` absolute positions of the context features.
        num_slots: γ.
        context_valid: optional ``[B, S]`` bool, False for padding.

    Returns:
        ``[B, 1, n·γ, S + n·γ]`` bool.
    """
    bsz, n = anchor_positions.shape
    q_block = torch.arange(n, device=anchor_positions.device).repeat_interleave(num_slots)  # [nγ]
    q_anchor = anchor_positions.repeat_interleave(num_slots, dim=1)  # [B, nγ]
    ctx = context_positions.unsqueeze(1) < q_anchor.unsqueeze(-1)  # [B, nγ, S]
    if context_valid is not None:
        ctx = ctx & context_valid.unsqueeze(1)
    own = (q_block.unsqueeze(-1) == q_block.unsqueeze(0)).expand(bsz, -1, -1)  # [B, nγ, nγ]
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


def gather_slots(values: torch.Tensor, anchor_positions: torch.LongTensor, num_slots: int) -> torch.Tensor:
    """``values`` at the block slots p..p+γ−1 of every anchor, clamped to the last position.

    Args:
        values: ``[B, L]`` or ``[B, L, X]`` per-position values (e.g. the target's hidden states or logsumexp).
        anchor_positions: ``[B, n]`` anchor positions p.
        num_slots: γ.

    Returns:
        ``[B, n, γ]`` or ``[B, n, γ, X]``.
    """
    bsz, length = values.shape[:2]
    n = anchor_positions.shape[1]
    slots = block_positions(anchor_positions, num_slots).clamp(max=length - 1).reshape(bsz, n * num_slots)
    if values.dim() == 2:
        return values.gather(1, slots).reshape(bsz, n, num_slots)
    return values.gather(1, slots[..., None].expand(-1, -1, values.shape[-1])).reshape(bsz, n, num_slots, -1)


def softcap(logits: torch.Tensor, cap: float | None, scale: float = 1.0) -> torch.Tensor:
    """A target family's logits from its LM head's output U: c·tanh(s·U / c) (Gemma's ``final_logit_softcapping`` c;
    s: Granite's 1 / ``logits_scaling``, Cohere's ``logit_scale``); identity for ``cap`` None and ``scale`` 1."""
    logits = logits if scale == 1.0 else logits * scale
    return logits if cap is None else torch.tanh(logits / cap) * cap
