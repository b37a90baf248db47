"""Imports between shardplan's packages run one way: no import circle between two packages,
imports made inside functions included.

The graph is read from the source with ``ast`` (every ``import`` and ``from ... import``
anywhere in a module, relative ones resolved), its nodes are the subpackages of ``shardplan/``
and its top-level modules, and its circles are the strongly connected components of more than
one node. ``plan/`` renders HTML through views ``viz/`` registers; ``make_plan``, ``check_plan``
and ``sp.auto``, which join the planner and the runtime, live in ``api/`` above both.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "shardplan"

def _node(module: str) -> str | None:
    """The graph node of a ``shardplan...`` module: its subpackage, or the top-level module."""
    parts = module.split(".")
    if parts[0] != "shardplan" or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, at any depth of its code."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def package_graph() -> dict[str, set[str]]:
    """Node -> the nodes it imports (itself excluded)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = _node(_module_name(path))
        if source is None:
            continue  # shardplan/__init__.py: the facade imports every package
        for name in _imports(path):
            target = _node(name)
            if target is not None and target != source and (
                    (ROOT / target).is_dir() or (ROOT / f"{target}.py").is_file()):
                graph.setdefault(source, set()).add(target)
        graph.setdefault(source, set())
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


LAYERS: tuple[tuple[str, ...], ...] = (
    # the bottom: the standard library (and each other) only
    ("errors", "_files", "_schema", "_format", "_version", "_traceback", "_gc"),
    ("xla", "kernels", "solver", "data"),
    ("cluster", "trace"),
    ("cost", "plan"),
    ("planner", "runtime", "viz"),
    ("api",),  # make_plan, check_plan, apply_plan, auto: where the planner meets the runtime
    ("train",),
    ("cli",),
)
"""shardplan's layers, lowest first (docs/architecture.md draws them): a package imports only
from layers below its own."""


def test_the_graph_reader_finds_imports_inside_functions_and_relative_ones() -> None:
    graph = package_graph()
    assert "viz" in graph["cli"]  # cli/main.py imports viz.terminal inside show_main
    assert "solver" in graph["planner"] and "trace" in graph["cost"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_circle_between_packages() -> None:
    found = circles(package_graph())
    assert not found, ("import circles between shardplan's packages: "
                       + "; ".join(" <-> ".join(sorted(c)) for c in found))


def test_the_planner_and_the_runtime_do_not_import_each_other() -> None:
    graph = package_graph()
    assert "runtime" not in graph["planner"] and "planner" not in graph["runtime"]
    assert {"planner", "runtime"} <= graph["api"]


def test_the_wheel_lists_every_package_and_installs_the_models_under_a_qualified_name() -> None:
    """``pyproject.toml`` names its packages (the models folder maps to ``shardplan_models``):
    the list must name every package under ``shardplan/``, and none is called ``models``."""
    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {_module_name(p.parent / "__init__.py") for p in ROOT.rglob("__init__.py")}
    assert set(config["packages"]) == on_disk | {"shardplan_models"}
    assert config["package-dir"] == {"shardplan_models": "models"}


def test_nothing_imports_the_models_folder_by_its_bare_name() -> None:
    """A user project's own ``models`` package must not be shadowed or shadow ours."""
    found = []
    for folder in ("shardplan", "models", "tests", "benchmarks"):
        for path in sorted((ROOT.parent / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom)
                         and not node.level else [])
                found += [f"{path.relative_to(ROOT.parent)}:{node.lineno}" for name in names
                          if name == "models" or name.startswith("models.")]
    assert not found, f"imports of the bare name `models`: {found}"


def test_each_package_imports_only_from_the_layers_below_it() -> None:
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    graph = package_graph()
    assert set(graph) <= set(layer), f"place {sorted(set(graph) - set(layer))} in LAYERS"
    upward = [f"{a} (layer {layer[a]}) imports {b} (layer {layer[b]})"
              for a, targets in sorted(graph.items()) for b in sorted(targets)
              if layer[b] >= layer[a] and not layer[a] == layer[b] == 0]
    assert not upward, "imports that do not go down a layer: " + "; ".join(upward)
