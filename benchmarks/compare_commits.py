"""Before/after speed of two checkouts of this repository: the same benchmark run alternately in each, paired.

Runs one benchmark command in checkout A and in checkout B, one process each, ``--repeats`` times, alternating
the order every repetition (A B, B A, A B, …) so that the machine's drift hits both alike. Each process imports its
own checkout (``PYTHONPATH`` = the checkout, run from inside it) and writes its JSON to a temporary file. Per
metric the report gives the median of each side, the paired per-repetition ratios B / A, in how many repetitions B
was faster and the two-sided sign test's p-value (``scipy.stats.binomtest``, p = 0.5).

Benchmarks:

- ``generate``: ``benchmarks/bench_generate.py`` (plain and DSpark ``generate()`` in the same process); metrics per
  dtype: DSpark tokens/s, plain tokens/s, and their ratio (the speed-up measured inside one process).
- ``serve``: ``python -m dspark.cli bench serve``; metrics per (R, policy): median total tokens/s, and each policy's
  tokens/s over ``none`` (plain decoding) in the same process where ``none`` is among the policies.
- ``default``: ``benchmarks/bench_default.py``; metrics per dtype: the default's speed over plain ``generate()`` in
  the same process, per domain and their mean (its ``--temperature`` compares sampled decoding), and drafting rounds
  per second of drafting (1000 / the mean over the three domains of ms per drafted round).

Arguments after ``--`` go to the benchmark unchanged, so both checkouts must accept them. Make a checkout of an old
commit with ``git worktree add ../dspark-old COMMIT``; both use the Python running this script, and the SPS(B)
table cache is shared (set ``DSPARK_PROFILE_DIR`` to profile once for both)::

    python benchmarks/compare_commits.py --before ../dspark-old --after . --bench generate --repeats 6 \\
        --out benchmarks/results/before-after-generate.json -- --drafter smollm2-135m-dspark \\
        --num-prompts 4 --max-new-tokens 64 --dtypes float32 --threads 2 --ranks ""
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.stats import paired, paired_ratios  # noqa: E402  (after the path: run as a script)
from benchmarks.common import code_version  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="checkout A (the old code)")
    p.add_argument("--after", required=True, help="checkout B (the new code)")
    p.add_argument("--bench", choices=("generate", "serve", "default"), required=True)
    p.add_argument("--repeats", type=int, default=6, help="processes per checkout (default: 6)")
    p.add_argument("--out", required=True, help="JSON report")
    p.add_argument("--after-args", default="", metavar="ARGS",
                   help="extra benchmark arguments for checkout B only, one string (e.g. an option A lacks)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the benchmark's own arguments")
    args = p.parse_args(argv)
    if args.bench_args[:1] == ["--"]:
        args.bench_args = args.bench_args[1:]
    for side in ("before", "after"):
        root = Path(getattr(args, side)).resolve()
        if not (root / "dspark" / "cli").is_dir() and not (root / "dspark_cli").is_dir():
            p.error(f"--{side} {root}: not a checkout of this repository (no dspark/cli/, nor dspark_cli/ of older "
                    f"commits)")
        setattr(args, side, root)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def run_once(root: Path, bench: str, bench_args: list[str]) -> dict:
    """Run the benchmark in checkout ``root``; return its JSON. Raises RuntimeError with its stderr tail."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        if bench in ("generate", "default"):
            cmd = [sys.executable, str(root / "benchmarks" / f"bench_{bench}.py"), *bench_args, "--out", str(out)]
        else:
            cli = "dspark.cli" if (root / "dspark" / "cli").is_dir() else "dspark_cli"  # older commits: dspark_cli
            cmd = [sys.executable, "-m", cli, "bench", "serve", *bench_args, "--out", str(out)]
        env = dict(os.environ, PYTHONPATH=str(root))
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"{' '.join(cmd)} failed in {root} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def metrics(bench: str, result: dict) -> dict[str, float]:
    """The numbers compared, by name."""
    if bench == "generate":
        found = {}
        for r in result["generate"]:
            d = r["dtype"] if r.get("draft_gate") in (None, True) else f"{r['dtype']} gate off"
            found[f"{d} dspark tok/s"] = r["dspark_tokens_per_s"]
            found[f"{d} plain tok/s"] = r["plain_tokens_per_s"]
            found[f"{d} dspark / plain"] = r["speedup"]
            found[f"{d} tau"] = r["tau"]
        return found
    if bench == "default":  # and drafting rounds per second of drafting (a rate: higher is faster)
        found = {f"{run['dtype']} {d} dspark / plain": x["ratio"] for run in result["runs"]
                 for d, x in [*run["generate"]["domains"].items(), ("macro", run["generate"]["macro"])]}
        for run in result["runs"]:
            ms = [x["t_draft_ms"] for x in run["generate"]["domains"].values()]
            if sum(ms):  # no domain drafted: no rate
                found[f"{run['dtype']} drafting rounds/s"] = 1000 * len(ms) / sum(ms)
        return found
    found = {f"R={r['R']} {r['policy']} tok/s": r["throughput_tok_s"] for r in result["results"]}
    for r in result["results"]:  # each policy over plain decoding in the same process, where `none` ran
        plain = found.get(f"R={r['R']} none tok/s")
        if plain and r["policy"] != "none":
            found[f"R={r['R']} {r['policy']} / none"] = r["throughput_tok_s"] / plain
    return found


