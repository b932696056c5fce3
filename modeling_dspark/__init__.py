"""DSpark draft models for Hugging Face transformers (docs/method.md, eqs. 2–7).

Importing this package

- registers `DSparkConfig` / `DSparkDraftModel` with `AutoConfig` / `AutoModel`, so `AutoModel.from_pretrained(dir)`
  works without `trust_remote_code`;
- installs a class-level hook on transformers' `GenerationMixin._get_candidate_generator`, so
  `target.generate(ids, assistant_model=drafter)` (and `pipeline("text-generation", model=target,
  assistant_model=drafter)`) drafts with DSpark for any target when ``drafter`` is a `DSparkDraftModel`, and
  defers to transformers unchanged for every other assistant (draft models, prompt lookup, early exit, …);
- wraps `GenerationMixin._assisted_decoding` so that, with a DSpark assistant, the loop's products of few rows
  take the faster BLAS call (:func:`dspark.generation.products.few_row_products`) and the drafter stays bound to
  this call's target while it runs (:meth:`DSparkDraftModel.drafting_for`); other assistants run it as is;
- wraps `GenerationMixin._validate_generation_mode`, so a call a DSpark drafter cannot serve (beam search, hidden
  states asked for, a drafter made for another target) is refused with a message naming it, before any compute.

The model sits above decoding, as transformers' models sit above `transformers.generation`: this package imports
`generation` (the hook's candidate generator, the target features of eq. 2) and `generation` never imports this
package, so neither imports the other in a circle.
"""

import inspect

from transformers import AutoConfig, AutoModel
from transformers.generation.utils import GenerationMixin

from dspark.generation.integration import dspark_candidate_generator, validate_generation_call
from dspark.generation.products import few_row_products

from .configuration_dspark import DSparkConfig, default_target_layer_ids
from .modeling_dspark import DSparkDraftModel, DSparkOutput

AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)


def dspark_drafter(assistant) -> DSparkDraftModel | None:
    """The `DSparkDraftModel` serving as ``assistant``: itself, or the base model of a peft ``PeftModel`` of one (its
    LoRA layers in place and active), else None (another kind of assistant, or none)."""
    base = assistant.get_base_model() if hasattr(assistant, "get_base_model") else assistant
    return base if isinstance(base, DSparkDraftModel) else None


def install_generate_hook() -> None:
    """Route `generate(..., assistant_model=<DSparkDraftModel>)` to DSpark's candidate generator (idempotent).

    Replaces `GenerationMixin._get_candidate_generator` by a wrapper that, when the assistant is a
    `DSparkDraftModel` (or a peft model of one, :func:`dspark_drafter`), returns
    :func:`dspark.generation.integration.dspark_candidate_generator`'s generator (which validates the request and
    binds the drafter to the target), and otherwise calls transformers' own method with the same arguments;
    wraps `GenerationMixin._assisted_decoding` (the assisted loop, reached by ``getattr(type(model), ...)`` in
    `generate()`) to run inside :func:`dspark.generation.products.few_row_products` of the target and the drafter
    and with the drafter held for the target (:meth:`DSparkDraftModel.drafting_for`);
    and wraps `GenerationMixin._validate_generation_mode` to refuse, for a DSpark assistant, what the drafter cannot
    serve (:func:`dspark.generation.integration.validate_generation_call`) before transformers' own checks. Other
    assistants go through all three unchanged. Installing twice keeps single wrappers.
    """
    transformers_method = GenerationMixin._get_candidate_generator
    if getattr(transformers_method, "_dspark_hook", False):
        return

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        if (drafter := dspark_drafter(assistant_model)) is not None:
            return dspark_candidate_generator(self, drafter, generation_config, input_ids, logits_processor,
                                              model_kwargs, tokenizer=target_tokenizer)
        return transformers_method(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                   assistant_model=assistant_model, target_tokenizer=target_tokenizer,
                                   assistant_tokenizer=assistant_tokenizer)

    _get_candidate_generator._dspark_hook = True
    _get_candidate_generator.__wrapped__ = transformers_method
    _get_candidate_generator.__doc__ = transformers_method.__doc__
    GenerationMixin._get_candidate_generator = _get_candidate_generator

    transformers_loop = GenerationMixin._assisted_decoding
    loop_signature = inspect.signature(transformers_loop)

    def _assisted_decoding(self, *args, **kwargs):
        assistant = loop_signature.bind_partial(self, *args, **kwargs).arguments.get("assistant_model")
        if (drafter := dspark_drafter(assistant)) is None:
            return transformers_loop(self, *args, **kwargs)
        with few_row_products(self, drafter), drafter.drafting_for(self):  # held: no other target re-binds it
            return transformers_loop(self, *args, **kwargs)

    # generate() reads the loop's parameters with inspect.signature (whether it takes inputs_tensor), which follows
    # __wrapped__ to transformers' own method
    _assisted_decoding.__wrapped__ = transformers_loop
    _assisted_decoding.__doc__ = transformers_loop.__doc__
    GenerationMixin._assisted_decoding = _assisted_decoding

    transformers_validate = GenerationMixin._validate_generation_mode

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        if (drafter := dspark_drafter(generation_mode_kwargs.get("assistant_model"))) is not None:
            validate_generation_call(self, drafter, generation_mode, generation_config)
        return transformers_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    _validate_generation_mode.__wrapped__ = transformers_validate
    _validate_generation_mode.__doc__ = transformers_validate.__doc__
    GenerationMixin._validate_generation_mode = _validate_generation_mode


install_generate_hook()

__all__ = ["DSparkConfig", "DSparkDraftModel", "DSparkOutput", "default_target_layer_ids", "install_generate_hook"]
