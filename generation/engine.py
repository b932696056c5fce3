"""Batched speculative decoding with continuous batching: :class:`DSparkEngine` (greedy).

transformers' assisted decoding is batch size 1; this engine serves R concurrent requests with a DSpark drafter. Its
round (:meth:`DSparkEngine._round`) runs the steps of :mod:`dspark.generation.round` (the decisions `generate()` makes),
verifies in ONE packed target forward over B = Σ_r (1 + ℓ_r) tokens
(:class:`~dspark.generation.packed_target.PackedTarget`) and accepts by :func:`accept_greedy`, cropping rejected tokens
from each request's K/V cache and queuing the features of its committed positions for its drafter. Waiting requests join
at the next :meth:`DSparkEngine.step` while at most ``max_batch_size`` run, prefilled in that step's verify forward
(replacing a request that finished costs no extra forward); each finishes on EOS or ``max_new_tokens``.

Greedy only: each request's output equals ``target.generate(prompt, max_new_tokens=n, do_sample=False)`` (token for
token in float32; no logits processors). Not thread-safe (see :mod:`dspark.generation.packed_target`). This engine is
the reference for the scheduler on one machine; serving at scale belongs to vLLM / SGLang.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .drafting import DraftContext, check_drafter
from .features import context_features
from .lookup import NUM_TOKENS as LOOKUP_TOKENS, NGramLookup
from .kv import RequestKV
from .packed_target import PackedTarget
from .policies import Policy, default_policy, parse_policy
from .products import few_row_products
from .round import RequestState, propose, record
from .stats import GenerationStats, RoundStats

__all__ = ["DSparkEngine", "EngineRound", "EngineStats", "RequestOutput", "accept_greedy", "generate_batch"]


def accept_greedy(drafts: Sequence[int], predicted: Sequence[int]) -> int:
    """The greedy acceptance rule: how many leading ``drafts`` equal the target's argmax ``predicted`` at the same
    position (``predicted`` has one more entry, the target's token after the last draft)."""
    n = 0
    while n < len(drafts) and drafts[n] == predicted[n]:
        n += 1
    return n


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
    """One engine round (prefill-only steps are not rounds): the :class:`~dspark.generation.stats.RoundStats` of each
    request verified in it, in the round's order, and views of them: ``requests`` (R), ``batch_tokens``
    (B = Σ_r (1 + ℓ_r), the tokens verified), per request ``lengths`` (ℓ_r, the chain verified beside the anchor),
    ``drafted``, ``accepted``, ``committed`` and ``sources`` (``"draft"``, ``"lookup"`` or ``""``); ``t_draft_ms`` (the
    round's propose time) and ``t_verify_ms`` (ms)."""

    members: list[RoundStats]

    @property
    def requests(self) -> int:
        return len(self.members)

    @property
    def batch_tokens(self) -> int:
        return sum(1 + m.verified for m in self.members)

    @property
    def lengths(self) -> list[int]:
        return [m.verified for m in self.members]

    @property
    def drafted(self) -> list[int]:
        return [m.drafted for m in self.members]

    @property
    def accepted(self) -> list[int]:
        return [m.accepted for m in self.members]

    @property
    def committed(self) -> list[int]:
        return [m.committed for m in self.members]

    @property
    def sources(self) -> list[str]:
        return [m.source for m in self.members]

    @property
    def t_draft_ms(self) -> float:
        return sum(m.t_draft_ms for m in self.members)

    @property
    def t_verify_ms(self) -> float:
        return self.members[0].t_verify_ms

    @property
    def drafted_any(self) -> bool:
        """Whether the drafter ran this round."""
        return any(self.drafted)


@dataclass
class EngineStats:
    """Engine-wide statistics: rounds, prefills, wall time of the steps (seconds), tokens; ``prefill_ms`` times the
    forwards that only prefilled (a prefill in a round's verify forward is timed in the round's ``t_verify_ms``)."""

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
            "lookup_request_rounds": sum(s == "lookup" for r in self.rounds for s in r.sources),
            "prefill_tokens": self.prefill_tokens,
            "prefill_ms": self.prefill_ms,
            "step_time_s": self.step_time_s,
        }


