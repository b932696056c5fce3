"""`DSparkCandidateGenerator`: the DSpark drafter as a transformers `CandidateGenerator` (R = 1).

Each round queues the target features of the newly committed positions (``output_hidden_states`` of the assisted loop)
for the drafter's context and runs :func:`dspark.generation.round.propose` for one request; transformers then verifies
the candidates in one target forward and accepts or rejects them (greedy match, or rejection sampling with residual
resampling), which keeps the output lossless, also for a chain of the n-gram lookup (:mod:`dspark.generation.lookup`),
which comes without candidate logits: a point mass.

Stop strings: transformers' assisted loop checks its stopping criteria once per round, on the last committed token, so a
stop string completed by an accepted draft inside the block would go unseen. With stop strings, the draft is cut before
the first token whose acceptance would complete one: a stop string completes only at a round's last token (the target's
own), where the criteria see it."""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

from .costs import Prices
from .drafting import DraftContext, Sampler, check_drafter
from .features import context_features, hidden_state_indices
from .lookup import NGramLookup
from .kv import RequestKV
from .policies import Exploration, Policy, PolicyRun, default_policy, parse_policy
from .round import Chain, RequestState, propose, record
from .stats import register


def validate_request(drafter, target, generation_config, input_ids=None, block_size=None, policy=None) -> int:
    """Check one `generate()` request before any compute; return the block size γ' to use.

    An attention mask with zeros is allowed: transformers applies it to the target in every verify forward, so the
    output is that of plain `generate()` with the same mask (transformers infers one from ``pad_token_id`` when none
    is passed, e.g. when the pad id equals a token of the chat template); the drafter reads all positions, which can
    only change how many drafts are accepted.

    Raises:
        ValueError: batch size > 1, an empty prompt, `assistant_ensemble_weight` (not lossless), or what
            :func:`~dspark.generation.drafting.check_drafter` refuses (the drafter, block size or policy).
    """
    if input_ids is not None:
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"DSpark through generate() supports batch size 1 (got {input_ids.shape[0]}), like all "
                "transformers assisted decoding; for batches use dspark.generation.engine.DSparkEngine"
            )
        if input_ids.shape[1] == 0:
            raise ValueError("empty prompt: input_ids has no tokens (a DSpark drafter reads ids, not inputs_embeds)")
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        raise ValueError("assistant_ensemble_weight relaxes verification (not lossless); DSpark does not support it")
    return check_drafter(drafter, target, block_size, policy)


_learned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def learned_prices(target, drafter, block_size: int) -> tuple[Prices, Exploration]:
    """The :class:`~dspark.generation.costs.Prices` and :class:`~dspark.generation.policies.Exploration` learned by the
    `generate()` calls with this target, drafter and block size in this process, so each call starts from what the
    earlier calls measured. Keyed by the objects, their dtype and device, and torch's thread count."""
    per_target = _learned.setdefault(target, {})
    key = (id(drafter), block_size, str(target.dtype), str(target.device), torch.get_num_threads())
    if key not in per_target:
        per_target[key] = (Prices(), Exploration())
    return per_target[key]


def _start_policy(drafter, target, policy: Policy | None, block_size: int, sps) -> PolicyRun:
    """The verify policy of a `generate()` call (``policy``, else :func:`~dspark.generation.policies.default_policy`),
    started, where priced, with an explicit SPS(B) ``sps`` or what earlier calls learned (:func:`learned_prices`)."""
    if policy is None:
        policy = default_policy(drafter)
    if not policy.priced:
        return policy.start()
    if sps is not None:
        return policy.start(sps)
    prices, exploration = learned_prices(target, drafter, block_size)
    return policy.start(prices=prices, exploration=exploration)


