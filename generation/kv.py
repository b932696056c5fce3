"""The per-request K/V cache: the target's in the packed verify forward (:mod:`dspark.generation.packed_target`) and the
drafter's context cache (:class:`dspark.generation.drafting.DraftContext`)."""

from __future__ import annotations

import torch

__all__ = ["RequestKV"]


class RequestKV:
    """K/V cache of one request: per layer a ``[1, kv_heads, capacity, head_dim]`` buffer whose first ``length``
    positions are valid, allocated at the first write (the keys' dtype/device) and doubled when a write overflows it."""

    def __init__(self, num_layers: int, capacity: int = 256):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.capacity = max(1, int(capacity))
        self.length = 0

    def write(self, layer: int, start: int, key: torch.Tensor, value: torch.Tensor):
        """Store ``key/value [1, kvh, q, d]`` at positions ``start..start+q-1``; return the K/V of ``[0, start+q)``."""
        end = start + key.shape[2]
        buf = self.keys[layer]
        if buf is None or end > buf.shape[2]:
            cap = max(end, self.capacity if buf is None else 2 * buf.shape[2])
            new_k = key.new_empty(key.shape[0], key.shape[1], cap, key.shape[3])
            new_v = value.new_empty(value.shape[0], value.shape[1], cap, value.shape[3])
            if buf is not None:
                new_k[:, :, :start] = buf[:, :, :start]
                new_v[:, :, :start] = self.values[layer][:, :, :start]
            self.keys[layer], self.values[layer] = new_k, new_v
            self.capacity = cap
        self.keys[layer][:, :, start:end] = key
        self.values[layer][:, :, start:end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (drop rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length
