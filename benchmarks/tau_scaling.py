"""Benchmark: how dev-set τ grows with the training sequences, and how many it would take to reach a goal.

Fits the macro τ of ``dspark eval`` reports (``summary.tau_greedy_macro``) against the natural log of the number of
training sequences behind each drafter by least squares (``scipy.stats.linregress``), x = ln N:

    τ(N) = ȳ + b · (ln N − x̄),        N_goal = exp(x̄ + (goal − ȳ) / b)

(x̄, ȳ: the points' mean ln N and mean τ), and gives N_goal also at both ends of the slope's 90 % confidence
interval, b ± t₀.₉₅(n − 2) · s.e.(b), the line pivoting on (x̄, ȳ) (infinite where that slope is ≤ 0). Each point
is one drafter, named ``N=EVAL_JSON``; the reports must share their eval options (sets, limit, block size, policy,
response length, dtype, seed, target). The fit extrapolates a trend: it says what the recipe that made the points
would need, not what another recipe would.

    python benchmarks/tau_scaling.py 1024=A/eval.json 2918=B/eval.json 4794=C/eval.json --goal 2.1 --out fit.json

Writes JSON to ``--out`` (when given) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import SAME  # noqa: E402  (after the path: run as a script)


def fit(points: list[tuple[int, float]], goal: float) -> dict:
    """The log-linear fit of τ on sequences (module docstring).

    Args:
        points: ``(sequences, macro τ)`` per drafter, at least 3, with at least 2 distinct sequence counts.
        goal: the τ to extrapolate to.

    Returns:
        ``slope`` (b: τ per unit of ln N), ``per_doubling`` (b · ln 2), ``intercept`` (τ at N = 1), ``r2``,
        ``slope_stderr``, ``slope_ci90``, ``sequences_for_goal`` and ``sequences_for_goal_ci90`` (N_goal at the
        slope interval's ends, smaller first; ``inf`` where unreachable), and ``points``.

    Raises:
        ValueError: fewer than 3 points, fewer than 2 distinct sequence counts, a count below 1 or a τ not finite.
    """
    from scipy.stats import linregress, t

    if len(points) < 3:
        raise ValueError(f"need at least 3 drafters to fit a trend with an error, got {len(points)}")
    if any(n < 1 for n, _ in points):
        raise ValueError("sequence counts must be >= 1")
    if not all(math.isfinite(tau) for _, tau in points):
        raise ValueError("every τ must be a finite number")
    if len({n for n, _ in points}) < 2:
        raise ValueError("the drafters must differ in their sequence counts")
    xs, ys = [math.log(n) for n, _ in points], [tau for _, tau in points]
    res = linregress(xs, ys)
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    half = t.ppf(0.95, len(points) - 2) * res.stderr
    slopes = (res.slope - half, res.slope + half)

    def needed(slope: float) -> float:
        if slope <= 0:
            return math.inf
        log_n = x_mean + (goal - y_mean) / slope
        return math.exp(log_n) if log_n < 700 else math.inf

    return {"slope": res.slope, "per_doubling": res.slope * math.log(2), "intercept": res.intercept,
            "r2": res.rvalue ** 2, "slope_stderr": res.stderr, "slope_ci90": list(slopes), "goal": goal,
            "sequences_for_goal": needed(res.slope),
            "sequences_for_goal_ci90": sorted(needed(b) for b in slopes),
            "points": [{"sequences": n, "tau": tau} for n, tau in points]}


def read_points(specs: list[str]) -> list[tuple[int, float]]:
    """``(sequences, macro τ)`` from ``N=EVAL_JSON`` arguments.

    Raises:
        ValueError: a malformed argument, a report without ``summary.tau_greedy_macro``, or reports whose eval
            options differ (:data:`benchmarks.common.SAME`).
        OSError: an unreadable report.
    """
    points, configs = [], []
    for spec in specs:
        n, sep, path = spec.partition("=")
        if not sep or not (n.strip().isascii() and n.strip().isdigit()):
            raise ValueError(f"{spec!r}: expected SEQUENCES=EVAL_JSON, e.g. 1024=runs/a/eval.json")
        try:
            report = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: not JSON ({err})") from None
        tau = (report.get("summary") or {}).get("tau_greedy_macro") if isinstance(report, dict) else None
        if not isinstance(tau, (int, float)):
            raise ValueError(f"{path}: no summary.tau_greedy_macro (not a greedy dspark eval report)")
        points.append((int(n), float(tau)))
        configs.append((path, report.get("config", {})))
    first_path, first = configs[0]
    for path, cfg in configs[1:]:
        diff = [k for k in SAME if cfg.get(k) != first.get(k)]
        if diff:
            raise ValueError(f"{path} and {first_path} differ in " + ", ".join(diff) + ": their τ do not compare")
    return points


def _null_inf(value):
    """``value`` (a number or a list of numbers) with infinities as None: JSON has no infinity."""
    if isinstance(value, list):
        return [_null_inf(v) for v in value]
    return None if isinstance(value, float) and math.isinf(value) else value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("points", nargs="+", metavar="N=EVAL_JSON",
                   help="training sequences behind a drafter and its dspark eval report")
    p.add_argument("--goal", type=float, default=2.1, help="the macro τ to extrapolate to (default: 2.1)")
    p.add_argument("--out", default=None, help="JSON output (default: print only)")
    args = p.parse_args(argv)
    try:
        res = fit(read_points(args.points), args.goal)
    except (OSError, ValueError) as err:
        print(f"tau_scaling: error: {err}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fit_json = {k: _null_inf(v) for k, v in res.items()}
        Path(args.out).write_text(json.dumps({"points": args.points, "fit": fit_json}, indent=2))
    print("| sequences | macro τ | fitted |\n|---:|---:|---:|")
    for pt in res["points"]:
        print(f"| {pt['sequences']:,} | {pt['tau']:.3f} | {res['intercept'] + res['slope'] * math.log(pt['sequences']):.3f} |")
    lo, hi = res["sequences_for_goal_ci90"]
    print(f"\nτ = {res['intercept']:.3f} + {res['slope']:.3f} ln N (+{res['per_doubling']:.3f} per doubling, "
          f"r² {res['r2']:.3f}); τ {res['goal']} at N ≈ {res['sequences_for_goal']:,.0f} "
          f"({lo:,.0f} to {hi:,.0f} at the ends of the slope's 90 % interval)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
