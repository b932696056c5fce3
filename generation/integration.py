"""Wiring DSpark into `target.generate(ids, assistant_model=drafter)`.

transformers 5.24 picks a candidate generator in a fixed chain inside `GenerationMixin._get_candidate_generator`.
:func:`enable_dspark` wraps that method on one target *instance*: when the assistant is a `DSparkDraftModel` it
returns a :class:`DSparkCandidateGenerator`, otherwise it defers to transformers unchanged (other assistants,
prompt lookup, …). `DSparkDraftModel.from_pretrained(path, target=model)` calls it for you.

Per-call options (verify policy, block size) are context-local, so concurrent users never share them::

    with dspark_options(policy="fixed:3", block_size=4):
        target.generate(ids, assistant_model=drafter)
"""

from __future__ import annotations

import contextlib
import contextvars
import types

from modeling_dspark.modeling_dspark import DSparkDraftModel

from .candidate_generator import DSparkCandidateGenerator, validate_request
from .policies import make_policy

_options: contextvars.ContextVar[dict] = contextvars.ContextVar("dspark_options", default={})


@contextlib.contextmanager
def dspark_options(policy=None, block_size: int | None = None, sps=None, draft_gate: bool = True):
    """Set the verify policy (``"full"``, ``"fixed:N"``, ``"threshold:P"``, ``"scheduler"`` or a
    :class:`~generation.policies.VerifyPolicy`), the block size γ', the SPS(B) table and, for the scheduler,
    whether the draft gate may skip drafting (:class:`~generation.draft_gate.DraftGate`) for `generate()` calls
    made inside the block (this thread / task only).

    Raises:
        ValueError: ``draft_gate`` not a bool.
    """
    if not isinstance(draft_gate, bool):
        raise ValueError(f"draft_gate must be True or False; got {draft_gate!r}")
    token = _options.set({"policy": policy, "block_size": block_size, "sps": sps, "draft_gate": draft_gate})
    try:
        yield
    finally:
        _options.reset(token)


def default_policy(drafter: DSparkDraftModel, sps=None, *, target=None, context_len=None, block_size=None):
    """The policy used when none is given: the DSpark scheduler when the drafter has a confidence head and an
    SPS(B) table is given or cached for ``target`` (its name, dtype and torch's thread count; see
    :func:`generation.profiling.sps_for_generate`), else the full block."""
    if sps is None and target is not None:
        from .profiling import sps_for_generate

        sps = sps_for_generate(target, drafter, context_len, block_size=block_size)
    if sps is not None and drafter.confidence_head is not None:
        return make_policy("scheduler", sps)
    return make_policy("full")


def enable_dspark(target):
    """Make ``target.generate(..., assistant_model=<DSparkDraftModel>)`` use :class:`DSparkCandidateGenerator`.

    Idempotent; affects only this target instance; other assistant models keep their transformers behaviour.
    Returns ``target``.
    """
    if getattr(target, "_dspark_enabled", False):
        return target
    original = target._get_candidate_generator

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        if isinstance(assistant_model, DSparkDraftModel):
            opts = _options.get()
            sps, policy, block_size = opts.get("sps"), opts.get("policy"), opts.get("block_size")
            # bad input fails here, before any profiling or model compute
            validate_request(assistant_model, self, generation_config, input_ids, model_kwargs, block_size,
                             make_policy(policy, {}) if isinstance(policy, str) else policy)
            context_len = input_ids.shape[1]
            if policy == "scheduler" and sps is None:  # asked for the scheduler: profile on first use, cache it
                from .profiling import sps_for_generate

                sps = sps_for_generate(self, assistant_model, context_len, block_size=block_size,
                                       profile_if_missing=True)
            if policy is not None:
                policy = make_policy(policy, sps)
            else:
                policy = default_policy(assistant_model, sps, target=self, context_len=context_len,
                                        block_size=block_size)
            return DSparkCandidateGenerator(
                assistant_model,
                self,
                generation_config,
                logits_processor=logits_processor,
                input_ids=input_ids,
                model_kwargs=model_kwargs,
                policy=policy,
                block_size=opts.get("block_size"),
                draft_gate=opts.get("draft_gate", True),
            )
        return original(
            generation_config=generation_config,
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            model_kwargs=model_kwargs,
            assistant_model=assistant_model,
            target_tokenizer=target_tokenizer,
            assistant_tokenizer=assistant_tokenizer,
        )

    target._get_candidate_generator = types.MethodType(_get_candidate_generator, target)
    target._dspark_enabled = True
    return target
