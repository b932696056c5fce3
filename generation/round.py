"""One speculative round for R ≥ 1 requests: the single sequence of decisions that `generate()` (R = 1,
:class:`~dspark.generation.candidate_generator.DSparkCandidateGenerator`) and the batched engine (R ≥ 1,
:class:`~dspark.generation.engine.DSparkEngine`) both run, so the two paths agree by construction.

A round, read top to bottom (:func:`propose`, then the caller's verify, then :func:`record`); the other modules'
docs refer here for the order:

1. **budget**: the most tokens each request may verify (γ', and the room left before its length limit); the
   drafter's budget is 0 where the policy does not draft;
2. **lookup**: each request's n-gram lookup (:class:`~dspark.generation.lookup.NGramLookup`) matches the end of its
   committed text;
3. **plan** (:meth:`~dspark.generation.policies.PolicyRun.plan`): the round's
   :class:`~dspark.generation.policies.RoundPlan`, a frozen value: how much of each lookup chain to verify, which
   requests draft and how much at most, and what a priced round prices the drafts against; a request that verifies a
   lookup chain skips the drafter this round (the rule of vLLM's hybrid proposer) and the features it committed
   meanwhile wait for its next drafting round;
4. **draft**: one drafting round for the drafting requests (:func:`~dspark.generation.drafting.draft_round`), which
   asks the policy, slot by slot, how many drafts of each request are verified given the confidences so far;
5. **verify** (the caller): one target forward over every request's anchor and chain, greedy or rejection sampling;
6. **record**: the policy's end of round (:meth:`~dspark.generation.policies.PolicyRun.end_round`), then each
   request's :class:`~dspark.generation.stats.RoundStats`, its proposers' acceptance records and the run's prices
   (:mod:`dspark.generation.costs`).

Every decision reads only the committed text, earlier rounds and the confidences known before a token is sampled,
so none can change the output (greedy: token for token; sampling: the same distribution)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .costs import AcceptanceRecord
from .drafting import DraftContext, DraftResult, Sampler, draft_round
from .lookup import NGramLookup
from .policies import PolicyRun, RoundPlan
from .stats import GenerationStats, RoundStats

__all__ = ["RequestState", "Chain", "propose", "record"]


@dataclass
class RequestState:
    """One sequence's speculative state across rounds (a `generate()` call, or one request of the engine).

    Attributes:
        draft: the drafter's context (None without a drafter).
        lookup: the n-gram lookup over the committed text (None with the lookup off).
        stats: the rounds so far.
        draft_record, lookup_record: the acceptance records of the drafter's and the lookup's chains.
    """

    draft: DraftContext | None
    lookup: NGramLookup | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    draft_record: AcceptanceRecord = field(default_factory=AcceptanceRecord)
    lookup_record: AcceptanceRecord = field(default_factory=AcceptanceRecord)


@dataclass
class Chain:
    """What one request verifies this round beside its anchor (outcome of :func:`propose`).

    Attributes:
        tokens: the chain x_1..x_ℓ (token ids).
        source: ``"draft"``, ``"lookup"``, or ``""`` (an empty chain: one plain decoding step).
        logits: ``[ℓ, V]`` float32 processed logits a draft chain was drawn from when the round had a
            :class:`~dspark.generation.drafting.Sampler`; else None (greedy drafts; a lookup chain is a point mass).
        draft_tokens: the drafter's tokens this round (empty when it did not run for this request).
        confidences: calibrated c_k of the slots the drafter reached.
        ingested: target positions the drafter ingested into this request's context this round.
        t_draft_ms: the round's lookup and drafting time (ms), the same for every request of the round.
        plan: the round's plan (:meth:`~dspark.generation.policies.PolicyRun.plan`), the same object for every
            request of the round.
    """

    tokens: list[int]
    source: str
    logits: torch.Tensor | None = None
    draft_tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    ingested: int = 0
    t_draft_ms: float = 0.0
    plan: RoundPlan | None = None

    def cut(self, n: int) -> None:
        """Keep the first ``n`` tokens (e.g. before a token that would complete a stop string)."""
        self.tokens = self.tokens[:n]
        self.logits = self.logits[:n] if self.logits is not None and n else None
        if not self.tokens:
            self.source = ""


def propose(drafter, policy: PolicyRun, states: list[RequestState], committed: list, rooms: list[int], block_size: int,
            sampler: Sampler | None = None) -> list[Chain]:
    """Steps 1–4 of the module doc: each request's :class:`Chain` for this round, at most ``rooms[r]`` tokens long.

    Args:
        drafter: the :class:`~modeling_dspark.DSparkDraftModel` (None only when no state has a drafter context).
        policy: the run's policy (:meth:`dspark.generation.policies.Policy.start`).
        states: per request its :class:`RequestState`.
        committed: per request its committed token ids (``[1, L]`` tensor or list, L ≥ 1; the last is the anchor).
        rooms: per request the most tokens it may verify beside the anchor (≥ 0).
        block_size: γ', the most draft tokens per request and round (≤ the drafter's γ).
        sampler: R = 1 with sampling or logits processors (:class:`~dspark.generation.drafting.Sampler`).
    """
    t0 = time.perf_counter()
    num = len(states)
    lengths = [ids.shape[-1] if isinstance(ids, torch.Tensor) else len(ids) for ids in committed]
    budgets = [min(block_size, room) if policy.drafts and s.draft is not None else 0 for s, room in zip(states, rooms)]
    lookups: list[list[int]] = []
    for s, ids, room in zip(states, committed, rooms):
        if s.lookup is not None:
            s.lookup.update(ids)
        lookups.append(s.lookup.propose(room).tokens if s.lookup is not None else [])
    plan = policy.plan(states, budgets, lookups, sum(lengths) / num - 1)
    if plan.drafts:
        anchors = [int(ids[..., -1]) if isinstance(ids, torch.Tensor) else int(ids[-1]) for ids in committed]
        out = draft_round(drafter, [s.draft for s in states], anchors, [n - 1 for n in lengths], plan, policy,
                          block_size=block_size, sampler=sampler)
    else:
        out = DraftResult([[] for _ in states], [0] * num, [[] for _ in states], [None] * num, [0] * num)
    t_draft_ms = (time.perf_counter() - t0) * 1e3
    chains = []
    for i in range(num):
        if plan.lookup_lengths[i]:
            chains.append(Chain(lookups[i][: plan.lookup_lengths[i]], "lookup", t_draft_ms=t_draft_ms, plan=plan))
            continue
        n, logits = out.lengths[i], out.logits[i]
        chains.append(Chain(out.tokens[i][:n], "draft" if n else "", logits[:n] if logits is not None and n else None,
                            out.tokens[i], out.confidences[i], out.ingested[i], t_draft_ms, plan))
    return chains


def record(policy: PolicyRun, states: list[RequestState], chains: list[Chain], accepted: list[int],
           committed: list[int], t_verify_ms: float, block_size: int, *, priced: bool = True) -> None:
    """Step 6 of the module doc. Each :class:`~dspark.generation.stats.RoundStats` gets its share of the round's
    drafting time; that time is a steady drafting price where every drafting request caught up on at most one round
    (≤ γ' + 1 positions).

    Args:
        policy: the run's policy (its :class:`~dspark.generation.costs.Prices`, if priced).
        chains: the round's chains (:func:`propose`), each carrying the round's plan.
        accepted: per request the chain tokens the target accepted.
        committed: per request the tokens appended (accepted + the target's own, cut by EOS / length).
        t_verify_ms: the verify forward and acceptance time (ms).
        block_size: γ'.
        priced: False where the verify forward also did other work (the engine's prefills): no price learned.
    """
    batch_tokens = sum(1 + len(c.tokens) for c in chains)
    t_draft_ms = chains[0].t_draft_ms
    policy.end_round(chains[0].plan, [c.confidences for c in chains], batch_tokens, priced)
    for s, c, a, n in zip(states, chains, accepted, committed):
        ell = len(c.tokens)
        drafter_ran = c.ingested > 0
        refused = c.source == "" and drafter_ran  # a chain rejected at its first position (costs' module doc)
        s.draft_record.update(ell if c.source == "draft" else (1 if refused else None), a)
        s.lookup_record.update(ell if c.source == "lookup" else None, a)
        s.stats.rounds.append(RoundStats(
            drafted=len(c.draft_tokens), verified=ell, accepted=a, committed=n,
            confidences=list(c.confidences[:ell]) if c.source == "draft" else [],
            draft_tokens=list(c.tokens) if c.source == "lookup" else list(c.draft_tokens),
            t_draft_ms=t_draft_ms / len(chains), t_verify_ms=t_verify_ms, ingested=c.ingested, source=c.source,
        ))
    if policy.prices is None:
        return
    if priced:
        policy.prices.observe_verify(batch_tokens, t_verify_ms / 1e3, len(chains))
    drafting = [c for c in chains if c.ingested]
    if drafting:
        steady = all(c.ingested <= block_size + 1 for c in drafting)
        policy.prices.observe_draft(t_draft_ms / 1e3, len(drafting), steady=steady)
