"""The seams between the project's modules, read from the source with `ast` (nothing is imported):

- imports run one way, down the layers of ``LAYERS``: the shared modules, the model, sampling, the pipeline,
  export, the serve runtime, the checks, the HTTP API, deployment, then training and importing, with the CLI
  on top. An import inside a function counts, and so does a look-up by name (a string that names a project
  module, as ``importlib.import_module`` or a registry takes it);
- no import cycle among the modules of ldlm, ldlm.export and ldlm.serve, counting the imports written
  inside functions too (an import moved into a function hides a cycle, it does not remove it);
- every import inside a function says why it is there (a comment on its line or just above), since
  only optional dependencies (TensorRT, Ray, ONNX Runtime...) and the CLI's lazy loading have a reason
  to be imported late.
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import REPO

ROOT = REPO
# the fixed layout installs export/ and serve/ under the ldlm namespace (pyproject's package-dir)
PACKAGE_DIRS = {"ldlm": "ldlm", "export": "ldlm.export", "serve": "ldlm.serve"}


# Bottom first. A module may import its own layer and those below, never one above. ``ldlm`` itself (the
# package's face: the version, and the public names loaded on first use) is on top, and below it only
# ``from ldlm import __version__`` is allowed.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ldlm.files", "ldlm.limits", "ldlm.interrupts", "ldlm.device", "ldlm.buckets"),
    ("ldlm.model",),
    ("ldlm.sampling",),
    ("ldlm.pipeline",),
    ("ldlm.export",),
    ("ldlm.serve.runtime",),
    ("ldlm.serve.checks",),
    ("ldlm.serve.api",),
    ("ldlm.serve.deploy",),
    ("ldlm.training", "ldlm.importing"),
    ("ldlm.cli", "ldlm.serve", "ldlm"),
)


def layer(module: str) -> int:
    """The index in LAYERS of the longest prefix that holds ``module``; a module in none is an error."""
    found = [
        (len(prefix), i) for i, prefixes in enumerate(LAYERS) for prefix in prefixes if module == prefix or module.startswith(prefix + ".")
    ]
    assert found, f"{module} is in no layer of LAYERS: add it where it belongs"
    return max(found)[1]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts[0] = PACKAGE_DIRS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for top in PACKAGE_DIRS if (root / top).is_dir() for p in sorted((root / top).rglob("*.py"))}


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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = project_files(root)
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


def is_version_import(node: ast.AST) -> bool:
    return isinstance(node, ast.ImportFrom) and node.module == "ldlm" and [a.name for a in node.names] == ["__version__"]


def logger_names(tree: ast.Module) -> set[int]:
    """The ids of the string constants given to logging.getLogger: a logger's name, not a look-up."""
    return {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
        for arg in node.args
    }


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import of a higher layer, as "file:line: a -> b (how)"; statements anywhere in a file count, and
    strings that name a project module (a look-up by name) too."""
    files = project_files(root)
    found = []
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        loggers = logger_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not is_version_import(node):
                targets, how = set(imported_modules(node, set(files))), "import"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value and id(node) not in loggers:
                # dotted: a bare "ldlm" is the project's name (a mapping, a model, an owner), never a look-up
                targets, how = {node.value} & set(files), "by name"
            else:
                continue
            found += [
                f"{path.relative_to(root)}:{node.lineno}: {name} -> {target} ({how})"
                for target in sorted(targets)
                if target != name and layer(target) > layer(name)
            ]
    return found


def test_imports_run_down_the_layers() -> None:
    upward = upward_imports()
    assert not upward, "imports of a higher layer (pass what is needed in instead):\n" + "\n".join(upward)


@pytest.mark.parametrize(
    "planted",
    [
        "from ldlm.serve.api.server import app\n",
        "def later():\n    import ldlm.serve.runtime.scheduler  # lazily\n",
        'import importlib\n\ndef later():\n    return importlib.import_module("ldlm.cli")\n',
        "import ldlm\n",
    ],
    ids=["top-level", "inside a function", "by name", "the package face"],
)
def test_an_upward_import_planted_in_the_model_is_found(tmp_path: Path, planted: str) -> None:
    """The check itself: a copy of the tree whose model imports the serve API, the runtime inside a
    function, or the CLI by name is refused, naming the file and both modules."""
    for top in PACKAGE_DIRS:
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    assert upward_imports(tmp_path) == []
    (tmp_path / "ldlm" / "model" / "planted.py").write_text(planted)
    found = upward_imports(tmp_path)
    assert len(found) == 1 and found[0].startswith("ldlm/model/planted.py:") and "ldlm.model.planted -> " in found[0]


def test_every_module_is_in_a_layer() -> None:
    assert all(isinstance(layer(name), int) for name in project_files())


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    """The finder itself, on graphs whose answer is known by hand."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "d"}, "b": set(), "d": {"d2"}, "d2": {"d"}}) == ["d", "d2", "d"]


def test_the_graph_sees_imports_inside_functions() -> None:
    """The CLI loads its stages inside its commands: those edges must be in the graph."""
    graph = import_graph()
    assert "ldlm.pipeline" in graph["ldlm.cli.model"]
    assert "ldlm.model.config" in graph["ldlm.model.ldlm"]


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
