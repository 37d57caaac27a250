"""The seams between the project's modules, read from the source with `ast` (nothing is imported):

- no import cycle among the modules of ldlm, ldlm.export and ldlm.serve, counting the imports written
  inside functions too (an import moved into a function hides a cycle, it does not remove it);
- every import inside a function says why it is there (a comment on its line or just above), since
  only optional dependencies (TensorRT, Ray, ONNX Runtime...) and the CLI's lazy loading have a reason
  to be imported late.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import REPO

ROOT = REPO
# the fixed layout installs export/ and serve/ under the ldlm namespace (pyproject's package-dir)
PACKAGE_DIRS = {"ldlm": "ldlm", "export": "ldlm.export", "serve": "ldlm.serve"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = PACKAGE_DIRS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> dict[str, Path]:
    return {module_name(p): p for top in PACKAGE_DIRS for p in sorted((ROOT / top).rglob("*.py"))}


def imported_modules(node: ast.Import | ast.ImportFrom, known: set[str]) -> Iterator[str]:
    """The project modules one import statement loads: `from a.b import c` loads a.b.c when c is a module."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        assert node.level == 0, "relative imports are not used here"
        names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
    yield from (name for name in names if name in known)


def function_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield node


def import_graph() -> dict[str, set[str]]:
    files = project_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not (isinstance(node, ast.ImportFrom) and node.level):
                graph[name].update(m for m in imported_modules(node, set(files)) if m != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None: depth-first search with the path on a stack."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every successor is explored
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == "open":
                return stack[stack.index(successor) :] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    """The finder itself, on graphs whose answer is known by hand."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "d"}, "b": set(), "d": {"d2"}, "d2": {"d"}}) == ["d", "d2", "d"]


def test_the_graph_sees_imports_inside_functions() -> None:
    """The CLI loads its stages inside its commands: those edges must be in the graph."""
    graph = import_graph()
    assert "ldlm.pipeline" in graph["ldlm.cli.model"]
    assert "ldlm.config" in graph["ldlm.model"]


def test_no_import_cycle_among_the_project_modules() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("path", sorted(project_files().values()), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_inside_a_function_says_why(path: Path) -> None:
    lines = path.read_text().splitlines()
    unexplained = []
    for node in function_level_imports(ast.parse("\n".join(lines), str(path))):
        # the reason is on the import's own line, or on a comment line above its block of imports (blank lines
        # between groups of the block allowed)
        row = node.lineno - 2
        while row >= 0 and (not lines[row].strip() or lines[row].strip().startswith(("import ", "from "))):
            row -= 1
        above = lines[row].strip() if row >= 0 else ""
        if "#" not in lines[node.lineno - 1] and not above.startswith("#"):
            unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not unexplained, "imports inside functions without a reason:\n" + "\n".join(unexplained)
