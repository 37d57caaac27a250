"""scripts/mutation_check.py's planted bugs still point at code that exists: each `old` text occurs
exactly once in its file and each named test file exists. Running the mutations takes minutes and is
not part of CI; a refactor or a reformat that moves the code they target must fail here, at once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_mutation_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_every_mutation_matches_the_tree_once() -> None:
    mutation_check = load_mutation_check()
    assert len(mutation_check.MUTATIONS) >= 100
    mutation_check.check_mutations(ROOT, mutation_check.MUTATIONS)


def test_a_stale_mutation_is_reported(tmp_path: Path) -> None:
    """The check itself: a mutation whose text is gone, or doubled, stops the run with its id."""
    mutation_check = load_mutation_check()
    (tmp_path / "m.py").write_text("x = 1\nx = 1\ny = 2\n")
    (tmp_path / "t.py").write_text("")
    gone = mutation_check.Mutation("gone", "m.py", "z = 3", "z = 4", ("t.py",), "a planted bug")
    twice = mutation_check.Mutation("twice", "m.py", "x = 1", "x = 2", ("t.py",), "a planted bug")
    once = mutation_check.Mutation("once", "m.py", "y = 2", "y = 3", ("t.py",), "a planted bug")
    mutation_check.check_mutations(tmp_path, (once,))
    for stale in (gone, twice):
        with pytest.raises(SystemExit, match=stale.id):
            mutation_check.check_mutations(tmp_path, (once, stale))
