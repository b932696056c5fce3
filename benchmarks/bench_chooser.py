"""Paired, interleaved benchmark of `generate(assistant_model=drafter)` in two checkouts of this repository.

Made to decide whether a piece of the round's logic earns its keep: checkout A (``--base``) and checkout B
(``--head``) each run in their own worker process (``PYTHONPATH`` = the checkout, its code imported from there),
both loaded once, with the same target, drafter, dtype, thread count and prompts. The driver sends one prompt at a
time and alternates which worker goes first, so drift of the machine (other jobs on the cores) falls on both arms
alike; only one worker computes at a time. Per prompt and arm the time of every repetition is kept; the report gives
per prompt the median time of each arm, the ratio base / head (> 1: head faster), the sign test over prompts
(``scipy.stats.binomtest``, two-sided, p = 0.5) and the geometric mean of the ratios. Plain `generate()` runs in the
head worker in the same rotation: each arm's speed-up over plain is a ratio within one run.

Arms:

- ``default``: `generate()` with no options in both checkouts (whatever each does by default). The SPS(B) cache is
  pointed at an empty directory, so the default policy does not depend on what this machine has profiled.
- ``scheduler`` (with ``--scheduler``): ``dspark_options(policy="scheduler", sps=TABLE)`` in both, with one SPS(B)
  table (R = 1) measured once by the head worker before the timed passes.
- ``engine`` (``--engine-batch R``, instead of the two above): ``DSparkEngine(target, drafter)`` with its defaults,
  serving the prompts R at a time (one batch is one pair); plain decoding is the engine with policy ``none`` and no
  lookup.

Greedy float32 decoding is token-exact in both checkouts: every arm's output is compared with plain `generate()`.

    python benchmarks/bench_chooser.py --base ../dspark-base --head . --per-set 12 --offset 40 --repeats 2 \\
        --threads 1 --scheduler --out benchmarks/results/chooser-ab.json

Writes JSON to ``--out`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SETS = ("gsm8k", "humaneval", "mtbench")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=False, help="checkout A (the reference)")
    p.add_argument("--head", default=str(REPO_ROOT), help="checkout B (default: this one)")
    p.add_argument("--drafter", default="modeling_dspark/drafters/smollm2-135m-dspark",
                   help="drafter directory (relative to head)")
    p.add_argument("--per-set", type=int, default=12, help="prompts per eval set (gsm8k, humaneval, mtbench)")
    p.add_argument("--offset", type=int, default=40, help="skip the first OFFSET prompts of each set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed passes over all prompts")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each worker")
    p.add_argument("--scheduler", action="store_true", help="add the scheduler arm (one measured SPS(B) table)")
    p.add_argument("--engine-batch", type=int, default=0, metavar="R",
                   help="time the batched engine instead, R prompts per batch (default 0: generate())")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "chooser-ab.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- worker
def worker(args) -> None:
    """One checkout's side: read JSON commands from stdin, answer one JSON line each."""
    import torch

    from dspark.generation import dspark_options
    from modeling_dspark import DSparkDraftModel
    from modeling_dspark.target import apply_chat_template, load_target

    torch.set_num_threads(args.threads)
    target, tok = load_target(dtype=torch.float32)
    drafter = DSparkDraftModel.from_pretrained(args.drafter, target=target, dtype=torch.float32)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "profile":
            from dspark.evaluation.profiling import profile_target

            res = profile_target(target, contexts=[256], requests=[1], tokens=list(range(1, cmd["max_b"] + 1)),
                                 repeats=5)
            reply = {"sps": {str(b): v for b, v in res["tables"][256][1].items()}}
        elif cmd["op"] == "engine":
            from dspark.generation import DSparkEngine

            plain = cmd["arm"] == "plain"
            engine = DSparkEngine(target, None if plain else drafter, "none" if plain else "full", lookup=not plain,
                                  max_batch_size=len(cmd["prompts"]))
            for prompt in cmd["prompts"]:
                engine.add_request(apply_chat_template(tok, prompt), cmd["max_new_tokens"])
            t0 = time.perf_counter()
            outs = engine.run()
            reply = {"seconds": time.perf_counter() - t0, "ids": [o.output_ids for o in outs]}
        else:
            ids = torch.tensor([apply_chat_template(tok, cmd["prompt"])])
            kwargs = {"max_new_tokens": cmd["max_new_tokens"], "do_sample": False}
            t0 = time.perf_counter()
            if cmd["arm"] == "plain":
                out = target.generate(ids, **kwargs)
            elif cmd["arm"] == "default":
                out = target.generate(ids, assistant_model=drafter, **kwargs)
            else:
                sps = {int(b): v for b, v in cmd["sps"].items()}
                with dspark_options(policy="scheduler", sps=sps):
                    out = target.generate(ids, assistant_model=drafter, **kwargs)
            seconds = time.perf_counter() - t0
            reply = {"seconds": seconds, "ids": out[0, ids.shape[1]:].tolist()}
        print(json.dumps(reply), flush=True)


class Worker:
    def __init__(self, checkout: str, args, profile_dir: str):
        env = dict(os.environ, PYTHONPATH=str(Path(checkout).resolve()), DSPARK_PROFILE_DIR=profile_dir,
                   OMP_NUM_THREADS=str(args.threads))
        drafter = str((Path(args.head) / args.drafter).resolve())
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--threads", str(args.threads),
               "--drafter", drafter]
        self.proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ---------------------------------------------------------------------------------------------- driver
