"""Benchmark: vLLM's CPU build against dspark on the same machine, prompts and greedy workload, in one run.

Rows (float32, greedy, SmolLM2-135M-Instruct, the same prompts for every row of a column):

- vLLM plain, and vLLM with a DFlash drafter (``"method": "dflash"``), at R = 1, 4, 16 requests in flight
  (vLLM runs in its own venv, .venv-vllm, as a subprocess of this script: ``--side vllm``);
- dspark ``generate()`` plain and with the shipped DSpark drafter at its defaults (R = 1), and with the same DFlash
  drafter vLLM serves;
- ``DSparkEngine`` plain (policy ``none``) and with the shipped drafter at its defaults, at R = 1, 4, 16.

The DFlash drafter is a seeded random one in the DFlash layout (written by ``dspark export --format dflash``): no
trained drafter in that layout ships, and the shipped DSpark drafter cannot be exported (target-style layers). So the
vLLM + DFlash rows measure what speculative decoding costs vLLM when nearly nothing is accepted, not a tuned setup.

Each column serves max(4, R) prompts (MT-Bench and GSM8K, interleaved), at most R at once; per-user tokens/s is the
mean over requests of tokens / (finish − admission), total tokens/s is all tokens / wall time. One untimed warm-up
request per engine first.

    python benchmarks/bench_vllm.py                      # writes benchmarks/results/vllm-cpu.json, prints a table
    python benchmarks/bench_vllm.py --levels 1 4 --max-new-tokens 16 --out /tmp/v.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="requests in flight (default: 1 4 16)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads on both sides (default: 2)")
    p.add_argument("--vllm-venv", default=str(REPO_ROOT / ".venv-vllm"))
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "vllm-cpu.json"))
    p.add_argument("--side", choices=("dspark", "vllm"), default="dspark", help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cell(requests: list[tuple[float, float, int]], wall: float) -> dict:
    """``requests``: (admitted, finished, tokens) per request, seconds; ``wall``: the column's wall time."""
    tokens = sum(n for _, _, n in requests)
    return {"per_user_tok_s": statistics.fmean(n / max(1e-9, f - a) for a, f, n in requests),
            "total_tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "requests": len(requests)}


# ---------------------------------------------------------------------------------------------------- vLLM side
def vllm_serve(llm, prompts: list[list[int]], concurrency: int, max_new: int) -> tuple[dict, list[list[int]]]:
    """Serve ``prompts`` through vLLM's engine loop, at most ``concurrency`` at once."""
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    queue, admitted, done, outputs = list(enumerate(prompts)), {}, [], {}
    t0 = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and len(admitted) - len(done) < concurrency:
            i, ids = queue.pop(0)
            admitted[str(i)] = time.perf_counter()
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
        for out in engine.step():
            if out.finished:
                done.append((admitted[out.request_id], time.perf_counter(), len(out.outputs[0].token_ids)))
                outputs[int(out.request_id)] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    return cell(done, wall), [outputs[i] for i in range(len(prompts))]


def vllm_side(job_file: str) -> int:
    from vllm import LLM

    job = json.loads(Path(job_file).read_text())
    result = {"vllm_version": __import__("vllm").__version__, "rows": {}, "outputs": {}}
    for name, spec in (("vLLM plain", None),
                       ("vLLM + DFlash drafter", {"method": "dflash", "model": job["dflash"],
                                                  "num_speculative_tokens": job["gamma"]})):
        t0 = time.perf_counter()
        llm = LLM(model=job["target"], dtype="float32", max_model_len=1024, seed=0, kv_cache_memory_bytes=2 << 30,
                  speculative_config=spec, disable_log_stats=False)
        start_s = time.perf_counter() - t0
        vllm_serve(llm, job["prompts"][:1], 1, 8)  # warm-up
        row = {"start_s": start_s}
        for r in job["levels"]:
            prompts = job["prompts"][: max(4, r)]
            row[str(r)], result["outputs"][f"{name} R={r}"] = vllm_serve(llm, prompts, r, job["max_new_tokens"])
        if spec is not None:
            try:
                metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
                row["spec_decode"] = {k: v for k, v in metrics.items() if "spec_decode" in k and v is not None}
            except Exception as err:  # metrics are informational only
                row["spec_decode"] = f"unavailable: {type(err).__name__}"
        result["rows"][name] = row
        del llm
    print(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------------- dspark side
def dspark_side(args) -> int:
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    import modeling_dspark as md
    from dspark.cli.main import main as cli_main
    from dspark.generation.engine import DSparkEngine
    from dspark.generation.stats import collect_stats
    from modeling_dspark.target import apply_chat_template, default_target_path, load_target
    from dspark.training.prompts import load_eval_prompts

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    target, tok = load_target(dtype=torch.float32)
    sets = [load_eval_prompts(name, 8) for name in ("mtbench", "gsm8k")]
    prompts = [apply_chat_template(tok, r["prompt"]) for pair in zip(*sets) for r in pair][: max(16, *args.levels)]
    shipped = md.DSparkDraftModel.from_pretrained("smollm2-135m-dspark").eval().bind_target(target)

    # the DFlash-layout drafter vLLM serves (seeded, random; tests/test_vllm.py makes the same kind)
    import tempfile

    from tests.test_vllm import GAMMA, dflash_drafter

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    flash = dflash_drafter(target)
    flash.save_pretrained(tmp / "trained")
    assert cli_main(["export", str(tmp / "trained"), str(tmp / "dflash"), "--format", "dflash"]) == 0
    flash.bind_target(target)

    job = {"target": str(default_target_path()), "prompts": prompts, "levels": args.levels,
           "max_new_tokens": args.max_new_tokens, "dflash": str(tmp / "dflash"), "gamma": GAMMA}
    (tmp / "job.json").write_text(json.dumps(job))
    vpy = Path(args.vllm_venv) / "bin" / "python"
    if not vpy.is_file():
        raise SystemExit(f"bench_vllm: vLLM's venv {args.vllm_venv} is absent (bash scripts/install_vllm_cpu.sh)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": "",
           "OMP_NUM_THREADS": str(args.threads), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([str(vpy), __file__, "--side", "vllm", "--job", str(tmp / "job.json")], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"bench_vllm: the vLLM side exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    vllm = json.loads(proc.stdout.strip().splitlines()[-1])
    vllm_s = time.perf_counter() - t0
    rows, outputs = dict(vllm["rows"]), dict(vllm["outputs"])

    def generate_row(name, drafter):
        target.generate(torch.tensor([prompts[0]]), assistant_model=drafter, do_sample=False, max_new_tokens=8)
        done, taus, outs = [], [], []
        t_start = time.perf_counter()
        for ids in prompts[:4]:
            t0 = time.perf_counter()
            with collect_stats() as runs:
                out = target.generate(torch.tensor([ids]), assistant_model=drafter, do_sample=False,
                                      max_new_tokens=args.max_new_tokens)
            done.append((t0, time.perf_counter(), out.shape[1] - len(ids)))
            outs.append(out[0, len(ids):].tolist())
            if runs:
                taus.append(runs[-1].tau)
        row = {"1": cell(done, time.perf_counter() - t_start)}
        outputs[f"{name} R=1"] = outs
        if taus:
            row["tau"] = statistics.fmean(taus)
        return row

    for name, drafter in (("dspark generate() plain", None),
                          ("dspark generate() + shipped DSpark drafter (defaults)", shipped),
                          ("dspark generate() + the DFlash drafter", flash)):
        rows[name] = generate_row(name, drafter)
    for name, drafter, policy in (("DSparkEngine plain (policy none)", None, "none"),
                                  ("DSparkEngine + shipped DSpark drafter (defaults)", shipped, "full")):
        engine = DSparkEngine(target, drafter, policy, lookup=drafter is not None)
        engine.add_request(prompts[0], 8)
        engine.run()  # warm-up
        row = {}
        for r in args.levels:
            engine.max_batch_size = r
            for ids in prompts[: max(4, r)]:
                engine.add_request(ids, args.max_new_tokens)
            t0 = time.perf_counter()
            outs = engine.run()[-max(4, r):]
            wall = time.perf_counter() - t0
            row[str(r)] = cell([(o.t_admitted, o.t_finished, o.num_tokens) for o in outs], wall)
            outputs[f"{name} R={r}"] = [o.output_ids for o in outs]
        rows[name] = row

    same = {k: v == outputs.get(f"vLLM plain R={k.rsplit('R=', 1)[1]}") for k, v in outputs.items()}
    result = {
        "machine": {"processor": platform.processor() or platform.machine(), "cpu_model": _cpu_model(),
                    "threads": args.threads, "load_average_before": load_before},
        "vllm_version": vllm["vllm_version"], "vllm_side_s": vllm_s,
        "max_new_tokens": args.max_new_tokens, "levels": args.levels, "dtype": "float32", "gamma": GAMMA,
        "rows": rows, "outputs_equal_vllm_plain": same, "load_average_after": os.getloadavg(),
    }
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)  # the exported drafter and the job file
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def markdown(result: dict) -> str:
    levels = [str(r) for r in result["levels"]]
    lines = ["| | " + " | ".join(f"R={r}" for r in levels) + " |", "|---|" + "---:|" * len(levels)]
    for name, row in result["rows"].items():
        cells = [f"{row[r]['total_tok_s']:.1f} / {row[r]['per_user_tok_s']:.1f}" if r in row else "–" for r in levels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n(total / per-user tokens/s)"


if __name__ == "__main__":
    ARGS = parse_args()
    sys.exit(vllm_side(ARGS.job) if ARGS.side == "vllm" else dspark_side(ARGS))
