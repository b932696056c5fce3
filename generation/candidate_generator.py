"""`DSparkCandidateGenerator`: the DSpark drafter as a transformers `CandidateGenerator`.

One round, read top to bottom (SPEC §1–§2):
1. ingest the target features of the tokens committed since the last round into the drafter's context K/V cache
   (the drafter never re-reads the whole prefix);
2. one parallel drafter forward over [anchor, mask × (γ−1)] → h_k, U_k for all γ slots;
3. left to right: confidence c_k (eq. 7, STS-calibrated) → the verify policy decides whether x_k is verified →
   correction B_k (eq. 5/6) → logits processors → sample (or argmax) x_k from exactly the distribution that is
   returned as its candidate logits (greedy without logits processors: argmax over the draft vocabulary, all
   confidences in one batched call, the same tokens and ℓ, no candidate logits: ``_propose_greedy``);
4. transformers' assisted-decoding loop verifies the candidates in one target forward and accepts/rejects them
   (greedy match, or rejection sampling with residual resampling), which keeps the output lossless.

With the DSpark scheduler (:class:`~generation.policies.PrefixScheduler`), a :class:`~generation.draft_gate.DraftGate`
first decides from past rounds whether drafting this round is expected to pay at all; a skipped round returns no
candidates (one plain decoding step) and its target features are ingested at the next drafting round.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from modeling_dspark.modeling_dspark import DSparkDraftModel
from modeling_dspark.target import context_features, hidden_state_indices

from .draft_gate import SKIP_REASONS, gate_for
from .policies import FullBlock, PrefixScheduler, VerifyPolicy
from .stats import GenerationStats, RoundStats, register


def validate_request(drafter, target, generation_config, input_ids=None, model_kwargs=None, block_size=None,
                     policy=None) -> int:
    """Check one `generate()` request before any compute; return the block size γ' to use.

    Raises:
        ValueError: batch size > 1, an empty or padded prompt, block_size out of [1, γ], a policy that needs a
            confidence head the drafter lacks, `assistant_ensemble_weight` (not lossless), or a drafter bound to
            a different target instance (re-binding would change it for every other user of the drafter).
    """
    if input_ids is not None:
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"DSpark through generate() supports batch size 1 (got {input_ids.shape[0]}), like all "
                "transformers assisted decoding; use generation.engine.DSparkEngine for batched speculative decoding"
            )
        if input_ids.shape[1] == 0:
            raise ValueError("empty prompt: input_ids has no tokens")
    mask = (model_kwargs or {}).get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("padded prompts are not supported with batch size 1; pass the unpadded input_ids")
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        raise ValueError("assistant_ensemble_weight relaxes verification (not lossless); DSpark does not support it")
    bound = drafter._target.get("model")
    if bound is None:
        drafter.bind_target(target)  # validates hidden size / vocab / layers / family
    elif bound is not target:
        raise ValueError(
            "this drafter is bound to another target instance; call drafter.bind_target(target) first (binding "
            "is shared by every user of the drafter, so generate() does not re-bind it silently)"
        )
    gamma = drafter.config.block_size if block_size is None else block_size
    if not 1 <= gamma <= drafter.config.block_size:
        raise ValueError(f"block_size must be in [1, {drafter.config.block_size}] for this drafter, got {gamma}")
    if getattr(policy, "needs_confidence", False) and drafter.confidence_head is None:
        raise ValueError(f"verify policy {policy.name!r} needs a drafter with a confidence head; this one has none")
    return gamma


class DSparkCandidateGenerator(CandidateGenerator):
    """Candidate generator for `target.generate(ids, assistant_model=drafter)` with a DSpark drafter.

    State for one `generate()` call lives here (context cache, policy, statistics); the drafter holds only weights.

    Args:
        drafter: a :class:`DSparkDraftModel` bound to ``target``.
        target: the target causal LM.
        generation_config: the call's generation config (``do_sample``, ``max_length``).
        logits_processor: the call's processors (incl. temperature / top-k / top-p warpers when sampling); applied
            to the draft logits exactly as the target's logits are processed.
        input_ids: ``[1, P]`` prompt ids.
        model_kwargs: the call's model kwargs (``attention_mask``).
        policy: a :class:`VerifyPolicy` (default :class:`FullBlock`).
        block_size: γ' ≤ γ slots per round (default ``drafter.config.block_size``).
        draft_gate: with the DSpark scheduler policy, skip drafting in rounds where past rounds say it does not pay
            (:class:`~generation.draft_gate.DraftGate`; default True). Ignored by the other policies, which draft
            every round as asked.

    Raises:
        ValueError: batch size > 1, an empty prompt, a padded prompt, block_size out of range, or a drafter that
            does not match the target — all before any compute.
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
        model_kwargs: dict | None = None,
        policy: VerifyPolicy | None = None,
        block_size: int | None = None,
        draft_gate: bool = True,
    ):
        gamma = validate_request(drafter, target, generation_config, input_ids, model_kwargs, block_size, policy)
        self.drafter = drafter
        self.block_size = gamma
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.model_kwargs_overrides = {"output_hidden_states": hidden_state_indices(self.layer_ids)}
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.policy = policy or FullBlock()
        # greedy with no logits processors: transformers ignores candidate logits and compares argmaxes, so drafts
        # are chosen in the draft vocabulary without building processed [1, V] logits (see _propose_greedy)
        self._greedy_fast = not self.do_sample and not (logits_processor is not None and len(logits_processor) > 0)
        self.cache = drafter.new_context_cache()
        self.num_context = 0  # target positions already in the drafter's context cache
        self.stats = GenerationStats()
        register(self.stats)
        self._t_drafted = None
        self.gate = None
        if draft_gate and isinstance(self.policy, PrefixScheduler):  # learned state carries over between calls
            self.gate = gate_for(drafter, target, gamma, self.policy.sps)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # features of rounds the gate skipped
        self._steady = False  # the current drafting round measures steady-state drafting (see get_candidates)

    # ------------------------------------------------------------------ helpers
    def _ingest(self, input_ids: torch.LongTensor, model_outputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Target features of the newly committed positions [num_context, cur_len − 1) and their positions."""
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("the target did not return hidden_states; DSpark needs them every round")
        n_new = input_ids.shape[1] - 1 - self.num_context
        feats = context_features(model_outputs.hidden_states, self.layer_ids, 0, n_new)
        pos = torch.arange(self.num_context, self.num_context + n_new, device=input_ids.device)[None]
        self.num_context += n_new
        return feats, pos

    def _sample(self, logits: torch.Tensor) -> torch.LongTensor:
        if self.do_sample:
            return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
        return logits.argmax(dim=-1, keepdim=True)

    @torch.no_grad()
    def propose(self, input_ids: torch.LongTensor, hidden: torch.Tensor, base_logits: torch.Tensor, budget: int):
        """Left-to-right drafting of up to ``budget`` tokens (steps 3 of the module doc).

        Args:
            input_ids: ``[1, L]`` committed ids (the last one is the anchor x_0).
            hidden: ``[γ', H]`` h_k; base_logits: ``[γ', N]`` U_k (float32; N = V or the draft vocabulary size).

        Returns:
            ``(tokens [1, ℓ] long, logits [1, ℓ, V] float32 processed, confidences list[float])``; logits are None
            for greedy decoding without logits processors (:meth:`_propose_greedy`) or when ℓ = 0.
        """
        if self._greedy_fast:
            return self._propose_greedy(input_ids, hidden, base_logits, budget)
        d = self.drafter
        ids, prev, state = input_ids, input_ids[:, -1], None
        tokens, logits_out, confs = [], [], []
        self.policy.start_round(budget)
        for k in range(budget):
            conf = None
            cl = d.confidence_logits(prev, hidden[k : k + 1])
            if cl is not None:
                conf = float(d.calibrated_confidence(cl, k))
            if not self.policy.admit(k + 1, conf):
                break
            logits = base_logits[k : k + 1]
            bias, state = d.correction_step(prev, hidden[k : k + 1], state)
            if bias is not None:
                logits = logits + bias
            logits = d.expand_draft_logits(logits)  # [1, V]: -inf outside the draft vocabulary, if one is set
            if self.logits_processor is not None and len(self.logits_processor) > 0:
                logits = self.logits_processor(ids, logits)
            token = self._sample(logits)
            ids = torch.cat([ids, token], dim=-1)
            tokens.append(token)
            logits_out.append(logits)
            if conf is not None:
                confs.append(conf)
            prev = token[:, 0]
        if not tokens:
            return input_ids.new_zeros(1, 0), None, confs
        return torch.cat(tokens, dim=-1), torch.stack(logits_out, dim=1), confs

    def _propose_greedy(self, input_ids: torch.LongTensor, hidden: torch.Tensor, base_logits: torch.Tensor,
                        budget: int):
        """:meth:`propose` for greedy decoding with no logits processors: the same tokens, confidences and ℓ.

        x_k = argmax(U_k + B_k) is taken in the draft vocabulary (:meth:`DSparkDraftModel.draft_token_ids`), all
        ``budget`` tokens first; then the confidences c_1..c_budget (eq. 7; each reads only x_{k−1}, so drafting
        ahead cannot change them) in one batched product; then the policy admits x_1, x_2, … in order, exactly as
        in :meth:`propose`. Candidate logits are None: greedy verification compares argmaxes only.
        """
        d = self.drafter
        prev, state, drafted = input_ids[0, -1:], None, []
        for k in range(budget):
            logits = base_logits[k : k + 1]
            bias, state = d.correction_step(prev, hidden[k : k + 1], state)
            if bias is not None:
                logits = logits + bias
            prev = d.draft_token_ids(logits.argmax(dim=-1))
            drafted.append(prev)
        tokens = torch.cat(drafted)
        confs: list[float] = []
        cl = d.confidence_logits(torch.cat([input_ids[0, -1:], tokens[:-1]]), hidden[:budget])
        if cl is not None:
            confs = d.calibrated_confidence(cl, torch.arange(budget, device=cl.device)).tolist()
        self.policy.start_round(budget)
        n = 0
        while n < budget and self.policy.admit(n + 1, confs[n] if confs else None):
            n += 1
        return tokens[None, :n], None, confs[:n]

    # ------------------------------------------------------------------ CandidateGenerator protocol
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
        budget = min(self.block_size, self.max_length - input_ids.shape[1] - 1)
        if budget <= 0:  # the next target step is the last one: nothing to draft, no later round needs context
            return input_ids, None
        t0 = time.perf_counter()
        feats, ctx_pos = self._ingest(input_ids, model_outputs)
        if self.gate is not None:
            drafts, reason = self.gate.decide(budget, now=t0)
            if not drafts:  # one plain step; the drafter ingests these features when it next drafts
                self._pending.append((feats, ctx_pos))
                self._t_drafted = time.perf_counter()
                self.stats.rounds.append(RoundStats(drafted=0, verified=0, gate=reason))
                return input_ids, None
            # steady: catching up on at most one skipped round (a pairing round), and not on the prompt (which a
            # later call's first drafting round ingests even after a skipped first round)
            first_pos = self._pending[0][1] if self._pending else ctx_pos
            self._steady = len(self._pending) <= 1 and int(first_pos[0, 0]) > 0
            if self._pending:
                feats = torch.cat([f for f, _ in self._pending] + [feats], dim=1)
                ctx_pos = torch.cat([p for _, p in self._pending] + [ctx_pos], dim=1)
                self._pending = []
            gate_reason = reason
        else:
            gate_reason = ""
        anchor_pos = torch.tensor([[input_ids.shape[1] - 1]], device=input_ids.device)
        out = self.drafter(
            input_ids[:, -1:].to(self.drafter.device),
            anchor_pos.to(self.drafter.device),
            feats.to(self.drafter.device),
            ctx_pos.to(self.drafter.device),
            cache=self.cache,
            num_slots=self.block_size,
        )
        hidden = out.hidden_states[0, 0].to(input_ids.device)
        base = out.base_logits[0, 0].to(input_ids.device)
        tokens, logits, confs = self.propose(input_ids, hidden, base, budget)
        self._t_drafted = time.perf_counter()
        self.stats.rounds.append(
            RoundStats(
                drafted=tokens.shape[1],
                verified=tokens.shape[1],
                confidences=confs,
                draft_tokens=tokens[0].tolist(),
                t_draft_ms=(self._t_drafted - t0) * 1e3,
                gate=gate_reason,
                ingested=feats.shape[1],
            )
        )
        return torch.cat([input_ids, tokens], dim=-1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Record the round's outcome (accepted count, committed tokens, verify time)."""
        if self._t_drafted is None or not self.stats.rounds:
            return
        r = self.stats.rounds[-1]
        r.accepted = int(num_matches)
        r.committed = int(num_matches) + 1
        r.t_verify_ms = (time.perf_counter() - self._t_drafted) * 1e3
        self._t_drafted = None
        if self.gate is not None:
            if r.gate not in SKIP_REASONS:
                self.gate.record_draft(r.t_draft_ms / 1e3, r.verified, r.accepted, steady=self._steady)
            self.gate.record_committed(r.committed)