def before_after(a: list[float], b: list[float]) -> dict:
    """One metric over the repetitions, before (``a``) and after (``b``): medians, the per-repetition ratios B / A,
    in how many B was higher, and the two-sided sign test (:func:`benchmarks.stats.paired`: ties dropped)."""
    ratios = paired_ratios(a, b)
    test = paired(b, a)
    return {"before_median": statistics.median(a), "after_median": statistics.median(b),
            "ratio_of_medians": statistics.median(b) / statistics.median(a), "per_rep": ratios,
            "after_faster": test["won"], "n": len(ratios), "sign_p_two_sided": test["p"]}


def compare(bench: str, runs: dict[str, list[dict]]) -> tuple[dict, str]:
    """Per metric found in every run of both sides: :func:`before_after` over the repetitions; and a markdown
    table."""
    before = [metrics(bench, r) for r in runs["before"]]
    after = [metrics(bench, r) for r in runs["after"]]
    names = [k for k in before[0] if all(k in m for m in before + after)]
    table = {k: before_after([m[k] for m in before], [m[k] for m in after]) for k in names}
    lines = ["| metric | before (median) | after (median) | after / before | after faster in | sign p |",
             "|---|---:|---:|---:|---:|---:|"]
    for k, t in table.items():
        lines.append(f"| {k} | {t['before_median']:.3g} | {t['after_median']:.3g} | {t['ratio_of_medians']:.3f}× | "
                     f"{t['after_faster']}/{t['n']} | {t['sign_p_two_sided']:.2g} |")
    return table, "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    sides = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for rep in range(args.repeats):
        order = ("before", "after") if rep % 2 == 0 else ("after", "before")
        for side in order:
            t0 = time.perf_counter()
            extra = shlex.split(args.after_args) if side == "after" else []
            runs[side].append(run_once(sides[side], args.bench, args.bench_args + extra))
            print(f"repetition {rep + 1}/{args.repeats} {side}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    table, markdown = compare(args.bench, runs)
    report = {"command": "python benchmarks/compare_commits.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "before": str(args.before), "after": str(args.after),
              "commits": {s: code_version(p) for s, p in sides.items()}, "bench": args.bench,
              "bench_args": args.bench_args, "after_args": args.after_args, "repeats": args.repeats, "metrics": table,
              "runs": runs, "markdown": markdown}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(report["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
