"""House rules read from the files (issue 50): small packages and functions a reader can hold in mind, and shipped
drafters stored in bfloat16 (each re-shipped copy stays in git history, so half the bytes matter).

Counted from the files (physical lines, ``ast`` for function spans, safetensors headers); nothing is imported.
"""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBRARY = ("modeling_dspark", "generation", "dspark/training", "dspark/evaluation")
"""The library's package folders (``generation/`` is the package ``dspark.generation``)."""
PACKAGE_LINES = {"generation": 2760, "dspark/cli": 2600}
"""The most lines a package folder's modules may hold together."""
MODULE_LINES = 600
"""The most lines of one library module."""
FUNCTION_LINES = {package: 60 for package in LIBRARY + ("dspark/cli",)}
"""The most lines of one function (decorators and docstring included) in these packages."""
LINE_CHARACTERS = 120
"""The longest line of a library or CLI module."""


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("package, limit", sorted(PACKAGE_LINES.items()))
def test_package_size(package, limit):
    total = sum(_lines(p) for p in _modules(package))
    assert total <= limit, f"{package}/ holds {total} lines, more than {limit}"


def test_module_size():
    big = [f"{p.relative_to(REPO)}: {n}" for pkg in LIBRARY for p in _modules(pkg) if (n := _lines(p)) > MODULE_LINES]
    assert not big, f"library modules over {MODULE_LINES} lines: {big}"


@pytest.mark.parametrize("package, limit", sorted(FUNCTION_LINES.items()))
def test_function_size(package, limit):
    long = []
    for path in _modules(package):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if (n := node.end_lineno - first + 1) > limit:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {limit} lines in {package}/: {long}"


@pytest.mark.parametrize("package", sorted(FUNCTION_LINES))
def test_line_length(package):
    long = [f"{p.relative_to(REPO)}:{i}" for p in _modules(package)
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > LINE_CHARACTERS]
    assert not long, f"lines over {LINE_CHARACTERS} characters in {package}/: {long}"


def test_the_counts_see_the_code():
    """The limits are checked against real files: each package has modules, and the largest is not empty."""
    for package in set(PACKAGE_LINES) | set(LIBRARY):
        assert max(_lines(p) for p in _modules(package)) > 100, package


def _safetensors_dtypes(path: Path) -> set[str]:
    """The tensor dtypes a safetensors file declares in its header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


SHIPPED = sorted((REPO / "modeling_dspark" / "drafters").glob("*/model.safetensors"))


@pytest.mark.parametrize("weights", SHIPPED, ids=[p.parent.name for p in SHIPPED])
def test_shipped_drafters_are_bfloat16(weights):
    floats = _safetensors_dtypes(weights) - {"I64", "I32", "BOOL"}
    assert floats == {"BF16"}, f"{weights.parent.name} stores {sorted(floats)}"
    assert json.loads((weights.parent / "config.json").read_text())["dtype"] == "bfloat16"


def test_there_are_shipped_drafters():
    assert {p.parent.name for p in SHIPPED} == {"smollm2-135m-dspark", "qwen2.5-coder-0.5b-dspark"}
