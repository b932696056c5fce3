"""The benchmark scripts: each answers ``--help``, none imports another (they share :mod:`benchmarks.common` and
:mod:`benchmarks.stats`), the statistics give known values and NaN for the empty case, the committed results still
render and compare, and one tiny run of ``bench_transformers.py`` on the real target."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
SHARED = ("__init__", "common", "stats")
"""The modules of benchmarks/ that are not scripts: what the scripts share."""


def is_script(path: Path) -> bool:
    """A file with a ``main()`` or an ``if __name__ == "__main__":`` block."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body) or any(
        isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


SCRIPTS = sorted(p for p in BENCH.glob("*.py") if is_script(p))


def load(name: str):
    """Import ``benchmarks/<name>.py`` from its file (as the tests of paired_eval and tau_scaling do)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth: ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a`` and
    ``a.b``; a relative import is taken inside benchmarks/ (``from . import x``: ``benchmarks.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = ("benchmarks" + ("." + node.module if node.module else "")) if node.level else node.module
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return found


def test_the_scripts_are_found():
    names = {p.stem for p in SCRIPTS}
    assert {"bench_generate", "bench_default", "bench_transformers", "compare_commits", "paired_eval"} <= names
    assert not names & set(SHARED)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_help(script):
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_no_script_imports_another():
    """A script imports the shared modules only; either way of naming another script (``benchmarks.x``, or ``x``
    from the script's own folder) is an import of it."""
    scripts = {p.stem for p in SCRIPTS}
    bad = []
    for path in sorted(BENCH.glob("*.py")):
        for module in imported_modules(path):
            parts = module.split(".")
            name = parts[1] if parts[0] == "benchmarks" and len(parts) > 1 else parts[0]
            if name in scripts and name != path.stem:
                bad.append(f"{path.name} imports {module}")
    assert not bad


def test_the_shared_modules_are_used():
    users = {p.stem for p in SCRIPTS if {"benchmarks.stats", "benchmarks.common"} & imported_modules(p)}
    assert {"bench_generate", "bench_default", "bench_transformers", "bench_proposers", "bench_chooser",
            "compare_commits", "paired_eval", "tau_gap", "tau_scaling"} <= users


def test_no_script_shadows_a_shared_name():
    """A name a script takes from benchmarks.stats or benchmarks.common is not rebound in it (a local ``stats`` or
    ``paired`` would hide the function where the script calls it)."""
    bad = []
    for path in SCRIPTS:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        shared = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  and (n.module or "").startswith("benchmarks") for a in n.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in shared:
                bad.append(f"{path.name}:{node.lineno} rebinds {node.id}")
            elif isinstance(node, ast.arg) and node.arg in shared:
                bad.append(f"{path.name}:{node.lineno} takes an argument {node.arg}")
    assert not bad


def test_no_stale_drafter_paths():
    """The shipped drafters live at modeling_dspark/drafters/<name>; every default drafter path resolves."""
    for path in SCRIPTS:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.startswith("drafters/"), f"{path.name}: {node.value!r}"
    chooser = load("bench_chooser").parse_args(["--base", "."])
    assert (Path(chooser.head) / chooser.drafter / "config.json").is_file()
    assert Path(chooser.out).parent.is_dir()


# ---------------------------------------------------------------------------------------------------- statistics
def test_sign_test():
    from benchmarks import stats

    assert stats.sign_test(10, 10) == pytest.approx(2 / 1024)
    assert stats.sign_test(4, 5) == pytest.approx(0.375)
    assert stats.sign_test(2, 4) == pytest.approx(1.0)
    assert stats.sign_test(9, 10, "greater") == pytest.approx(11 / 1024)  # one-sided: 9 or more of 10
    assert stats.sign_test(0, 5, "greater") == pytest.approx(1.0)
    assert math.isnan(stats.sign_test(0, 0))  # the empty case: no pairs, no test
    with pytest.raises(ValueError, match="0 <= wins <= n"):
        stats.sign_test(4, 3)


def test_paired():
    from benchmarks import stats

    nan = float("nan")
    r = stats.paired([3, 2, nan, 1, 5], [1, 2, 4, 2, 4])  # the NaN pair is dropped, the tie too (from the test)
    assert (r["pairs"], r["won"], r["lost"], r["ties"]) == (4, 2, 1, 1)
    assert r["mean_delta"] == pytest.approx(0.5) and r["p"] == pytest.approx(1.0)
    assert stats.paired([2, 3, 4], [1, 1, 1], "greater")["p"] == pytest.approx(1 / 8)
    for empty in (stats.paired([], []), stats.paired([nan], [1.0]), stats.paired([1.0, 2.0], [1.0, 2.0])):
        assert math.isnan(empty["p"])
    assert math.isnan(stats.paired([], [])["mean_delta"])
    assert stats.paired_ratios([2, 4, nan], [3, 2, 1]) == [1.5, 0.5]
    with pytest.raises(ValueError, match="differ in number"):
        stats.paired([1.0], [1.0, 2.0])


def test_means():
    from benchmarks import stats

    assert stats.geometric_mean([2.0, 0.5]) == pytest.approx(1.0)
    assert stats.geometric_mean([1.0, 4.0]) == pytest.approx(2.0)
    assert stats.harmonic_mean([1.0, 4.0]) == pytest.approx(1.6)
    # rates weighted by the work: total tokens over total seconds
    assert stats.harmonic_mean([10.0, 20.0], [100, 100]) == pytest.approx(200 / 15)
    assert math.isnan(stats.geometric_mean([])) and math.isnan(stats.harmonic_mean([]))


def test_tau_pairs_keep_their_keys():
    from benchmarks.common import tau_pairs

    r = tau_pairs([2.0, 1.5, float("nan")], [1.0, 2.0, 1.0])
    assert r == {"mean_delta": pytest.approx(0.25), "won": 1, "lost": 1, "batches": 2, "p": pytest.approx(1.0)}


# ---------------------------------------------------------------------------------------------- committed results
def committed(key: str, values: set[str]) -> list[Path]:
    found = []
    for path in sorted((BENCH / "results").rglob("*.json")):
        text = path.read_text(encoding="utf-8")
        if any(f'"{key}": "{v}"' in text for v in values):
            found.append(path)
    return found


def test_committed_results_render():
    """Every committed result of a script that renders its table renders again from the JSON alone (but the four
    bench_generate.py results written before it counted faster passes: the table has needed that key since)."""
    scripts = {"generate": "bench_generate", "default": "bench_default", "proposers": "bench_proposers",
               "transformers": "bench_transformers"}
    modules = {b: load(s) for b, s in scripts.items()}
    paths = committed("benchmark", set(scripts))
    assert paths
    for path in paths:
        result = json.loads(path.read_text(encoding="utf-8"))
        if result.get("benchmark") == "generate" and not all("faster_passes" in g for g in result["generate"]):
            continue
        if result.get("benchmark") in modules:
            assert modules[result["benchmark"]].markdown(result), path


def test_committed_before_after_reports_compare_again():
    """compare_commits.py's reports: the stored runs give the stored table again (but a metric whose repetitions
    all tied now has NaN for its sign test, where 1.0 was written)."""
    cc = load("compare_commits")
    paths = committed("bench", {"generate", "serve", "default"})
    assert paths
    for path in paths:
        report = json.loads(path.read_text(encoding="utf-8"))
        table, _ = cc.compare(report["bench"], report["runs"])
        assert table.keys() >= report["metrics"].keys(), path  # older reports lack the later "/ none" ratios
        for name, old in report["metrics"].items():
            row = table[name]
            assert row.keys() == old.keys()
            assert (row["after_faster"], row["n"]) == (old["after_faster"], old["n"])
            if all(r == 1 for r in row["per_rep"]):  # every repetition tied (τ often does): no test, NaN (was 1.0)
                assert math.isnan(row["sign_p_two_sided"])
            else:
                assert row["sign_p_two_sided"] == pytest.approx(old["sign_p_two_sided"])
            assert row["per_rep"] == pytest.approx(old["per_rep"])


def test_committed_chooser_reports_summarize_again():
    """bench_chooser.py's reports: their raw times give the stored per-arm rows again."""
    bc = load("bench_chooser")
    paths = committed("benchmark", {"bench_chooser"})
    assert paths
    for path in paths:
        report = json.loads(path.read_text(encoding="utf-8"))
        times = {(key, int(i)): v for k, v in report["raw_times"].items() for key, i in [k.rsplit("|", 1)]}
        units = [{"id": u["id"]} for u in report["results"][0]["per_unit"]]
        rows = bc.summarize(times, units, [r["arm"] for r in report["results"]])
        for row, old in zip(rows, report["results"]):
            assert row.keys() == old.keys()
            for key, value in old.items():
                assert row[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key


# ---------------------------------------------------------------------------------------------------- smoke run
@pytest.mark.slow
def test_bench_transformers_smoke(tmp_path):
    """One prompt per domain, 4 new tokens, float32, one thread, the default SmolLM2 target: the JSON has its keys
    and every arm's float32 output equals plain decoding."""
    out = tmp_path / "t.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH / "bench_transformers.py"), "--per-domain", "1",
                           "--max-new-tokens", "4", "--dtypes", "float32", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"benchmark", "date", "code", "command", "machine", "processor", "transformers", "threads", "target",
            "drafter", "settings", "runs", "markdown"} <= result.keys()
    assert result["benchmark"] == "transformers" and result["threads"] == 1
    (run,) = result["runs"]
    assert run["dtype"] == "float32" and set(run) == {"dtype", "domains", "macro_ratio", "per_prompt"}
    assert set(run["domains"]) == {"math", "code", "chat"} and len(run["per_prompt"]) == 3
    for x in run["domains"].values():
        assert x["prompts"] == 1
        for arm in ("plain", "dflash", "pld", "dspark"):
            assert x[arm]["identical"] == 1, (arm, x)
            assert {"tok_s", "ratio", "tau"} <= x[arm].keys()
        for arm in ("plain", "dflash", "pld"):
            vs = x[f"dspark_vs_{arm}"]
            assert vs["faster"] in (0, 1) and (vs["sign_p"] == pytest.approx(1.0) or math.isnan(vs["sign_p"]))
    assert "| float32 | math |" in result["markdown"]


def test_background_load_runs_only_inside_its_block():
    """bench_default's --background-load: the busy processes run inside the block and are gone after it, also when
    the block raises."""
    import multiprocessing

    bench = load("bench_default")
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="inside"):
        with bench.background_load(1):
            started = set(multiprocessing.active_children()) - before
            assert len(started) == 1 and all(p.is_alive() for p in started)
            raise RuntimeError("inside")
    assert not any(p.is_alive() for p in started)
    assert bench.parse_args(["--out", "x.json", "--background-load", "2"]).background_load == 2
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--background-load", "-1"])