@dataclass(kw_only=True)
class _Request(RequestState):
    """One engine request: its round state (drafter context, lookup, statistics), K/V cache and output."""

    id: int
    prompt: list[int]
    max_new: int
    kv: RequestKV | None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
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


class DSparkEngine:
    """Batched greedy speculative decoding of R concurrent requests with continuous batching (see module doc).

    Usage::

        engine = DSparkEngine(target, drafter)          # by default every round is priced (dspark.generation.costs)
        a = engine.add_request(prompt_ids_a, max_new_tokens=64)
        engine.step()                                  # one round; new requests prefilled in its forward
        outputs = engine.run()                         # until every request is finished; sorted by id

    Args:
        target: the target causal LM (eval mode; float32 for exact greedy equality with ``generate()``).
        drafter: a :class:`~modeling_dspark.DSparkDraftModel` (bound to ``target`` here and at every step, where
            another target's call may have re-bound it); may be None only with ``policy="none"``.
        policy: a spec of :func:`dspark.generation.policies.parse_policy` or a
            :class:`~dspark.generation.policies.Policy`; None: :func:`~dspark.generation.policies.default_policy`'s.
        block_size: γ' ≤ the drafter's γ slots per round (default γ).
        sps: an explicit SPS(B) for ``scheduler`` / ``lagged``, as :class:`~dspark.generation.costs.Prices` takes it;
            default: verify prices learned from the rounds.
        max_batch_size: at most this many requests run at once; more wait in a queue (FIFO).
        eos_token_id: int or list; default the target's ``generation_config.eos_token_id``.
        lookup: run the n-gram lookup proposer (:mod:`dspark.generation.lookup`; up to γ' tokens, 10 without a
            drafter), the only proposer with policy ``none`` (``lookup=False`` too: plain decoding).

    Raises:
        ValueError: a bad policy, ``lookup`` or ``max_batch_size``, a policy that needs a drafter without one, or
            what :func:`~dspark.generation.drafting.check_drafter` refuses (as for `generate()`).
    """

    def __init__(
        self,
        target,
        drafter=None,
        policy: str | Policy | None = None,
        *,
        block_size: int | None = None,
        sps=None,
        max_batch_size: int = 16,
        eos_token_id: int | Sequence[int] | None = None,
        lookup: bool = True,
    ):
        policy = default_policy(drafter) if policy is None else parse_policy(policy)
        if not isinstance(lookup, bool):
            raise ValueError(f"lookup must be True or False; got {lookup!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if policy.drafts and drafter is None:
            raise ValueError(f"policy {policy.name!r} needs a drafter (use policy='none' without one)")
        block_size = check_drafter(drafter, target, block_size, policy) if policy.drafts else 0
        self.target = target
        self.drafter = drafter if policy.drafts else None
        self.block_size = block_size
        self.max_batch_size = int(max_batch_size)
        self.packed = PackedTarget(target)
        self.policy = policy.start(sps=sps)
        eos = target.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos = frozenset([] if eos is None else [int(eos)] if isinstance(eos, int) else map(int, eos))
        self.layer_ids = list(drafter.config.target_layer_ids) if self.drafter is not None else []
        self.lookup_tokens = (block_size or LOOKUP_TOKENS) if lookup else 0
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._finished: dict[int, RequestOutput] = {}
        self._next_id = 0
        self.stats = EngineStats()

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
        lookup = NGramLookup(num_tokens=self.lookup_tokens) if self.lookup_tokens else None
        self._waiting.append(_Request(draft=None, lookup=lookup, id=rid, prompt=prompt, max_new=int(max_new_tokens),
                                      kv=self.packed.new_cache(capacity)))
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
        """One speculative round over the running requests, with the waiting requests that fit prefilled in its forward
        (they run from the next step on); returns the requests that finished during this step."""
        t0 = time.perf_counter()
        if self._running or self._waiting:  # the drafter held for this target: another's call may have re-bound it
            hold = self.drafter.drafting_for(self.target) if self.drafter is not None else contextlib.nullcontext()
            with few_row_products(self.target, self.drafter), hold:  # the faster BLAS call for few rows, measured
                self._round(self._running)
        done = self._retire()
        self.stats.step_time_s += time.perf_counter() - t0
        return done

    def run(self) -> list[RequestOutput]:
        """Step until no request is running or waiting; return the outputs finished meanwhile, sorted by id."""
        done: list[RequestOutput] = []
        while self.has_unfinished():
            done += self.step()
        return sorted(done, key=lambda o: o.request_id)

    def _round(self, reqs: list[_Request]) -> None:
        """One round over the running ``reqs`` (:mod:`dspark.generation.round`); waiting requests that fit are admitted
        after the proposal, prefilled in its forward, unless :meth:`~.policies.PolicyRun.measures` the round."""
        chains = propose(self.drafter, self.policy, reqs, [r.prompt + r.output for r in reqs],
                         [r.remaining - 1 for r in reqs], self.block_size) if reqs else []
        room = 0 if reqs and self.policy.measures(chains[0].plan) else self.max_batch_size - len(reqs)
        new = [self._waiting.popleft() for _ in range(min(len(self._waiting), room))]
        t1 = time.perf_counter()
        segments = [(r.kv, [r.output[-1]] + c.tokens) for r, c in zip(reqs, chains)]
        starts = [r.kv.length for r in reqs]
        logits, hidden = self.packed.forward(segments + [(r.kv, r.prompt) for r in new],  # verify and prefill
                                             output_hidden_states=self.drafter is not None, last_only=len(new))
        n_round = sum(1 + len(c.tokens) for c in chains)  # the round's tokens; the prompts follow
        predicted = logits[:n_round].argmax(dim=-1).tolist()
        feats = context_features(hidden, self.layer_ids, 0, None) if self.drafter is not None else None  # [1, B, m·H]
        accepted, committed, off = [], [], 0
        for r, chain, start in zip(reqs, chains, starts):  # accept
            ell = len(chain.tokens)
            n = accept_greedy(chain.tokens, predicted[off : off + ell + 1])
            committed.append(r.commit(chain.tokens[:n] + [predicted[off + n]], self.eos))
            r.kv.crop(start + 1 + n)  # anchor + accepted tokens are now context; the rest is dropped
            if r.draft is not None and r.finish_reason is None:  # a view would pin the whole round's features
                r.draft.pending.append(feats[:, off : off + 1 + n].clone())
            accepted.append(n)
            off += ell + 1
        self._start(new, logits[n_round:], feats[:, n_round:] if feats is not None else None, t1)
        self._running = reqs + new
        t2 = time.perf_counter()
        if not reqs:
            self.stats.prefill_ms += (t2 - t1) * 1e3
            return
        record(self.policy, reqs, chains, accepted, committed, (t2 - t1) * 1e3, self.block_size, priced=not new)
        self.stats.rounds.append(EngineRound([r.stats.rounds[-1] for r in reqs]))

    def _start(self, reqs: list[_Request], logits: torch.Tensor, feats: torch.Tensor | None, admitted: float) -> None:
        """Start the requests just prefilled from the target's ``logits [len(reqs), V]`` at their prompts' last
        positions and features ``feats [1, ΣP, m·H]`` at all, in order: their first token (the argmax), their drafter's
        context and their admission time ``admitted`` (``time.perf_counter()`` seconds)."""
        off, now = 0, time.perf_counter()
        for r, first in zip(reqs, logits.argmax(-1).tolist()):  # one device-to-host copy for all
            p, r.t_admitted = len(r.prompt), admitted
            if feats is not None:
                cache = RequestKV(self.drafter.config.num_draft_layers, p + r.max_new + 2)
                r.draft = DraftContext(cache, [feats[:, off : off + p].clone()])
            r.commit([first], self.eos)
            r.t_first = now
            off += p
        self.stats.prefill_tokens += off

    def _retire(self) -> list[RequestOutput]:
        out, keep, now = [], [], time.perf_counter()
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


def generate_batch(
    target,
    prompts: Sequence,
    drafter=None,
    policy: str | Policy | None = None,
    max_new_tokens: int | Sequence[int] = 128,
    **engine_kwargs,
) -> list[RequestOutput]:
    """Run all ``prompts`` (token-id lists / tensors) through one :class:`DSparkEngine` (other keyword arguments go to
    it); ``max_new_tokens`` is one int or one per prompt. Returns the outputs in prompt order.

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
