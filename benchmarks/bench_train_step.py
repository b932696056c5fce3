"""Benchmark: seconds per `DSparkTrainer` step (forward + backward) on the default target, three ways.

* ``online, full vocab``   — the target runs on every batch; the drafter drafts over all V = 49,152 tokens;
* ``online, draft vocab``  — the target runs on every batch; the drafter drafts over N = ``--draft-vocab-size``
  tokens and the loss uses the exact reduced-vocabulary L1 (target logsumexp, `dspark/training/losses.py`);
* ``cached, draft vocab``  — the target's outputs come from a feature cache (`dspark/training/feature_cache.py`),
  no target forward.

Same batch for all three (``--batch-size`` sequences of the data, ``--anchors`` blocks each), collated inside
every timed step, bf16 autocast, one warm-up step then the median of ``--repeats``. The cache is built for just those sequences in a temporary directory.

    python benchmarks/bench_train_step.py --data data/smollm2-v1 --threads 1

Writes JSON to ``--out`` (default ``benchmarks/results/train_step.json``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a `dspark data build` directory")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "train_step.json"))
    args = p.parse_args(argv)

    import torch
    from transformers import TrainingArguments

    from modeling_dspark import DSparkConfig, DSparkDraftModel
    from dspark.training.data import load_data
    from dspark.training.feature_cache import CachedFeatureCollator, FeatureCache, build_feature_cache
    from modeling_dspark.target import load_target
    from dspark.training.trainer import DSparkCollator, DSparkTrainer, prepare_dataset, select_draft_vocab

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tok = load_target(None, dtype=torch.bfloat16)
    data = prepare_dataset(load_data(args.data))
    if len(data) < args.batch_size:
        p.error(f"--data has {len(data)} usable rows, fewer than --batch-size {args.batch_size}")
    data = data.select(range(args.batch_size))
    rows = [data[i] for i in range(len(data))]

    def drafter(vocab):
        torch.manual_seed(0)
        cfg = DSparkConfig.from_target_config(target.config, block_size=args.block_size, num_draft_layers=2,
                                              markov_rank=64, draft_vocab_size=vocab)
        d = DSparkDraftModel(cfg)
        if vocab:
            d.draft_vocab_ids.copy_(select_draft_vocab(data, vocab, always=[tok.eos_token_id]))
        return d

    def step_seconds(d, collator):
        targs = TrainingArguments(output_dir=tempfile.mkdtemp(), bf16=True, report_to="none", use_cpu=True,
                                  per_device_train_batch_size=args.batch_size)
        tr = DSparkTrainer(model=d, target=target, args=targs, train_dataset=data, data_collator=collator)
        d.train()
        times = []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            batch = collator(rows)  # collation is part of a step (the cached setting reads its memmaps here)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                tr.compute_loss(d, batch).backward()
            d.zero_grad(set_to_none=True)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times), int(batch["anchor_valid"].sum())

    online = DSparkCollator(args.block_size, args.anchors, tok.pad_token_id or 0, seed=0)
    results = []
    for name, vocab in (("online, full vocab", None), ("online, draft vocab", args.draft_vocab_size)):
        s, blocks = step_seconds(drafter(vocab), online)
        results.append({"setting": name, "s_per_step": s, "blocks": blocks})
    with tempfile.TemporaryDirectory() as tmp:
        d = drafter(args.draft_vocab_size)
        t0 = time.perf_counter()
        build_feature_cache(data, target, d.config.target_layer_ids, tmp, batch_size=args.batch_size, progress=False)
        build_s = time.perf_counter() - t0
        cache = FeatureCache(tmp, d.config.target_layer_ids, target.config.hidden_size)
        tokens = cache.meta["num_tokens"]
        s, blocks = step_seconds(d, CachedFeatureCollator(args.block_size, args.anchors, tok.pad_token_id or 0,
                                                          seed=0, cache=cache))
        results.append({"setting": "cached, draft vocab", "s_per_step": s, "blocks": blocks,
                        "cache_build_s": build_s, "cache_tokens": tokens})
    for r in results:
        r["blocks_per_s"] = r["blocks"] / r["s_per_step"]
    report = {"config": vars(args) | {"torch_threads": torch.get_num_threads()}, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("| setting | s/step | blocks/s |\n|---|---:|---:|")
    for r in results:
        print(f"| {r['setting']} | {r['s_per_step']:.2f} | {r['blocks_per_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