def test_bench_default_keeps_each_finished_part(tmp_path, monkeypatch):
    """bench_default writes its JSON after every finished part, so a run stopped before its end (a lease's time
    limit) keeps what it measured: here the second dtype's load fails, and the first dtype's generate and engine
    rows are on disk."""
    import torch

    import dspark.pairing as pairing

    spec = importlib.util.spec_from_file_location("_gpu_tools", REPO / "scripts" / "gpu_tools.py")
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    tiny = tools.make_tiny(tmp_path / "tiny")
    real, loads = pairing.load_models, []

    def load_once(*args, **kwargs):
        loads.append(args)
        if len(loads) > 1:
            raise KeyboardInterrupt("stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(pairing, "load_models", load_once)
    out = tmp_path / "d.json"
    threads = torch.get_num_threads()  # main() sets the process's torch threads
    try:
        with pytest.raises(KeyboardInterrupt):
            load("bench_default").main(["--target", tiny["target"], "--drafter", tiny["drafter"], "--per-domain", "1",
                                        "--max-new-tokens", "6", "--dtypes", "float32,bfloat16", "--engine-requests",
                                        "1,2", "--engine-tokens", "4", "--engine-waves", "1", "--repeats", "1",
                                        "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["dtype"] == "float32" and set(run["engine"]) == {"1", "2"}
    assert set(run["generate"]["domains"]) == {"math", "code", "chat"}
