"""No function in export/ or serve/ is longer than 80 lines (def to last line): past that a handler or
a stage hides several jobs, and a newcomer cannot see where a change belongs."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 80


def long_functions(source: str, name: str) -> list[str]:
    tree = ast.parse(source, name)
    return [
        f"{name}:{node.lineno} {node.name} is {node.end_lineno - node.lineno + 1} lines"  # type: ignore[operator]
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LIMIT  # type: ignore[operator]
    ]


def test_the_counter_counts_def_to_last_line() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMIT - 1))
    assert long_functions(f"def f():\n{body}", "ok.py") == []  # 80 lines
    assert long_functions(f"def f():\n{body}    y = 0\n", "long.py") == [f"long.py:1 f is {LIMIT + 1} lines"]
    method = "".join(f"        x{i} = {i}\n" for i in range(LIMIT))  # a method counts too
    assert long_functions(f"class C:\n    def m(self):\n{method}", "m.py") == [f"m.py:2 m is {LIMIT + 1} lines"]


def test_no_function_over_80_lines_in_export_and_serve() -> None:
    found = [
        problem
        for top in ("export", "serve")
        for path in sorted((ROOT / top).rglob("*.py"))
        for problem in long_functions(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, "\n".join(found)
