"""Batched speculative decoding with continuous batching: :class:`DSparkEngine` (greedy only).

transformers' assisted decoding is batch size 1. This engine serves R concurrent requests with a DSpark drafter:
every round it drafts for all running requests, chooses a verify length ℓ_r per request (a static policy, a
confidence threshold, DSpark's Algorithm 1 over all R requests, or the two-round-lag budget variant; SPEC §4),
verifies all requests in ONE packed target forward, and accepts a different number of tokens per request.

Design (correctness first):

* **Packed verify forward with per-request KV caches.** Each request owns a :class:`RequestKV` (one preallocated
  K/V buffer per target layer). A round concatenates the new tokens of all requests into one sequence of
  B = Σ_r (1 + ℓ_r) tokens (``[1, B]``, per-token position ids), so every linear layer and the LM head run once
  over B tokens, exactly the batch the scheduler's SPS(B) table describes (no padding to the longest request).
  Attention is the only per-request part: a small attention function (registered with transformers'
  ``AttentionInterface`` and switched on only for the duration of the engine's forward) writes each request's new
  K/V into its own cache and runs SDPA over that cache alone, causal inside the new tokens. Rejected draft
  tokens are dropped by cropping the cache length; nothing else needs masking.
* **Per-request drafter context caches.** The drafter ingests, per request, the target features of the tokens
  committed since its last round (as :class:`~generation.candidate_generator.DSparkCandidateGenerator` does),
  then runs one block forward; the sequential part (confidence c_k, correction B_k, argmax) is batched over the
  requests still drafting at slot k.
* **Lazy drafting, non-anticipating decisions.** Slot k of request r is drafted only if the policy, looking at
  the calibrated confidences known so far (c_{r,k} included, x_{r,k} not yet sampled), would verify it. For
  Algorithm 1 this is the same left-to-right evaluation as the R = 1 :class:`~generation.policies.PrefixScheduler`.
* **Continuous batching.** :meth:`DSparkEngine.add_request` may be called at any time; waiting requests join at
  the next :meth:`~DSparkEngine.step` (their prompts are prefilled in one packed forward) while at most
  ``max_batch_size`` requests run. Requests finish independently (EOS or ``max_new_tokens``).

Draft cost and draft gate (``scheduler`` / ``lagged``; not in the paper, which prices the verify batch only):

* **Draft cost.** A round that drafts lasts T_verify(B) + t_draft(n), n = requests drafting. The policies are fed
  SPS_eff(B) = 1 / (1/SPS(B) + t_draft(n)) (:func:`generation.scheduler.effective_sps`) instead of SPS(B), so
  Algorithm 1 (and the lagged budget search) maximise committed tokens per second of the whole round. t_draft(n)
  comes from ``draft_cost_ms``: by default (``"auto"``) a moving average (weight :attr:`DSparkEngine.DRAFT_TIME_EMA`)
  of this engine's own measured drafting time per n, linear in between measured n, nearest outside, from
  steady-state rounds only (a round where a drafting request first catches up on more than γ' + 1 positions, after
  its prefill or a run of gated rounds, is not measured: that catch-up is paid once whenever it drafts); the first
  steady drafting rounds measure it (0 until then). A fixed number of ms, or None (unpriced, paper behaviour),
  also work.
* **Draft excess.** The measured parts of the model are taken apart (verify times per kind of round below, drafting
  time from steady rounds only), so a drafting round can cost more than their sum: the round's bookkeeping grows
  with its draft tokens, and a request drafting after gated rounds first catches up on them. (The step that a verify
  batch pays for holding any draft token, ~5 ms on SmolLM2-135M at R = 4, is priced by the verify-time correction's
  offset o₁, fitted apart from the B = R rounds.) :meth:`~DSparkEngine.draft_excess` keeps, per R, a decayed mean
  (:attr:`~DSparkEngine.EXCESS_DECAY`) of measured − modelled time of the rounds that drafted, and the gate and the
  policies price t_draft(n) + excess (``draft_cost_ms="auto"`` only). A round where a drafting request first catches
  up on more than 2(γ' + 1) positions (two fully accepted drafting rounds' worth: a prompt, or a run of gated
  rounds, each of which adds its committed tokens, one or more) is left out, the cut-off the drafting veto uses:
  such a catch-up is paid whenever the request drafts again, now or later, so it is hardly a cost of drafting now
  rather than skipping, and counted, it made drafting look dearest exactly while the gate drafted rarely (re-probes
  after long skips; the gate then stayed closed at R = 2 in float32 on the AVX2 EPYC, README). A re-probe round (the
  gate's, or the first round of a veto probe; its second round follows a drafting round and counts as steady)
  follows gated rounds, so its drafting request first catches up on them, however few: its residual over-states a
  steady round's and may only lower the excess (folded in when below the current excess, else left out, whatever
  its catch-up; never while this R has no excess yet). Counted in full, re-probes after 8–16 gated rounds
  (catch-ups under the cut-off) kept the excess at +4 to +9 ms at R = 2 in float32 on the EPYC and the gate closed
  (README); left out entirely, an excess that steady rounds had left high would never come down while the gate
  stays closed. The rule is one-sided: while the gate is closed the excess drifts toward the lowest probe residuals
  (noise included), possibly below what steady rounds cost, until steady rounds raise it again; and an excess too
  high by less than a probe's catch-up costs still does not come down. Shorter catch-ups in steady rounds (after a
  pairing round) still count.
* **Measured verify time.** The SPS table is a microbenchmark of the bare forward; a serving round also pays the
  packing, acceptance and bookkeeping around it, and the table can be off for the machine's current state. With
  ``sps_correction`` (default) the engine fits, per R, the residual (measured verify time − 1/SPS(B)) in two
  parts (:meth:`~DSparkEngine.verify_correction`): a decayed mean o₀ over rounds that verified no draft
  token (B = R), and a decayed least-squares line o₁ + s · (B − R − 1) over rounds that did (slope s ≥ 0,
  ridge-shrunk toward 0, :attr:`~DSparkEngine.VERIFY_SLOPE_PRIOR`). A verify batch that holds any draft
  token costs a step more than the table's slope gives, and one line through both kinds of round reads that step
  as a per-token slope, pricing every draft token too high. Decisions use SPS'(B) = 1 / max(½ / SPS(B), t'(B))
  with t'(R) = 1/SPS(R) + o₀ and, for B > R, t'(B) = max(t'(R), 1/SPS(B) + o₁ + s · (B − R − 1)):
  non-increasing like SPS. o₁ is shrunk toward o₀ (:attr:`~DSparkEngine.VERIFY_STEP_PRIOR` pseudo-rounds) and the
  drafting part ages every round, so a few stalled drafting rounds stop steering while only B = R rounds follow; a
  part with no rounds yet borrows the other's offset. Timing only steers decisions, never the output.
* **Draft gate.** Before drafting, the engine decides from PAST rounds only whether drafting is expected to pay,
  per request: each request keeps decayed sums (:attr:`~DSparkEngine.YIELD_DECAY`) of its realized yield in the
  rounds it drafted, [accepted, verified] draft tokens under the policy's own ℓ (so the option of verifying little
  after seeing low confidences is priced in, and an over-confident drafter yields little), shrunk toward an
  engine-wide average for the current R (:meth:`~DSparkEngine.yield_prior`, :attr:`~DSparkEngine.YIELD_PRIOR_ROUNDS`
  pseudo-rounds), which alone serves requests without history.
  :func:`generation.scheduler.yield_gate` ranks requests by expected accepted tokens and scans every prefix,
  Θ_n = (R + Σ accepted) / (1/SPS(R + Σ verified) + t_draft(n)), against the no-drafting R·SPS(R); only the
  requests in the best prefix draft (the others verify their anchor token only, and their drafter context catches
  up when they next draft). Nothing is drafted when (``scheduler``) Algorithm 1 would admit nothing even at a = 1 (a
  verdict that rests on measured times is re-probed like a gate decision; one from the table alone is not). A gated
  round re-probes after 1, 2, 4, … up to ``probe_max_interval`` consecutive gated rounds: the gated request skipped
  longest drafts too, refreshing its estimate; the back-off (kept per R) resets when the gate drafts every request at
  that R. The gate never looks at this round's confidences or draft tokens, so outputs stay exact;
  :class:`EngineRound` records ``gated`` and ``probe``, :meth:`EngineStats.summary` the skipped-draft / gated / probe
  counts. A new engine drafts every request until the draft cost is measured and a yield prior exists; the learned
  state (draft-time averages, yield priors, verify-time fits, draft excess, probe back-off) persists across requests,
  as in a long-running server. Nothing is drafted when, before any yield estimate, even perfect drafts (all a = 1)
  could not pay.
* **Drafting veto.** The gate's cost model is measured in parts and can still miss what a drafting round costs as
  a whole. :class:`generation.round_rates.RoundRates` compares, per R, the committed tokens per wall second of the
  engine's rounds that drafted with those of the rounds that did not, paired in time (windows of at least a
  second and 16 mean rounds, so that the machine's drift cancels); while the drafting rounds at this R (or, before it is measured, at
  the largest smaller R measured) are the slower ones with one standard error to spare
  (:meth:`~generation.round_rates.RoundRates.ratio_upper` below 1), the gate skips drafting at this R, re-probing
  with its back-off (up to ``probe_max_interval`` rounds): a probe drafts the request skipped longest, for
  :attr:`DSparkEngine.VETO_PROBE_ROUNDS` rounds in a row, and asks whether drafting even one request pays at this
  R (``drafting_veto``, default True). To keep the two kinds paired, a window half over with drafting rounds only
  skips drafting for one round (at most one per window).
  :class:`EngineRound` records the veto's part in a round (``veto``), :meth:`EngineStats.summary` the counts. On
  SmolLM2-135M (bf16, 2 threads) the model-gated scheduler without the veto drafted in 37 of 69 rounds at R = 4,
  where drafting does not pay, and lost 6 % to no speculation (``dspark bench serve``, README).

Greedy only: each request's output equals ``target.generate(prompt, max_new_tokens=n, do_sample=False)`` (token
for token in float32; no logits processors). Not thread-safe: while :meth:`DSparkEngine.step` runs, the target
must not be used from another thread (its attention implementation is switched for the duration of the call).
Full-attention decoder families only (Llama, Qwen2, … as the drafter supports); sliding-window layers are refused.

Policies (``policy=``): ``"none"`` (no speculation: one token per request per round), ``"fixed:N"`` (verify N
drafted tokens, ``"fixed:1"`` is the MTP-1 analogue), ``"full"`` (the whole block), ``"threshold:P"`` (DeepSpec
style: verify while the survival Π c_k ≥ P), ``"scheduler"`` (DSpark Algorithm 1 over all running requests,
:func:`generation.scheduler.prefix_schedule`), ``"lagged"`` / ``"lagged:LAG"`` (the production variant: the verify
budget comes from the confidences of LAG = 2 rounds earlier, filled by the current ranking).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from modeling_dspark.target import context_features

from .round_rates import RoundRates
from .scheduler import (
    MissingSPSEntry,
    budget_from_confidences,
    draft_gate,
    effective_sps,
    fill_budget,
    prefix_schedule,
    yield_gate,
)
from .stats import GenerationStats, RoundStats

__all__ = [
    "DSparkEngine",
    "EngineRound",
    "EngineStats",
    "PackedTarget",
    "RequestKV",
    "RequestOutput",
    "VerifyCorrection",
    "generate_batch",
    "parse_engine_policy",
    "ENGINE_POLICIES",
]

ENGINE_POLICIES = ("none", "fixed:N", "full", "threshold:P", "scheduler", "lagged[:LAG]")

# ---------------------------------------------------------------------------------------------- packed target
_ATTN_NAME = "dspark_packed"
_registered = False
_swap_lock = threading.RLock()


class RequestKV:
    """Target K/V cache of one request: per layer a ``[1, kv_heads, capacity, head_dim]`` buffer.

    ``length`` positions are valid. Buffers are allocated at the first write (dtype/device of the keys) with
    ``capacity`` slots and grow by doubling if a write goes beyond it.
    """

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


class _Layout:
    """Per-forward description of the packed sequence: (cache, start position, number of tokens, mask) per request."""

    __slots__ = ("segments",)

    def __init__(self, segments):
        self.segments = segments


def _packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention over per-request caches for a packed ``[1, B]`` query (see the module doc).

    Without a layout (a plain call while the engine's implementation is switched on) it is ordinary SDPA.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = kwargs.get("dspark_layout")
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    outs, off = [], 0
    for kv, start, q, mask in layout.segments:
        k_all, v_all = kv.write(module.layer_idx, start, key[:, :, off : off + q], value[:, :, off : off + q])
        out, _ = sdpa_attention_forward(
            module, query[:, :, off : off + q], k_all, v_all, mask, dropout=0.0, scaling=scaling, is_causal=True
        )
        outs.append(out)
        off += q
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def _register_attention() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(_ATTN_NAME, _packed_attention)
        _registered = True


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


class _BatchedDraftContext:
    """Duck-typed cache for ONE batched drafter forward over A requests with per-request context caches.

    The drafter's attention calls ``update(k_new [A, kvh, S_max, d], v_new, layer)`` with the K/V of the new context
    rows (right-padded to S_max); this writes each request's ``counts[a]`` valid rows into its own
    :class:`RequestKV` and returns the full contexts right-padded to the longest (``[A, kvh, L_max, d]``); the
    attention mask built by the engine hides the padding.
    """

    def __init__(self, caches: list[RequestKV], counts: list[int]):
        self.caches, self.counts = caches, counts
        self.starts = [kv.length for kv in caches]
        self.ends = [st + n for st, n in zip(self.starts, counts)]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        l_max = max(self.ends)
        shape = (len(self.caches), key.shape[1], l_max, key.shape[3])
        k_out, v_out = key.new_zeros(shape), value.new_zeros(shape)
        for a, (kv, st, n) in enumerate(zip(self.caches, self.starts, self.counts)):
            k_all, v_all = kv.write(layer_idx, st, key[a : a + 1, :, :n], value[a : a + 1, :, :n])
            k_out[a, :, : st + n] = k_all[0]
            v_out[a, :, : st + n] = v_all[0]
        return k_out, v_out

    def commit(self) -> None:
        for kv, end in zip(self.caches, self.ends):
            kv.length = end


class PackedTarget:
    """Runs a causal-LM target over the new tokens of several requests in one forward (per-request KV caches).

    Args:
        target: a transformers ``*ForCausalLM`` with full attention in every layer.

    Raises:
        ValueError: the model has sliding-window / non-full attention layers.
    """

    def __init__(self, target):
        cfg = target.config.get_text_config()
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"PackedTarget supports full-attention layers only; this target has {set(layer_types)}")
        if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
            raise ValueError("PackedTarget does not support sliding-window attention")
        self.target = target
        self.num_layers = cfg.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return self.target.device

    def new_cache(self, capacity: int = 256) -> RequestKV:
        return RequestKV(self.num_layers, capacity)

    @torch.no_grad()
    def forward(self, segments: Sequence[tuple[RequestKV, torch.Tensor]], output_hidden_states: bool = False):
        """One packed forward.

        Args:
            segments: per request ``(cache, new_ids [q])``; the new tokens take positions
                ``cache.length .. cache.length + q - 1``. Afterwards ``cache.length`` has grown by q (crop it to drop
                rejected tokens).
            output_hidden_states: also return the hidden states tuple (index 0 = embeddings), each ``[1, B, H]``.

        Returns:
            ``(logits [B, V], hidden_states | None)`` with the segments' tokens in order.
        """
        if not segments:
            raise ValueError("PackedTarget.forward needs at least one segment")
        device = self.device
        ids, pos, layout = [], [], []
        for kv, new_ids in segments:
            new_ids = torch.as_tensor(new_ids, dtype=torch.long, device=device).reshape(-1)
            q, start = new_ids.numel(), kv.length
            if q == 0:
                raise ValueError("every segment needs at least one token")
            if q > 1 and start > 0:  # causal inside the new tokens, everything before them visible
                mask = torch.ones(q, start + q, dtype=torch.bool, device=device).tril(diagonal=start)[None, None]
            else:  # q == 1: sees all; prefill of an empty cache: is_causal
                mask = None
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
            )
        for kv, _, q, _ in layout:
            kv.length += q
        return out.logits[0], (out.hidden_states if output_hidden_states else None)


# ---------------------------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class _PolicySpec:
    kind: str  # none | fixed | full | threshold | scheduler | lagged
    value: float = 0.0

    @property
    def name(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.value)}"
        if self.kind == "threshold":
            return f"threshold:{self.value:g}"
        if self.kind == "lagged":
            return f"lagged:{int(self.value)}"
        return self.kind


def parse_engine_policy(spec: str) -> _PolicySpec:
    """Parse ``none``, ``fixed:N``, ``full``, ``threshold:P``, ``scheduler`` or ``lagged[:LAG]``.

    Raises:
        ValueError: unknown name or bad argument.
    """
    if not isinstance(spec, str):
        raise ValueError(f"engine policy must be a string (one of {', '.join(ENGINE_POLICIES)}); got {spec!r}")
    name, _, arg = spec.strip().partition(":")
    try:
        if name in ("none", "full", "scheduler") and not arg:
            return _PolicySpec(name)
        if name == "fixed":
            n = int(arg or 1)
            if n < 0:
                raise ValueError
            return _PolicySpec("fixed", n)
        if name == "threshold":
            p = float(arg or 0.5)
            if not 0.0 <= p <= 1.0:
                raise ValueError
            return _PolicySpec("threshold", p)
        if name == "lagged":
            lag = int(arg or 2)
            if lag < 1:
                raise ValueError
            return _PolicySpec("lagged", lag)
    except ValueError:
        raise ValueError(f"bad argument in engine policy {spec!r}") from None
    raise ValueError(f"unknown engine policy {spec!r}; use one of {', '.join(ENGINE_POLICIES)}")


def _sps_value(sps, batch_tokens: int) -> float:
    """SPS(B) from a mapping or a callable, with the scheduler's error for a missing table entry."""
    if isinstance(sps, Mapping):
        if batch_tokens not in sps:
            raise MissingSPSEntry(f"SPS table has no entry for verify batch size B = {batch_tokens}")
        return float(sps[batch_tokens])
    return float(sps(batch_tokens))


