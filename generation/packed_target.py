"""The target's packed verify forward: R requests' new tokens in ONE forward, each request with its own K/V cache.

A round concatenates the new tokens of all requests into one sequence of B = Σ_r (1 + ℓ_r) tokens (``[1, B]``, per-token
position ids), so every linear layer runs once over B tokens (the LM head too, but at a prefilled prompt's last token
only), the batch that the scheduler's SPS(B) table describes (no padding). Attention is the only per-request part: a
small attention function (registered with transformers' ``AttentionInterface``, switched on for the forward only)
writes each request's new K/V into its own :class:`RequestKV` and runs SDPA over that cache alone, causal inside the
new tokens. Rejected draft tokens are dropped by cropping the cache. Full-attention decoder families only
(sliding-window layers are refused). Not thread-safe: no other thread may use the target during a packed forward (it
switches its attention function).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Sequence

import torch

from .kv import RequestKV

__all__ = ["PackedTarget"]

_ATTN_NAME = "dspark_packed"
_swap_lock = threading.RLock()


class _Layout:
    """Per-forward description of the packed sequence: (cache, start position, number of tokens, mask) per request."""

    __slots__ = ("segments",)

    def __init__(self, segments):
        self.segments = segments


def _packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention over per-request caches for a packed ``[1, B]`` query (see the module doc); without a layout (a
    plain call while the engine's implementation is switched on), ordinary SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = kwargs.get("dspark_layout")
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    outs, off = [], 0
    for kv, start, q, mask in layout.segments:
        k_all, v_all = kv.write(module.layer_idx, start, key[:, :, off : off + q], value[:, :, off : off + q])
        outs.append(sdpa_attention_forward(module, query[:, :, off : off + q], k_all, v_all, mask, dropout=0.0,
                                           scaling=scaling, is_causal=True)[0])
        off += q
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


@functools.cache
def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTN_NAME, _packed_attention)


@contextlib.contextmanager
def _packed_attention_mode(model):
    """Switch ``model`` to the packed attention for the duration of one forward, then restore it."""
    _register_attention()
    cfg = model.config
    with _swap_lock:
        old = cfg._attn_implementation
        cfg._attn_implementation = _ATTN_NAME
        try:
            yield
        finally:
            cfg._attn_implementation = old


class PackedTarget:
    """Runs a causal-LM target over the new tokens of several requests in one forward (per-request KV caches).

    Args:
        target: a transformers ``*ForCausalLM`` with full attention in every layer.

    Raises:
        ValueError: a sliding-window layer in ``layer_types``, or a window shorter than the model's context.
    """

    def __init__(self, target):
        cfg = target.config.get_text_config()
        types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if window and window < getattr(cfg, "max_position_embeddings", window + 1):  # Mistral's, whatever its types
            types = [*(types or []), "sliding_attention"]
        if types and any(t != "full_attention" for t in types):
            raise ValueError(f"the batched engine packs full-attention layers only; this target has {set(types)} "
                             f"(sliding_window={window}): decode it with generate(assistant_model=drafter)")
        self.target = target
        self.num_layers = cfg.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return self.target.device

    def new_cache(self, capacity: int = 256) -> RequestKV:
        return RequestKV(self.num_layers, capacity)

    @torch.no_grad()
    def forward(self, segments: Sequence[tuple[RequestKV, torch.Tensor]], output_hidden_states: bool = False,
                last_only: int = 0):
        """One packed forward; returns ``(logits [B', V], hidden_states | None)`` with the segments' tokens in order.

        Args:
            segments: per request ``(cache, new_ids [q])``, the new tokens at positions ``cache.length`` on;
                afterwards ``cache.length`` has grown by q (crop it to drop rejected tokens).
            output_hidden_states: also return the hidden states tuple (index 0 = embeddings), each ``[1, B, H]``.
            last_only: the last this many segments (prefills) get logits at their last token only, so B' is the
                other segments' tokens plus ``last_only``: the LM head skips the prompt positions nobody reads.
        """
        if not segments or not 0 <= last_only <= len(segments):
            raise ValueError(f"forward needs segments and 0 <= last_only <= {len(segments)}, got {last_only}")
        device = self.device
        ids, pos, layout, keep, off = [], [], [], [], 0  # off: the segment's first row in the packed tokens
        for i, (kv, new_ids) in enumerate(segments):
            new_ids = torch.as_tensor(new_ids, dtype=torch.long, device=device).reshape(-1)
            q, start = new_ids.numel(), kv.length
            if q == 0:
                raise ValueError("every segment needs at least one token")
            # causal inside the new tokens, all before them visible; q = 1 sees all, an empty cache's prefill is_causal
            mask = torch.ones(q, start + q, dtype=torch.bool, device=device).tril(diagonal=start)[None, None] \
                if q > 1 and start > 0 else None
            if last_only:  # the rows the LM head reads: all of the first segments', a prefill's last
                keep += [off + q - 1] if i >= len(segments) - last_only else range(off, off + q)
            off += q
            ids.append(new_ids)
            pos.append(torch.arange(start, start + q, device=device))
            layout.append((kv, start, q, mask))
        with _packed_attention_mode(self.target):
            out = self.target(
                input_ids=torch.cat(ids)[None],
                position_ids=torch.cat(pos)[None],
                use_cache=False,
                output_hidden_states=output_hidden_states,
                dspark_layout=_Layout(layout),
                logits_to_keep=torch.tensor(keep, device=device) if last_only else 0,
            )
        for kv, _, q, _ in layout:
            kv.length += q
        return out.logits[0], (out.hidden_states if output_hidden_states else None)
