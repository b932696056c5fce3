"""Benchmark: the dtype `--dtype auto` picks, against a longer measurement of the same jobs.

:func:`dspark.evaluation.dtype.auto_dtype` times greedy ``generate()`` of one prompt for 32 tokens in float32 and
bfloat16 and picks the faster (float32 within 5 %). This script times the same two jobs (plain decoding, and
with the shipped drafter at its default options) longer — ``--max-new-tokens`` tokens, ``--repeats`` interleaved
runs, the fastest kept — and reports, per job, tokens/s in each dtype, the ratio bf16 / fp32 and what the short
measurement of ``auto_dtype`` picked in the same run, so a disagreement shows.

    python benchmarks/bench_dtype.py --out benchmarks/results/dtype-epyc-avx512bf16.json

Writes JSON to ``--out`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default=str(REPO_ROOT / "modeling_dspark" / "drafters" / "smollm2-135m-dspark"))
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "dtype.json"))
    args = p.parse_args(argv)

    import torch
    from transformers.utils import logging as hf_logging

    from dspark.evaluation import dtype as choice
    from dspark.evaluation import profiling

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for job, drafter in (("plain", None), ("drafter", args.drafter)):
        load = os.getloadavg()[0]
        rates = choice._time_generate(None, drafter, (torch.float32, torch.bfloat16), args.max_new_tokens,
                                         args.repeats, "cpu")
        with tempfile.TemporaryDirectory() as tmp:  # auto_dtype's own short measurement, not the user's cache
            picked, why = choice.auto_dtype(None, drafter, path=Path(tmp) / "sps.json")
        rows.append({"job": job, "tokens_per_s": rates, "bf16_over_fp32": rates["bfloat16"] / rates["float32"],
                     "auto_picks": profiling.dtype_name(picked), "auto_reason": why,
                     "load_average_before": round(load, 2)})
    result = {"processor": profiling.cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "prompt": choice.DTYPE_PROMPT,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{result['processor']}, {result['threads']} threads, {args.max_new_tokens} tokens, best of {args.repeats}")
    print("| job | float32 tok/s | bfloat16 tok/s | bf16 / fp32 | auto picks |")
    print("|---|---|---|---|---|")
    for r in rows:
        t = r["tokens_per_s"]
        print(f"| {r['job']} | {t['float32']:.1f} | {t['bfloat16']:.1f} | {r['bf16_over_fp32']:.2f}× | "
              f"{r['auto_picks']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
