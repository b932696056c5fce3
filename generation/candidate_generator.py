"""`DSparkCandidateGenerator`: the DSpark drafter as a transformers `CandidateGenerator` (R = 1).

Each round takes the target features that transformers' assisted loop returns (``output_hidden_states``), queues
those of the newly committed positions for the drafter's context, and calls the shared drafting round
(:func:`generation.drafting.draft_round`) for one request. transformers then verifies the candidates in one target
forward and accepts or rejects them (greedy match, or rejection sampling with residual resampling), which keeps the
output lossless.

With the ``scheduler`` or ``lagged`` policy the round is priced by a :class:`~generation.cost_model.CostModel`
(SPS(B) and the drafter's measured time); its draft gate may skip drafting in a round where past rounds say it does
not pay: the round then returns no candidates (one plain decoding step) and its features wait for the next drafting
round.

The n-gram lookup proposer (:class:`generation.lookup.LookupChain`, on unless ``dspark_options(lookup=False)``)
proposes a second candidate chain at no model cost: the continuation of the most recent earlier occurrence of the
last committed tokens. Each round verifies one chain, a prefix of the drafter's block or of the lookup
continuation, whichever has the larger expected committed tokens per second (Algorithm 1 with two candidate chains,
:func:`generation.scheduler.choose_chain`); when the lookup is expected to beat drafting, the drafter forward is
skipped and its features wait for the next drafting round. A lookup proposal is a point mass, returned without
candidate logits: transformers then draws the target's token at every position and keeps the candidates while they
agree, which is its rejection rule for a one-hot proposal, so greedy and sampled outputs stay lossless.

Stop strings: transformers' assisted loop checks its stopping criteria once per round, on the last committed token,
so a stop string completed by an accepted draft token inside the block would go unseen. When the call has stop
strings, the draft is cut before the first token whose acceptance would complete one, so a stop string can only
complete at a round's last committed token (the target's own token), where the criteria see it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

from modeling_dspark.modeling_dspark import DSparkDraftModel
from modeling_dspark.target import context_features, hidden_state_indices

from .cost_model import CostModel, cost_model_for
from .drafting import DraftContext, Sampler, draft_round
from .lookup import LookupChain, MeasuredPrices
from .packed_target import RequestKV
from .policies import LaggedBudget, Policy, parse_policy
from .profiling import sps_for_generate
from .stats import GenerationStats, RoundStats, register


def validate_request(drafter, target, generation_config, input_ids=None, block_size=None, policy=None) -> int:
    """Check one `generate()` request before any compute; return the block size γ' to use.

    An attention mask with zeros is allowed: transformers applies it to the target in every verify forward, so the
    output is that of plain `generate()` with the same mask (transformers infers one from ``pad_token_id`` when none
    is passed, e.g. when the pad id equals a token of the chat template); the drafter reads all positions, which can
    only change how many drafts are accepted.

    Raises:
        ValueError: batch size > 1, an empty prompt, block_size out of [1, γ], a policy that needs a confidence
            head the drafter lacks, `assistant_ensemble_weight` (not lossless), or a drafter bound to a different
            target instance (re-binding would change it for every other user of the drafter).
    """
    if input_ids is not None:
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"DSpark through generate() supports batch size 1 (got {input_ids.shape[0]}), like all "
                "transformers assisted decoding; use generation.engine.DSparkEngine for batched speculative decoding"
            )
        if input_ids.shape[1] == 0:
            raise ValueError("empty prompt: input_ids has no tokens")
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        raise ValueError("assistant_ensemble_weight relaxes verification (not lossless); DSpark does not support it")
    return check_drafter(drafter, target, block_size, policy)


def check_drafter(drafter, target, block_size: int | None = None, policy: str | Policy | None = None) -> int:
    """Bind an unbound drafter to ``target`` (and move it to the target's device) and check that it serves this
    request; return the block size γ'.

    The same checks for `generate()` (:func:`validate_request`) and :class:`~generation.engine.DSparkEngine`.

    Raises:
        ValueError: a drafter bound to a different target instance (re-binding would change it for every other
            user of the drafter), a drafter that does not match the target (:meth:`DSparkDraftModel.bind_target`),
            ``block_size`` out of [1, γ], or a policy that needs a confidence head the drafter lacks.
    """
    bound = drafter._target.get("model")
    if bound is None:
        drafter.bind_target(target)  # validates hidden size / vocab / layers / family
        if drafter.device != target.device:
            drafter.to(target.device)
    elif bound is not target:
        raise ValueError(
            "this drafter is bound to another target instance; call drafter.bind_target(target) first (binding "
            "is shared by every user of the drafter, so it is not re-bound silently)"
        )
    gamma = drafter.config.block_size if block_size is None else block_size
    if not 1 <= gamma <= drafter.config.block_size:
        raise ValueError(f"block_size must be in [1, {drafter.config.block_size}] for this drafter, got {gamma}")
    policy = None if policy is None else parse_policy(policy)
    if policy is not None and policy.needs_confidence and drafter.confidence_head is None:
        raise ValueError(f"verify policy {policy.name!r} needs a drafter with a confidence head; this one has none")
    return gamma


def _policy_and_cost(drafter, target, policy: Policy | None, gamma: int, sps, draft_gate: bool,
                     context_len: int | None) -> tuple[Policy, CostModel | None]:
    """The verify policy of a `generate()` call (``policy``, or the default: see :class:`DSparkCandidateGenerator`)
    and, for ``scheduler`` / ``lagged``, its cost model.

    Raises:
        ValueError: ``scheduler`` / ``lagged`` and no SPS(B) table given, cached or measurable.
    """
    if sps is None and (policy is None or policy.needs_sps):
        sps = sps_for_generate(target, drafter, context_len, block_size=gamma, profile_if_missing=policy is not None)
    if policy is None:
        policy = parse_policy("scheduler" if sps is not None and drafter.confidence_head is not None else "full")
    if policy.needs_sps and sps is None:
        raise ValueError(f"verify policy {policy.name!r} needs an SPS(B) table and none could be profiled "
                         "(the drafter has no confidence head, or $DSPARK_SCHEDULER is off)")
    return policy, (cost_model_for(drafter, target, gamma, sps, draft_gate) if policy.needs_sps else None)


class DSparkCandidateGenerator(CandidateGenerator):
    """Candidate generator for `target.generate(ids, assistant_model=drafter)` with a DSpark drafter.

    State for one `generate()` call lives here (context cache, policy state, cost model, statistics); the drafter
    holds only weights.

    Args:
        drafter: a :class:`DSparkDraftModel` bound to ``target``.
        target: the target causal LM.
        generation_config: the call's generation config (``do_sample``, ``max_length``, ``stop_strings``).
        logits_processor: the call's processors (incl. temperature / top-k / top-p warpers when sampling); applied
            to the draft logits exactly as the target's logits are processed.
        input_ids: ``[1, P]`` prompt ids.
        policy: a verify policy spec or :class:`~generation.policies.Policy`; None: the scheduler when the drafter
            has a confidence head and ``sps`` is given or an SPS(B) table made by ``dspark profile`` is cached for
            ``target`` (its name, dtype, torch's thread count), else ``full``.
        block_size: γ' ≤ γ slots per round (default ``drafter.config.block_size``).
        sps: SPS(B) (a mapping or callable, steps/s) that prices ``scheduler`` / ``lagged`` rounds
            (:class:`~generation.cost_model.CostModel`); when None they use the cached table, profiled on first use
            where none is cached (:func:`generation.profiling.sps_for_generate`).
        draft_gate: whether the cost model may skip drafting in rounds where it does not pay.
        tokenizer: the call's tokenizer (needed with ``stop_strings``, as for plain `generate()`).
        lookup: run the n-gram lookup proposer beside the drafter (module doc); with policy ``none`` it is the only
            proposer.

    Raises:
        ValueError: batch size > 1, an empty prompt, block_size out of range, a drafter that does not match the
            target, stop strings without a tokenizer — all before any compute or profiling — and ``scheduler`` /
            ``lagged`` when no SPS(B) table can be had (no confidence head, ``$DSPARK_SCHEDULER`` off).
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict[str, Any] = {"output_hidden_states": True}

    def __init__(
        self,
        drafter: DSparkDraftModel,
        target,
        generation_config,
        logits_processor=None,
        input_ids: torch.LongTensor | None = None,
        policy: str | Policy | None = None,
        block_size: int | None = None,
        sps=None,
        draft_gate: bool = True,
        tokenizer=None,
        lookup: bool = True,
    ):
        requested = None if policy is None else parse_policy(policy)
        gamma = validate_request(drafter, target, generation_config, input_ids, block_size, requested)
        stop_strings = getattr(generation_config, "stop_strings", None)
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer= to generate()")
        self.policy, cost_model = _policy_and_cost(drafter, target, requested, gamma, sps, draft_gate,
                                                   None if input_ids is None else input_ids.shape[1])
        self.drafter = drafter
        self.block_size = gamma
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.model_kwargs_overrides = {"output_hidden_states": hidden_state_indices(self.layer_ids)}
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        self.cost = cost_model
        self.lagged = LaggedBudget(self.policy.lag) if self.policy.kind == "lagged" else None
        self.stop = StopStringCriteria(tokenizer, stop_strings) if stop_strings else None
        self.context = DraftContext(RequestKV(drafter.config.num_draft_layers))
        self.num_context = 0  # target positions whose features were taken (ingested or pending)
        self.skipped = 0  # consecutive rounds the draft gate skipped
        self.stats = GenerationStats()
        register(self.stats)
        self._round: tuple[float, RoundStats, int] | None = None  # (end of drafting, its record, ingested)
        self.lookup = LookupChain(num_tokens=gamma) if lookup else None
        self.measured = MeasuredPrices()  # prices the lookup chooser without a cost model

    def _take_features(self, input_ids: torch.LongTensor, model_outputs) -> None:
        """Queue the target features of the newly committed positions [num_context, L − 1) for the drafter."""
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("the target did not return hidden_states; DSpark needs them every round")
        n_new = input_ids.shape[1] - 1 - self.num_context
        self.context.pending.append(context_features(model_outputs.hidden_states, self.layer_ids, 0, n_new))
        self.num_context += n_new

    def _prices(self, length: int):
        """SPS(B) of the verify alone and the drafter's time t_draft (s) for the lookup chooser: the cost model's
        where the policy is priced, else :class:`~generation.lookup.MeasuredPrices`."""
        if self.cost is not None:
            return self.cost.curve(1, length), self.cost.draft_seconds(1)
        return self.measured.sps(), self.measured.draft_seconds()

    def _stop_cut(self, input_ids: torch.LongTensor, tokens: list[int]) -> int:
        """How many leading draft tokens can be accepted without completing a stop string (module doc)."""
        if self.stop is None:
            return len(tokens)
        ids = input_ids
        for j, tok in enumerate(tokens):
            ids = torch.cat([ids, ids.new_tensor([[tok]])], dim=-1)
            if bool(self.stop(ids, None)[0]):
                return j
        return len(tokens)

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Return ``([1, L + ℓ] ids with ℓ candidates appended, [1, ℓ, V] candidate logits or None)``."""
        if is_first_iteration:  # the target must prefill first: its features are the drafter's context
            return input_ids, None
        length = input_ids.shape[1]
        room = self.max_length - length - 1
        budget = min(self.block_size, room) if self.policy.drafts else 0
        # the lookup proposes at most γ' tokens: an SPS(B) profile covers the drafter's verify sizes B ≤ γ' + 1
        proposal = None
        if self.lookup is not None and room > 0:
            proposal = self.lookup.propose(input_ids, min(room, self.block_size))
        if budget <= 0 and not (proposal and proposal.tokens):  # one plain step; no later round needs the context
            return input_ids, None
        t0 = time.perf_counter()
        budgets, reason = [budget], ""
        if budget > 0:
            self._take_features(input_ids, model_outputs)
            if self.cost is not None:
                budgets, reason = self.cost.plan(budgets, [self.skipped], length)
        verify_sps, draft_s = self._prices(length) if proposal is not None else (None, 0.0)
        if budgets[0] > 0 and proposal is not None and proposal.tokens:
            if self.lookup.before_drafting(budgets[0], verify_sps, draft_s, reason).source == "lookup":
                budgets = [0]  # the lookup beats drafting: no drafter forward this round (the gate's reason kept)
        if budgets[0] == 0:  # no drafter forward: the lookup's prefix or one plain step; features wait
            if budget > 0:
                self.skipped += 1
            cand = []
            if proposal is not None:
                choice = self.lookup.without_drafter(verify_sps)
                cand = proposal.tokens[: choice.length] if choice.source == "lookup" else []
            n = self._stop_cut(input_ids, cand)
            if self.lookup is not None:
                self.lookup.verifying("lookup" if n else "none")
            record = RoundStats(drafted=0, verified=n, draft_tokens=cand[:n], gate=reason, source="lookup" if n else "")
            self.stats.rounds.append(record)
            self._round = (time.perf_counter(), record, 0)
            return torch.cat([input_ids, input_ids.new_tensor([cand[:n]])], dim=-1) if n else input_ids, None
        self.skipped = 0
        sps = self.cost.round_sps(1, length, 1) if self.cost is not None else None
        sampler = None
        if self.do_sample or self.logits_processor is not None:
            sampler = Sampler(self.do_sample, self.logits_processor, input_ids)
        lag_budget = self.lagged.take(1) if self.lagged is not None else None
        out = draft_round(self.drafter, [self.context], [int(input_ids[0, -1])], [length - 1], budgets, self.policy,
                          num_slots=self.block_size, sps=sps, lag_budget=lag_budget, sampler=sampler)
        if self.lagged is not None:
            self.lagged.push(out.confidences, budgets, sps)
        source, cand = "draft", out.tokens[0][: out.lengths[0]]
        if proposal is not None and proposal.tokens:
            # t_draft as measured in earlier rounds: this round's time depends on how many slots were drafted
            choice = self.lookup.after_drafting(out.confidences[0], out.lengths[0], budgets[0], verify_sps, draft_s,
                                                greedy=not self.do_sample)
            if choice.source == "lookup":
                source, cand = "lookup", proposal.tokens[: choice.length]
        n = self._stop_cut(input_ids, cand)
        tokens = input_ids.new_tensor([cand[:n]])
        logits = None  # a lookup proposal is a point mass: no candidate logits (module doc)
        if source == "draft" and out.logits[0] is not None and n > 0:
            logits = out.logits[0][None, :n]
        if self.lookup is not None:
            self.lookup.verifying(source, cand[:n])
        t1 = time.perf_counter()
        record = RoundStats(drafted=len(out.tokens[0]), verified=n,
                            confidences=out.confidences[0][:n] if source == "draft" else [],
                            draft_tokens=out.tokens[0] if source == "draft" else cand[:n],
                            t_draft_ms=(t1 - t0) * 1e3, gate=reason,
                            ingested=out.ingested[0], source=source if n else "")
        self.stats.rounds.append(record)
        self._round = (t1, record, out.ingested[0])
        return torch.cat([input_ids, tokens], dim=-1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Record the round's outcome (accepted count, committed tokens, verify time), judge the lookup proposal and
        feed the cost model."""
        if self.lookup is not None:
            self.lookup.observe(input_ids)
        if self._round is None:
            return
        t1, record, ingested = self._round
        self._round = None
        record.accepted = int(num_matches)
        record.committed = int(num_matches) + 1
        record.t_verify_ms = (time.perf_counter() - t1) * 1e3
        self.measured.observe_verify(record.t_verify_ms / 1e3)
        if 0 < ingested <= self.block_size + 1:  # a steady drafting round (no catch-up)
            self.measured.observe_draft(record.t_draft_ms / 1e3)
        if self.cost is not None and ingested > 0 and record.source != "lookup":  # the drafter's chain was verified
            self.cost.observe(1, [(record.accepted, record.verified)], record.t_draft_ms / 1e3, [ingested],
                              self.block_size)

