"""Hugging Face-native use: after `import modeling_dspark`, `AutoModel` drafters, `target.generate(assistant_model=)`,
`pipeline(...)`, `num_assistant_tokens`, Hub ids through `huggingface_hub`, and clear errors for bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.generation.utils import GenerationMixin

import modeling_dspark as md
from dspark.generation import collect_stats, dspark_options

pytestmark = pytest.mark.core  # also run at both ends of the supported versions (scripts/test_versions.sh)

REPO_ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ["llama", "qwen2", "qwen3"]


def _save_tiny_target(family: str, path: Path) -> Path:
    """A tiny random causal LM of ``family``, saved with its special tokens (bos 1, eos 2, pad 0)."""
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)  # a peaked random model: greedy continuations vary
    model.save_pretrained(path)
    return path


def _save_drafter(target, path: Path, seed: int = 0, **kw) -> Path:
    torch.manual_seed(seed)
    cfg = md.DSparkConfig.from_target_config(target.config, **{"block_size": 4, "markov_rank": 8, **kw})
    md.DSparkDraftModel(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    """(target loaded with AutoModelForCausalLM in fp32, drafter directory) for one family."""
    root = tmp_path_factory.mktemp(request.param)
    target = AutoModelForCausalLM.from_pretrained(_save_tiny_target(request.param, root / "target"),
                                                  dtype=torch.float32).eval()
    return target, _save_drafter(target, root / "drafter")


PROMPT = torch.tensor([[1, 5, 9, 13, 17, 21]])


def _generate(target, drafter=None, **kw):
    kw = {"max_new_tokens": 24, "do_sample": False, **kw}
    if drafter is None:
        return target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **kw)
    return target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), assistant_model=drafter, **kw)


def _count_forwards(model):
    calls = {"n": 0}
    handle = model.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    return calls, handle


# ---------------------------------------------------------------------------------------------- the generate hook
def test_hook_is_installed_once_at_class_level(gpt2):
    hook = GenerationMixin._get_candidate_generator
    assert getattr(hook, "_dspark_hook", False), "importing modeling_dspark must install the hook"
    md.install_generate_hook()
    assert GenerationMixin._get_candidate_generator is hook
    assert "_get_candidate_generator" not in vars(gpt2)
    assert not getattr(hook.__wrapped__, "_dspark_hook", False)  # wraps transformers' own method, not itself


@pytest.mark.parametrize("how", ["AutoModel", "from_pretrained", "from_pretrained(target=)", "bind_target"])
def test_generate_with_any_loading_path_equals_plain_greedy(tiny, how):
    """With no other call, each way of loading the drafter drafts with DSpark and gives plain greedy's output."""
    target, drafter_dir = tiny
    if how == "AutoModel":
        drafter = AutoModel.from_pretrained(drafter_dir)
        assert isinstance(drafter, md.DSparkDraftModel) and isinstance(AutoConfig.from_pretrained(drafter_dir),
                                                                        md.DSparkConfig)
    elif how == "from_pretrained":
        drafter = md.DSparkDraftModel.from_pretrained(drafter_dir)
    elif how == "from_pretrained(target=)":
        drafter = md.DSparkDraftModel.from_pretrained(drafter_dir, target=target)
    else:
        drafter = md.DSparkDraftModel.from_pretrained(drafter_dir).bind_target(target)
    reference = _generate(target)
    with collect_stats() as runs, dspark_options(policy="full"):  # every round drafts (the default prices them)
        out = _generate(target, drafter)
    assert torch.equal(out, reference)
    assert runs and runs[-1].rounds, "DSpark's candidate generator was not used"
    assert sum(r.drafted for r in runs[-1].rounds) > 0
    assert drafter._target["model"] is target  # an unbound drafter binds itself to the generate() target


def test_other_assistants_still_use_transformers(tiny):
    """A plain causal-LM assistant and prompt lookup keep transformers' own candidate generators."""
    target, _ = tiny
    reference = _generate(target)
    with collect_stats() as runs:
        assert torch.equal(_generate(target, target), reference)
        assert torch.equal(_generate(target, prompt_lookup_num_tokens=3), reference)
    assert runs == []