class _CorrectedSPS:
    """SPS'(B) = 1 / max(½ / SPS(B), t'(B)): the table's curve with the engine's measured verify-time correction
    (module doc): t'(R) = 1/SPS(R) + o₀; t'(B) = max(t'(R), 1/SPS(B) + o₁ + s · (B − R − 1)) for B > R.
    Non-increasing in B whenever SPS is, as s ≥ 0."""

    def __init__(self, base, num_requests: int, correction: "VerifyCorrection"):
        self.base, self.num_requests, self.correction = base, num_requests, correction

    def _seconds(self, batch_tokens: int) -> float:
        t = 1.0 / _sps_value(self.base, batch_tokens)
        c, extra = self.correction, batch_tokens - self.num_requests
        if extra <= 0:
            return max(0.5 * t, t + c.offset_none)
        return max(0.5 * t, t + c.offset_draft + c.slope * (extra - 1), self._seconds(self.num_requests))

    def __call__(self, batch_tokens: int) -> float:
        return 1.0 / self._seconds(batch_tokens)


class VerifyCorrection(NamedTuple):
    """Measured verify time over the SPS table's 1/SPS(B) at one R, in seconds (:meth:`DSparkEngine.verify_correction`).

    Attributes:
        offset_none: o₀, residual of rounds that verified no draft token (B = R).
        offset_draft: o₁, residual at B = R + 1 of rounds that verified draft tokens (shrunk toward o₀ by
            :attr:`DSparkEngine.VERIFY_STEP_PRIOR` pseudo-rounds).
        slope: s ≥ 0, residual per further draft token, in seconds per token.
    """

    offset_none: float
    offset_draft: float
    slope: float


