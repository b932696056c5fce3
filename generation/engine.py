"""Batched speculative decoding with continuous batching: :class:`DSparkEngine` (greedy).

transformers' assisted decoding is batch size 1. This engine serves R concurrent requests with a DSpark drafter.
One round (:meth:`DSparkEngine._round`) reads top to bottom:

1. **decide**: each request's budget (block size, length left); with ``scheduler`` / ``lagged`` the cost model's
   draft gate may skip drafting some requests (:class:`~generation.cost_model.CostModel`); with the lookup
   proposer on, a request whose n-gram lookup continuation is expected to beat drafting skips drafting too;
2. **draft**: one drafting round for all requests (:func:`generation.drafting.draft_round`), which also chooses
   the verify lengths ℓ_r by the policy (Algorithm 1 over all R requests for ``scheduler``; docs/method.md §4);
   then each request with a lookup proposal verifies whichever chain, draft or lookup prefix, has the larger
   expected committed tokens per second (:class:`~generation.lookup.LookupChain`, as in `generate()`);
3. **verify**: ONE packed target forward over B = Σ_r (1 + ℓ_r) tokens
   (:class:`~generation.packed_target.PackedTarget`);
4. **accept**: per request the longest prefix of its chain equal to the target's argmax, plus the target's own next
   token (:func:`accept_greedy`); rejected tokens are cropped from its K/V cache;
5. **observe**: the cost model folds in the round (drafting time, realized yield of the drafts verified), and each
   request's lookup judges its proposal against the committed tokens.

A request's chain is priced as if the others verified their anchor only: SPS_r(B) = SPS_R(R − 1 + B) of the round's
curve, and t_draft(n) / n of the n requests drafting (for R = 1 exactly `generate()`'s prices). Any chain is
lossless under greedy acceptance, so these choices can change speed only.

Waiting requests join at the next :meth:`DSparkEngine.step` (their prompts prefilled in one packed forward) while
at most ``max_batch_size`` run; requests finish independently (EOS or ``max_new_tokens``).

Greedy only: each request's output equals ``target.generate(prompt, max_new_tokens=n, do_sample=False)`` (token
for token in float32; no logits processors). Not thread-safe (see :mod:`generation.packed_target`).
This engine is the reference for the scheduler on one machine; serving at scale belongs to vLLM / SGLang.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from modeling_dspark.target import context_features

from .candidate_generator import check_drafter
from .cost_model import CostModel
from .drafting import DraftContext, DraftResult, draft_round
from .lookup import NUM_TOKENS as LOOKUP_TOKENS, LookupChain, MeasuredPrices
from .packed_target import PackedTarget, RequestKV
from .policies import LaggedBudget, Policy, parse_policy
from .scheduler import shifted_sps
from .stats import GenerationStats, RoundStats

__all__ = ["DSparkEngine", "EngineRound", "EngineStats", "RequestOutput", "accept_greedy", "generate_batch"]


def accept_greedy(drafts: Sequence[int], predicted: Sequence[int]) -> int:
    """The greedy acceptance rule: how many leading ``drafts`` equal the target's argmax ``predicted`` at the same
    position (``predicted`` has one more entry, the target's token after the last draft)."""
    n = 0
    while n < len(drafts) and drafts[n] == predicted[n]:
        n += 1
    return n


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
        t_added, t_admitted, t_first_token, t_finished: ``time.perf_counter()`` stamps (seconds).
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


@dataclass
class EngineRound:
    """One engine round (prefill-only steps are not rounds).

    Attributes:
        requests: R, requests verified this round.
        batch_tokens: B = Σ_r (1 + ℓ_r), tokens in the verify forward.
        lengths: ℓ_r per request: the tokens of the chain verified (``sources``), beside the anchor.
        drafted: draft tokens sampled per request (≥ ℓ_r where the draft chain was verified).
        accepted: accepted chain tokens per request.
        committed: tokens appended per request.
        t_draft_ms, t_verify_ms: decide + draft time, and verify forward + acceptance time (ms).
        gated: per request, True when the draft gate skipped a request that could have drafted.
        gate: the gate's reason (:meth:`generation.cost_model.CostModel.plan`; ``""`` without a gate).
        sources: per request the chain verified: ``"draft"``, ``"lookup"`` or ``""`` (the anchor only).
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
    gate: str = ""
    sources: list[str] = field(default_factory=list)

    @property
    def drafted_any(self) -> bool:
        """Whether the drafter ran this round."""
        return any(self.drafted)


@dataclass
class EngineStats:
    """Engine-wide statistics: rounds, prefills, wall time of the steps (seconds), tokens."""

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
            "probe_rounds": sum(r.gate == "probe" for r in self.rounds),
            "lookup_request_rounds": sum(s == "lookup" for r in self.rounds for s in r.sources),
            "prefill_tokens": self.prefill_tokens,
            "prefill_ms": self.prefill_ms,
            "step_time_s": self.step_time_s,
        }


@dataclass
class _Request:
    """Engine-internal state of one request."""

    id: int
    prompt: list[int]
    max_new: int
    kv: RequestKV | None
    draft: DraftContext | None = None  # the drafter's context (None without a drafter)
    lookup: LookupChain | None = None  # the n-gram lookup proposer (None when off)
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    skipped: int = 0  # consecutive rounds this request could have drafted but did not (draft gate or lookup)
    stats: GenerationStats = field(default_factory=GenerationStats)
    t_added: float = field(default_factory=time.perf_counter)
    t_admitted: float = 0.0
    t_first: float = 0.0

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

        engine = DSparkEngine(target, drafter, policy="scheduler")  # SPS(B) profiled on first use, then cached
        a = engine.add_request(prompt_ids_a, max_new_tokens=64)
        engine.step()                                  # one round (new requests are prefilled first)
        outputs = engine.run()                         # until every request is finished; sorted by id

    Args:
        target: the target causal LM (eval mode; float32 for exact greedy equality with ``generate()``).
        drafter: a :class:`~modeling_dspark.DSparkDraftModel` (bound to ``target`` here if it is not yet); may be
            None only with ``policy="none"``.
        policy: a spec of :func:`generation.policies.parse_policy` or a :class:`~generation.policies.Policy`.
        block_size: γ' ≤ the drafter's γ slots per round (default γ).
        sps: SPS(B) for ``scheduler`` / ``lagged``: a mapping ``{B: steps/s}``, a callable, or a
            :class:`generation.profiling.SPSProfile` (then the curve for the round's R and mean context is used);
            default: the cached profile of this target, measured on first use.
        max_batch_size: at most this many requests run at once; more wait in a queue (FIFO).
        eos_token_id: int or list; default the target's ``generation_config.eos_token_id``.
        lag_default_budget: budget K of the lagged policy for its first LAG rounds (default: R).
        draft_cost_ms: the drafting time as ``scheduler`` / ``lagged`` price it: ``"auto"`` (measured), a number of
            milliseconds, or None (not priced, as the paper's Algorithm 1) (:class:`~generation.cost_model.CostModel`).
        draft_gate: ``scheduler`` / ``lagged`` only: skip drafting where past rounds say it does not pay.
        lookup: run the n-gram lookup proposer beside the drafter (module doc); with policy ``none`` it is the only
            proposer (``lookup=False`` and ``policy="none"``: plain decoding). It proposes up to γ' tokens (10
            without a drafter); without an SPS profile its chain is priced by
            :class:`~generation.lookup.MeasuredPrices`.

    Raises:
        ValueError: a bad policy, a policy that needs a drafter / confidence head without one, block_size out of
            range, a drafter that does not match the target or is bound to another target instance
            (:func:`~generation.candidate_generator.check_drafter`, as `generate()`), a bad draft_cost_ms /
            draft_gate / lookup.
    """

    def __init__(
        self,
        target,
        drafter=None,
        policy: str | Policy = "full",
        *,
        block_size: int | None = None,
        sps=None,
        max_batch_size: int = 16,
        eos_token_id: int | Sequence[int] | None = None,
        lag_default_budget: int | None = None,
        draft_cost_ms: str | float | None = "auto",
        draft_gate: bool = True,
        lookup: bool = True,
    ):
        self.policy = parse_policy(policy)
        if not isinstance(lookup, bool):
            raise ValueError(f"lookup must be True or False; got {lookup!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if self.policy.drafts and drafter is None:
            raise ValueError(f"policy {self.policy.name!r} needs a drafter (use policy='none' without one)")
        gamma = check_drafter(drafter, target, block_size, self.policy) if self.policy.drafts else 0
        self.target = target
        self.drafter = drafter if self.policy.drafts else None
        self.block_size = gamma
        self.max_batch_size = int(max_batch_size)
        self.packed = PackedTarget(target)
        self.cost: CostModel | None = None
        if self.policy.needs_sps:
            cost = CostModel(sps, draft_gate=draft_gate, draft_cost_ms=draft_cost_ms)  # validates first
            cost.sps = sps if sps is not None else self._profile()
            self.cost = cost
        self.lagged = LaggedBudget(self.policy.lag, lag_default_budget) if self.policy.kind == "lagged" else None
        if eos_token_id is None:
            eos_token_id = target.generation_config.eos_token_id
        if eos_token_id is None:
            self.eos = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos = frozenset([eos_token_id])
        else:
            self.eos = frozenset(int(e) for e in eos_token_id)
        self.layer_ids = list(drafter.config.target_layer_ids) if self.drafter is not None else []
        self.lookup_tokens = (gamma or LOOKUP_TOKENS) if lookup else 0
        self.measured = MeasuredPrices()  # prices the lookup chooser without a cost model
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._finished: dict[int, RequestOutput] = {}
        self._next_id = 0
        self.stats = EngineStats()

    def _profile(self):
        """The cached SPS(B) profile of this target for R up to ``max_batch_size``, measured where missing."""
        from .profiling import ensure_profile, first_use_tokens

        requests = {1, self.max_batch_size} | {2 ** i for i in range(8) if 2 ** i < self.max_batch_size}
        return ensure_profile(self.target, requests=requests, tokens=first_use_tokens(self.block_size))

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
        capacity = len(prompt) + int(max_new_tokens) + max(self.block_size, self.lookup_tokens) + 2
        lookup = LookupChain(num_tokens=self.lookup_tokens) if self.lookup_tokens else None
        self._waiting.append(_Request(rid, prompt, int(max_new_tokens), self.packed.new_cache(capacity),
                                      lookup=lookup))
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
        new = []
        while self._waiting and len(self._running) + len(new) < self.max_batch_size:
            req = self._waiting.popleft()
            req.t_admitted = time.perf_counter()
            new.append(req)
        done: list[RequestOutput] = []
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

    # ------------------------------------------------------------------ the round
    def _round(self, reqs: list[_Request]) -> None:
        """One speculative round over the running requests: decide → draft → verify → accept → observe."""
        t0 = time.perf_counter()
        num = len(reqs)
        context_len = statistics.fmean(r.kv.length for r in reqs)
        budgets = [max(0, min(self.block_size, r.remaining - 1)) for r in reqs]  # decide
        wanted, gate = list(budgets), ""
        if self.cost is not None:
            budgets, gate = self.cost.plan(budgets, [r.skipped for r in reqs], context_len)
        gated = [w > 0 and b == 0 for w, b in zip(wanted, budgets)] if self.cost is not None else []
        proposals = [r.lookup.propose(r.prompt + r.output, min(self.lookup_tokens, r.remaining - 1)).tokens
                     if r.lookup is not None else [] for r in reqs]
        prices = self._lookup_prices(num, context_len, sum(b > 0 for b in budgets)) if any(proposals) else None
        for i, r in enumerate(reqs):
            if budgets[i] > 0 and proposals[i] \
                    and r.lookup.before_drafting(budgets[i], *prices, gate).source == "lookup":
                budgets[i] = 0  # the lookup beats drafting: this request skips the drafter; its features wait
        draft = self._draft(reqs, budgets, context_len)  # draft
        chains, sources = [], []
        for i, r in enumerate(reqs):
            chain, source = draft.tokens[i][: draft.lengths[i]], "draft"
            if proposals[i]:
                choice = r.lookup.after_drafting(draft.confidences[i], draft.lengths[i], budgets[i], *prices,
                                                 greedy=True) if budgets[i] > 0 else r.lookup.without_drafter(prices[0])
                if choice.source == "lookup":
                    chain, source = proposals[i][: choice.length], "lookup"
            if r.lookup is not None:  # the verified drafts train the drafter's predicted survival
                r.lookup.verifying(source if chain else "none", chain)
            chains.append(chain)
            sources.append(source if chain else "")
        t1 = time.perf_counter()
        segments = [(r.kv, [r.output[-1]] + chains[i]) for i, r in enumerate(reqs)]
        starts = [r.kv.length for r in reqs]
        logits, hidden = self.packed.forward(segments, output_hidden_states=self.drafter is not None)  # verify
        predicted = logits.argmax(dim=-1).tolist()
        feats = context_features(hidden, self.layer_ids, 0, None) if self.drafter is not None else None  # [1, B, m·H]
        accepted, committed, off = [], [], 0
        for i, r in enumerate(reqs):  # accept
            ell = len(chains[i])
            n = accept_greedy(chains[i], predicted[off : off + ell + 1])
            committed.append(r.commit(chains[i][:n] + [predicted[off + n]], self.eos))
            r.kv.crop(starts[i] + 1 + n)  # anchor + accepted tokens are now context; the rest is dropped
            if r.draft is not None and r.finish_reason is None:  # a view would pin the whole round's features
                r.draft.pending.append(feats[:, off : off + 1 + n].clone())
            if r.lookup is not None:
                r.lookup.observe(r.prompt + r.output)
            accepted.append(n)
            off += ell + 1
        t2 = time.perf_counter()
        drafting = [i for i, n in enumerate(draft.ingested) if n > 0]  # the drafter ran for these
        if self.cost is not None:  # observe
            # a request that drafted but verified the lookup chain gives no yield; the round's drafting time is then
            # not timed, since CostModel.observe files it under the number of yields
            timed = all(sources[i] != "lookup" for i in drafting)
            self.cost.observe(num, [(accepted[i], draft.lengths[i]) for i in drafting if sources[i] != "lookup"],
                              t1 - t0 if timed else 0.0, [draft.ingested[i] for i in drafting], self.block_size)
        self.measured.observe_verify(t2 - t1)
        if drafting and max(draft.ingested[i] for i in drafting) <= self.block_size + 1:  # a steady drafting round
            self.measured.observe_draft((t1 - t0) / len(drafting))
        for i, r in enumerate(reqs):
            r.skipped = r.skipped + 1 if wanted[i] > 0 and budgets[i] == 0 else 0
        self._record(reqs, draft, chains, sources, accepted, committed, off, gated, gate, (t1 - t0) * 1e3,
                     (t2 - t1) * 1e3)

    def _lookup_prices(self, num: int, context_len: float, rows: int):
        """``(SPS_r, t_draft)`` for one request's chain choice (module doc): the round's curve shifted to
        SPS_R(R − 1 + B) and the drafting time per drafting request; :class:`MeasuredPrices` without a cost model."""
        if self.cost is None:
            return self.measured.sps(), self.measured.draft_seconds()
        rows = max(rows, 1)
        return shifted_sps(self.cost.curve(num, context_len), num - 1), self.cost.draft_seconds(rows) / rows

    def _draft(self, reqs: list[_Request], budgets: list[int], context_len: float) -> DraftResult:
        """The drafting round of the module doc (step 2), with the cost model's SPS_eff(B) and the lagged budget."""
        num = len(reqs)
        if self.drafter is None:
            return DraftResult([[] for _ in reqs], [0] * num, [[] for _ in reqs], [None] * num, [0] * num)
        rows = sum(b > 0 for b in budgets)
        sps = self.cost.round_sps(num, context_len, rows) if self.cost is not None else None
        lag_budget = self.lagged.take(num) if self.lagged is not None else None
        out = draft_round(self.drafter, [r.draft for r in reqs], [r.output[-1] for r in reqs],
                          [r.kv.length for r in reqs], budgets, self.policy, num_slots=self.block_size, sps=sps,
                          lag_budget=lag_budget)
        if self.lagged is not None:  # budget for LAG rounds ahead, from this round's confidences only
            self.lagged.push(out.confidences, budgets, sps)
        return out

    # ------------------------------------------------------------------ bookkeeping
    def _prefill(self, reqs: list[_Request]) -> None:
        t0 = time.perf_counter()
        logits, hidden = self.packed.forward([(r.kv, r.prompt) for r in reqs],
                                             output_hidden_states=self.drafter is not None)
        off, now = 0, time.perf_counter()
        for r in reqs:
            p = len(r.prompt)
            if self.drafter is not None:
                cache = RequestKV(self.drafter.config.num_draft_layers, p + r.max_new + 2)
                r.draft = DraftContext(cache, [context_features(hidden, self.layer_ids, off, off + p)])
            r.commit([int(logits[off + p - 1].argmax())], self.eos)
            r.t_first = now
            off += p
        self.stats.prefill_tokens += off
        self.stats.prefill_ms += (time.perf_counter() - t0) * 1e3

    def _retire(self) -> list[RequestOutput]:
        out, keep = [], []
        now = time.perf_counter()
        for req in self._running:
            if req.finish_reason is None:
                keep.append(req)
                continue
            res = RequestOutput(req.id, req.prompt, list(req.output), req.finish_reason, req.stats, req.t_added,
                                req.t_admitted, req.t_first, now)
            self._finished[req.id] = res
            out.append(res)
            req.kv, req.draft = None, None  # free the caches
        self._running = keep
        return out

    def _record(self, reqs, draft: DraftResult, chains, sources, accepted, committed, batch_tokens, gated, gate,
                draft_ms, verify_ms):
        for i, r in enumerate(reqs):
            ell, lookup = len(chains[i]), sources[i] == "lookup"
            r.stats.rounds.append(RoundStats(
                drafted=len(draft.tokens[i]), verified=ell, accepted=accepted[i], committed=committed[i],
                confidences=list(draft.confidences[i][:ell]) if self.policy.needs_confidence and not lookup else [],
                draft_tokens=list(chains[i]) if lookup else list(draft.tokens[i]), t_draft_ms=draft_ms / len(reqs),
                t_verify_ms=verify_ms, gate=gate, ingested=draft.ingested[i], source=sources[i],
            ))
        self.stats.rounds.append(EngineRound(
            requests=len(reqs), batch_tokens=batch_tokens, lengths=[len(c) for c in chains],
            drafted=[len(t) for t in draft.tokens], accepted=accepted, committed=committed,
            t_draft_ms=draft_ms, t_verify_ms=verify_ms, gated=gated, gate=gate, sources=sources,
        ))


def generate_batch(
    target,
    prompts: Sequence,
    drafter=None,
    policy: str | Policy = "full",
    max_new_tokens: int | Sequence[int] = 128,
    **engine_kwargs,
) -> list[RequestOutput]:
    """Run all ``prompts`` (token-id lists / tensors) through one :class:`DSparkEngine`; outputs in prompt order.

    ``max_new_tokens`` is one int or one per prompt; other keyword arguments go to :class:`DSparkEngine`.

    Raises:
        ValueError: as :class:`DSparkEngine`, or a ``max_new_tokens`` list of the wrong length.
    """
    if not isinstance(max_new_tokens, int):
        max_new_tokens = list(max_new_tokens)
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"{len(max_new_tokens)} max_new_tokens values for {len(prompts)} prompts")
    else:
        max_new_tokens = [max_new_tokens] * len(prompts)
    engine = DSparkEngine(target, drafter, policy, **engine_kwargs)
    for p, n in zip(prompts, max_new_tokens):
        engine.add_request(p, n)
    return engine.run()