class DSparkCandidateGenerator(CandidateGenerator):
    """Candidate generator for `target.generate(ids, assistant_model=drafter)` with a DSpark drafter. State for one
    `generate()` call lives here (the request's :class:`~dspark.generation.round.RequestState`, the started policy); the
    drafter holds only weights.

    Args:
        drafter: a :class:`DSparkDraftModel` bound to ``target``.
        target: the target causal LM.
        generation_config: the call's generation config (``do_sample``, ``max_length``, ``stop_strings``).
        logits_processor: the call's processors (warpers included), applied to the draft logits as to the target's.
        input_ids: ``[1, P]`` prompt ids.
        policy: a verify policy spec or :class:`~dspark.generation.policies.Policy`; None:
            :func:`~dspark.generation.policies.default_policy`'s.
        block_size: γ' ≤ γ slots per round (default ``drafter.config.block_size``).
        sps: an explicit SPS(B) (a mapping or callable, steps/s) for the verify prices of ``scheduler`` /
            ``lagged``; None: learned from the rounds.
        tokenizer: the call's tokenizer (needed with ``stop_strings``, as for plain `generate()`).
        lookup: run the n-gram lookup proposer beside the drafter; with policy ``none`` it is the only proposer.

    Raises:
        ValueError: as :func:`validate_request`, or stop strings without a tokenizer — all before any compute.
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict[str, Any] = {"output_hidden_states": True}

    def __init__(
        self,
        drafter,
        target,
        generation_config,
        logits_processor=None,
        input_ids: torch.LongTensor | None = None,
        policy: str | Policy | None = None,
        block_size: int | None = None,
        sps=None,
        tokenizer=None,
        lookup: bool = True,
    ):
        requested = None if policy is None else parse_policy(policy)
        block_size = validate_request(drafter, target, generation_config, input_ids, block_size, requested)
        stop_strings = getattr(generation_config, "stop_strings", None)
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer= to generate()")
        self.policy = _start_policy(drafter, target, requested, block_size, sps)
        self.drafter = drafter
        self.block_size = block_size
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.model_kwargs_overrides = {"output_hidden_states": hidden_state_indices(self.layer_ids)}
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        self.stop = StopStringCriteria(tokenizer, stop_strings) if stop_strings else None
        self.state = RequestState(DraftContext(RequestKV(drafter.config.num_draft_layers)),
                                  NGramLookup(num_tokens=block_size) if lookup else None)
        self.stats = self.state.stats
        self.stats.policy = self.policy.name + (" (default)" if requested is None else "")
        register(self.stats)
        self.num_context = 0  # target positions whose features were taken (ingested or pending)
        self._chain: tuple[Chain, float] | None = None  # (this round's chain, end of proposing)

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a round proposes (γ'; lookup chains are as long at most). transformers 5.25 reads it once
        per call for ``cache.activate_past_recording`` (:mod:`dspark.generation.compat`)."""
        return self.block_size

    def _take_features(self, input_ids: torch.LongTensor, model_outputs) -> None:
        """Queue the target features of the newly committed positions [num_context, L − 1) for the drafter."""
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("the target did not return hidden_states; DSpark needs them every round")
        n_new = input_ids.shape[1] - 1 - self.num_context
        self.state.draft.pending.append(context_features(model_outputs.hidden_states, self.layer_ids, 0, n_new))
        self.num_context += n_new

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
        room = self.max_length - input_ids.shape[1] - 1
        if self.policy.drafts and room > 0:  # a later round may draft: keep the features of this round's forward
            self._take_features(input_ids, model_outputs)
        sampler = None
        if self.do_sample or self.logits_processor is not None:
            sampler = Sampler(self.do_sample, self.logits_processor, input_ids)
        chain = propose(self.drafter, self.policy, [self.state], [input_ids], [room], self.block_size, sampler)[0]
        chain.cut(self._stop_cut(input_ids, chain.tokens))
        if not chain.tokens and not (self.policy.drafts and room > 0):
            return input_ids, None  # nothing could be proposed: one plain step, not a speculative round (no record)
        self._chain = (chain, time.perf_counter())
        if not chain.tokens:
            return input_ids, None
        logits = chain.logits[None] if chain.logits is not None else None
        return torch.cat([input_ids, input_ids.new_tensor([chain.tokens])], dim=-1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Record the round (accepted count, committed tokens, verify time)."""
        if self._chain is None:
            return
        chain, t1 = self._chain
        self._chain = None
        record(self.policy, [self.state], [chain], [int(num_matches)], [int(num_matches) + 1],
               (time.perf_counter() - t1) * 1e3, self.block_size)
