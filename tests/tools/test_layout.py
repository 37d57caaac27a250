"""tests/ mirrors the package: every test module sits in the folder of the package folder it tests
(tests/ldlm/sampling/ for ldlm/sampling/, tests/serve/runtime/ for serve/runtime/, ...) and is named for
the module it tests (test_<module>.py or test_<module>_<aspect>.py; test_<package>_... for the package
as a whole), or lives in tests/e2e/ (whole-product runs) or tests/tools/ (checks of the tree itself).
Shared fixtures and the independent references sit in tests/ itself, and nothing else does."""

from __future__ import annotations

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