def _survival_row(conf: list[float]) -> list[float]:
    out, prod = [], 1.0
    for c in conf:
        prod *= c
        out.append(prod)
    return out


# ---------------------------------------------------------------------------------------------- records
@dataclass
class RequestOutput:
    """A finished request.

    Attributes:
        request_id: as returned by :meth:`DSparkEngine.add_request`.
        prompt_ids: the prompt token ids.
        output_ids: the generated token ids (EOS included when it ended the request).
        finish_reason: ``"eos"`` or ``"length"``.
        stats: per-round statistics of this request (drafted / verified ℓ / accepted / committed, confidences).
        t_added, t_admitted, t_first_token, t_finished: ``time.perf_counter()`` stamps.
    """

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    t_added: float
    t_admitted: float
    t_first_token: float
    t_finished: float

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tokens_per_s(self) -> float:
        """Per-user speed: generated tokens / (finish − admission) seconds."""
        return self.num_tokens / max(1e-9, self.t_finished - self.t_admitted)

    @property
    def full_ids(self) -> list[int]:
        """Prompt + output, as ``generate()`` returns it."""
        return self.prompt_ids + self.output_ids


@dataclass
class EngineRound:
    """One engine round (prefill-only steps are not rounds).

    Attributes:
        requests: R, requests verified this round.
        batch_tokens: B = Σ_r (1 + ℓ_r), tokens in the verify forward.
        lengths: ℓ_r per request.
        drafted: draft tokens sampled per request (≥ ℓ_r).
        accepted: accepted draft tokens per request.
        committed: tokens appended per request.
        t_draft_ms, t_verify_ms: drafter time (all requests) and verify forward + acceptance time.
        gated: per request, True when the draft gate (scheduler / lagged) skipped drafting it this round although
            it could have drafted, by its cost model or by the drafting veto (empty for the other policies).
        probe: the round drafted a request the gate would have skipped (periodic re-probe of the cost model or of
            the veto, see the module doc).
        veto: the drafting veto's part in this round (module doc, "Drafting veto"): ``"skip"`` (vetoed: nothing
            drafted), ``"pair"`` (nothing drafted, to pair a window of drafting rounds), ``"probe"`` (a re-probe of
            a vetoed R: one request drafts), or ``""``.
    """

    requests: int
    batch_tokens: int
    lengths: list[int]
    drafted: list[int]
    accepted: list[int]
    committed: list[int]
    t_draft_ms: float
    t_verify_ms: float
    gated: list[bool] = field(default_factory=list)
    probe: bool = False
    veto: str = ""

    @property
    def drafted_any(self) -> bool:
        """Whether the drafter ran this round."""
        return any(self.drafted)


@dataclass
class EngineStats:
    """Engine-wide statistics: rounds, prefills, wall time of the steps, tokens."""

    rounds: list[EngineRound] = field(default_factory=list)
    prefill_tokens: int = 0
    prefill_ms: float = 0.0
    step_time_s: float = 0.0

    def summary(self) -> dict:
        n = max(1, len(self.rounds))
        committed = sum(sum(r.committed) for r in self.rounds)
        req_rounds = max(1, sum(r.requests for r in self.rounds))
        return {
            "rounds": len(self.rounds),
            "mean_requests": sum(r.requests for r in self.rounds) / n,
            "mean_batch_tokens": sum(r.batch_tokens for r in self.rounds) / n,
            "mean_verified": sum(sum(r.lengths) for r in self.rounds) / req_rounds,
            "mean_accepted": sum(sum(r.accepted) for r in self.rounds) / req_rounds,
            "tau": committed / req_rounds,
            "t_draft_ms": sum(r.t_draft_ms for r in self.rounds) / n,
            "t_verify_ms": sum(r.t_verify_ms for r in self.rounds) / n,
            "draft_rounds": sum(r.drafted_any for r in self.rounds),
            "skipped_draft_rounds": sum(not r.drafted_any for r in self.rounds),
            "gated_request_rounds": sum(sum(r.gated) for r in self.rounds),
            "probe_rounds": sum(r.probe for r in self.rounds),
            "veto_skip_rounds": sum(r.veto == "skip" for r in self.rounds),
            "veto_pair_rounds": sum(r.veto == "pair" for r in self.rounds),
            "veto_probe_rounds": sum(r.veto == "probe" for r in self.rounds),
            "prefill_tokens": self.prefill_tokens,
            "prefill_ms": self.prefill_ms,
            "step_time_s": self.step_time_s,
        }


class _Request:
    """Engine-internal state of one request."""

    def __init__(self, rid: int, prompt: list[int], max_new: int, kv: RequestKV):
        self.id = rid
        self.prompt = prompt
        self.max_new = max_new
        self.output: list[int] = []
        self.kv = kv
        self.pending_feats: list[torch.Tensor] = []  # [1, n_i, m·H] pieces: committed positions not yet ingested
        self.draft_cache: RequestKV | None = None  # the drafter's context K/V (its length = positions ingested)
        self.finish_reason: str | None = None
        self.yield_sums: list[float] = [0.0, 0.0, 0.0]  # decayed [accepted, verified, rounds] of drafted rounds (gate)
        self.gated_rounds = 0  # consecutive rounds the draft gate skipped this request
        self.stats = GenerationStats()
        self.t_added = time.perf_counter()
        self.t_admitted = self.t_first = self.t_finished = 0.0

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.output)

    def commit(self, tokens: Iterable[int], eos: frozenset[int]) -> int:
        """Append tokens until EOS or max_new_tokens; return how many were appended."""
        n = 0
        for tok in tokens:
            self.output.append(int(tok))
            n += 1
            if int(tok) in eos:
                self.finish_reason = "eos"
                break
            if len(self.output) >= self.max_new:
                self.finish_reason = "length"
                break
        return n


