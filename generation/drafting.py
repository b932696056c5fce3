"""One drafting round for R ≥ 1 requests: the single implementation that `generate()` and the engine both call.

A round, read top to bottom (docs/method.md §2 and §4):

1. every drafting request ingests the target features of the positions committed since it last drafted into its
   own context K/V cache (:class:`DraftContext`; the drafter never re-reads the whole prefix);
2. ONE drafter forward over [anchor, mask × (γ'−1)] for all drafting requests → h_k and the base logits U_k
   (docs/method.md eqs. 2–4);
3. slot by slot, batched over the requests still drafting: confidence c_k (docs/method.md eqs. 7 and 10) into the
   round's ``[R, γ']`` confidence table → the verify policy's :meth:`~dspark.generation.policies.PolicyRun.lengths`
   (is x_k verified, asked before x_k is sampled) → correction B_k (eq. 5 or 6) → logits processors → argmax, or a
   sample from exactly the distribution returned as the candidate logits.

Greedy without logits processors takes the argmax in the draft vocabulary and keeps no logits; with logits
processors or sampling (R = 1, `generate()`) the full-vocabulary processed logits of every drafted token are kept,
so that transformers' verification (rejection sampling with residual resampling) stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .kv import RequestKV
from .policies import Policy, PolicyRun, RoundPlan, parse_policy
from .tunables import EAGER_LOGITS_ROWS

__all__ = ["DraftContext", "DraftResult", "Drafter", "Sampler", "check_drafter", "draft_round"]


@runtime_checkable
class Drafter(Protocol):
    """What :mod:`dspark.generation` calls on a drafter: the whole interface between decoding and the model
    (:class:`modeling_dspark.DSparkDraftModel` implements it, docs there; decoding imports no model class). ``config``
    gives ``block_size`` (γ), ``target_layer_ids`` and ``num_draft_layers``; ``confidence_head`` is None without the
    head of eq. 7; ``bound_target`` is the target whose embeddings and LM head are shared, or None."""

    config: Any
    confidence_head: Any
    device: torch.device  # read-only properties on DSparkDraftModel
    bound_target: Any

    def bind_target(self, target) -> Any: ...
    def drafting_for(self, target) -> Any: ...  # a context manager holding the binding to target
    def __call__(self, anchor_ids, anchor_positions, context_features=None, context_positions=None,
                 attention_mask=None, cache=None, num_slots=None, return_logits=True) -> Any: ...  # eqs. 2–4
    def block_slots(self, num_slots: int | None = None) -> int: ...
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # U_k over the draft vocabulary
    def draft_token_ids(self, columns: torch.LongTensor) -> torch.LongTensor: ...
    def expand_draft_logits(self, logits: torch.Tensor) -> torch.Tensor: ...
    def correction_step(self, prev_token: torch.LongTensor, hidden: torch.Tensor, state=None) -> tuple: ...  # B_k
    def confidence_logits(self, prev_tokens: torch.LongTensor, hidden: torch.Tensor) -> torch.Tensor | None: ...
    def calibrated_confidence(self, logits: torch.Tensor, positions) -> torch.Tensor: ...  # c_k, eq. 10


@dataclass
class DraftContext:
    """The drafter's state for one request.

    Attributes:
        cache: the drafter's context K/V (``cache.length`` = target positions ingested).
        pending: target features ``[1, n_i, m·H]`` of committed positions not yet ingested, in order.
    """

    cache: RequestKV
    pending: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_pending(self) -> int:
        """Committed positions waiting to be ingested (the catch-up of the next drafting round)."""
        return sum(f.shape[1] for f in self.pending)


@dataclass
class Sampler:
    """How a one-request round (`generate()`) turns draft logits into tokens when not plain greedy.

    Attributes:
        do_sample: sample x_k from softmax(processed logits), else argmax.
        logits_processor: the call's processors (temperature / top-k / top-p warpers included), applied to the
            draft logits exactly as transformers applies them to the target's.
        input_ids: ``[1, L]`` committed ids (the last is the anchor); the processors see them plus the drafts so far.
    """

    do_sample: bool
    logits_processor: object | None
    input_ids: torch.LongTensor


@dataclass
class DraftResult:
    """Outcome of :func:`draft_round` for R requests.

    Attributes:
        tokens: per request, the drafted token ids (at least ℓ_r of them; empty when it did not draft).
        lengths: ℓ_r, draft tokens to verify (0 ≤ ℓ_r ≤ budget_r).
        confidences: per request, c_k of the slots it reached (the drafted ones, and the slot where the policy
            stopped; empty without a confidence head).
        logits: per request, ``[len(tokens), V]`` float32 processed logits the tokens were drawn from, or None
            (greedy without a :class:`Sampler`).
        ingested: per request, target positions ingested into its context this round (0: the drafter did not run).
    """

    tokens: list[list[int]]
    lengths: list[int]
    confidences: list[list[float]]
    logits: list[torch.Tensor | None]
    ingested: list[int]


def check_drafter(drafter: Drafter, target, block_size: int | None = None, policy: str | Policy | None = None) -> int:
    """Bind the drafter to ``target`` unless it is (:meth:`DSparkDraftModel.bind_target` moves it to the target's
    device) and check that it serves this request, for `generate()` and :class:`~dspark.generation.engine.DSparkEngine`
    alike; return the block size γ'.

    Raises:
        ValueError: a drafter that does not match the target, or one that a call for another target (another
            thread) is drafting with now (:meth:`DSparkDraftModel.bind_target`), ``block_size`` out of [1, γ], or a
            policy that needs a confidence head the drafter lacks.
    """
    if drafter.bound_target is not target or drafter.device != target.device:  # drafts for the call's target
        drafter.bind_target(target)  # validates hidden size / vocab / layers / family; moves it to target's device
    block_size = drafter.config.block_size if block_size is None else block_size
    if not 1 <= block_size <= drafter.config.block_size:
        raise ValueError(f"block_size must be in [1, {drafter.config.block_size}] for this drafter, got {block_size}")
    policy = None if policy is None else parse_policy(policy)
    if policy is not None and policy.needs_confidence and drafter.confidence_head is None:
        raise ValueError(f"verify policy {policy.name!r} needs a drafter with a confidence head; this one has none")
    return block_size


class _BatchedDraftContext:
    """Duck-typed cache for ONE batched drafter forward over A requests with per-request context caches: the drafter's
    attention calls ``update(k_new [A, kvh, S_max, d], v_new, layer)`` with the K/V of the new context rows
    (right-padded to S_max); this writes each request's ``counts[a]`` valid rows into its own :class:`RequestKV` and
    returns the full contexts right-padded to the longest (``[A, kvh, L_max, d]``); the mask hides the padding."""

    def __init__(self, caches: list[RequestKV], counts: list[int]):
        self.caches, self.counts = caches, counts
        self.starts = [kv.length for kv in caches]
        self.ends = [st + n for st, n in zip(self.starts, counts)]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if len(self.caches) == 1:
            return self.caches[0].write(layer_idx, self.starts[0], key[:, :, : self.counts[0]],
                                        value[:, :, : self.counts[0]])
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


def _block_forward(drafter, contexts: list[DraftContext], anchors: list[int], anchor_positions: list[int],
                   block_size: int) -> torch.Tensor:
    """Steps 1–2 of the module doc for A requests; returns ``h [A, γ', H]`` (the drafter's dtype), the contexts'
    caches grown by their pending positions."""
    device = drafter.device
    feats = [torch.cat(c.pending, dim=1) if len(c.pending) > 1 else c.pending[0] for c in contexts]
    counts = [f.shape[1] for f in feats]
    batch_ctx = _BatchedDraftContext([c.cache for c in contexts], counts)
    ctx = feats[0].new_zeros(len(contexts), max(counts), feats[0].shape[-1])
    ctx_pos = torch.zeros(len(contexts), max(counts), dtype=torch.long, device=device)
    for a, (f, start) in enumerate(zip(feats, batch_ctx.starts)):
        ctx[a, : f.shape[1]] = f[0]
        ctx_pos[a, : f.shape[1]] = torch.arange(start, start + f.shape[1], device=device)
    mask = None
    l_max = max(batch_ctx.ends)
    if min(batch_ctx.ends) < l_max:  # right-padded contexts: hide the padding (True = attend)
        rows = drafter.block_slots(block_size)  # γ' (+1 where the anchor slot predicts nothing)
        mask = torch.ones(len(contexts), 1, rows, l_max + rows, dtype=torch.bool, device=device)
        for a, end in enumerate(batch_ctx.ends):
            mask[a, :, :, end:l_max] = False
    out = drafter(torch.tensor(anchors, device=device)[:, None], torch.tensor(anchor_positions, device=device)[:, None],
                  ctx.to(device), ctx_pos, attention_mask=mask, cache=batch_ctx, num_slots=block_size,
                  return_logits=False)
    batch_ctx.commit()
    for c in contexts:
        c.pending = []
    return out.hidden_states[:, 0]


@torch.no_grad()
def draft_round(
    drafter: Drafter,
    contexts: list[DraftContext],
    anchors: list[int],
    anchor_positions: list[int],
    plan: RoundPlan,
    policy: PolicyRun,
    *,
    block_size: int,
    sampler: Sampler | None = None,
) -> DraftResult:
    """Draft for R requests and choose their verify lengths ℓ_r (module doc); returns a :class:`DraftResult`.

    Args:
        drafter: a :class:`Drafter` bound to the target (a :class:`~modeling_dspark.DSparkDraftModel`).
        contexts: per request its :class:`DraftContext` (R of them).
        anchors: per request the anchor x_0, its last committed token id.
        anchor_positions: per request the anchor's position (committed tokens − 1).
        plan: the round's :class:`~dspark.generation.policies.RoundPlan` (its ``budgets``: who drafts, how much).
        policy: the run's verify policy, which made ``plan``.
        block_size: γ' ≤ γ, the drafts of the block forward.
        sampler: R = 1 with logits processors or sampling (None: greedy argmax, no logits kept).
    """
    num = len(contexts)
    assert sampler is None or num == 1, "a Sampler drafts for one request"
    budgets = plan.budgets
    tokens: list[list[int]] = [[] for _ in range(num)]
    conf = torch.zeros(num, max(budgets, default=0), dtype=torch.float64)  # c_{r,k}, known for k < known[r]
    known = [0] * num
    kept: list[list[torch.Tensor]] = [[] for _ in range(num)]
    ingested = [0] * num
    active = [i for i in range(num) if budgets[i] > 0]
    if active:
        ingested = [contexts[i].num_pending if i in active else 0 for i in range(num)]
        h = _block_forward(drafter, [contexts[i] for i in active], [anchors[i] for i in active],
                           [anchor_positions[i] for i in active], block_size)  # [A, γ', H]
        _sequential(drafter, h, active, anchors, plan, policy, sampler, tokens, conf, known, kept)
    lengths = policy.lengths(plan, conf, known)
    lengths = [min(ell, len(t)) for ell, t in zip(lengths, tokens)]
    logits = [torch.cat(k, dim=0) if k else None for k in kept]
    return DraftResult(tokens, lengths, [row[:n] for row, n in zip(conf.tolist(), known)], logits, ingested)


def _sequential(drafter, h, active, anchors, plan, policy, sampler, tokens, conf, known, kept) -> None:
    """Step 3 of the module doc: fills ``tokens``, the confidence table ``conf`` and its ``known`` counts, ``kept``."""
    d, device = drafter, drafter.device
    row_of = {i: a for a, i in enumerate(active)}
    budgets = plan.budgets
    prev = torch.tensor([anchors[i] for i in active], device=device)
    max_slots = max(budgets[i] for i in active)
    base = None
    if len(active) * max_slots <= EAGER_LOGITS_ROWS:
        flat = h[:, :max_slots].reshape(-1, h.shape[-1])  # 2-D with canonical strides (a fast GEMM path)
        base = d.lm_logits(flat).view(len(active), max_slots, -1)
    state = None
    alive = list(active)
    for k in range(max_slots):
        rows = torch.tensor([row_of[i] for i in alive], device=device)
        h_k, p_k = h[rows, k], prev[rows]
        cl = d.confidence_logits(p_k, h_k)
        if cl is not None:
            conf[alive, k] = d.calibrated_confidence(cl, k).to("cpu", torch.float64)
            for i in alive:
                known[i] = k + 1
        lengths = policy.lengths(plan, conf, known)
        admit = [n for n, i in enumerate(alive) if lengths[i] > k]
        if not admit:
            break
        sel = torch.tensor(admit, device=device)
        rows_a = rows[sel]
        logits = base[rows_a, k] if base is not None else d.lm_logits(h_k[sel])
        bias, st = d.correction_step(p_k[sel], h_k[sel], None if state is None else state[rows_a])
        if bias is not None:
            logits = logits + bias
        if st is not None:
            if state is None:
                state = st.new_zeros(len(active), *st.shape[1:])
            state[rows_a] = st
        if sampler is None:
            new_tok = d.draft_token_ids(logits.argmax(dim=-1))  # draft-vocabulary column -> target token id
        else:
            full = d.expand_draft_logits(logits)  # [1, V]: -inf outside the draft vocabulary, if one is set
            i = alive[admit[0]]
            if sampler.logits_processor:  # None or a LogitsProcessorList, empty or not
                ids = torch.cat([sampler.input_ids, sampler.input_ids.new_tensor([tokens[i]])], dim=-1)
                full = sampler.logits_processor(ids, full)
            if sampler.do_sample:  # drawn among q's positive entries: torch.multinomial costs O(V) random numbers
                probs = torch.softmax(full[0], dim=-1)
                support = probs.nonzero()[:, 0]  # the draft vocabulary at most, top-k / top-p's few after them
                new_tok = support[torch.multinomial(probs[support], num_samples=1)]
            else:
                new_tok = full.argmax(dim=-1)
            kept[i].append(full)
        prev[rows_a] = new_tok.to(device)
        alive_next = []
        for n, tok in zip(admit, new_tok.tolist()):
            i = alive[n]
            tokens[i].append(int(tok))
            if k + 1 < budgets[i]:
                alive_next.append(i)
        alive = alive_next
        if not alive:
            break
