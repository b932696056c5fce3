"""Wiring DSpark into `target.generate(ids, assistant_model=drafter)`.

transformers 5.24 picks a candidate generator in a fixed chain inside `GenerationMixin._get_candidate_generator`.
:func:`enable_dspark` wraps that method on one target *instance*: when the assistant is a `DSparkDraftModel` it
returns a :class:`DSparkCandidateGenerator`, otherwise it defers to transformers unchanged (other assistants,
prompt lookup, …). `DSparkDraftModel.from_pretrained(path, target=model)` calls it for you.

Per-call options (verify policy, block size, SPS(B) table, draft gate) are context-local, so concurrent users never
share them::

    with dspark_options(policy="fixed:3", block_size=4):
        target.generate(ids, assistant_model=drafter)
"""

from __future__ import annotations

import contextlib
import contextvars
import types

from modeling_dspark.modeling_dspark import DSparkDraftModel

from .candidate_generator import DSparkCandidateGenerator, validate_request
from .policies import Policy, parse_policy

_options: contextvars.ContextVar[dict] = contextvars.ContextVar("dspark_options", default={})


@contextlib.contextmanager
def dspark_options(policy: str | Policy | None = None, block_size: int | None = None, sps=None,
                   draft_gate: bool = True, lookup: bool = True):
    """Set, for `generate()` calls made inside the block (this thread / task only): the verify policy (a spec of
    :func:`generation.policies.parse_policy` or a :class:`~generation.policies.Policy`; default: the scheduler when
    the drafter has a confidence head and an SPS(B) table is given or cached, else ``full``), the block size γ', the
    SPS(B) table (``scheduler`` / ``lagged`` profile one on first use when none is given or cached) and whether the
    cost model's draft gate may skip drafting (:class:`~generation.cost_model.CostModel`) and whether the n-gram
    lookup proposer runs beside the drafter (:mod:`generation.lookup`; ``policy="none"`` with ``lookup=True`` is
    lookup alone).

    Raises:
        ValueError: ``draft_gate`` or ``lookup`` not a bool (a bad policy spec fails when `generate()` starts, before
            any compute).
    """
    if not isinstance(draft_gate, bool):
        raise ValueError(f"draft_gate must be True or False; got {draft_gate!r}")
    if not isinstance(lookup, bool):
        raise ValueError(f"lookup must be True or False; got {lookup!r}")
    token = _options.set({"policy": policy, "block_size": block_size, "sps": sps, "draft_gate": draft_gate,
                          "lookup": lookup})
    try:
        yield
    finally:
        _options.reset(token)


def build_candidate_generator(target, generation_config, input_ids, logits_processor, model_kwargs, drafter,
                              tokenizer=None) -> DSparkCandidateGenerator:
    """The candidate generator of one `target.generate(..., assistant_model=drafter)` call, with the options of
    :func:`dspark_options`. Bad input fails here, before any profiling or model compute.

    The policy: the one asked for; else the scheduler when the drafter has a confidence head and an SPS(B) table
    is given or cached for ``target`` (its name, dtype and torch's thread count), else ``full``. ``scheduler`` and
    ``lagged`` asked for without a table profile one on first use and cache it
    (:func:`generation.profiling.sps_for_generate`).
    """
    from .cost_model import cost_model_for
    from .profiling import sps_for_generate

    opts = _options.get()
    sps, block_size = opts.get("sps"), opts.get("block_size")
    policy = parse_policy(opts["policy"]) if opts.get("policy") is not None else None
    gamma = validate_request(drafter, target, generation_config, input_ids, block_size, policy)
    context_len = input_ids.shape[1]
    if sps is None and (policy is None or policy.needs_sps):
        sps = sps_for_generate(target, drafter, context_len, block_size=block_size,
                               profile_if_missing=policy is not None)
    if policy is None:
        policy = parse_policy("scheduler" if sps is not None and drafter.confidence_head is not None else "full")
    if policy.needs_sps and sps is None:
        raise ValueError(f"verify policy {policy.name!r} needs an SPS(B) table and none could be profiled "
                         "(the drafter has no confidence head, or $DSPARK_SCHEDULER is off)")
    cost = cost_model_for(drafter, target, gamma, sps, opts.get("draft_gate", True)) if policy.needs_sps else None
    return DSparkCandidateGenerator(drafter, target, generation_config, logits_processor=logits_processor,
                                    input_ids=input_ids, policy=policy, block_size=block_size, cost_model=cost,
                                    tokenizer=tokenizer, lookup=opts.get("lookup", True))


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
            return build_candidate_generator(self, generation_config, input_ids, logits_processor, model_kwargs,
                                             assistant_model, target_tokenizer)
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
