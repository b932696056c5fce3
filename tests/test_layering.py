"""Every package imports only downward, read from the import statements with ``ast`` (nothing is imported).

Layers, lowest first: ``dspark.generation`` (decoding, which knows a drafter only by the methods it calls; its source
is the top-level folder generation/), ``modeling_dspark`` (the model, whose package installs the ``generate()`` hook
that returns ``dspark.generation``'s candidate generator: transformers' models sit above ``transformers.generation``
the same way), ``dspark.training``, ``dspark.evaluation``; ``dspark.cli``, the page (``app.py``,
``dspark.app_render``) and what they share (``dspark.pairing``: which target a drafter is for, loading both) may
import any of them. A module may import its own package and any lower layer, at module level or inside a function
alike: a lazy import upward is still a dependency upward. The namespace package ``dspark`` itself imports none of
them.

No module takes part in an import cycle (the same imports, as a graph): a circle means two modules that should be one,
or a piece of one that belongs elsewhere.

Inside ``dspark.generation`` the batched engine and the drafting round sit below the ``generate()`` adapter
(``candidate_generator``, ``integration``), and only the engine uses its packed target (``packed_target``).

Module names are the installed ones: each package's folder comes from pyproject.toml (``package-dir``).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYER = {"dspark.generation": 0, "modeling_dspark": 1, "dspark.training": 2, "dspark.evaluation": 3, "dspark.cli": 4,
         "dspark.app_render": 4, "dspark.pairing": 4, "app": 4}
"""Layer of each package or module (``dspark``'s subpackages, the other top-level names); a higher layer may import
a lower one."""
TOP = max(LAYER.values())
ROOT = "dspark"
"""The namespace package: it holds the layers above and imports none of them."""

GENERATE_ADAPTER = {"dspark.generation.candidate_generator", "dspark.generation.integration"}
"""The ``generate()`` adapter: modules of ``dspark.generation`` that nothing else in ``dspark.generation`` may import,
but each other."""
ENGINE_ONLY = {"dspark.generation.packed_target": {"dspark.generation.engine"}}
"""Modules of ``dspark.generation`` and the only modules of ``dspark.generation`` that may import them (the engine's
packed target: the engine; :mod:`dspark.evaluation.profiling`, a layer above, times its batched verify)."""

APART = {("dspark.evaluation", "dspark.training.calibration")}
"""(package, module) pairs that may not meet although the layers allow it: measuring does not depend on fitting."""


class Import(NamedTuple):
    importer: str  # dotted module name of the importing file
    module: str  # dotted module imported (a from-import's module; relative imports resolved)
    name: str | None  # the name a from-import takes, else None
    line: int

    def __str__(self):
        what = f"{self.module}.{self.name}" if self.name else self.module
        return f"{self.importer}:{self.line} imports {what}"


def package_dirs() -> dict[str, Path]:
    """The folder of each installed package, as pyproject.toml's setuptools table maps it."""
    with open(REPO / "pyproject.toml", "rb") as f:
        tool = tomllib.load(f)["tool"]["setuptools"]
    mapped = tool.get("package-dir", {})
    return {pkg: REPO / mapped.get(pkg, pkg.replace(".", "/")) for pkg in tool["packages"]}


def module_files() -> dict[str, tuple[Path, bool]]:
    """``{dotted module name: (file, is a package's __init__)}`` for the namespace root and every layer."""
    dirs = package_dirs()
    found = {ROOT: (dirs[ROOT] / "__init__.py", True)}
    for name in LAYER:
        if name in dirs:  # a package: every module under its folder
            for path in sorted(dirs[name].rglob("*.py")):
                parts = path.relative_to(dirs[name]).with_suffix("").parts
                is_package = parts[-1] == "__init__"
                found[".".join((name, *(parts[:-1] if is_package else parts)))] = (path, is_package)
        else:  # a module: in its parent package's folder (dspark.app_render), or at the root (app.py)
            parent, _, leaf = name.rpartition(".")
            found[name] = ((dirs[parent] if parent else REPO) / f"{leaf}.py", False)
    return found


def imports() -> list[Import]:
    """Every import statement of the library, the CLI and the page, at any depth (function bodies included)."""
    found = []
    for importer, (path, is_package) in module_files().items():
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
    for importer, (path, _) in module_files().items():
        if _package(importer) == "modeling_dspark":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "_target":
                found.append(f"{importer}:{node.lineno} reads {ast.unparse(node)}")
    return found


def _package(module: str) -> str:
    """The layer a dotted module belongs to: ``dspark.<sub>`` inside the namespace, else its top-level name."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == ROOT and len(parts) > 1 else parts[0]


def _imported(imp: Import) -> str:
    """The module ``imp`` reaches: a from-import of the namespace ``dspark`` reaches the subpackage it names."""
    return f"{ROOT}.{imp.name}" if imp.module == ROOT and imp.name else imp.module


def violation(imp: Import) -> str | None:
    """Why ``imp`` breaks the layering, or None."""
    src, dst = _package(imp.importer), _package(_imported(imp))
    if src == ROOT and dst in LAYER | {ROOT: 0}:
        return f"the namespace package {ROOT} may not import {_imported(imp)}"
    if dst not in LAYER or src not in LAYER:
        return None
    if src != dst and LAYER[src] < TOP and LAYER[dst] >= LAYER[src]:
        return f"{src} (layer {LAYER[src]}) may not import {dst} (layer {LAYER[dst]})"
    # `from dspark.training import calibration`, or the namespace's from-import of `training`
    named = {imp.module, _imported(imp)} | ({f"{imp.module}.{imp.name}"} if imp.name else set())
    if any(src == p and any(n == m or n.startswith(m + ".") for n in named) for p, m in APART):
        return f"{src} may not import {imp.module}"
    if src == dst == "dspark.generation":
        # a from-import of the package itself names a submodule: `from dspark.generation import integration`
        targets = {imp.module} | ({f"{imp.module}.{imp.name}"} if imp.module == "dspark.generation" else set())
        if targets & GENERATE_ADAPTER and imp.importer not in GENERATE_ADAPTER | {"dspark.generation"}:
            return "only the generate() adapter and the package's __init__ may import the adapter"
        for module, users in ENGINE_ONLY.items():
            if module in targets and imp.importer not in users:
                return f"only {', '.join(sorted(users))} may import {module}"
    return None


def test_every_installed_module_has_a_layer():
    """Every module of the installed packages is read here: a new subpackage or module needs its layer."""
    read = {path for path, _ in module_files().values()}
    installed = {p for folder in package_dirs().values() for p in folder.rglob("*.py")}
    assert installed - read == set(), "modules in no layer (add them to LAYER)"


def test_the_parser_sees_the_packages():
    found = imports()
    assert {_package(i.importer) for i in found} >= set(LAYER) - {"dspark.app_render"}
    # a relative import resolves to its absolute module
    assert any(i.importer == "dspark.generation.integration" and i.module == "dspark.generation.policies"
               for i in found)
    # nothing imports the old top-level names
    old = {"generation", "training", "evaluation", "dspark_cli", "app_render"}
    assert not [str(i) for i in found if i.module.split(".")[0] in old]


def test_every_package_imports_only_downward():
    bad = [f"{imp}: {why}" for imp in imports() if (why := violation(imp))]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_private_target_reads_outside_the_model():
    assert not private_target_reads()


def test_options_do_not_take_their_base_from_the_statistics():
    assert not [imp for imp in imports() if imp.module == "dspark.generation.stats" and imp.name == "ScopedValue"]


@pytest.mark.parametrize("imp, allowed", [
    (Import("dspark.generation.round", "modeling_dspark.target", "x", 1), False),
    (Import("dspark.generation.integration", "modeling_dspark", "DSparkDraftModel", 1), False),
    (Import("modeling_dspark", "dspark.generation.integration", "x", 1), True),
    (Import("modeling_dspark.target", "dspark.evaluation.profiling", "x", 1), False),
    (Import("modeling_dspark.target", "dspark", "evaluation", 1), False),
    (Import("dspark.generation.costs", "dspark.evaluation.profiling", "x", 1), False),
    (Import("dspark.generation.engine", "dspark.training.data", "x", 1), False),
    (Import("dspark.generation.engine", "dspark", "training", 1), False),
    (Import("dspark.training.trainer", "dspark.evaluation.acceptance", "x", 1), False),
    (Import("dspark.evaluation.eval_sets", "dspark.training.prompts", "x", 1), True),
    (Import("dspark.evaluation.eval_sets", "dspark.training.calibration", "x", 1), False),
    (Import("dspark.evaluation.eval_sets", "dspark.training", "calibration", 1), False),
    (Import("dspark.cli.main", "dspark.evaluation.serving", "x", 1), True),
    (Import("dspark.cli.main", "dspark", "evaluation", 1), True),
    (Import("app", "dspark.cli.common", "x", 1), True),
    (Import("app", "dspark.app_render", "x", 1), True),
    (Import("dspark.app_render", "dspark.generation.stats", "x", 1), True),
    (Import("dspark", "dspark.generation", "x", 1), False),
    (Import("dspark", "modeling_dspark", "x", 1), False),
    (Import("dspark", "importlib.metadata", "version", 1), True),
    (Import("dspark.generation.engine", "dspark.generation.integration", "x", 1), False),
    (Import("dspark.generation.engine", "dspark.generation", "integration", 1), False),
    (Import("dspark.generation.integration", "dspark.generation.candidate_generator", "x", 1), True),
    (Import("dspark.generation.round", "dspark.generation.packed_target", "x", 1), False),
    (Import("dspark.generation.engine", "dspark.generation.packed_target", "x", 1), True),
])
def test_the_rules(imp, allowed):
    assert (violation(imp) is None) == allowed


def import_graph() -> dict[str, set[str]]:
    """``{module: the modules of the library it imports}`` over :func:`imports` (every depth, relative imports
    resolved): ``import a.b`` reaches ``a.b``; ``from a import b`` reaches the module ``a.b`` where there is one, else
    ``a`` (a package: its ``__init__``). Parent packages that an import runs first are not counted."""
    known = set(module_files())
    graph: dict[str, set[str]] = {m: set() for m in known}
    for imp in imports():
        sub = f"{imp.module}.{imp.name}" if imp.name else None
        dst = sub if sub in known else imp.module
        while dst and dst not in known:  # `import a.b.c` of a name inside a module: the module
            dst = dst.rpartition(".")[0]
        if dst and dst != imp.importer:
            graph[imp.importer].add(dst)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_module_is_part_of_an_import_cycle():
    """No module of the library (``dspark``, its source folder generation/, ``modeling_dspark``) nor of the page
    reaches itself through its imports, at module level or inside a function alike."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set(), "c": {"d"}, "d": {"c", "a"}}) == [["c", "d"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    # a relative from-import of a submodule reaches the submodule, not the package
    assert "dspark.training.code_stubs" in graph["dspark.training.prompts"]
    assert "dspark.generation.policies" in graph["dspark.generation.integration"]