@pytest.mark.parametrize("vocab", [64, 80])
def test_unbound_drafter_for_another_target_fails_before_compute(tiny, tmp_path, vocab):
    """Named as a drafter/target mismatch, also where the vocabularies differ (transformers would otherwise ask for
    two tokenizers, as for universal assisted decoding)."""
    target, _ = tiny
    other = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=vocab, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True))
    drafter = AutoModel.from_pretrained(_save_drafter(other, tmp_path / "d"))
    calls, handle = _count_forwards(target)
    try:
        with pytest.raises(ValueError, match=r"mismatch.*hidden size 48"):
            _generate(target, drafter)
    finally:
        handle.remove()
    assert calls["n"] == 0 and not drafter._target


def test_a_filled_cache_is_refused_before_compute(tiny):
    """transformers' assisted loop from a cache holding earlier tokens can part from plain generate(): refused; an
    empty cache passed in is fine."""
    from transformers import DynamicCache

    target, drafter_dir = tiny
    drafter = AutoModel.from_pretrained(drafter_dir)
    first = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=4, do_sample=False,
                            return_dict_in_generate=True)
    ids = torch.cat([first.sequences, torch.tensor([[7, 11]])], dim=1)
    calls, handle = _count_forwards(target)
    try:
        for name in ("cache", "past_key_values"):  # transformers 5.24 names it cache; past_key_values still works
            with pytest.raises(ValueError, match=r"a cache holding earlier tokens .* is not supported"):
                target.generate(ids, attention_mask=torch.ones_like(ids), **{name: first.past_key_values},
                                assistant_model=drafter, max_new_tokens=8, do_sample=False)
    finally:
        handle.remove()
    assert calls["n"] == 0
    reference = _generate(target)
    assert torch.equal(_generate(target, drafter, cache=DynamicCache(config=target.config)), reference)


# ---------------------------------------------------------------------------------------------- generation options
def test_num_assistant_tokens_sets_the_block_size(tiny):
    target, drafter_dir = tiny
    drafter = AutoModel.from_pretrained(drafter_dir)
    reference = _generate(target)
    for n in (1, 3):
        with collect_stats() as runs, dspark_options(lookup=False, policy="full"):  # every round drafts its block
            assert torch.equal(_generate(target, drafter, num_assistant_tokens=n), reference)
        drafted = [r.drafted for r in runs[-1].rounds]
        assert max(drafted) == n, (n, drafted)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_assistant_tokens": 5}, r"num_assistant_tokens=5 out of range.*\[1, 4\]"),
        ({"num_assistant_tokens": 0}, r"num_assistant_tokens=0 out of range"),
        ({"num_assistant_tokens_schedule": "heuristic"}, r"num_assistant_tokens_schedule='heuristic' is not supp"),
        ({"assistant_confidence_threshold": 0.7}, r"assistant_confidence_threshold=0.7 is not supported"),
        ({"prompt_lookup_num_tokens": 3}, r"prompt_lookup_num_tokens .*cannot be combined"),
        ({"assistant_ensemble_weight": 0.5}, r"assistant_ensemble_weight"),
        ({"num_beams": 2}, r"select beam_search, which decodes without assistant_model"),
        ({"num_beams": 2, "do_sample": True}, r"select beam_sample"),
        ({"output_hidden_states": True, "return_dict_in_generate": True}, r"output_hidden_states is not supported"),
        ({"num_return_sequences": 2, "do_sample": True}, r"num_return_sequences=2: .*call generate\(\) once per"),
        ({"output_attentions": True, "return_dict_in_generate": True}, r"attn_implementation='eager'"),
    ],
)
def test_generation_options_dspark_cannot_honour_fail_before_compute(tiny, kwargs, message):
    target, drafter_dir = tiny
    drafter = AutoModel.from_pretrained(drafter_dir)
    calls, handle = _count_forwards(target)
    try:
        with pytest.raises(ValueError, match=message):
            _generate(target, drafter, **kwargs)
    finally:
        handle.remove()
    assert calls["n"] == 0


