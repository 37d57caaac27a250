"""tests/tools/mutation_check.py's planted bugs still point at code that exists: each entry's module
file exists and defines its target once, the `old` text occurs exactly once within the target's
source, and each named test file exists. Running the mutations takes minutes and is not part of CI;
an edit that removes or renames a targeted function, or changes its pinned text, must fail here, at
once, while moving the function within its file (or to another module, with its entries' module
names updated) must not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.tools.mutation_check import MUTATIONS, Mutation, check_mutations, locate, mutated

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
