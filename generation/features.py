"""The target features the drafter conditions on (docs/method.md §2, eq. 2): which hidden states to ask the target
for, and their concatenation. Used at inference (the `generate()` adapter, the engine) and in training (the trainer
and its feature cache read the same rows)."""

from __future__ import annotations

import torch

__all__ = ["context_features", "hidden_state_indices"]


def hidden_state_indices(target_layer_ids) -> list[int]:
    """Indices into ``outputs.hidden_states`` for the raw outputs of decoder layers ``target_layer_ids``:
    transformers puts the embeddings at index 0, so layer ``l`` is index ``l + 1``."""
    return [int(i) + 1 for i in target_layer_ids]


def context_features(hidden_states, target_layer_ids, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Concatenate the raw decoder-layer outputs ``[H^(l_1); …; H^(l_m)]`` of eq. 2.

    Args:
        hidden_states: the tuple ``outputs.hidden_states`` of a target forward (index 0 = embeddings).
        target_layer_ids: the m decoder layers to read (never the last one: transformers returns the
            final *normed* state there).
        start, end: slice of sequence positions to keep.

    Returns:
        ``[batch, end - start, m * hidden_size]`` in the target's dtype.
    """
    return torch.cat([hidden_states[i][:, start:end] for i in hidden_state_indices(target_layer_ids)], dim=-1)
