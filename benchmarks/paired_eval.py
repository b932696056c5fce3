"""Benchmark: two drafters' τ on the same eval prompts, paired prompt by prompt (two ``dspark eval`` reports).

Per eval set and pooled over the sets: each prompt's τ = committed tokens / speculative rounds (from the reports'
``per_prompt`` counts), the mean Δτ (new − base) over prompts, prompts won / lost (ties dropped) and the two-sided
sign-test p-value. Both reports must come from the same prompts and options (sets, limit, block size, response
length, dtype, policy, seed, target); greedy prompts then share the target's output up to bf16 near-ties.

    python benchmarks/paired_eval.py BASE/eval.json NEW/eval.json --mode greedy --out paired.json

Writes JSON to ``--out`` (when given) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import SAME, tau_pairs  # noqa: E402  (after the path: run as a script)


def prompt_tau(mode: dict) -> list[float]:
    """τ of each prompt, in prompt order (NaN for a prompt without a round).

    Raises:
        ValueError: no ``per_prompt`` counts, or ``rounds`` and ``committed`` of different lengths.
    """
    pp = mode.get("per_prompt")
    if pp is None:
        raise ValueError("report has no per_prompt counts (written by an older dspark eval): run dspark eval again")
    if len(pp["rounds"]) != len(pp["committed"]):
        raise ValueError(f"per_prompt has {len(pp['rounds'])} rounds but {len(pp['committed'])} committed counts")
    return [c / r if r else float("nan") for c, r in zip(pp["committed"], pp["rounds"])]


def compare(base: dict, new: dict, mode: str = "greedy") -> dict:
    """``{set: paired, ..., "pooled": paired}`` (:func:`benchmarks.common.tau_pairs` over prompts) of ``new`` against
    ``base``.

    Raises:
        ValueError: the reports differ in a :data:`SAME` option, lack ``mode`` for a set, lack per-prompt counts,
            or hold different numbers of prompts for a set.
    """
    diff = [k for k in SAME if base["config"].get(k) != new["config"].get(k)]
    if diff:
        raise ValueError("reports are not paired: they differ in " + ", ".join(
            f"{k} ({base['config'].get(k)!r} vs {new['config'].get(k)!r})" for k in diff))
    out, pooled_new, pooled_base = {}, [], []
    for name in base["config"]["sets"]:
        for label, rep in (("base", base), ("new", new)):
            if mode not in rep["results"].get(name, {}):
                raise ValueError(f"the {label} report has no {mode!r} results for set {name!r}")
        a, b = prompt_tau(new["results"][name][mode]), prompt_tau(base["results"][name][mode])
        if len(a) != len(b):
            raise ValueError(f"set {name!r}: {len(b)} prompts in the base report, {len(a)} in the new one")
        out[name] = tau_pairs(a, b)
        pooled_new += a
        pooled_base += b
    out["pooled"] = tau_pairs(pooled_new, pooled_base)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="eval.json of the reference drafter")
    p.add_argument("new", help="eval.json of the drafter compared with it")
    p.add_argument("--mode", default="greedy", choices=["greedy", "sample"])
    p.add_argument("--out", default=None, help="JSON output (default: print only)")
    args = p.parse_args(argv)
    try:
        base, new = (json.loads(Path(f).read_text()) for f in (args.base, args.new))
        res = compare(base, new, args.mode)
    except (OSError, ValueError, KeyError, TypeError) as err:  # unreadable, or not two dspark eval reports
        print(f"paired_eval: error: {err}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"base": args.base, "new": args.new, "mode": args.mode,
                                              "paired": res}, indent=2))
    print(f"{args.new} against {args.base}, {args.mode}, per prompt:\n")
    print("| set | prompts | Δτ | won / lost | sign-test p |\n|---|---:|---:|---:|---:|")
    for name, v in res.items():
        print(f"| {name} | {v['batches']} | {v['mean_delta']:+.3f} | {v['won']} / {v['lost']} | {v['p']:.3g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