def git_rev(checkout: str) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_prompts(per_set: int, offset: int) -> list[dict]:
    from dspark.training.prompts import load_eval_prompts

    return [r for s in SETS for r in load_eval_prompts(s, offset + per_set)[offset:]]


def summarize(times: dict, units: list[dict], arms: list[str]) -> list[dict]:
    """Per arm: base vs head per unit (a prompt, or an engine batch; median seconds over repeats), the sign test and
    speed-ups over plain."""
    from benchmarks.stats import geometric_mean, paired, paired_ratios

    rows = []
    plain = [statistics.median(times[("plain", i)]) for i in range(len(units))]
    for arm in arms:
        base = [statistics.median(times[("base-" + arm, i)]) for i in range(len(units))]
        head = [statistics.median(times[("head-" + arm, i)]) for i in range(len(units))]
        ratios = paired_ratios(head, base)
        test = paired(base, head)  # won: head faster (base took longer)
        rows.append({
            "arm": arm, "units": len(units), "head_faster": test["won"], "base_faster": test["lost"],
            "sign_p": test["p"],
            "geomean_base_over_head": geometric_mean(ratios),
            "median_base_over_head": statistics.median(ratios),
            "base_speedup_vs_plain": geometric_mean(paired_ratios(base, plain)),
            "head_speedup_vs_plain": geometric_mean(paired_ratios(head, plain)),
            "per_unit": [{"id": pr["id"], "plain_s": p, "base_s": b, "head_s": h}
                           for pr, p, b, h in zip(units, plain, base, head)],
        })
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not args.base:
        print("--base is required", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO_ROOT))  # the driver: this checkout's prompts and statistics (not in the workers)
    prompts = load_prompts(args.per_set, args.offset)
    op, size = ("engine", args.engine_batch) if args.engine_batch else ("generate", 1)
    units = [{"id": "+".join(p["id"] for p in prompts[i : i + size]),
              "prompts": [p["prompt"] for p in prompts[i : i + size]]}
             for i in range(0, len(prompts) - size + 1, size)]  # one pair each
    arms = ["engine"] if args.engine_batch else ["default"] + (["scheduler"] if args.scheduler else [])

    def ask(w, arm, unit, max_new_tokens):
        prompt = {"prompts": unit["prompts"]} if args.engine_batch else {"prompt": unit["prompts"][0]}
        return w.ask(op=op, arm=arm, max_new_tokens=max_new_tokens, sps=sps, **prompt)

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as profile_dir:
        base, head = Worker(args.base, args, profile_dir), Worker(args.head, args, profile_dir)
        try:
            sps = None
            if args.scheduler and not args.engine_batch:
                sps = head.ask(op="profile", max_b=18)["sps"]
                print(f"SPS(B): {json.dumps({b: round(v, 1) for b, v in sps.items()})}", file=sys.stderr)
            for w in (base, head):  # warm-up: one call per arm
                for arm in arms:
                    ask(w, arm, units[0], 8)
            ask(head, "plain", units[0], 8)
            times: dict = {}
            outputs: dict = {}
            identical = {f"{side}-{arm}": 0 for side in ("base", "head") for arm in arms}
            for rep in range(args.repeats):
                for i, unit in enumerate(units):
                    order = [("plain", head, "plain")]
                    for arm in arms:
                        pair = [("base-" + arm, base, arm), ("head-" + arm, head, arm)]
                        order += pair if (rep + i) % 2 == 0 else pair[::-1]
                    for key, w, arm in order:
                        res = ask(w, arm, unit, args.max_new_tokens)
                        times.setdefault((key, i), []).append(res["seconds"])
                        outputs[(key, i)] = res["ids"]
                    for key in identical:
                        identical[key] += rep == 0 and outputs[(key, i)] == outputs[("plain", i)]
                    print(f"rep {rep + 1}/{args.repeats} unit {i + 1}/{len(units)} " + " ".join(
                        f"{k}={times[(k, i)][-1]:.2f}s" for k, _, _ in order), file=sys.stderr, flush=True)
        finally:
            base.close()
            head.close()
    rows = summarize(times, units, arms)
    report = {
        "benchmark": "bench_chooser",
        "command": " ".join(["python", "benchmarks/bench_chooser.py"] + (argv if argv is not None else sys.argv[1:])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base": {"path": str(args.base), "commit": git_rev(args.base)},
        "head": {"path": str(args.head), "commit": git_rev(args.head)},
        "config": {"drafter": args.drafter, "dtype": "float32", "greedy": True, "threads": args.threads,
                   "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "sets": SETS,
                   "per_set": args.per_set, "offset": args.offset, "engine_batch": args.engine_batch, "sps": sps,
                   "host": platform.node(),
                   "load_avg_end": os.getloadavg()},
        "identical_to_plain": {k: f"{v}/{len(units)}" for k, v in identical.items()},
        "seconds": round(time.perf_counter() - t_start, 1),
        "results": rows,
        "raw_times": {f"{k}|{i}": v for (k, i), v in times.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("| arm | pairs | head faster | base faster | sign test p | base/head (geomean) | base vs plain | "
          "head vs plain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['units']} | {r['head_faster']} | {r['base_faster']} | {r['sign_p']:.3g} | "
              f"{r['geomean_base_over_head']:.3f} | {r['base_speedup_vs_plain']:.2f}x | "
              f"{r['head_speedup_vs_plain']:.2f}x |")
    print(f"identical to plain: {report['identical_to_plain']}; wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
