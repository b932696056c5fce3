"""The transformers releases dspark is tested with, every transformers internal it touches, and the check of the range.

`target.generate(ids, assistant_model=drafter)` reaches DSpark through transformers' generation internals. Each one is
listed in :data:`INTERNALS` with how dspark reaches it on each supported release; a release outside
:func:`supported_transformers` may have changed any of them, so `generate()` with a DSpark drafter refuses it
(:func:`check_transformers`) and pyproject.toml declares the same range. CI tests both ends (`.ci/run` at the lowest,
`scripts/test_versions.sh` at the highest). The seams that are not transformers interfaces, the hook on
``GenerationMixin._get_candidate_generator`` and the wrappers of ``_assisted_decoding`` and
``_validate_generation_mode``, are told in
:mod:`dspark.generation.integration` and :mod:`modeling_dspark`. Everything a round needs from the target (its hidden
states at the drafter's layers, the committed ids) comes through the candidate-generator interface of the assisted loop.
"""

from __future__ import annotations

from typing import NamedTuple

TRANSFORMERS_MIN = "5.24.0"
"""The lowest transformers release supported (inclusive)."""
TRANSFORMERS_BELOW = "5.26"
"""The first transformers release not supported (exclusive): the next minor release after the highest tested."""
TESTED_RELEASES = ("5.24", "5.25")
"""The minor releases CI runs the tests on (the lowest with the main suite, the highest with the core suite)."""


class Internal(NamedTuple):
    """One transformers internal dspark relies on: its name, what dspark uses it for, and how each tested release
    provides it (a release missing from ``per_release`` provides it as the first one listed does)."""

    name: str
    used_for: str
    per_release: dict[str, str]


INTERNALS: tuple[Internal, ...] = (
    Internal("GenerationMixin._get_candidate_generator",
             "choose DSpark's candidate generator for a DSpark assistant (the hook)",
             {"5.24": "private method, wrapped once at class level; same signature in 5.25"}),
    Internal("GenerationMixin._assisted_decoding", "run the assisted loop inside products.few_row_products",
             {"5.24": "private method, found by getattr(type(model), name); generate() reads its signature "
                      "(inputs_tensor) through __wrapped__; same in 5.25"}),
    Internal("GenerationMixin._validate_generation_mode, generation.configuration_utils.GenerationMode",
             "refuse, for a DSpark assistant, a mode (beam search, …) or option the drafter cannot serve",
             {"5.24": "private method, wrapped once at class level; called by generate() with (generation_mode, "
                      "generation_config, generation_mode_kwargs) once the mode is chosen; same in 5.25"}),
    Internal("generation.candidate_generator.CandidateGenerator.get_candidates",
             "one round: called with (input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches)",
             {"5.24": "the assisted loop passes the target's last outputs when requires_model_outputs is set"}),
    Internal("CandidateGenerator.requires_model_outputs / model_kwargs_overrides",
             "the target's hidden states at the drafter's layers in every verify forward "
             "(output_hidden_states=[l + 1 for l in target_layer_ids])",
             {"5.24": "added to the verify forward's inputs by the assisted loop; list-valued output_hidden_states "
                      "keeps only those layers"}),
    Internal("CandidateGenerator.num_drafting_tokens",
             "the most tokens one round proposes (γ')",
             {"5.24": "not read", "5.25": "read once by the assisted loop: cache.activate_past_recording("
                                          "recurrent_states_to_keep=num_drafting_tokens)"}),
    Internal("CandidateGenerator.update_candidate_strategy",
             "record each round's accepted count and verify time",
             {"5.24": "called after every verify with (input_ids, scores, num_matches)"}),
    Internal("generation.stopping_criteria.StopStringCriteria",
             "cut a draft before a token that would complete a stop string inside the block",
             {"5.24": "public class, same in 5.25"}),
    Internal("GenerationConfig._get_default_generation_params",
             "tell transformers' filled-in defaults (num_assistant_tokens=20, …) from values a caller passed",
             {"5.24": "private static method, same in 5.25"}),
    Internal("GenerationConfig.speculation_type / use_mtp / prompt_lookup_num_tokens / assistant_early_exit",
             "refuse other drafting methods combined with a DSpark assistant",
             {"5.24": "config attributes, same in 5.25"}),
    Internal("generation.candidate_generator.DFlashTokenCandidateGenerator / cache_utils.DFlashCache",
             "transformers' own DFlash loop driving a DSpark drafter's backbone (modeling_dspark.dflash)",
             {"5.24": "speculation_type='dflash'; the assistant is called with noise_embeds, context_hidden_states, "
                      "position_ids, attention_mask, cache and must return last_hidden_state; same in 5.25"}),
    Internal("cache_utils.DynamicCache (layers[i].keys / .values)",
             "the drafter's context K/V across rounds",
             {"5.24": "public class; the layer tensors read directly, same in 5.25"}),
    Internal("modeling_utils.ALL_ATTENTION_FUNCTIONS, AttentionInterface, integrations.sdpa_attention",
             "the drafter's attention; the batched engine's packed verify registers its own attention function "
             "and passes dspark_layout through the target's forward kwargs",
             {"5.24": "public registries; attention kwargs reach the function unchanged, same in 5.25"}),
    Internal("models.llama.modeling_llama (LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, eager_attention_forward, "
             "rotate_half)", "the draft layers' building blocks", {"5.24": "module attributes, same in 5.25"}),
    Internal("PretrainedConfig._attn_implementation",
             "the batched engine's packed verify switches the target's attention function for one forward",
             {"5.24": "private config attribute, read by the attention layers at every forward; same in 5.25"}),
    Internal("PreTrainedModel._init_weights", "the drafter's weight initialisation",
             {"5.24": "overridden hook, same in 5.25"}),
    Internal("AutoModelForCausalLM / AutoTokenizer .from_pretrained(gguf_file=...)",
             "dequantise the packaged targets' GGUF files once (modeling_dspark.target)",
             {"5.24": "public, needs the gguf package; same in 5.25"}),
    Internal("trainer_utils.get_last_checkpoint", "resume training", {"5.24": "public function, same in 5.25"}),
)


def supported_transformers() -> str:
    """The supported range as a pip requirement specifier, e.g. ``">=5.24.0,<5.26"``."""
    return f">={TRANSFORMERS_MIN},<{TRANSFORMERS_BELOW}"


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers release outside :func:`supported_transformers` before `generate()` uses its internals.

    Args:
        version: the release to check (default: the installed ``transformers.__version__``).

    Raises:
        RuntimeError: the release is outside the range; the message names the installed and supported versions and
            the pip command that installs a supported one.
    """
    from packaging.specifiers import SpecifierSet

    if version is None:
        import transformers

        version = transformers.__version__
    # pip's reading of the range: a pre-release of the excluded release is excluded too
    if not SpecifierSet(supported_transformers()).contains(version, prereleases=True):
        raise RuntimeError(
            f"generate(assistant_model=<DSpark drafter>) needs transformers {supported_transformers()} (its "
            f"candidate-generator and assisted-decoding internals, generation/compat.py, are tested on those "
            f"releases only); installed: transformers {version}. Install a supported release: "
            f"pip install 'transformers{supported_transformers()}'"
        )
