"""Benchmark: target tokens/s of `dspark data build`'s generation against the batch size.

``dspark data build`` answers prompts with :func:`dspark.training.data.generate_responses`: one plain batched, greedy
``target.generate()`` per batch (left padding, KV cache), prompts sorted by length within a shard. This script
times it on the same ShareGPT prompts (sorted by length, as the build does) for each ``--batch-sizes`` value and
dtype, after one warm-up call, and reports new tokens/s (tokens up to and including EOS; the rest of a finished
row's steps are the cost of batching).

    python benchmarks/bench_data_build.py --batch-sizes 16,32,64,128 --dtypes bfloat16,float32 --threads 2 \\
        --out benchmarks/results/data-build.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="16,32,64,128")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--prompts", type=int, default=128, help="prompts timed per setting")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    from dspark.evaluation.profiling import cpu_model
    from modeling_dspark.target import apply_chat_template, load_target
    from dspark.training import prompts as P
    from dspark.training.data import eos_token_ids, generate_responses

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for dtype_name in args.dtypes.split(","):
        target, tok = load_target(None, dtype=getattr(torch, dtype_name))
        ids = [apply_chat_template(tok, r["prompt"]) for r in P.iter_train_prompts("sharegpt", 0, 4 * args.prompts)]
        ids = sorted((i for i in ids if len(i) <= 256), key=len)[: args.prompts]
        eos, pad = eos_token_ids(target, tok), tok.pad_token_id if tok.pad_token_id is not None else 0
        generate_responses(target, ids[:8], 8, pad, eos)  # warm-up
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            t0, new = time.perf_counter(), 0
            for b in range(0, len(ids), bs):
                new += sum(len(r) for r in generate_responses(target, ids[b:b + bs], args.max_new_tokens, pad, eos))
            wall = time.perf_counter() - t0
            rows.append({"dtype": dtype_name, "batch_size": bs, "new_tokens": new, "wall_s": round(wall, 2),
                         "tokens_per_s": round(new / wall, 1)})
            print(json.dumps(rows[-1]), flush=True)
    out = {"prompts": len(ids), "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
           "cpu_model": cpu_model(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("| dtype | batch | tokens/s |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch_size']} | {r['tokens_per_s']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