def test_output_attentions_with_eager_attention_are_returned(tiny):
    """With eager attention (the one attention that returns weights) the attentions come back, one entry per new
    token as in plain generate(), and the output is plain generate()'s; other kernels are refused above."""
    target, drafter_dir = tiny
    kernel = target.config._attn_implementation  # the fixture's, shared by the module's tests: restored after
    target.set_attn_implementation("eager")
    try:
        kw = {"return_dict_in_generate": True, "output_attentions": True}
        out, ref = _generate(target, AutoModel.from_pretrained(drafter_dir), **kw), _generate(target, **kw)
    finally:
        target.set_attn_implementation(kernel)
    assert torch.equal(out.sequences, ref.sequences) and len(out.attentions) == len(ref.attentions) == 24


def test_output_hidden_states_without_a_dict_is_ignored_as_transformers_does(tiny):
    """transformers returns hidden states only with return_dict_in_generate; without it the flag changes nothing,
    with a DSpark drafter too."""
    target, drafter_dir = tiny
    out = _generate(target, AutoModel.from_pretrained(drafter_dir), output_hidden_states=True)
    assert torch.equal(out, _generate(target))


def test_num_assistant_tokens_and_dspark_options_must_agree(tiny):
    target, drafter_dir = tiny
    drafter = AutoModel.from_pretrained(drafter_dir)
    with dspark_options(block_size=2), pytest.raises(ValueError, match=r"num_assistant_tokens=3 and dspark_options"):
        _generate(target, drafter, num_assistant_tokens=3)
    with dspark_options(block_size=2, policy="full"), collect_stats() as runs:  # every round drafts its block
        _generate(target, drafter, num_assistant_tokens=2)
    assert max(r.drafted for r in runs[-1].rounds) == 2


# ---------------------------------------------------------------------------------------------- pipeline (real target)
@pytest.mark.parametrize("which", ["shipped", "shipped-exported", "new"])
def test_auto_model_drafter_in_generate_and_pipeline_equals_plain_greedy(smollm, tmp_path, which):
    """The shipped drafter (its speculators export loaded back, or a new one) from AutoModel, unbound:
    target.generate and pipeline("text-generation") give plain greedy's output, and pipeline's num_assistant_tokens
    sets the block size."""
    from transformers import pipeline

    from modeling_dspark import export

    target, tok = smollm
    shipped = REPO_ROOT / "modeling_dspark" / "drafters" / "smollm2-135m-dspark"
    if which == "shipped":
        drafter = AutoModel.from_pretrained(shipped)
    elif which == "shipped-exported":  # what vLLM loads, back in transformers
        out = export.export_drafter(md.DSparkDraftModel.from_pretrained(shipped, target=target), tmp_path / "spec",
                                     format="speculators")
        drafter = md.DSparkDraftModel.from_pretrained(out)  # unbound, as the other cases
    else:
        drafter = AutoModel.from_pretrained(_save_drafter(target, tmp_path / "d", block_size=4, markov_rank=16))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with collect_stats() as runs:
        out = target.generate(**ids, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, target.generate(**ids, max_new_tokens=24, do_sample=False))
    assert runs[-1].rounds
    plain = pipeline("text-generation", model=target, tokenizer=tok)
    spec = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=drafter)
    reference = plain(messages, max_new_tokens=24, do_sample=False)
    with collect_stats() as runs:
        assert spec(messages, max_new_tokens=24, do_sample=False) == reference
        assert runs and runs[-1].rounds
        with dspark_options(policy="full"):  # every round drafts its block (the default prices them)
            assert spec(messages, max_new_tokens=24, do_sample=False, num_assistant_tokens=2) == reference
    assert max(r.drafted for r in runs[-1].rounds) == 2


