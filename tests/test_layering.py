"""Every package imports only downward, read from the import statements with ``ast`` (nothing is imported).

Layers, lowest first: ``generation`` (decoding, which knows a drafter only by the methods it calls),
``modeling_dspark`` (the model, whose package installs the ``generate()`` hook that returns ``generation``'s
candidate generator: transformers' models sit above ``transformers.generation`` the same way), ``training``,
``evaluation``; ``dspark_cli`` and the page (``app.py``, ``app_render.py``) may import any of them. A module may
import its own package and any lower layer, at module level or inside a function alike: a lazy import upward is
still a dependency upward.

Inside ``generation`` the batched engine and the drafting round sit below the ``generate()`` adapter
(``candidate_generator``, ``integration``), and only the engine uses its packed
target (``packed_target``).

"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYER = {"generation": 0, "modeling_dspark": 1, "training": 2, "evaluation": 3, "dspark_cli": 4, "app": 4,
         "app_render": 4}
"""Layer of each top-level package or module; a higher layer may import a lower one."""
TOP = max(LAYER.values())

GENERATE_ADAPTER = {"generation.candidate_generator", "generation.integration"}
"""The ``generate()`` adapter: modules of ``generation`` that nothing else in ``generation`` may import, but each
other."""
ENGINE_ONLY = {"generation.packed_target": {"generation.engine"}}
"""Modules of ``generation`` and the only modules of ``generation`` that may import them (the engine's packed
target: the engine; :mod:`evaluation.profiling`, a layer above, times its batched verify)."""

APART = {("evaluation", "training.calibration")}
"""(package, module) pairs that may not meet although the layers allow it: measuring does not depend on fitting."""


class Import(NamedTuple):
    importer: str  # dotted module name of the importing file
    module: str  # dotted module imported (a from-import's module; relative imports resolved)
    name: str | None  # the name a from-import takes, else None
    line: int

    def __str__(self):
        what = f"{self.module}.{self.name}" if self.name else self.module
        return f"{self.importer}:{self.line} imports {what}"


def _sources() -> list[Path]:
    files = [p for pkg in LAYER if (REPO / pkg).is_dir() for p in sorted((REPO / pkg).rglob("*.py"))]
    return files + [REPO / f"{m}.py" for m in LAYER if (REPO / f"{m}.py").is_file()]


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def imports() -> list[Import]:
    """Every import statement of the library, the CLI and the page, at any depth (function bodies included)."""
    found = []
    for path in _sources():
        importer, is_package = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found += [Import(importer, alias.name, None, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative: from the importer's package, one level up per extra dot
                    base = importer.split(".")[: len(importer.split(".")) - node.level + is_package]
                    module = ".".join(base + ([module] if module else []))
                found += [Import(importer, module, alias.name, node.lineno) for alias in node.names]
    return found


def private_target_reads() -> list[str]:
    """``x._target`` reads outside ``modeling_dspark`` (the drafter's private binding to its target)."""
    found = []
    for path in _sources():
        importer, _ = _module_name(path)
        if importer.split(".")[0] == "modeling_dspark":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "_target":
                found.append(f"{importer}:{node.lineno} reads {ast.unparse(node)}")
    return found


def _package(module: str) -> str:
    return module.split(".")[0]


def violation(imp: Import) -> str | None:
    """Why ``imp`` breaks the layering, or None."""
    src, dst = _package(imp.importer), _package(imp.module)
    if dst not in LAYER or src == "tests":
        return None
    if src != dst and LAYER[src] < TOP and LAYER[dst] >= LAYER[src]:
        return f"{src} (layer {LAYER[src]}) may not import {dst} (layer {LAYER[dst]})"
    named = {imp.module} | ({f"{imp.module}.{imp.name}"} if imp.name else set())  # `from training import calibration`
    if any(src == p and any(n == m or n.startswith(m + ".") for n in named) for p, m in APART):
        return f"{src} may not import {imp.module}"
    if src == dst == "generation":
        # a from-import of the package itself names a submodule: `from generation import integration`
        targets = {imp.module} | ({f"{imp.module}.{imp.name}"} if imp.module == "generation" else set())
        if targets & GENERATE_ADAPTER and imp.importer not in GENERATE_ADAPTER | {"generation"}:
            return "only the generate() adapter and the package's __init__ may import the adapter"
        for module, users in ENGINE_ONLY.items():
            if module in targets and imp.importer not in users:
                return f"only {', '.join(sorted(users))} may import {module}"
    return None


def test_the_parser_sees_the_packages():
    found = imports()
    assert {_package(i.importer) for i in found} >= set(LAYER) - {"app_render"}
    # a relative import resolves to its absolute module
    assert any(i.importer == "generation.integration" and i.module == "generation.policies" for i in found)


def test_every_package_imports_only_downward():
    bad = [f"{imp}: {why}" for imp in imports() if (why := violation(imp))]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_private_target_reads_outside_the_model():
    assert not private_target_reads()


def test_options_do_not_take_their_base_from_the_statistics():
    assert not [imp for imp in imports() if imp.module == "generation.stats" and imp.name == "ScopedValue"]


@pytest.mark.parametrize("imp, allowed", [
    (Import("generation.round", "modeling_dspark.target", "x", 1), False),
    (Import("generation.integration", "modeling_dspark", "DSparkDraftModel", 1), False),
    (Import("modeling_dspark", "generation.integration", "x", 1), True),
    (Import("modeling_dspark.target", "evaluation.profiling", "x", 1), False),
    (Import("generation.costs", "evaluation.profiling", "x", 1), False),
    (Import("generation.engine", "training.data", "x", 1), False),
    (Import("training.trainer", "evaluation.acceptance", "x", 1), False),
    (Import("evaluation.eval_sets", "training.prompts", "x", 1), True),
    (Import("evaluation.eval_sets", "training.calibration", "x", 1), False),
    (Import("evaluation.eval_sets", "training", "calibration", 1), False),
    (Import("dspark_cli.main", "evaluation.serving", "x", 1), True),
    (Import("app", "dspark_cli.common", "x", 1), True),
    (Import("generation.engine", "generation.integration", "x", 1), False),
    (Import("generation.engine", "generation", "integration", 1), False),
    (Import("generation.integration", "generation.candidate_generator", "x", 1), True),
    (Import("generation.round", "generation.packed_target", "x", 1), False),
    (Import("generation.engine", "generation.packed_target", "x", 1), True),
])
def test_the_rules(imp, allowed):
    assert (violation(imp) is None) == allowed
