"""The shape of the core, as docs/design.md draws it, checked on the source.

No import cycles among ``corelooper/`` modules (imports inside functions count too); nothing
outside ``loop.py`` reaches into a ``loop._name``; the core names no plugin package; small
functions; a loop that reads in one sitting.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

CORE = REPO / "corelooper"
MAX_FUNCTION_LINES = 60
MAX_LOOP_LINES = 350


def modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(CORE.glob("*.py")) if p.stem != "__main__"}


def imports_of(path: Path) -> set[str]:
    """corelooper modules ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("corelooper."):
                found.add(node.module.split(".")[1])
            elif node.module == "corelooper":
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("corelooper."):
                    found.add(alias.name.split(".")[1])
    return found & set(modules()) - {path.stem}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles_in_the_core():
    graph = {name: imports_of(path) for name, path in modules().items()}
    # __init__ re-exports lazily (module __getattr__); it is the package, not a layer
    graph.pop("__init__", None)
    for deps in graph.values():
        deps.discard("__init__")
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def python_files(*roots: str) -> list[Path]:
    out = []
    for root in roots:
        out += [p for p in (REPO / root).rglob("*.py") if ".venv" not in p.parts]
    return out


@pytest.mark.parametrize("root", ["corelooper", "cli", "plugins", "examples"])
def test_nothing_outside_the_loop_uses_a_private_loop_attribute(root):
    offenders = []
    for path in python_files(root):
        if path == CORE / "loop.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "loop" and node.attr.startswith("_")):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} loop.{node.attr}")
    assert offenders == []


def test_the_core_and_the_cli_import_no_plugin_package():
    offenders = []
    for path in python_files("corelooper", "cli"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                          if n.startswith("corelooper_")]
    assert offenders == []


def test_no_function_in_the_core_is_longer_than_60_lines():
    long = []
    for path in python_files("corelooper"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_loop_reads_in_one_sitting():
    assert len((CORE / "loop.py").read_text().splitlines()) < MAX_LOOP_LINES