# ---------------------------------------------------------------------------------------------- Hub ids, paths
def _fill_hub_cache(cache: Path, repo_id: str, src: Path, revision: str = "a" * 40) -> str:
    """Lay out ``repo_id`` in a Hugging Face cache by hand, as huggingface_hub would: snapshots/<rev>/ + refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(src, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return revision


def test_hub_id_loads_from_the_local_cache(tiny, tmp_path, monkeypatch):
    target, drafter_dir = tiny
    cache = tmp_path / "hub"
    rev = _fill_hub_cache(cache, "someorg/tiny-dspark", drafter_dir)
    reference = _generate(target)
    d = md.DSparkDraftModel.from_pretrained("someorg/tiny-dspark", target=target, cache_dir=cache,
                                            local_files_only=True)
    assert torch.equal(_generate(target, d), reference)
    d = md.DSparkDraftModel.from_pretrained("someorg/tiny-dspark", cache_dir=cache, revision=rev,
                                            local_files_only=True)
    assert torch.equal(_generate(target, d), reference)
    d = AutoModel.from_pretrained("someorg/tiny-dspark", cache_dir=cache, local_files_only=True)
    assert isinstance(d, md.DSparkDraftModel) and torch.equal(_generate(target, d), reference)
    # the default cache location (HF_HUB_CACHE), read at call time, with HF_HUB_OFFLINE=1 (conftest)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert constants.HF_HUB_OFFLINE
    d = md.DSparkDraftModel.from_pretrained("someorg/tiny-dspark")
    assert torch.equal(_generate(target, d), reference)


@pytest.mark.parametrize("revision", [None, "b" * 40])
def test_unknown_hub_id_or_revision_is_a_clear_not_found(tiny, tmp_path, revision):
    _, drafter_dir = tiny
    cache = tmp_path / "hub"
    _fill_hub_cache(cache, "someorg/tiny-dspark", drafter_dir)
    name = "someorg/tiny-dspark" if revision else "someorg/absent"
    with pytest.raises(FileNotFoundError, match=r"not found: no local directory .*could not be fetched"):
        md.DSparkDraftModel.from_pretrained(name, cache_dir=cache, revision=revision, local_files_only=True)


def test_generate_refuses_an_unsupported_transformers(tiny, monkeypatch):
    """Outside the supported transformers range, generate() with a DSpark drafter fails before any forward, naming
    the installed and the supported versions; the installed release is inside the range."""
    import transformers

    from dspark.generation.compat import check_transformers, supported_transformers

    check_transformers()
    target, drafter_dir = tiny
    drafter = md.DSparkDraftModel.from_pretrained(drafter_dir, target=target)
    monkeypatch.setattr(transformers, "__version__", "9.0.0")
    calls, handle = _count_forwards(target)
    try:
        with pytest.raises(RuntimeError, match=re.escape(f"needs transformers {supported_transformers()}") +
                           r".*installed: transformers 9\.0\.0"):
            _generate(target, drafter)
    finally:
        handle.remove()
    assert calls["n"] == 0


def test_relative_paths_resolve_as_paths(tiny, tmp_path, monkeypatch):
    """Outside the repository root, an old relative path of a shipped drafter is not found (a clear error naming the
    shipped name, no network); an existing relative directory loads as a path even when it also has the form of a
    Hub id; a missing directory under an existing one fails before any Hub lookup."""
    import huggingface_hub

    target, drafter_dir = tiny
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"drafters/smollm2-135m-dspark.*not found: no local directory.*"
                                                r"loads as 'smollm2-135m-dspark'"):
        md.DSparkDraftModel.from_pretrained("drafters/smollm2-135m-dspark", local_files_only=True)
    with pytest.raises(FileNotFoundError, match=r"drafter directory not found: './absent'"):
        md.DSparkDraftModel.from_pretrained("./absent")
    shutil.copytree(drafter_dir, tmp_path / "someorg" / "tiny-dspark")
    d = md.DSparkDraftModel.from_pretrained("someorg/tiny-dspark", target=target)
    assert torch.equal(_generate(target, d), _generate(target))

    def no_hub(*args, **kwargs):
        raise AssertionError("a local path was looked up on the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    with pytest.raises(FileNotFoundError, match=r"drafter directory not found: 'someorg/absent'.*shipped drafters: "
                                                r"qwen2.5-coder-0.5b-dspark, smollm2-135m-dspark"):
        md.DSparkDraftModel.from_pretrained("someorg/absent")
    with pytest.raises(FileNotFoundError, match=r"did you mean 'smollm2-135m-dspark'\? shipped drafters: qwen"):
        md.DSparkDraftModel.from_pretrained("smollm2-135m-dspak", local_files_only=True)
    with pytest.raises(FileNotFoundError, match=r"not found: '/absent/smollm2-135m-dspak' \(shipped drafters: "):
        md.DSparkDraftModel.from_pretrained("/absent/smollm2-135m-dspak")  # a path: no guess, no "looked in" echo


def test_shipped_drafters_load_by_name_from_any_directory(tmp_path, monkeypatch):
    """Each packaged target's shipped drafter loads by its name from outside the repository, from the package's own
    files, and is the one the CLI picks by default."""
    from dspark.cli.common import shipped_drafter_for as cli_default
    from modeling_dspark.hub import SHIPPED_DRAFTERS_DIR
    from modeling_dspark.target import PACKAGED_TARGETS, shipped_drafter_for

    monkeypatch.chdir(tmp_path)
    for name, packaged in PACKAGED_TARGETS.items():
        path = shipped_drafter_for(name)
        assert path == SHIPPED_DRAFTERS_DIR / packaged.drafter and cli_default(name) == str(path)
        assert json.loads((path / "config.json").read_text())["target_name_or_path"] == name
    drafter = md.DSparkDraftModel.from_pretrained("smollm2-135m-dspark")
    assert drafter.config.target_name_or_path == "SmolLM2-135M-Instruct"
    assert shipped_drafter_for(None) == shipped_drafter_for("SmolLM2-135M-Instruct")
    assert shipped_drafter_for(str(tmp_path)) is None


def test_drafter_directory_without_config_json_fails(tiny, tmp_path):
    _, drafter_dir = tiny
    shutil.copytree(drafter_dir, tmp_path / "d")
    (tmp_path / "d" / "config.json").unlink()
    with pytest.raises(OSError, match=r"has no config.json"):
        md.DSparkDraftModel.from_pretrained(tmp_path / "d")


def test_not_a_dspark_config_is_refused(tiny, tmp_path):
    target, _ = tiny
    target.save_pretrained(tmp_path / "t")
    with pytest.raises(ValueError, match=r"unrecognised drafter config"):
        md.DSparkDraftModel.from_pretrained(tmp_path / "t")


def test_other_formats_load_through_from_pretrained(tiny, tmp_path):
    """A checkpoint in another implementation's format (here speculators, written by dspark's exporter) loads with
    from_pretrained, from a directory and from a Hub id, and drafts what the original drafts."""
    from modeling_dspark import export, formats

    target, _ = tiny
    original = md.DSparkDraftModel.from_pretrained(_save_drafter(target, tmp_path / "d", mask_token_id=3),
                                                   target=target)
    exported = export.export_drafter(original, tmp_path / "spec", format="speculators", verifier_name="tiny-target")
    assert formats.detect_format(json.loads((exported / "config.json").read_text())) == "speculators"
    _fill_hub_cache(tmp_path / "hub", "someorg/spec-drafter", exported)
    # lookup off and policy full: every round drafts the whole block, so the recorded drafts compare the drafters
    # (the default's choices follow measured times)
    with collect_stats() as runs, dspark_options(lookup=False, policy="full"):
        reference = _generate(target, original)
        for loaded in (md.DSparkDraftModel.from_pretrained(exported, target=target),
                       md.DSparkDraftModel.from_pretrained("someorg/spec-drafter", target=target,
                                                           cache_dir=tmp_path / "hub", local_files_only=True)):
            assert isinstance(loaded, md.DSparkDraftModel) and loaded.dtype == torch.float32
            assert torch.equal(_generate(target, loaded), reference)
    drafts = [[r.draft_tokens for r in run.rounds] for run in runs]
    assert drafts[1] == drafts[0] and drafts[2] == drafts[0]


# ---------------------------------------------------------------------------------------------- unsupported family
@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=128)).eval()


def test_unsupported_target_family_is_named_before_compute(tiny, gpt2):
    _, drafter_dir = tiny
    with pytest.raises(ValueError, match=r"family .gpt2. is not supported"):
        md.DSparkConfig.from_target_config(gpt2.config)
    with pytest.raises(ValueError, match=r"family .gpt2. is not supported"):
        md.DSparkDraftModel.from_pretrained(drafter_dir, target=gpt2)
    with pytest.raises(ValueError, match=r"family .gpt2. is not supported"):
        md.DSparkDraftModel.from_pretrained(drafter_dir).bind_target(gpt2)
    drafter = AutoModel.from_pretrained(drafter_dir)
    calls, handle = _count_forwards(gpt2)
    try:
        with pytest.raises(ValueError, match=r"family .gpt2. is not supported"):
            gpt2.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), assistant_model=drafter, max_new_tokens=4)
    finally:
        handle.remove()
    assert calls["n"] == 0


# ---------------------------------------------------------------------------------------------- dspark generate
def test_cli_target_without_drafter_is_an_error(tmp_path, capsys):
    from dspark.cli.main import main

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text('{"model_type": "llama"}')  # a model directory, not the default
    assert main(["generate", "--prompt", "hi", "--target", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "--drafter" in err and "--no-draft" in err and "random" in err


def test_cli_relative_drafter_outside_the_repository(tmp_path, monkeypatch, capsys):
    from dspark.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--prompt", "hi", "--drafter", "drafters/smollm2-135m-dspark"]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and str(tmp_path / "drafters") in err
    assert main(["generate", "--prompt", "hi", "--drafter", "./absent/drafter"]) == 2
    assert "drafter directory not found" in capsys.readouterr().err


def test_cli_unsupported_target_family(tmp_path, capsys):
    """--target of an unsupported family: plain generation when asked (--no-draft), a clear error with a drafter."""
    from dspark.cli.main import main
    from transformers import AutoTokenizer

    from modeling_dspark.target import default_target_path

    tok = AutoTokenizer.from_pretrained(default_target_path())
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
        tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    argv = ["generate", "--prompt", "hi", "--target", str(tmp_path / "gpt2"), "--max-new-tokens", "2",
            "--dtype", "float32"]
    assert main([*argv, "--no-draft"]) == 0
    capsys.readouterr()
    assert main([*argv, "--drafter", "random"]) == 2
    assert "family 'gpt2' is not supported" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- options at the call
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "bogus"}, r"unknown verify policy 'bogus'"),
        ({"policy": "fixed:x"}, r"fixed:N"),
        ({"block_size": 0}, r"block_size must be None or an int >= 1"),
        ({"block_size": 2.5}, r"block_size must be None or an int >= 1"),
        ({"sps": "fast"}, r"sps must be None, a mapping"),
        ({"lookup": 1}, r"lookup must be True or False"),
    ],
)
def test_dspark_options_refuses_a_bad_spec_at_the_call(kwargs, message):
    """A bad option fails when dspark_options(...) is called, before (and without) any `with`."""
    with pytest.raises(ValueError, match=message):
        dspark_options(**kwargs)


def test_options_and_stats_never_entered_warn():
    """A plain call (no `with`) changes nothing, so it says so instead of passing silently."""
    with pytest.warns(UserWarning, match=r"dspark_options\(\.\.\.\) was created but never entered"):
        dspark_options(policy="full")
    with pytest.warns(UserWarning, match=r"collect_stats\(\) was created but never entered"):
        collect_stats()


def test_options_in_a_with_block_do_not_warn_and_nest(tiny, recwarn):
    """Entered objects never warn; nested blocks restore the outer options; the parsed policy reaches generate()."""
    target, drafter_dir = tiny
    drafter = AutoModel.from_pretrained(drafter_dir)
    with dspark_options(policy="fixed:1", lookup=False), collect_stats() as outer:
        with dspark_options(policy="fixed:2", lookup=False), collect_stats() as inner:
            _generate(target, drafter, max_new_tokens=8)
        _generate(target, drafter, max_new_tokens=8)
    assert {r.drafted for r in inner[-1].rounds} == {2}
    assert len(outer) == 1 and {r.drafted for r in outer[-1].rounds} == {1}
    assert not [w for w in recwarn if "never entered" in str(w.message)]


def test_one_generate_checks_and_binds_once(tiny, monkeypatch):
    """generate() checks the request (and binds an unbound drafter) once, in the candidate generator."""
    import dspark.generation.candidate_generator as cg

    target, drafter_dir = tiny
    drafter = AutoModel.from_pretrained(drafter_dir)
    checks, binds = [], []
    real_check, real_bind = cg.check_drafter, type(drafter).bind_target
    monkeypatch.setattr(cg, "check_drafter", lambda *a, **k: checks.append(a[3:]) or real_check(*a, **k))
    monkeypatch.setattr(type(drafter), "bind_target", lambda self, t: binds.append(t) or real_bind(self, t))
    with dspark_options(policy="fixed:2", lookup=False):
        _generate(target, drafter, max_new_tokens=6)
    assert len(checks) == 1 and binds == [target]
    _generate(target, drafter, max_new_tokens=6)  # bound now: checked again, not re-bound
    assert len(checks) == 2 and binds == [target]
