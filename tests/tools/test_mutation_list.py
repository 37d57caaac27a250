"""tests/tools/mutation_check.py's planted bugs still point at code that exists: each entry's module
file exists and defines its target once, the `old` text occurs exactly once within the target's
source, and each named test file exists. Running the mutations takes minutes and is not part of CI;
an edit that removes or renames a targeted function, or changes its pinned text, must fail here, at
once, while moving the function within its file (or to another module, with its entries' module
names updated) must not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.tools.mutation_check import (
    CAUGHT,
    CAUGHT_ELSEWHERE,
    MUTATIONS,
    NAMED_STAGE,
    REST_STAGE,
    SURVIVED,
    Mutation,
    check_mutations,
    failing_tests,
    locate,
    mirror_of,
    mutated,
    verdict,
    write_report,
)

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = '[tool.setuptools.package-dir]\n"ldlm" = "ldlm"\n"ldlm.serve" = "serve"\n'
MODULE = """LIMIT = 3


def check(n):
    if n > LIMIT:
        raise ValueError(n)
    return n


class Queue:
    @staticmethod
    def admit(n):
        if n > LIMIT:
            return n > LIMIT
        return False
"""


def test_every_mutation_matches_the_tree_once() -> None:
    assert len(MUTATIONS) >= 100
    check_mutations(ROOT, MUTATIONS)


def entry(mutation_id: str, target: str, old: str, new: str = "if False:") -> Mutation:
    return Mutation(mutation_id, target, old, new, ("tests/t.py",), "a planted bug")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A repository with pyproject's package-dir mapping (ldlm.serve -> serve/) and one module in it."""
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "m.py").write_text(MODULE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("")
    return tmp_path


def test_a_stale_mutation_is_reported(tree: Path) -> None:
    """The check itself: an entry whose target is gone, or whose text is not once in it, stops the run naming
    its id and the target it expected; the same text elsewhere in the file does not count, and a target
    moved within its file, or its text to another of its lines, still matches and is mutated there."""
    good = (
        # "    if n > LIMIT:\n" is in Queue.admit too: only check's lines count
        entry("in-a-function", "ldlm.serve.m:check", "    if n > LIMIT:\n", "    if False:\n"),
        entry("in-a-method", "ldlm.serve.m:Queue.admit", "return n > LIMIT", "return True"),
        entry("a-decorator", "ldlm.serve.m:Queue.admit", "@staticmethod", "@classmethod"),  # a definition's lines start at its decorators
        entry("an-assignment", "ldlm.serve.m:LIMIT", "LIMIT = 3", "LIMIT = 4"),
    )
    check_mutations(tree, good)
    stale = {
        entry("module-gone", "ldlm.serve.gone:check", "if n > LIMIT:"): "module file serve/gone.py does not exist",
        entry("function-gone", "ldlm.serve.m:missing", "if n > LIMIT:"): "defines missing 0 times",
        entry("method-gone", "ldlm.serve.m:Queue.check", "if n > LIMIT:"): "defines Queue.check 0 times",
        entry("text-only-outside", "ldlm.serve.m:check", "return n > LIMIT"): "'return n > LIMIT' occurs 0 times in it",
        entry("text-twice-inside", "ldlm.serve.m:Queue.admit", "n > LIMIT"): "'n > LIMIT' occurs 2 times in it",
        entry("a-python-file-path", "serve/m.py", "LIMIT = 3"): "named by module and name",
    }
    for m, problem in stale.items():
        with pytest.raises(SystemExit, match=re.escape(f"{m.id}: {m.target}: ") + ".*" + re.escape(problem)):
            check_mutations(tree, (*good, m))
    no_test = Mutation("no-test", "ldlm.serve.m:LIMIT", "LIMIT = 3", "LIMIT = 4", ("tests/gone.py",), "a planted bug")
    with pytest.raises(SystemExit, match="no-test: test file tests/gone.py does not exist"):
        check_mutations(tree, (*good, no_test))
    (tree / "tests" / "tools").mkdir()
    (tree / "tests" / "tools" / "test_mutation_list.py").write_text("")
    by_the_list = Mutation(
        "by-the-list", "ldlm.serve.m:LIMIT", "LIMIT = 3", "LIMIT = 4", ("tests/tools/test_mutation_list.py",), "a planted bug"
    )
    with pytest.raises(SystemExit, match="by-the-list: names tests/tools/test_mutation_list.py, which would catch any edit"):
        check_mutations(tree, (*good, by_the_list))
    with pytest.raises(SystemExit, match="mutation ids are not unique: in-a-function"):
        check_mutations(tree, (*good, good[0]))

    # The class moved above the function, and a line added above admit's pinned text: all on other lines now.
    function, cls = MODULE.split("\n\n\n")[1:]
    edited = "LIMIT = 3\n\n\n" + cls.replace("    def admit(n):\n", "    def admit(n):\n        n = int(n)\n") + "\n\n" + function + "\n"
    (tree / "serve" / "m.py").write_text(edited)
    check_mutations(tree, good)
    path, text, start, end = locate(tree, good[0])
    planted = mutated(text, start, end, good[0])
    assert path == tree / "serve" / "m.py"
    assert planted == edited.replace(function, function.replace("    if n > LIMIT:\n", "    if False:\n"))  # admit's line is left alone


def test_a_named_test_is_checked_by_its_node_id(tree: Path) -> None:
    """A test named by node id (file::test) must still be defined there: a renamed test goes stale at once."""
    (tree / "tests" / "t.py").write_text("class TestCheck:\n    def test_limit(self):\n        pass\n\n\ndef test_here():\n    pass\n")
    named = ("tests/t.py::test_here", "tests/t.py::TestCheck::test_limit", "tests/t.py::test_here[1-2]")
    check_mutations(tree, (Mutation("named", "ldlm.serve.m:LIMIT", "LIMIT = 3", "LIMIT = 4", named, "a planted bug"),))
    gone = Mutation("gone", "ldlm.serve.m:LIMIT", "LIMIT = 3", "LIMIT = 4", ("tests/t.py::test_here_too",), "a planted bug")
    with pytest.raises(SystemExit, match="gone: tests/t.py defines no test test_here_too"):
        check_mutations(tree, (gone,))


def test_only_a_failure_of_the_modules_own_tests_counts_as_caught(tree: Path, tmp_path: Path) -> None:
    """A planted bug is caught by a test of its module: a named test (whatever made it fail), or, in the
    rest of the suite, a test in a file that mirrors the module (tests/serve/test_m.py, test_m_<aspect>.py)
    or in a named test's file. Any other failure is "caught elsewhere", naming the failing test, and the
    report does not count it as caught."""
    m = entry("in-a-function", "ldlm.serve.m:check", "    if n > LIMIT:\n")  # names tests/t.py
    assert verdict(tree, m, NAMED_STAGE, "failed", ["tests/t.py::test_a"]) == (CAUGHT, "tests/t.py::test_a")
    assert verdict(tree, m, NAMED_STAGE, "timeout", []) == (CAUGHT, "timeout")
    for own in ("tests/serve/test_m.py::test_b", "tests/serve/test_m_values.py::test_c[1-2]", "tests/t.py::test_d"):
        assert verdict(tree, m, REST_STAGE, "failed", ["tests/ldlm/test_x.py::test_e", own]) == (CAUGHT, own)
    others = (
        "tests/ldlm/test_pipeline.py::test_f",
        "tests/serve/test_mx.py::test_g",  # another module's (m is only its stem's prefix)
        "tests/serve/test_service_m.py::test_h",  # module service, aspect m
        "tests/test_m.py::test_i",  # the stem in another folder
        "tests/serve/api/test_m.py::test_j",
    )
    for other in others:
        assert verdict(tree, m, REST_STAGE, "failed", [other, "tests/ldlm/test_x.py::test_e"]) == (CAUGHT_ELSEWHERE, other)
    assert verdict(tree, m, REST_STAGE, "timeout", []) == (CAUGHT_ELSEWHERE, "timeout (rest of the suite)")
    assert verdict(tree, m, REST_STAGE, "passed", []) == (SURVIVED, None)
    not_python = Mutation("a-file", "serve/Dockerfile", "FROM", "FROM", ("tests/t.py",), "a planted bug")
    assert verdict(tree, not_python, REST_STAGE, "failed", ["tests/serve/test_m.py::test_b"])[0] == CAUGHT_ELSEWHERE
    (tree / "serve" / "pkg").mkdir()
    (tree / "serve" / "pkg" / "__init__.py").write_text("")
    assert mirror_of(tree, "ldlm.serve.pkg:X") == ("tests/serve/pkg", "test_pkg")  # a package by its own name

    verdicts = (CAUGHT, CAUGHT_ELSEWHERE, CAUGHT_ELSEWHERE, SURVIVED)
    results = [{"id": f"m{i}", "caught": v == CAUGHT, "verdict": v} for i, v in enumerate(verdicts)]
    write_report(tmp_path / "report.json", results, quick=False)
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["mutations"], report["caught"], report["caught_elsewhere"], report["survived"]) == (4, 1, 2, 1)


def test_failing_tests_are_read_from_pytests_summary_not_from_captured_logs() -> None:
    output = "\n".join(
        [
            "ERROR    ldlm.serve:executor.py:72 the fused denoiser step failed; steps run unfused from now on",
            "FAILED tests/serve/runtime/test_x.py::test_a[1-2] - AssertionError: assert 1 == 2",
            "ERROR tests/serve/test_y.py::test_b - RuntimeError: fixture broke",
            "ERROR tests/serve/test_z.py",
            "1 failed, 1 error in 2.0s",
        ]
    )
    assert failing_tests(output) == ["tests/serve/runtime/test_x.py::test_a[1-2]", "tests/serve/test_y.py::test_b", "tests/serve/test_z.py"]
