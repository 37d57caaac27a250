"""Every script and module the docs run (``python scripts/X.py``, ``python -m ldlm.X``) imports only what the
README's set-up installs: the core dependencies, the extras of its ``bootstrap.sh`` line, and the extras the
entry point's own docstring names (``.[ray]`` for a mode that needs Ray).

What an entry point imports is read from the source with ``ast``: every import of its file and of each project
module it reaches, inside functions too (the paths a command takes by default import there). Each third-party
module is mapped to the distribution that installs it, and that distribution must be in the closure of those
requirements, as pip resolves them here (with the extras each requirement asks for).
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# where each importable prefix lives in a checkout (pyproject's package-dir); scripts import scripts.harness
SOURCE_DIRS = {"ldlm.export": "export", "ldlm.serve": "serve", "ldlm": "ldlm", "scripts": "scripts"}
# Subpackages that work only with an extra of their distribution: tritonclient.http needs geventhttpclient
# (tritonclient[http]), which the core's tritonclient[grpc] does not bring.
SUBPACKAGE_EXTRAS = {"tritonclient.http": "http", "tritonclient.grpc": "grpc"}
COMMAND = re.compile(r"python3? (?:-P )?(?:-m (ldlm(?:\.\w+)+)|(scripts/[\w/]+\.py))")


def documented_entry_points(docs: Iterable[Path] = DOCS) -> set[str]:
    """The modules (dotted) and scripts (paths) the docs tell users to run with python."""
    return {module or script for doc in docs for module, script in COMMAND.findall(doc.read_text())}


def source_file(module: str, root: Path = REPO) -> Path | None:
    """The checkout's file of a project module, or None when ``module`` is not one (a name imported from it)."""
    prefix = next((p for p in SOURCE_DIRS if module == p or module.startswith(p + ".")), None)
    if prefix is None:
        return None
    base = root / SOURCE_DIRS[prefix] / Path(*module[len(prefix) :].lstrip(".").split(".")) if module != prefix else root / prefix
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_names(path: Path) -> Iterator[tuple[str, int]]:
    """Every absolute import in ``path``, at any depth, as (dotted name, line); `from a import b` gives a and a.b."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module, node.lineno
            yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)


def third_party_imports(entry: Path, root: Path = REPO) -> dict[str, str]:
    """The non-project, non-stdlib modules ``entry`` and the project modules it reaches import: name -> where."""
    found: dict[str, str] = {}
    seen: set[Path] = set()
    todo = [entry]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name, line in imported_names(path):
            parts = name.split(".")
            if parts[0] in ("ldlm", "scripts"):
                todo += [f for i in range(1, len(parts) + 1) if (f := source_file(".".join(parts[:i]), root))]
            elif parts[0] not in sys.stdlib_module_names:
                found.setdefault(name, f"{path.relative_to(root)}:{line}")
    return found


def installed_closure(requirements: Iterable[str]) -> dict[str, set[str]]:
    """Each distribution pip installs for ``requirements`` (canonical name) -> the extras asked of it."""
    closure: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name, extras = canonicalize_name(requirement.name), set(requirement.extras)
        if name in closure and extras <= closure[name]:
            continue
        closure.setdefault(name, set()).update(extras)
        for line in metadata.requires(requirement.name) or []:
            needed = Requirement(line)
            if needed.marker is None or any(needed.marker.evaluate({"extra": e}) for e in {"", *closure[name]}):
                todo.append(needed)
    return closure


def project_requirements(extras: Iterable[str]) -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]


def setup_extras() -> set[str]:
    """The extras of the README's install line (``bash scripts/bootstrap.sh cpu``)."""
    install = (REPO / "README.md").read_text().split("## Install", 1)[1]
    found = re.search(r"bash scripts/bootstrap\.sh ([\w,]+)", install)
    assert found, "the README's Install section has no `bash scripts/bootstrap.sh EXTRAS` line"
    return set(found.group(1).split(","))


def docstring_extras(entry: Path) -> set[str]:
    """The extras an entry point's docstring says a mode of it needs (`pip install -e .[ray]`)."""
    doc = ast.get_docstring(ast.parse(entry.read_text())) or ""
    return {e for group in re.findall(r"\.\[([\w,]+)\]", doc) for e in group.split(",")}


def missing_distributions(imports: dict[str, str], closure: dict[str, set[str]]) -> list[str]:
    """The imports nothing in ``closure`` installs, as "module (where): why"."""
    owners = metadata.packages_distributions()
    missing = []
    for name, where in sorted(imports.items()):
        dists = {canonicalize_name(d) for d in owners.get(name.split(".")[0], [])}
        extra = next((e for prefix, e in SUBPACKAGE_EXTRAS.items() if name == prefix or name.startswith(prefix + ".")), None)
        if not dists:
            missing.append(f"{name} ({where}): installed by no distribution here")
        elif not dists & closure.keys():
            missing.append(f"{name} ({where}): {', '.join(sorted(dists))} is not a dependency")
        elif extra and not any(extra in closure.get(d, set()) for d in dists):
            missing.append(f"{name} ({where}): needs {', '.join(sorted(dists))}[{extra}]")
    return missing


def entry_file(entry: str) -> Path:
    path = REPO / entry if entry.endswith(".py") else source_file(entry)
    assert path is not None and path.is_file(), f"the docs run {entry}, which is not in the checkout"
    return path


def test_the_docs_run_these_entry_points() -> None:
    """The parser finds what the docs run (a check of the regex, against lines read by eye)."""
    found = documented_entry_points()
    assert {"scripts/load_test.py", "ldlm.serve.deploy.triton_local"} <= found


@pytest.mark.parametrize("entry", sorted(documented_entry_points()))
def test_a_documented_command_needs_only_what_the_setup_installs(entry: str) -> None:
    path = entry_file(entry)
    extras = setup_extras() | docstring_extras(path)
    closure = installed_closure(project_requirements(extras))
    missing = missing_distributions(third_party_imports(path), closure)
    assert not missing, (
        f"`python {entry}` imports what `pip install -e .[{','.join(sorted(extras))}]` does not install; "
        "add it to pyproject's dependencies, or name the extra in the entry point's docstring:\n" + "\n".join(missing)
    )


def test_the_check_finds_an_extra_and_a_dependency_the_core_lacks(tmp_path: Path) -> None:
    """The check itself, on a planted script: tritonclient's HTTP client (an extra the core's tritonclient[grpc]
    lacks) and hypothesis (a test dependency only), one of them imported inside a function."""
    script = tmp_path / "scripts" / "planted.py"
    script.parent.mkdir()
    script.write_text("import numpy\nimport tritonclient.grpc\n\n\ndef later():\n    import tritonclient.http\n    import hypothesis\n")
    closure = installed_closure(["numpy", "tritonclient[grpc]"])
    missing = missing_distributions(third_party_imports(script, tmp_path), closure)
    assert [m.split(" ")[0] for m in missing] == ["hypothesis", "tritonclient.http"]
    assert "needs tritonclient[http]" in missing[1] and "hypothesis is not a dependency" in missing[0]