# ---------------------------------------------------------------------------------------------- engine
class DSparkEngine:
    """Batched greedy speculative decoding of R concurrent requests with continuous batching (see module doc).

    Usage::

        engine = DSparkEngine(target, drafter, policy="scheduler", sps=load_profile(...))
        a = engine.add_request(prompt_ids_a, max_new_tokens=64)
        b = engine.add_request(prompt_ids_b, max_new_tokens=32)
        engine.step()                                  # one round (new requests are prefilled first)
        c = engine.add_request(prompt_ids_c, 16)       # joins at the next step
        outputs = engine.run()                         # until every request is finished; sorted by id

    Args:
        target: the target causal LM (eval mode; float32 for exact greedy equality with ``generate()``).
        drafter: a :class:`~modeling_dspark.DSparkDraftModel` (bound to ``target`` here if it is not yet); may be
            None only with ``policy="none"``.
        policy: ``"none"``, ``"fixed:N"``, ``"full"``, ``"threshold:P"``, ``"scheduler"`` or ``"lagged[:LAG]"``.
        block_size: γ' ≤ the drafter's γ slots per round (default γ).
        sps: SPS(B) for ``scheduler`` / ``lagged``: a mapping ``{B: steps/s}``, a callable ``B -> steps/s``, or a
            :class:`generation.profiling.SPSProfile` (then the curve for the round's R and mean context is used).
        max_batch_size: at most this many requests run at once; more wait in a queue (FIFO).
        eos_token_id: int or list; default the target's ``generation_config.eos_token_id``.
        lag_default_budget: budget K of the lagged policy for its first LAG rounds (default: R).
        draft_cost_ms: the drafter's time per round as ``scheduler`` / ``lagged`` price it (module doc, "Draft
            cost"): ``"auto"`` (default; a moving average of this engine's own measured drafting time per number of
            drafting requests), a number of milliseconds ≥ 0 (fixed), or None (not priced: SPS(B) alone, as the
            paper's Algorithm 1).
        draft_gating: ``scheduler`` / ``lagged`` only: before each round decide from past rounds whether drafting a
            request is expected to pay, and skip the drafter for those where it does not (default True).
        probe_max_interval: longest run of gated (or vetoed) rounds before the gate re-probes (drafts anyway) to
            refresh its estimates; the interval doubles from 1 up to this (default 32).
        sps_correction: ``scheduler`` / ``lagged`` only: correct the SPS table by this engine's measured verify
            times (module doc, "Measured verify time"; default True).
        drafting_veto: ``scheduler`` / ``lagged`` with ``draft_gating`` only: skip drafting (re-probing with the
            gate's back-off) at an R where this engine's drafting rounds committed fewer tokens per second than its
            rounds without drafting, measured in the same windows of about a second; costs at most one round
            without drafting per window where drafting pays, to pair it (module doc, "Drafting veto";
            :class:`generation.round_rates.RoundRates`; default True).

    Raises:
        ValueError: unknown policy, a policy that needs a drafter / confidence head / SPS table without one,
            block_size out of range, a drafter that does not match the target, a bad draft_cost_ms /
            draft_gating / probe_max_interval / sps_correction / drafting_veto.
    """

    YIELD_DECAY = 0.8
    """Per-drafted-round decay of a request's sums of realized yield (accepted, verified draft tokens; draft gate):
    about the last 1 / (1 - 0.8) = 5 drafted rounds count."""
    VETO_PROBE_ROUNDS = 2
    """Consecutive rounds a re-probe of a vetoed R drafts one request (the same one): the first pays its drafter's
    catch-up on the positions it skipped and is not recorded by the veto (:mod:`generation.round_rates`); the
    second measures a drafting round."""
    YIELD_PRIOR_ROUNDS = 12.0
    """Pseudo-rounds of the engine-wide prior mixed into every request's yield estimate (shrinkage). Acceptance is
    bursty, so a request's own recent rounds predict its next round only weakly: on SmolLM2-135M with the shipped
    drafter (R = 1, ungated), rounds whose own estimate was below 0.3 accepted 0.37 tokens on average and the rest
    0.53, i.e. about 0.3 of the own-history spread is real; at most ~5 decayed own rounds against 12 prior rounds
    keeps that weight."""
    PRIOR_EMA = 0.02
    """Weight of each drafted request-round in the engine-wide yield prior per concurrency R: a slow average over
    about 50 request-rounds, i.e. over several requests even at R = 1."""
    VERIFY_SLOPE_PRIOR = 1.0
    """Ridge weight (draft tokens² per round of weight, the drafting rounds' decayed weight plus
    :attr:`VERIFY_STEP_PRIOR`) pulling the fitted verify-time slope toward 0."""
    VERIFY_STEP_PRIOR = 2.0
    """Pseudo-rounds pulling the drafting rounds' verify-time offset o1 toward the B = R offset o0 (and damping the
    slope): with the drafting part aging every round, a few stalled drafting rounds stop steering once only B = R
    rounds follow (:meth:`DSparkEngine.verify_correction`)."""
    VERIFY_FIT_DECAY = 0.97
    """Per-round decay of the sums behind :meth:`DSparkEngine.verify_correction` (about the last 33 rounds count):
    the drafting part decays every round at its R, the B = R part on its own rounds."""
    DRAFT_TIME_EMA = 0.3
    """Weight of the newest measurement in the moving average of drafting time (``draft_cost_ms="auto"``)."""
    EXCESS_DECAY = 0.9
    """Per-drafted-round decay of the round-time residual behind :meth:`DSparkEngine.draft_excess` (about the last
    10 drafting rounds at each R count)."""

    def __init__(
        self,
        target,
        drafter=None,
        policy: str = "full",
        *,
        block_size: int | None = None,
        sps=None,
        max_batch_size: int = 16,
        eos_token_id: int | Sequence[int] | None = None,
        lag_default_budget: int | None = None,
        draft_cost_ms: str | float | None = "auto",
        draft_gating: bool = True,
        probe_max_interval: int = 32,
        sps_correction: bool = True,
        drafting_veto: bool = True,
    ):
        self.policy = parse_engine_policy(policy)
        if draft_cost_ms is not None and draft_cost_ms != "auto":
            ok = isinstance(draft_cost_ms, (int, float)) and not isinstance(draft_cost_ms, bool)
            if not ok or not (0.0 <= float(draft_cost_ms) < float("inf")):
                raise ValueError(
                    f"draft_cost_ms must be 'auto', None or a finite number of milliseconds >= 0; got {draft_cost_ms!r}"
                )
        if not isinstance(sps_correction, bool):
            raise ValueError(f"sps_correction must be True or False; got {sps_correction!r}")
        if not isinstance(drafting_veto, bool):
            raise ValueError(f"drafting_veto must be True or False; got {drafting_veto!r}")
        if not isinstance(draft_gating, bool):
            raise ValueError(f"draft_gating must be True or False; got {draft_gating!r}")
        if isinstance(probe_max_interval, bool) or not isinstance(probe_max_interval, int) or probe_max_interval < 1:
            raise ValueError(f"probe_max_interval must be an int >= 1; got {probe_max_interval!r}")
        kind = self.policy.kind
        if kind != "none" and drafter is None:
            raise ValueError(f"policy {self.policy.name!r} needs a drafter (use policy='none' without one)")
        if drafter is not None:
            if drafter._target.get("model") is not target:
                drafter.bind_target(target)
            gamma = block_size or drafter.config.block_size
            if not 1 <= gamma <= drafter.config.block_size:
                raise ValueError(f"block_size must be in [1, {drafter.config.block_size}], got {gamma}")
            if kind in ("threshold", "scheduler", "lagged") and drafter.confidence_head is None:
                raise ValueError(f"policy {self.policy.name!r} needs a drafter with a confidence head")
        else:
            gamma = 0
        if kind in ("scheduler", "lagged") and sps is None:
            raise ValueError(
                f"policy {self.policy.name!r} needs an SPS(B) table: pass sps= "
                "(see generation.profiling / `dspark profile`)"
            )
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.target = target
        self.drafter = drafter if kind != "none" else None
        self.block_size = gamma
        self.sps = sps
        self.max_batch_size = int(max_batch_size)
        self.packed = PackedTarget(target)
        if eos_token_id is None:
            eos_token_id = target.generation_config.eos_token_id
        if eos_token_id is None:
            eos = frozenset()
        elif isinstance(eos_token_id, int):
            eos = frozenset([eos_token_id])
        else:
            eos = frozenset(int(e) for e in eos_token_id)
        self.eos = eos
        self.layer_ids = list(drafter.config.target_layer_ids) if self.drafter is not None else []
        self.lag_default_budget = lag_default_budget
        self.eager_logits_rows = 64  # see _draft: below this many rows, all draft slots' base logits in one matmul
        self._lag_pending: deque[int] = deque()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._finished: dict[int, RequestOutput] = {}
        self._next_id = 0
        self._curves: dict = {}
        self.draft_cost_ms = draft_cost_ms
        self.draft_gating = draft_gating
        self.probe_max_interval = probe_max_interval
        self._draft_ms_ema: dict[int, float] = {}  # drafting requests -> moving average of measured ms ("auto")
        self._draft_ms_count: dict[int, int] = {}  # drafting requests -> measurements taken
        self._yield_prior: dict[int, list[float]] = {}  # R -> moving average [accepted, verified] over requests
        self._yield_prior_count: dict[int, int] = {}  # R -> drafted request-rounds folded into the prior
        self._perfect_cache: dict = {}  # (curve id, budgets, draft costs) -> would perfect drafts pay (gate)
        self.sps_correction = sps_correction
        self._verify_fit: dict[int, tuple] = {}  # R -> decayed (weight, sum) at B = R, decayed LSQ sums at B > R
        self._corrected: dict = {}  # (base curve id, R, rounded o0, o1, slope) -> _CorrectedSPS
        self._excess: dict[int, tuple[float, float]] = {}  # R -> decayed (weight, sum) of drafting-round residuals
        self._probe_state: dict[int, list[int]] = {}  # R -> [re-probe interval, gated rounds since the last probe]
        self.drafting_veto = drafting_veto
        self.round_rates = RoundRates()  # per R: time-paired tokens/s of drafting vs non-drafting rounds (veto)
        self._veto_probe_state: dict[int, list[int]] = {}  # R -> [veto re-probe interval, vetoed rounds since]
        self._veto_probe: list = [0, 0, None]  # [R, rounds still to go, request id] of a veto probe in progress
        self._veto_mark = ""  # the veto's part in the current round: "", "skip", "pair" or "probe" (EngineRound.veto)
        self.stats = EngineStats()

    # ------------------------------------------------------------------ public API
    def add_request(self, prompt_ids, max_new_tokens: int = 128) -> int:
        """Queue a request; it joins the batch at the next :meth:`step`. Returns its id.

        Args:
            prompt_ids: token ids (list, 1-D tensor or ``[1, P]`` tensor), unpadded, P ≥ 1.
            max_new_tokens: ≥ 1.

        Raises:
            ValueError: empty / 2-D batched prompt, max_new_tokens < 1.
        """
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() == 2:
                if prompt_ids.shape[0] != 1:
                    raise ValueError("add_request takes one prompt; call it once per request")
                prompt_ids = prompt_ids[0]
            prompt = [int(t) for t in prompt_ids.tolist()]
        else:
            prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt")
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        rid = self._next_id
        self._next_id += 1
        capacity = len(prompt) + int(max_new_tokens) + self.block_size + 2
        self._waiting.append(_Request(rid, prompt, int(max_new_tokens), self.packed.new_cache(capacity)))
        return rid

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def result(self, request_id: int) -> RequestOutput | None:
        """The output of a finished request (None while it runs)."""
        return self._finished.get(request_id)

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefill), then run one speculative round over all running requests.

        Returns:
            the requests that finished during this step.
        """
        t0 = time.perf_counter()
        done: list[RequestOutput] = []
        new = []
        while self._waiting and len(self._running) + len(new) < self.max_batch_size:
            req = self._waiting.popleft()
            req.t_admitted = time.perf_counter()
            new.append(req)
        if new:
            self._prefill(new)
            self._running.extend(new)
            done += self._retire()
        if self._running:
            self._round(self._running)
            done += self._retire()
        self.stats.step_time_s += time.perf_counter() - t0
        return done

    def run(self) -> list[RequestOutput]:
        """Step until no request is running or waiting; return the outputs finished meanwhile, sorted by id."""
        done: list[RequestOutput] = []
        while self.has_unfinished():
            done += self.step()
        return sorted(done, key=lambda o: o.request_id)

    # ------------------------------------------------------------------ internals
    def _retire(self) -> list[RequestOutput]:
        out, keep = [], []
        now = time.perf_counter()
        for req in self._running:
            if req.finish_reason is None:
                keep.append(req)
                continue
            req.t_finished = now
            res = RequestOutput(
                req.id, req.prompt, list(req.output), req.finish_reason, req.stats,
                req.t_added, req.t_admitted, req.t_first, req.t_finished,
            )
            self._finished[req.id] = res
            out.append(res)
            req.kv = None  # free the caches
            req.draft_cache = None
            req.pending_feats = []
        self._running = keep
        return out

    def _features(self, hidden_states, start: int, end: int) -> torch.Tensor:
        return context_features(hidden_states, self.layer_ids, start, end)

    def _prefill(self, reqs: list[_Request]) -> None:
        t0 = time.perf_counter()
        segments = [(r.kv, torch.tensor(r.prompt)) for r in reqs]
        logits, hidden = self.packed.forward(segments, output_hidden_states=self.drafter is not None)
        off = 0
        now = time.perf_counter()
        for r in reqs:
            p = len(r.prompt)
            if self.drafter is not None:
                r.pending_feats = [self._features(hidden, off, off + p)]
                r.draft_cache = RequestKV(self.drafter.config.num_draft_layers, p + r.max_new + 2)
            r.commit([int(logits[off + p - 1].argmax())], self.eos)
            r.t_first = now
            off += p
        self.stats.prefill_tokens += off
        self.stats.prefill_ms += (time.perf_counter() - t0) * 1e3

    def _base_curve(self, reqs: list[_Request]):
        """SPS(B) as given: a fixed table/callable, or the profile's curve for (R, mean context)."""
        sps = self.sps
        if hasattr(sps, "curve"):  # an SPSProfile
            ctx = sum(r.kv.length for r in reqs) / len(reqs)
            key = (len(reqs), sps.context_bucket(ctx) if hasattr(sps, "context_bucket") else None)
            if key not in self._curves:
                self._curves[key] = sps.curve(requests=len(reqs), context_len=ctx)
            return self._curves[key]
        return sps

    def _sps_curve(self, reqs: list[_Request]):
        """SPS(B) for this round's decisions: :meth:`_base_curve`, corrected by the measured verify times
        (``sps_correction``, module doc) once this R has some."""
        base = self._base_curve(reqs)
        fit = self.verify_correction(len(reqs))
        if fit is None:
            return base
        key = (id(base), len(reqs), *(round(v, 5 if i < 2 else 6) for i, v in enumerate(fit)))  # 10 µs, 1 µs/token
        curve = self._corrected.get(key)
        if curve is None:
            if len(self._corrected) > 1024:
                self._corrected.clear()
                self._perfect_cache.clear()  # keyed by curve ids: a freed curve's id may be reused
            rounded = VerifyCorrection(*(float(v) for v in key[2:]))
            curve = self._corrected[key] = _CorrectedSPS(base, len(reqs), rounded)
        return curve

    def verify_correction(self, num_requests: int) -> VerifyCorrection | None:
        """The measured verify time over the SPS table's 1/SPS(B) at R = ``num_requests`` (module doc, "Measured
        verify time"): o₀, the decayed mean residual of rounds with B = R; o₁ + s · (B − R − 1), a decayed
        least-squares line over rounds with B > R (s ≥ 0, ridge-shrunk toward 0; 0 while every such round had the
        same B). A part without rounds takes the other's offset. None when disabled or nothing was measured at this
        R yet. Seconds (offsets) and seconds per draft token (slope)."""
        parts = self._verify_fit.get(num_requests) if self.sps_correction else None
        if parts is None:
            return None
        none, draft = parts
        offset_none = none[1] / none[0] if none[0] > 0 else None
        offset_draft, slope = None, 0.0
        w, sx, sy, sxx, sxy = draft
        if w > 0:
            # ridge toward 0 (VERIFY_SLOPE_PRIOR per round at unit spread, plus VERIFY_STEP_PRIOR rounds' worth):
            # a slope fitted from a few (possibly stalled) drafted rounds is damped, and fades as its sums decay
            sxx_c, sxy_c = sxx - sx * sx / w, sxy - sx * sy / w
            slope = max(0.0, sxy_c / (sxx_c + self.VERIFY_SLOPE_PRIOR * (w + self.VERIFY_STEP_PRIOR)))
            offset_draft = (sy - slope * sx) / w
            if offset_none is not None:  # shrunk toward o0: stale drafting rounds fade while only B = R rounds run
                k = self.VERIFY_STEP_PRIOR
                offset_draft = (w * offset_draft + k * offset_none) / (w + k)
        if offset_none is None:
            offset_none = offset_draft
        if offset_draft is None:
            offset_draft = offset_none
        return VerifyCorrection(offset_none, offset_draft, slope)

    def _record_verify_time(self, reqs: list[_Request], batch_tokens: int, seconds: float) -> None:
        if not self.sps_correction:
            return
        try:
            profiled = 1.0 / _sps_value(self._base_curve(reqs), batch_tokens)
        except ValueError:  # outside the table: nothing to correct
            return
        num = len(reqs)
        y = min(seconds, 3.0 * profiled) - profiled  # a stall moves the fit less
        d = self.VERIFY_FIT_DECAY
        none, draft = self._verify_fit.get(num, ((0.0, 0.0), (0.0, 0.0, 0.0, 0.0, 0.0)))
        # the drafting part ages every round (o1 shrinks back toward o0 while only B = R rounds run); the B = R part
        # is a mean, which uniform aging would not move, so it ages on its own rounds only
        draft = tuple(d * v for v in draft) if draft[0] * d > 1e-6 else (0.0, 0.0, 0.0, 0.0, 0.0)  # no underflow
        if batch_tokens <= num:
            none = (d * none[0] + 1, d * none[1] + y)
        else:
            x = float(batch_tokens - num - 1)
            w, sx, sy, sxx, sxy = draft
            draft = (w + 1, sx + x, sy + y, sxx + x * x, sxy + x * y)
        self._verify_fit[num] = (none, draft)

    # ------------------------------------------------------------------ draft cost and draft gate
    def _draft_seconds(self, rows: int) -> float:
        """t_draft for a round where ``rows`` requests draft, in seconds (0 when not priced or not yet measured)."""
        if self.draft_cost_ms is None or rows <= 0:
            return 0.0
        if self.draft_cost_ms != "auto":
            return float(self.draft_cost_ms) / 1e3
        ema = self._draft_ms_ema
        if not ema:
            return 0.0
        xs = sorted(ema)  # linear between the nearest measured row counts, the end values outside them
        return float(np.interp(rows, xs, [ema[x] for x in xs])) / 1e3

    def draft_excess(self, num_requests: int) -> float:
        """Seconds by which this engine's rounds that drafted at R = ``num_requests`` outlasted the cost model,
        1/SPS'(B) + t_draft(n): a decayed mean (:attr:`EXCESS_DECAY`) of measured − modelled round time (0 before
        any such round, or unless ``draft_cost_ms="auto"``). Added to t_draft(n) wherever the gate and the policies
        price a drafting round (:meth:`_draft_price`). The model's parts are measured apart (verify times per kind
        of round, :meth:`verify_correction`; drafting time in steady rounds only), so what a drafting round costs
        beyond them would otherwise go unpriced: bookkeeping, a short catch-up. Rounds where a drafting request
        first catches up on more than 2(γ' + 1) positions are not folded in, re-probe rounds only when they lower an
        existing excess (module doc, "Draft excess")."""
        sums = self._excess.get(num_requests)
        return 0.0 if sums is None or self.draft_cost_ms != "auto" else sums[1] / sums[0]

    def _draft_price(self, num_requests: int, rows: int) -> float:
        """t_draft(rows) in seconds as the gate and the policies price it at R = ``num_requests``: the measured
        drafting time plus :meth:`draft_excess` (never below 0; 0 while the drafting time is unmeasured)."""
        t = self._draft_seconds(rows)
        return max(0.0, t + self.draft_excess(num_requests)) if t > 0.0 else t

    def _record_excess(self, num_requests: int, seconds: float, modelled: float, upper_bound: bool = False) -> None:
        """Fold one drafting round's measured − modelled time into :meth:`draft_excess` (a stall counts at most
        as one more modelled round). ``upper_bound``: the round's residual over-states a steady round's (a
        re-probe): folded in only when below the current excess."""
        if self.draft_cost_ms != "auto" or modelled <= 0.0:
            return
        resid = min(seconds - modelled, modelled)
        if upper_bound and (num_requests not in self._excess or resid >= self.draft_excess(num_requests)):
            return
        w, total = self._excess.get(num_requests, (0.0, 0.0))
        d = self.EXCESS_DECAY
        self._excess[num_requests] = (d * w + 1.0, d * total + resid)

    def _draft_cost_measured(self) -> bool:
        return self.draft_cost_ms != "auto" or bool(self._draft_ms_ema)

    def _record_draft_time(self, rows: int, ms: float) -> None:
        if self.draft_cost_ms != "auto" or rows <= 0:
            return
        prev = self._draft_ms_ema.get(rows)
        seen = self._draft_ms_count.get(rows, 0)
        self._draft_ms_count[rows] = seen + 1
        if prev is None:
            self._draft_ms_ema[rows] = ms
        elif seen == 1:  # the first call of a shape often stalls (allocation, kernels): keep the faster of two
            self._draft_ms_ema[rows] = min(prev, ms)
        else:  # a single stall (another process) moves the average by at most 3x
            ms = min(ms, 3.0 * prev)
            self._draft_ms_ema[rows] = (1 - self.DRAFT_TIME_EMA) * prev + self.DRAFT_TIME_EMA * ms

    def _round_sps(self, reqs: list[_Request], rows: int):
        """SPS_eff(B) = 1 / (1/SPS(B) + t_draft(rows)) for a round where ``rows`` requests draft."""
        sps = self._sps_curve(reqs)
        t = self._draft_price(len(reqs), rows)
        return sps if t == 0.0 else effective_sps(sps, t)

    def _update_yield(self, req: _Request, num_requests: int, accepted: int, verified: int) -> None:
        """Fold a drafted round's realized yield (accepted, verified draft tokens) into the request's decayed sums
        and the engine-wide prior for ``num_requests`` concurrent requests."""
        d = self.YIELD_DECAY
        req.yield_sums = [d * old + new for old, new in zip(req.yield_sums, (accepted, verified, 1))]
        seen = [float(accepted), float(verified)]
        count = self._yield_prior_count.get(num_requests, 0) + 1
        self._yield_prior_count[num_requests] = count
        prior = self._yield_prior.get(num_requests, seen)
        w = max(1.0 / count, self.PRIOR_EMA)  # the plain mean of the first 1 / PRIOR_EMA rounds, then a moving one
        self._yield_prior[num_requests] = [(1 - w) * p + w * c for p, c in zip(prior, seen)]

    def yield_estimate(self, req: _Request, prior: list[float] | None) -> list[float] | None:
        """[accepted, verified] expected if ``req`` drafts: its decayed sums shrunk toward ``prior`` by
        :attr:`YIELD_PRIOR_ROUNDS` pseudo-rounds; the prior alone without history; None without either."""
        acc, ver, n = req.yield_sums
        if prior is None:
            return [acc / n, ver / n] if n > 0 else None
        k = self.YIELD_PRIOR_ROUNDS
        return [(acc + k * prior[0]) / (n + k), (ver + k * prior[1]) / (n + k)]

    def yield_prior(self, num_requests: int) -> list[float] | None:
        """The engine-wide moving average [accepted, verified] of drafted request-rounds at ``num_requests``
        concurrent requests (the nearest R with data when there is none for this R; None before any drafting)."""
        if not self._yield_prior:
            return None
        near = min(self._yield_prior, key=lambda n: (abs(n - num_requests), n))
        return list(self._yield_prior[near])

    def _gate(self, reqs: list[_Request], budgets: list[int]) -> tuple[list[int], list[bool], bool]:
        """Which requests draft this round (scheduler / lagged). Returns (budgets, gated per request, probe).

        Uses only information from earlier rounds (the SPS curve and its measured correction, the measured draft
        cost, the requests' realized yields and the per-R yield prior, the drafting veto's measured round rates)
        and the clock (the veto's windows), never this round's confidences or draft: non-anticipating, hence
        lossless. See the module doc.
        """
        kind = self.policy.kind
        none = [False] * len(reqs)
        if kind not in ("scheduler", "lagged") or not any(budgets):
            return budgets, none, False
        sps = self._sps_curve(reqs)
        num = len(reqs)
        can = [b > 0 for b in budgets]
        skip_all = [0] * num
        if kind == "scheduler":
            # Algorithm 1 admits nothing even for a draft token certain to be accepted (a = 1): drafting is waste.
            # (The draft cost, the same for every B of the round, only makes admitting easier: price it at R rows.)
            eff = self._round_sps(reqs, num)
            if (num + 1) * _sps_value(eff, num + 1) <= num * _sps_value(eff, num):
                if self.verify_correction(num) is None:  # the table alone says so: no need to look again
                    return skip_all, can, False
                return self._skip_or_probe(reqs, budgets, skip_all, can)  # measured costs: re-probe now and then
        if not self.draft_gating:
            return budgets, none, False
        if self.drafting_veto:
            ids = [r.id for r in reqs]
            num_left, left, probe_id = self._veto_probe
            if left > 0 and num_left == num and probe_id in ids and budgets[ids.index(probe_id)] > 0:
                self._veto_probe[1] -= 1  # the next round of a veto probe: the same request drafts again
                return self._veto_probe_round(budgets, can, ids.index(probe_id))
            self._veto_probe = [num, 0, None]  # none in progress (or abandoned: R changed, the request left)
            if self.round_rates.drafting_loses(num):
                if not self._probe_due(self._veto_probe_state, num):
                    self._veto_mark = "skip"
                    return skip_all, can, False
                # one request drafts (the one skipped longest; ties: first), for VETO_PROBE_ROUNDS rounds in a row:
                # its paired rounds say whether drafting even one request pays at this R, at a fraction of the
                # cost of drafting them all
                i = _longest_gated(reqs, can)
                self._veto_probe = [num, self.VETO_PROBE_ROUNDS - 1, reqs[i].id]
                return self._veto_probe_round(budgets, can, i)
            self._veto_probe_state.pop(num, None)  # a later veto starts its back-off afresh
            if self.round_rates.plain_round_due(num):  # pair this window's drafting rounds with a plain one
                self._veto_mark = "pair"
                return skip_all, can, False
        return self._model_gate(reqs, budgets, sps, can, skip_all)

    def _veto_probe_round(self, budgets: list[int], can: list[bool], i: int):
        """A round of a veto probe: request ``i`` drafts, the others are skipped (gated)."""
        self._veto_mark = "probe"
        return [b if j == i else 0 for j, b in enumerate(budgets)], [c and j != i for j, c in enumerate(can)], True

    def _model_gate(self, reqs: list[_Request], budgets: list[int], sps, can: list[bool], skip_all: list[int]
                    ) -> tuple[list[int], list[bool], bool]:
        """The gate's cost model (module doc, "Draft gate"): which requests draft, from the SPS curve, the measured
        draft cost and the requests' realized yields. ``can``: which requests have room to draft; ``skip_all``: zero
        budgets. Returns (budgets, gated per request, probe)."""
        num = len(reqs)
        none = [False] * num

        def price(n: int) -> float:
            return self._draft_price(num, n)

        prior = self.yield_prior(num)
        estimates = [self.yield_estimate(r, prior) for r in reqs]
        if not self._draft_cost_measured() or any(e is None for e, b in zip(estimates, budgets) if b > 0):
            # warm-up (no yield estimate yet): draft to measure, unless even perfect drafts (every a = 1) would not
            # beat R·SPS(R) at the measured draft cost; then skip, but still re-probe now and then (the cost is a
            # measurement: a stall must not switch drafting off for good). With estimates, the yield gate below
            # subsumes this check: a realized yield is never worth more than perfect drafts.
            cost = tuple(round(price(n) * 1e4) for n in range(1, num + 1))  # 0.1 ms resolution
            key = (id(sps), tuple(budgets), cost)  # curves live in self._curves / self._corrected (cleared with it)
            perfect = self._perfect_cache.get(key)
            if perfect is None:
                perfect = any(draft_gate([[1.0] * self.block_size] * num, sps, price, budgets).draft)
                if len(self._perfect_cache) > 4096:
                    self._perfect_cache.clear()
                self._perfect_cache[key] = perfect
            if not perfect:
                return self._skip_or_probe(reqs, budgets, skip_all, can)
            return budgets, none, False
        decision = yield_gate([e[0] for e in estimates], [e[1] for e in estimates], sps, price, budgets)
        gated = [b > 0 and not d for b, d in zip(budgets, decision.draft)]
        if not any(gated):
            self._probe_state[num] = [1, 0]
            return budgets, none, False
        return self._skip_or_probe(reqs, budgets, [b if d else 0 for b, d in zip(budgets, decision.draft)], gated)

    def _probe_due(self, states: dict[int, list[int]], num: int) -> bool:
        """Count one more skipped round at R = ``num`` in ``states`` (R -> [interval, skipped rounds since the last
        probe]); True when it is due a re-probe, which doubles the interval (from 1, up to ``probe_max_interval``)."""
        state = states.setdefault(num, [1, 0])
        state[1] += 1
        if state[1] <= state[0]:
            return False
        state[:] = [min(2 * state[0], self.probe_max_interval), 0]
        return True

    def _skip_or_probe(self, reqs: list[_Request], budgets: list[int], gated_budgets: list[int], gated: list[bool]):
        """Apply a gate decision, unless this gated round is due a re-probe (back-off 1, 2, 4, … rounds): then the
        gated request skipped longest (ties: first) drafts too, refreshing its yield estimate."""
        if self._probe_due(self._probe_state, len(reqs)):  # per R: what pays at one R says little of another
            probe = _longest_gated(reqs, gated)
            gated_budgets, gated = list(gated_budgets), list(gated)
            gated_budgets[probe], gated[probe] = budgets[probe], False
            return gated_budgets, gated, True
        return gated_budgets, gated, False

    def _policy_lengths(self, conf: list[list[float]], budgets: list[int], sps, lag_budget: int | None) -> list[int]:
        """ℓ per request from the confidences known so far (unknown / beyond budget = 0)."""
        kind, value = self.policy.kind, self.policy.value
        if kind == "none":
            return [0] * len(budgets)
        if kind == "full":
            return list(budgets)
        if kind == "fixed":
            return [min(int(value), b) for b in budgets]
        masked = [[c if k < b else 0.0 for k, c in enumerate(row)] for row, b in zip(conf, budgets)]
        if kind == "threshold":
            out = []
            for row, b in zip(masked, budgets):
                a = _survival_row(row)
                n = 0
                while n < b and a[n] >= value:
                    n += 1
                out.append(n)
            return out
        if kind == "scheduler":
            lengths = prefix_schedule(masked, sps)
        else:  # lagged
            lengths = fill_budget(masked, lag_budget)
        return [min(ell, b) for ell, b in zip(lengths, budgets)]

    def _draft(self, reqs: list[_Request], budgets: list[int]):
        """Draft for every request; returns (tokens per request, confidences per request, ℓ per request)."""
        d = self.drafter
        gamma = self.block_size
        num = len(reqs)
        device = d.device
        rows = sum(b > 0 for b in budgets)
        sps = self._round_sps(reqs, rows) if self.policy.kind in ("scheduler", "lagged") else None
        lag_budget = None
        if self.policy.kind == "lagged":
            lag = int(self.policy.value)
            if len(self._lag_pending) >= lag:
                lag_budget = self._lag_pending.popleft()
            else:
                lag_budget = num if self.lag_default_budget is None else self.lag_default_budget

        # 1. one block forward for all drafting requests; each ingests its newly committed positions into its own
        #    context cache (right-padded batch, padding masked out)
        active = [i for i in range(num) if budgets[i] > 0]
        if active:
            feats = [torch.cat(f, dim=1) if len(f) > 1 else f[0] for f in (reqs[i].pending_feats for i in active)]
            counts = [f.shape[1] for f in feats]
            caches = [reqs[i].draft_cache for i in active]
            ctx = feats[0].new_zeros(len(active), max(counts), feats[0].shape[-1])
            ctx_pos = torch.zeros(len(active), max(counts), dtype=torch.long, device=device)
            for a, (f, kv) in enumerate(zip(feats, caches)):
                ctx[a, : f.shape[1]] = f[0]
                ctx_pos[a, : f.shape[1]] = torch.arange(kv.length, kv.length + f.shape[1], device=device)
            batch_ctx = _BatchedDraftContext(caches, counts)
            l_max = max(batch_ctx.ends)
            mask = torch.ones(len(active), 1, gamma, l_max + gamma, dtype=torch.bool, device=device)
            for a, end in enumerate(batch_ctx.ends):
                mask[a, :, :, end:l_max] = False
            if d.config._attn_implementation in (None, "eager"):  # eager attention adds the mask
                additive = torch.zeros(mask.shape, dtype=d.dtype, device=device)
                mask = additive.masked_fill(~mask, torch.finfo(d.dtype).min)
            anchors = torch.tensor([[reqs[i].output[-1]] for i in active], device=device)
            anchor_pos = torch.tensor([[reqs[i].kv.length] for i in active], device=device)
            out = d(anchors, anchor_pos, ctx.to(device), ctx_pos, attention_mask=mask, cache=batch_ctx,
                    num_slots=gamma, return_logits=False)
            batch_ctx.commit()
            for i in active:
                reqs[i].pending_feats = []
            h_all = out.hidden_states[:, 0]  # [A, γ', H]

        # 2. left to right, batched over the requests still drafting
        conf = [[0.0] * gamma for _ in range(num)]
        tokens: list[list[int]] = [[] for _ in range(num)]
        needs_conf = self.policy.kind in ("threshold", "scheduler", "lagged")
        alive = list(active)
        if alive:
            row_of = {i: n for n, i in enumerate(active)}
            prev = torch.tensor([reqs[i].output[-1] for i in active], device=device)
            state = None
            # Base logits U_k through the (large) LM head: while few rows are needed the matmul is bound by reading
            # the head's weights, so compute every slot that may be needed in ONE pass; otherwise slot by slot,
            # only for the requests still drafting.
            max_slots = min(gamma, max(budgets[i] for i in active))
            if self.policy.kind == "fixed":
                max_slots = min(max_slots, int(self.policy.value))
            base = None
            if len(active) * max_slots <= self.eager_logits_rows:
                flat = h_all[:, :max_slots].reshape(-1, h_all.shape[-1])  # 2-D with canonical strides: a strided
                base = d.lm_logits(flat).view(len(active), max_slots, -1)  # 3-D input can hit a slow CPU GEMM path
            for k in range(gamma):
                if not alive:
                    break
                rows = torch.tensor([row_of[i] for i in alive], device=device)
                h_k = h_all[rows, k]
                p_k = prev[rows]
                if needs_conf:
                    c = d.calibrated_confidence(d.confidence_logits(p_k, h_k), k).tolist()
                    for i, ci in zip(alive, c):
                        conf[i][k] = float(ci)
                lengths = self._policy_lengths(conf, budgets, sps, lag_budget)
                admit = [n for n, i in enumerate(alive) if lengths[i] > k]
                if not admit:
                    break
                sel = torch.tensor(admit, device=device)
                rows_a = rows[sel]
                logits = base[rows_a, k] if base is not None else d.lm_logits(h_k[sel])
                st = None if state is None else state[rows_a]
                bias, st = d.correction_step(p_k[sel], h_k[sel], st)
                if bias is not None:
                    logits = logits + bias
                if st is not None:
                    if state is None:
                        state = st.new_zeros(len(active), *st.shape[1:])
                    state[rows_a] = st
                new_tok = d.draft_token_ids(logits.argmax(dim=-1))  # draft-vocabulary column -> target token id
                prev[rows_a] = new_tok
                alive_next = []
                for n, tok in zip(admit, new_tok.tolist()):
                    i = alive[n]
                    tokens[i].append(int(tok))
                    if k + 1 < budgets[i]:
                        alive_next.append(i)
                alive = alive_next
        lengths = self._policy_lengths(conf, budgets, sps, lag_budget)
        lengths = [min(ell, len(t)) for ell, t in zip(lengths, tokens)]
        if self.policy.kind == "lagged":
            # budget for LAG rounds ahead, from this round's known confidences (never from the current draft tokens)
            masked = [[c if k < b else 0.0 for k, c in enumerate(row)] for row, b in zip(conf, budgets)]
            self._lag_pending.append(budget_from_confidences(masked, sps))
        return tokens, conf, lengths

    def _round(self, reqs: list[_Request]) -> None:
        num = len(reqs)
        t0 = time.perf_counter()
        budgets = [max(0, min(self.block_size, r.remaining - 1)) for r in reqs]
        gated, probe = [False] * num, False
        self._veto_mark = ""
        if self.drafter is not None:
            budgets, gated, probe = self._gate(reqs, budgets)
        rows = sum(b > 0 for b in budgets)
        gating = self.policy.kind in ("scheduler", "lagged")
        if gating and rows:  # the cost model of this round, before its own measurements update it
            curve, modelled_draft = self._sps_curve(reqs), self._draft_seconds(rows)
        long_catch_up = False
        if self.drafter is not None and rows:
            # a drafting request that must first catch up on many positions (just prefilled, or gated for a while)
            # makes this round's drafting time unrepresentative: the catch-up is paid once whenever it drafts
            pending = [sum(f.shape[1] for f in r.pending_feats) for r, b in zip(reqs, budgets) if b > 0]
            catch_up = any(n > self.block_size + 1 for n in pending)
            # the drafting veto and the draft excess leave out only catch-ups of more than two rounds' worth: one
            # non-drafting round (a pairing round) before a drafting one is part of what drafting costs (round_rates
            # module doc; module doc, "Draft excess")
            long_catch_up = any(n > 2 * (self.block_size + 1) for n in pending)
            tokens, conf, lengths = self._draft(reqs, budgets)
            t1 = time.perf_counter()
            if not catch_up:
                self._record_draft_time(rows, (t1 - t0) * 1e3)
        else:
            tokens, conf, lengths = [[] for _ in reqs], [[] for _ in reqs], [0] * num
            t1 = time.perf_counter()

        segments = [(r.kv, torch.tensor([r.output[-1]] + tokens[i][: lengths[i]])) for i, r in enumerate(reqs)]
        starts = [r.kv.length for r in reqs]
        need_hidden = self.drafter is not None
        logits, hidden = self.packed.forward(segments, output_hidden_states=need_hidden)
        predicted = logits.argmax(dim=-1).tolist()
        feats_all = self._features(hidden, 0, None) if need_hidden else None  # [1, B, m·H], sliced per request

        accepted_all, committed_all = [], []
        off = 0
        for i, r in enumerate(reqs):
            ell = lengths[i]
            pred = predicted[off : off + ell + 1]
            drafts = tokens[i][:ell]
            n = 0
            while n < ell and drafts[n] == pred[n]:
                n += 1
            committed = r.commit(drafts[:n] + [pred[n]], self.eos)
            r.kv.crop(starts[i] + 1 + n)  # anchor + accepted drafts are now context; the rest is dropped
            if need_hidden and r.finish_reason is None:
                # rows not yet ingested (a request that did not draft this round keeps its older rows)
                r.pending_feats.append(feats_all[:, off : off + 1 + n].clone())  # a view would pin the round
            accepted_all.append(n)
            committed_all.append(committed)
            ell_conf = conf[i][:ell] if conf[i] else []
            if gating:
                if budgets[i] > 0:  # drafted this round: its realized yield under the policy's own ℓ
                    self._update_yield(r, num, n, ell)
                    r.gated_rounds = 0
                elif gated[i]:
                    r.gated_rounds += 1
            r.stats.rounds.append(
                RoundStats(
                    drafted=len(tokens[i]),
                    verified=ell,
                    accepted=n,
                    committed=committed,
                    confidences=list(ell_conf) if self.policy.kind in ("threshold", "scheduler", "lagged") else [],
                    draft_tokens=list(tokens[i]),
                    t_draft_ms=(t1 - t0) * 1e3 / num,
                )
            )
            off += ell + 1
        t2 = time.perf_counter()
        if gating:
            first_probe = self._veto_mark == "probe" and self._veto_probe[1] == self.VETO_PROBE_ROUNDS - 1
            # a re-probe after gated rounds (the gate's, or a veto probe's first round; its second is steady) only
            # lowers the excess, a long catch-up is left out: module doc, "Draft excess"
            reprobe = probe and (self._veto_mark != "probe" or first_probe)
            if rows and modelled_draft > 0.0 and (reprobe or not long_catch_up):
                with contextlib.suppress(ValueError):  # B outside the table: no model to compare with
                    self._record_excess(num, t2 - t0, 1.0 / _sps_value(curve, off) + modelled_draft,
                                        upper_bound=reprobe)
            self._record_verify_time(reqs, off, t2 - t1)
            if not (long_catch_up or first_probe):  # what a catch-up costs, the next drafting round does not
                self.round_rates.record(num, rows > 0, t2 - t0, sum(committed_all), now=t2)
        for r in reqs:
            r.stats.rounds[-1].t_verify_ms = (t2 - t1) * 1e3
        self.stats.rounds.append(
            EngineRound(
                requests=num,
                batch_tokens=off,
                lengths=list(lengths),
                drafted=[len(t) for t in tokens],
                accepted=accepted_all,
                committed=committed_all,
                t_draft_ms=(t1 - t0) * 1e3,
                t_verify_ms=(t2 - t1) * 1e3,
                gated=list(gated) if self.policy.kind in ("scheduler", "lagged") else [],
                probe=probe,
                veto=self._veto_mark,
            )
        )


def _longest_gated(reqs: list[_Request], flags: list[bool]) -> int:
    """Index of the flagged request skipped by the gate for the most consecutive rounds (ties: the first)."""
    return max((i for i, f in enumerate(flags) if f), key=lambda i: (reqs[i].gated_rounds, -i))


def generate_batch(
    target,
    prompts: Sequence,
    drafter=None,
    policy: str = "full",
    max_new_tokens: int | Sequence[int] = 128,
    **engine_kwargs,
) -> list[RequestOutput]:
    """Convenience wrapper: run all ``prompts`` (token-id lists / tensors) through one :class:`DSparkEngine`.

    ``max_new_tokens`` is one int or one per prompt; other keyword arguments go to :class:`DSparkEngine`.
    Returns the outputs in prompt order.
    """
    engine = DSparkEngine(target, drafter, policy, **engine_kwargs)
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    if len(max_new_tokens) != len(prompts):
        raise ValueError(f"{len(max_new_tokens)} max_new_tokens values for {len(prompts)} prompts")
    for p, n in zip(prompts, max_new_tokens):
        engine.add_request(p, n)
    return engine.run()
