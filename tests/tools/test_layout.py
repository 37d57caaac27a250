"""tests/ mirrors the package: every test module sits in the folder of the package folder it tests
(tests/ldlm/sampling/ for ldlm/sampling/, tests/serve/runtime/ for serve/runtime/, ...) and is named for
the module it tests (test_<module>.py or test_<module>_<aspect>.py; test_<package>_... for the package
as a whole), or lives in tests/e2e/ (whole-product runs) or tests/tools/ (checks of the tree itself).
Shared fixtures and the independent references sit in tests/ itself, and nothing else does."""

from __future__ import annotations

import re
from pathlib import Path

from tests import REPO

TESTS = REPO / "tests"
FREE = ("e2e", "tools")  # not tied to one module
SHARED = {"__init__.py", "conftest.py", "reference.py", "reference_model.py", "servers.py", "artifacts.py"}
# where a tests/ folder's modules live: tests/ldlm/x -> ldlm/x, tests/export -> export/, tests/serve/x -> serve/x
SOURCE_OF = {"ldlm": REPO / "ldlm", "export": REPO / "export", "serve": REPO / "serve"}


def source_folder(folder: Path) -> Path | None:
    parts = folder.relative_to(TESTS).parts
    if not parts or parts[0] not in SOURCE_OF:
        return None
    source = SOURCE_OF[parts[0]].joinpath(*parts[1:])
    return source if source.is_dir() else None


def misplaced(test: Path) -> str | None:
    """Why ``test`` is not where its module is, or None."""
    folder = test.parent
    if folder.relative_to(TESTS).parts[:1] and folder.relative_to(TESTS).parts[0] in FREE:
        return None
    source = source_folder(folder) if folder != TESTS else None
    if source is None:
        return f"{test.relative_to(REPO)} is in no folder that mirrors a package folder (or e2e/, tools/)"
    stem = test.stem.removeprefix("test_")
    modules = {p.stem for p in source.glob("*.py") if p.stem != "__init__"} | {source.name}
    if not any(stem == m or stem.startswith(m + "_") for m in modules):
        return f"{test.relative_to(REPO)} names no module of {source.relative_to(REPO)}/ (allowed: test_<module>[_<aspect>].py, modules: {', '.join(sorted(modules))})"
    return None


def test_every_test_module_sits_with_the_module_it_tests() -> None:
    problems = [why for test in sorted(TESTS.rglob("test_*.py")) if (why := misplaced(test)) is not None]
    assert not problems, "\n".join(problems)


def test_only_shared_fixtures_and_references_sit_at_the_top() -> None:
    top = {p.name for p in TESTS.glob("*.py")}
    assert top <= SHARED, f"modules directly in tests/: {sorted(top - SHARED)}; allowed: {sorted(SHARED)}"


def test_the_rule_refuses_a_test_away_from_its_module(tmp_path: Path) -> None:
    """The check itself: a scheduler test under tests/export/ and a test named for no module are refused."""
    assert misplaced(TESTS / "serve" / "runtime" / "test_scheduler_fairness.py") is None
    assert misplaced(TESTS / "ldlm" / "cli" / "test_cli_messages.py") is None
    assert "names no module of export/" in (misplaced(TESTS / "export" / "test_scheduler.py") or "")
    assert "mirrors a package folder" in (misplaced(TESTS / "misc" / "test_x.py") or "")
    assert "mirrors a package folder" in (misplaced(TESTS / "test_pipeline.py") or "")


def layout_section(readme: str) -> str:
    start = readme.index("## Layout\n")
    block = readme[start:].split("```", 2)[1]
    return block


def named_modules(block: str) -> dict[str, set[str]]:
    """The README's layout tree read back: each folder (as a path) -> the module files named under it. A line
    whose first word ends in "/" opens a folder inside the nearest open one to its left; other lines belong to
    the folder opened last."""
    open_folders: list[tuple[int, str]] = []
    named: dict[str, set[str]] = {}
    for line in block.splitlines():
        if not line.strip():
            continue
        indent, first = len(line) - len(line.lstrip()), line.split()[0].rstrip(",")
        if first.endswith("/") and indent < 20:
            while open_folders and open_folders[-1][0] >= indent:
                open_folders.pop()
            parent = open_folders[-1][1] if open_folders else ""
            open_folders.append((indent, parent + first))
            line = line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else ""
        if open_folders:
            named.setdefault(open_folders[-1][1], set()).update(re.findall(r"\b(\w+\.py)\b", line))
    return named


def layout_problems(readme: str) -> list[str]:
    named = named_modules(layout_section(readme))
    problems = []
    for top in ("ldlm", "export", "serve"):
        for folder in sorted({p.parent for p in (REPO / top).rglob("*.py")}):
            key = str(folder.relative_to(REPO)) + "/"
            modules = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
            shown = named.get(key, set()) - {"__init__.py"}
            problems += [f"{key}{m} is not in the README's layout" for m in sorted(modules - shown)]
            problems += [f"the README's layout names {key}{m}, which does not exist" for m in sorted(shown - modules)]
    return problems


def test_the_readme_layout_names_every_module_in_its_folder() -> None:
    problems = layout_problems((REPO / "README.md").read_text())
    assert not problems, "\n".join(problems)


def test_the_layout_check_sees_a_module_left_out() -> None:
    """The check itself: the README with one module's name taken out of its folder's lines is refused."""
    readme = (REPO / "README.md").read_text()
    assert layout_problems(readme.replace("tensorrt_executor.py,", "", 1)) == [
        "serve/runtime/tensorrt_executor.py is not in the README's layout"
    ]
