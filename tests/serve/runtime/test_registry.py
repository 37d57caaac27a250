"""The backend registry: the one table of backends, read by everything that picks one.

Pinned here: no module outside the registry and the backend modules names a backend by a string literal;
every entry's module opens what the entry says; the CLI's choices are the table's; a backend the table
lists but this machine cannot run (ort-cuda without onnxruntime-gpu) is refused naming what to install."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from ldlm.serve.runtime.registry import REGISTRY, backend_info, backend_names
from tests import REPO

# The registry, and the modules that implement a backend: the only places a backend's name is written.
OWNERS = {REPO / "serve" / "runtime" / "registry.py"} | {
    REPO / Path(*info.module.split(".")[1:]).with_suffix(".py") for info in REGISTRY.values()
}


def literal_names(path: Path) -> list[str]:
    """Each string constant of ``path`` that is exactly a backend's name (docstrings and f-string text excluded)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    return [
        f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in REGISTRY
        and id(node) not in docstrings | in_fstrings
    ]


def package_modules() -> list[Path]:
    return sorted(p for top in ("ldlm", "export", "serve") for p in (REPO / top).rglob("*.py") if p not in OWNERS)


def test_no_module_outside_the_registry_names_a_backend() -> None:
    found = [hit for path in package_modules() for hit in literal_names(path)]
    assert not found, "backend names written outside the registry and the backend modules:\n" + "\n".join(found)


def test_the_literal_finder_finds_a_planted_name(tmp_path: Path) -> None:
    planted = REPO / "serve" / "api" / "_planted_for_test.py"  # a module of the package, for relative_to
    try:
        planted.write_text('"""ort is named in a docstring, which is fine."""\nBACKEND = "ort"\nHELP = f"ort: {BACKEND}"\n')
        assert literal_names(planted) == ["serve/api/_planted_for_test.py:2 'ort'"]
    finally:
        planted.unlink()


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_entry_names_a_module_that_opens_it(name: str) -> None:
    info = backend_info(name)
    module = importlib.import_module(info.module)
    assert callable(getattr(module, "open_backend", None)), f"{info.module} has no open_backend"
    assert info.precisions and info.opens in ("checkpoint", "export", "engines")


def test_trt_precisions_are_what_build_engine_builds() -> None:
    from ldlm.export.engine_builder import BUILD_PRECISIONS

    assert set(backend_info("trt").precisions) == set(BUILD_PRECISIONS)


def test_the_cli_offers_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    from ldlm.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command in ("serve", "parity"):
        action = next(a for a in commands[command]._actions if "--backend" in a.option_strings)
        # neither names one by default: each picks serve's for --device (test_registry_default.py)
        assert tuple(action.choices) == backend_names() and action.default is None


def test_ort_cuda_without_onnxruntime_gpu_names_it(export_dir: Path) -> None:
    """The CPU build of ONNX Runtime has no CUDA provider: ort-cuda is refused before any session, naming onnxruntime-gpu."""
    import onnxruntime

    from ldlm.serve.runtime.backends import open_graphs
    from ldlm.serve.runtime.graph_backend import BackendError

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here: ort-cuda's refusal is not exercised")
    with pytest.raises(BackendError, match=r"\['CUDAExecutionProvider'\] are not available here.*onnxruntime-gpu"):
        open_graphs("ort-cuda", export_dir)
    with pytest.raises(
        BackendError, match="provider='tensorrt' applies to backend 'ort' only; backend 'ort-cuda' runs CUDAExecutionProvider"
    ):
        from ldlm.serve.runtime.backends import ort_providers

        ort_providers("tensorrt", "ort-cuda")
