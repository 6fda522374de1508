"""No import cycles inside trainflow, module by module (package by package, the order is the layers contract in
pyproject.toml, checked by lint-imports).

The graph is read from the source (ast), not by importing it: every import counts, also one inside a function,
because a cycle hidden behind a lazy import still ties the two modules together. An import inside a function is
one kept lazy on purpose (an extra, a heavy torch submodule): a comment beside it says why.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_names(src: Path, package: str) -> dict[str, Path]:
    """Every module of `package` under `src`, by dotted name (a package is its __init__.py)."""
    names = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import of `name` executes last: `name` itself, else its nearest enclosing package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (itself excluded)."""
    modules = module_names(src, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = own_package.rsplit(".", node.level - 1)[0] if node.level > 1 else own_package
                    base = f"{anchor}.{base}" if base else anchor
                # `from a import b` imports the module a.b when there is one, else the name b of module a
                imported += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                             for alias in node.names]
        targets = {t for i in imported if (t := _target(i, modules))}
        # importing a.b.c runs the __init__ of a.b first, unless the importer is inside a.b (already running)
        targets |= {package for t in targets for package in _enclosing_packages(t, modules)
                    if not (name == package or name.startswith(package + "."))}
        graph[name] = targets - {name}
    return graph


def _enclosing_packages(name: str, modules: dict[str, Path]) -> list[str]:
    parts = name.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_through(group, graph) for group in groups]


def _path_through(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest import path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group always has one


def test_trainflow_has_no_import_cycles() -> None:
    graph = import_graph(SRC, "trainflow")
    assert "trainflow.run.training" in graph["trainflow.cli"]  # lazy imports inside functions are read too
    found = cycles(graph)
    assert not found, "import cycles in src/trainflow:\n" + "\n".join(" -> ".join(c) for c in found)


def test_a_cycle_is_named(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a\n")  # imports into the cycle without being part of it
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_a_cycle_through_a_package_init_is_named(tmp_path: Path) -> None:
    """`from pkg.store.state import S` runs pkg/store/__init__.py first: a cycle through it fails at import."""
    import subprocess
    import sys

    pkg = tmp_path / "pkg"
    (pkg / "store").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "store" / "__init__.py").write_text("from pkg.store.writer import Writer\n")
    (pkg / "store" / "writer.py").write_text("from pkg.interface import Interface\n\nclass Writer(Interface): ...\n")
    (pkg / "store" / "state.py").write_text("class State: ...\n")
    (pkg / "interface.py").write_text("from pkg.store.state import State\n\nclass Interface: ...\n")
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.interface", "pkg.store", "pkg.store.writer",
                                                     "pkg.interface"]]
    failed = subprocess.run([sys.executable, "-c", "import pkg.interface"], cwd=tmp_path, capture_output=True,
                            text=True)
    assert failed.returncode == 1 and "circular import" in failed.stderr


def unexplained_inner_imports(package: Path) -> list[str]:
    """path:line of each import inside a function with no comment on its line or the line above: an import
    belongs at the top of its module, unless it keeps a heavy or optional one lazy, and then the comment says so."""
    found: dict[str, None] = {}  # a nested function's imports are walked twice: each is named once, in order
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1] and not (
                            node.lineno > 1 and lines[node.lineno - 2].lstrip().startswith("#")):
                        found[f"{path.relative_to(package.parent)}:{node.lineno}"] = None
    return list(found)


def test_every_import_inside_a_function_says_why() -> None:
    unexplained = unexplained_inner_imports(SRC / "trainflow")
    assert unexplained == [], ("imports inside functions without a comment saying why they are not at the top of "
                               "the module (move them there, or say why, e.g. '# lazy: mlflow is the mlflow "
                               "extra'):\n" + "\n".join(unexplained))


def test_an_unexplained_inner_import_is_named(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import json  # the top of the module: nothing to say\n"
        "\n"
        "def f():\n"
        "    import os\n"  # named
        "    import sys  # lazy: a reason\n"
        "    # lazy: the reason for the next line\n"
        "    from math import (\n"
        "        pi,\n"
        "    )\n"
        "    def inner():\n"
        "        from re import compile\n"  # named, once
        "\n"
        "class C:\n"
        "    async def method(self):\n"
        "        import time\n")  # named
    assert unexplained_inner_imports(pkg) == ["pkg/a.py:4", "pkg/a.py:11", "pkg/a.py:15"]


# Past validation (trainflow.config.checks.check_config) the run reads the typed config, never a DictConfig: these
# packages and modules may not import it; Hydra's side (config, cli, the report and run-directory callbacks) may.
TYPED_ONLY = ("checkpoint", "compile", "data", "distributed", "loggers", "loop", "metrics", "models", "profile",
              "optim", "tasks")


def test_the_run_reads_the_typed_config_only() -> None:
    """One representation: no signature takes `X | DictConfig`, and no module of the run imports DictConfig."""
    either = [f"{path.relative_to(SRC)}:{node.lineno}" for path in sorted((SRC / "trainflow").rglob("*.py"))
              for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.BinOp)
              and isinstance(node.op, ast.BitOr) and "DictConfig" in ast.unparse(node)]
    assert either == [], f"X | DictConfig in {either}"
    importers = [name for name, path in module_names(SRC, "trainflow").items()
                 if name.split(".")[1:2] and name.split(".")[1] in TYPED_ONLY and any(
                     isinstance(node, ast.ImportFrom) and node.module == "omegaconf"
                     and any(alias.name == "DictConfig" for alias in node.names)
                     for node in ast.walk(ast.parse(path.read_text())))]
    assert importers == [], f"modules past validation that import DictConfig: {importers}"
