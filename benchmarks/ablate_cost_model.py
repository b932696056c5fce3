"""Ablation of the cost model's draft gate in the serving engine: the same engine with and without it.

Serves the held-out prompts of `dspark bench serve` (its loading, prompt pool and serving loop,
:mod:`evaluation.serving`) with three engines, one each for the whole run (steady state): ``none`` (no
speculation), ``scheduler`` with the draft gate, ``scheduler`` without it, all three without the lookup proposer
(the gate prices the drafter alone). Repetitions are paired and interleaved:
within a repetition, at each R the three engines serve the same requests back to back, in an order rotated every
repetition, so the machine's drift hits all alike. Reports per R the median throughput of each, the per-repetition
ratios gate / no gate and each / none, in how many repetitions the first was faster, and the one-sided sign test's
p-value (:func:`evaluation.serving.sign_test_p`).

    python benchmarks/ablate_cost_model.py --dtype float32 --requests 1 2 4 --repeats 10 --max-new-tokens 16 \
        --limit 8 --min-requests 4 --threads 2 --out benchmarks/results/ablation-cost-model-fp32-r10.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

VARIANTS = ("none", "scheduler+gate", "scheduler")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped drafter)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    p.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4], help="concurrency levels R")
    p.add_argument("--datasets", nargs="+", default=["mtbench", "gsm8k"])
    p.add_argument("--limit", type=int, default=16, help="prompts per dataset")
    p.add_argument("--min-requests", type=int, default=4, help="requests per R: max(2 R, this)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup-repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "ablation-cost-model.json"))
    return p.parse_args(argv)


def _paired(a: list[float], b: list[float]) -> dict:
    from evaluation.serving import sign_test_p

    ratios = [x / y for x, y in zip(a, b)]
    faster = sum(r > 1 for r in ratios)
    return {"ratio": statistics.median(a) / statistics.median(b), "per_rep": ratios, "faster": faster,
            "n": len(ratios), "sign_p": sign_test_p(faster, len(ratios))}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from dspark_cli.common import load_models, shipped_drafter_for
    from evaluation import serving
    from generation import profiling
    from generation.engine import DSparkEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    drafter_spec = args.drafter or shipped_drafter_for(args.target)
    target, tok, drafter = load_models(args.target, drafter_spec, args.dtype)
    prompts = serving.prompt_pool(tok, args.datasets, args.limit)
    gamma = drafter.config.block_size
    levels = sorted(set(args.requests))
    context = serving.sps_context(prompts, args.max_new_tokens)
    tokens = profiling.first_use_tokens(gamma)
    sps = profiling.ensure_profile(target, contexts=[context], requests=levels, tokens=tokens,
                                   progress=lambda s: print("  " + s, file=sys.stderr))
    engines = {
        "none": DSparkEngine(target, None, "none", lookup=False),
        "scheduler+gate": DSparkEngine(target, drafter, "scheduler", sps=sps, draft_gate=True, lookup=False),
        "scheduler": DSparkEngine(target, drafter, "scheduler", sps=sps, draft_gate=False, lookup=False),
    }
    reps: dict[tuple[int, str], list[dict]] = {}
    for rep in range(-args.warmup_repeats, args.repeats):
        for li, R in enumerate(levels):
            n = max(2 * R, args.min_requests)
            shift = (rep + li) % len(VARIANTS)
            for name in VARIANTS[shift:] + VARIANTS[:shift]:
                res, _ = serving.serve(engines[name], prompts, n, R, args.max_new_tokens,
                                      first=n if rep < 0 else 0)
                tag = "warm-up" if rep < 0 else f"rep {rep + 1}/{args.repeats}"
                print(f"{tag} R={R} {name:<15} {res['throughput_tok_s']:7.2f} tok/s  tau {res['tau']:.2f}  "
                      f"skipped-draft rounds {res['skipped_draft_rounds']}/{res['rounds']}", file=sys.stderr)
                if rep >= 0:
                    reps.setdefault((R, name), []).append(res)
    rows = []
    for R in levels:
        tput = {v: [r["throughput_tok_s"] for r in reps[(R, v)]] for v in VARIANTS}
        rows.append({
            "R": R,
            "throughput": {v: statistics.median(t) for v, t in tput.items()},
            "throughput_reps": tput,
            "skipped_draft_rounds": {v: statistics.median(r["skipped_draft_rounds"] for r in reps[(R, v)])
                                     for v in VARIANTS},
            "rounds": {v: statistics.median(r["rounds"] for r in reps[(R, v)]) for v in VARIANTS},
            "gate_vs_no_gate": _paired(tput["scheduler+gate"], tput["scheduler"]),
            "gate_vs_none": _paired(tput["scheduler+gate"], tput["none"]),
            "no_gate_vs_none": _paired(tput["scheduler"], tput["none"]),
        })
    lines = ["| R | none tok/s | scheduler + gate | scheduler, no gate | gate / no gate (faster in, sign p) | "
             "gate / none (faster in, p) | no gate / none (faster in, p) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        t = row["throughput"]
        cells = [f"{c['ratio']:.2f}x ({c['faster']}/{c['n']}, p={c['sign_p']:.2g})"
                 for c in (row["gate_vs_no_gate"], row["gate_vs_none"], row["no_gate_vs_none"])]
        lines.append(f"| {row['R']} | {t['none']:.1f} | {t['scheduler+gate']:.1f} | {t['scheduler']:.1f} | "
                     + " | ".join(cells) + " |")
    table = "\n".join(lines)
    report = {
        "command": " ".join(["benchmarks/ablate_cost_model.py"] + (argv if argv is not None else sys.argv[1:])),
        "config": {"target": profiling.target_name(target), "dtype": args.dtype, "threads": torch.get_num_threads(),
                   "drafter": drafter_spec, "block_size": gamma, "datasets": args.datasets, "limit": args.limit,
                   "min_requests": args.min_requests, "max_new_tokens": args.max_new_tokens,
                   "repeats": args.repeats, "warmup_repeats": args.warmup_repeats, "requests": levels,
                   "sps_context": context, "processor": profiling.device_model(target.device),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__},
        "results": rows,
        "markdown": table,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table)
    print(f"\nJSON: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
