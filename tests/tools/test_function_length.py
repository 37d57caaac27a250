"""No function in ldlm/, serve/ or export/ is longer than 60 lines (def to last line): past that a handler or a
stage hides several jobs, and a newcomer cannot see where a change belongs. The CLI included: a command's parser
is one function per subcommand (``_add_<command>``), its option groups their own. Modules have no line cap: a
module is as long as its one job needs, and splits when it holds two."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import REPO

ROOT = REPO
FUNCTION_LIMITS = {"ldlm": 60, "serve": 60, "export": 60}  # lines per function, by top-level folder


def long_functions(source: str, name: str, limit: int) -> list[str]:
    tree = ast.parse(source, name)
    return [
        f"{name}:{node.lineno} {node.name} is {node.end_lineno - node.lineno + 1} lines"  # type: ignore[operator]
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit  # type: ignore[operator]
    ]


def checked_files(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


@pytest.mark.parametrize("limit", [60, 80])
def test_the_counter_counts_def_to_last_line(limit: int) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(limit - 1))
    assert long_functions(f"def f():\n{body}", "ok.py", limit) == []  # exactly the limit
    assert long_functions(f"def f():\n{body}    y = 0\n", "long.py", limit) == [f"long.py:1 f is {limit + 1} lines"]
    method = "".join(f"        x{i} = {i}\n" for i in range(limit))  # a method counts too
    assert long_functions(f"class C:\n    def m(self):\n{method}", "m.py", limit) == [f"m.py:2 m is {limit + 1} lines"]


def test_every_package_module_is_checked() -> None:
    assert {ROOT / "ldlm" / "model" / "ldlm.py", ROOT / "ldlm" / "cli" / "serving.py", ROOT / "ldlm" / "sampling" / "loop.py"} <= set(
        checked_files("ldlm")
    )


@pytest.mark.parametrize("top", sorted(FUNCTION_LIMITS))
def test_no_long_function(top: str) -> None:
    found = [
        problem
        for path in checked_files(top)
        for problem in long_functions(path.read_text(), str(path.relative_to(ROOT)), FUNCTION_LIMITS[top])
    ]
    assert not found, f"functions over {FUNCTION_LIMITS[top]} lines:\n" + "\n".join(found)
