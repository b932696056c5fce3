"""Wiring DSpark into `target.generate(ids, assistant_model=drafter)`.

transformers (5.24 and 5.25) picks a candidate generator in a fixed chain inside
`GenerationMixin._get_candidate_generator`, which no model or config can extend; this is dspark's seam into
transformers' internals, beside two wrappers: of the loop, which only chooses BLAS calls (:mod:`.products`), and of
`_validate_generation_mode`, which refuses what a DSpark drafter cannot serve (:func:`validate_generation_call`;
:mod:`.compat` lists every internal). Importing :mod:`modeling_dspark` wraps that method once, at class level
(:func:`modeling_dspark.install_generate_hook`): for a `DSparkDraftModel` assistant the wrapper returns the
:class:`DSparkCandidateGenerator` of :func:`dspark_candidate_generator`; every other assistant (draft models, prompt
lookup, …) keeps transformers' behaviour. So any supported target loaded with `AutoModelForCausalLM` drafts with DSpark
with no other call, also through ``pipeline("text-generation", model=target, assistant_model=drafter)``.

Per-call options (verify policy, block size, …) are set with :class:`dspark_options`, context-local so concurrent users
never share them. The block size may also be given as ``target.generate(..., num_assistant_tokens=4)``, except 20, which
reads as unset (the drafter's γ; :func:`_assistant_options` tells why): ``dspark_options(block_size=20)`` asks for 20.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping

from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from .candidate_generator import DSparkCandidateGenerator
from .compat import check_transformers
from .drafting import check_drafter
from .policies import Policy, parse_policy
from .scoped import ScopedValue

_options: contextvars.ContextVar[dict] = contextvars.ContextVar("dspark_options", default={})


class dspark_options(ScopedValue):
    """Set, for `generate()` calls made inside a ``with`` block (this thread / task only): the verify policy (a spec of
    :func:`dspark.generation.policies.parse_policy` or a :class:`~dspark.generation.policies.Policy`; default:
    :func:`dspark.generation.policies.default_policy`), the block size γ', an explicit SPS(B) table for ``scheduler`` /
    ``lagged`` (None: the rounds price themselves, :mod:`dspark.generation.costs`) and whether the n-gram lookup
    proposer runs beside the drafter (:mod:`dspark.generation.lookup`; ``policy="none"`` with ``lookup=True`` is lookup
    alone). Checked here, at the call, the options act only inside a ``with`` block::

        with dspark_options(policy="fixed:3", block_size=4):
            target.generate(ids, assistant_model=drafter)

    Raises:
        ValueError: a bad policy spec, ``block_size`` not an int ≥ 1 (its upper bound, the drafter's γ, is checked
            when `generate()` starts), ``sps`` neither a mapping ``{B: steps/s}`` nor a callable, ``lookup`` not a bool.
    """

    def __init__(self, policy: str | Policy | None = None, block_size: int | None = None, sps=None,
                 lookup: bool = True):
        if not isinstance(lookup, bool):
            raise ValueError(f"lookup must be True or False; got {lookup!r}")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise ValueError(f"block_size must be None or an int >= 1; got {block_size!r}")
        if sps is not None and not (isinstance(sps, Mapping) or callable(sps)):
            raise ValueError(f"sps must be None, a mapping {{B: steps/s}} or a callable B -> steps/s; got {sps!r}")
        self.options = {"policy": None if policy is None else parse_policy(policy), "block_size": block_size,
                        "sps": sps, "lookup": lookup}
        super().__init__(_options, self.options, "dspark_options(...)", "changed nothing",
                         "with dspark_options(...): target.generate(...)")

    def __enter__(self) -> dspark_options:
        super().__enter__()
        return self


def _transformers_default(name: str):
    return GenerationConfig._get_default_generation_params().get(name)


def _assistant_options(generation_config, block_size: int | None, max_block_size: int) -> int | None:
    """The block size γ' asked for by ``num_assistant_tokens`` and/or ``dspark_options(block_size=...)`` (None = the
    drafter's γ), after refusing the transformers assisted-decoding options DSpark cannot honour. transformers fills
    unset options with its defaults before this point (``num_assistant_tokens`` 20, ``num_assistant_tokens_schedule``
    "constant", ``assistant_confidence_threshold`` 0.4) and keeps no record of which ones the caller passed, so a value
    equal to the default reads as unset.

    Raises:
        ValueError: ``num_assistant_tokens`` outside [1, ``max_block_size``] (the drafter's block size γ),
            ``prompt_lookup_num_tokens``, ``assistant_early_exit``, ``use_mtp`` or ``speculation_type`` (each
            selects another drafting method), a ``num_assistant_tokens_schedule`` other than "constant" or an
            ``assistant_confidence_threshold`` other than the default (DSpark's verify policy decides how many drafts
            are verified: ``dspark_options(policy=...)``), or ``num_assistant_tokens`` and
            ``dspark_options(block_size=...)`` that disagree.
    """
    for name, what in (("prompt_lookup_num_tokens", "prompt lookup decoding"),
                       ("assistant_early_exit", "early-exit self-speculation"),
                       ("use_mtp", "multi-token-prediction drafting"),
                       ("speculation_type", f"speculation_type={generation_config.speculation_type!r}")):
        if getattr(generation_config, name, None) not in (None, False):
            raise ValueError(f"{name} selects {what}, which cannot be combined with a DSpark assistant_model; "
                             f"pass one or the other")
    schedule = getattr(generation_config, "num_assistant_tokens_schedule", None)
    if schedule not in (None, "constant"):
        raise ValueError(
            f"num_assistant_tokens_schedule={schedule!r} is not supported with a DSpark drafter: its verify policy "
            "chooses how many drafts to verify each round (dspark_options(policy='scheduler' | 'threshold:P' | "
            "'fixed:N' | 'full')); num_assistant_tokens sets the block size"
        )
    threshold = getattr(generation_config, "assistant_confidence_threshold", None)
    if threshold not in (None, _transformers_default("assistant_confidence_threshold")):
        raise ValueError(
            f"assistant_confidence_threshold={threshold} is not supported with a DSpark drafter; to stop drafting "
            "when confidence falls, use dspark_options(policy='threshold:P') (verify while the survival "
            "a_k = c_1...c_k stays >= P) or the default DSpark scheduler"
        )
    n = getattr(generation_config, "num_assistant_tokens", None)
    if n is None or n == _transformers_default("num_assistant_tokens"):
        return block_size
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_block_size:
        raise ValueError(f"num_assistant_tokens={n!r} out of range: it sets the DSpark block size, an int in "
                         f"[1, {max_block_size}] for this drafter (20, transformers' default, cannot be told from "
                         "unset and means the drafter's block size; dspark_options(block_size=...) sets any size)")
    if block_size is not None and block_size != n:
        raise ValueError(f"num_assistant_tokens={n} and dspark_options(block_size={block_size}) disagree; give one")
    return n


def validate_generation_call(target, drafter, generation_mode, generation_config) -> None:
    """Refuse a `generate()` call a DSpark drafter cannot serve, before any compute and before transformers' own checks
    (the hook of :func:`modeling_dspark.install_generate_hook`, once transformers has chosen the decoding mode).

    Raises:
        ValueError: what :func:`_assistant_options` or :func:`~dspark.generation.drafting.check_drafter` refuses (a
            drafter for another target: named here, not as transformers' "different tokenizers"); a mode that decodes
            without the assistant (beam search, constraints, DoLa); ``num_return_sequences`` > 1; with
            ``return_dict_in_generate``, ``output_hidden_states`` (the verify forwards return only the layers the
            drafter reads) or ``output_attentions`` without eager attention (transformers' loop fails on it).
        RuntimeError: the installed transformers is outside the supported range (:mod:`dspark.generation.compat`).
    """
    check_transformers()
    _assistant_options(generation_config, _options.get().get("block_size"), drafter.config.block_size)
    if generation_mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(f"these generate() options select {generation_mode.value}, which decodes without "
                         "assistant_model; a DSpark drafter drafts for greedy decoding and sampling (num_beams=1)")
    if generation_config.num_return_sequences > 1:
        raise ValueError(f"num_return_sequences={generation_config.num_return_sequences}: assisted decoding returns "
                         "one sequence per call; call generate() once per sequence (each call samples anew)")
    if generation_config.return_dict_in_generate and generation_config.output_hidden_states:
        raise ValueError("output_hidden_states is not supported with a DSpark drafter; run the target on the output")
    if generation_config.return_dict_in_generate and generation_config.output_attentions and \
            getattr(target.config.get_text_config(), "_attn_implementation", None) != "eager":  # else IndexError
        raise ValueError("output_attentions in assisted decoding needs the target's eager attention: load it with "
                         "attn_implementation='eager' (transformers' loop fails on the weights others do not return)")
    check_drafter(drafter, target)


def dspark_candidate_generator(target, drafter, generation_config, input_ids, logits_processor,
                               model_kwargs, tokenizer=None) -> DSparkCandidateGenerator:
    """The candidate generator of one `target.generate(..., assistant_model=drafter)` call (called by the hook of
    :func:`modeling_dspark.install_generate_hook` after :func:`validate_generation_call`, which binds the drafter
    to the target), with the options of :func:`dspark_options`: the block size γ' from ``num_assistant_tokens`` or
    ``dspark_options(block_size=...)`` (:func:`_assistant_options`); the policy and its SPS(B) table are resolved by
    :class:`DSparkCandidateGenerator` (after its checks).

    Raises:
        ValueError: a ``cache`` (``past_key_values``) already holding tokens (a previous turn's), before any compute.
    """
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("a cache holding earlier tokens (cache= or past_key_values=) is not supported with a DSpark "
                         "drafter: transformers' assisted decoding from a filled cache can part from plain generate() "
                         "(its prompt lookup too); pass the whole conversation as input_ids and no cache")
    opts = _options.get()
    block_size = _assistant_options(generation_config, opts.get("block_size"), drafter.config.block_size)
    return DSparkCandidateGenerator(drafter, target, generation_config, logits_processor=logits_processor,
                                    input_ids=input_ids, policy=opts.get("policy"), block_size=block_size,
                                    sps=opts.get("sps"), tokenizer=tokenizer, lookup=opts.get("lookup", True))
