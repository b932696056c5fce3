"""The drafter interface decoding relies on (dspark.generation.drafting.Drafter) is what DSparkDraftModel provides."""

from __future__ import annotations

import inspect

import modeling_dspark as md
from dspark.generation.drafting import Drafter


def _protocol_methods() -> dict[str, inspect.Signature]:
    out = {}
    for name, member in vars(Drafter).items():
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(member, property):
            continue
        if callable(member):
            out["forward" if name == "__call__" else name] = inspect.signature(member)
    return out


def test_the_dspark_drafter_satisfies_the_drafter_protocol():
    """Every method decoding calls exists on the model and accepts the protocol's parameters by name and position
    (extra parameters only with defaults); the attributes and properties exist on an instance."""
    cfg = md.DSparkConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          intermediate_size=64, vocab_size=64, target_layer_ids=[1], block_size=4)
    drafter = md.DSparkDraftModel(cfg)
    assert isinstance(drafter, Drafter)
    methods = _protocol_methods()
    assert {"forward", "block_slots", "lm_logits", "correction_step", "confidence_logits"} <= set(methods)
    for name, wanted in methods.items():
        have = inspect.signature(getattr(md.DSparkDraftModel, name))
        params = list(have.parameters.values())
        for i, p in enumerate(wanted.parameters.values()):
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            assert i < len(params) and params[i].name == p.name, (name, p.name, str(have))
            assert (p.default is p.empty) or params[i].default is not p.empty, (name, p.name)
        for extra in params[len(wanted.parameters):]:
            assert extra.default is not extra.empty or extra.kind in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD), \
                (name, extra.name)
    for attr in ("config", "confidence_head", "device", "bound_target"):
        getattr(drafter, attr)
