"""A refused output directory is answered with an example of the command's own kind (engines for
build-engine, a repository for triton-repo, a checkpoint for import-checkpoint), placed where it would be
allowed: never the source itself, inside it or holding it, and never the current directory."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ldlm.cli import build_parser, main
from ldlm.files import example_directory


@pytest.mark.parametrize(
    ("command", "example"),
    [("build-engine", "./engines"), ("triton-repo", "./triton-repo"), ("import-checkpoint", "./checkpoint"), ("export", "./onnx")],
)
def test_an_out_that_is_the_source_gets_an_example_of_the_commands_kind(
    command: str, example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run from inside runs/, where the old example ./onnx was the export being read."""
    runs = tmp_path / "runs"
    (runs / "source").mkdir(parents=True)
    monkeypatch.chdir(runs)
    assert main([command, "source", "source", "--force"]) == 2
    err = capsys.readouterr().err
    assert f"ldlm {command}: error: output directory 'source' is the " in err
    assert err.rstrip().endswith(f"source; allowed: a directory outside it, e.g. {example}"), err


@pytest.mark.parametrize(("command", "example"), [("build-engine", "../engines"), ("triton-repo", "../triton-repo")])
def test_from_inside_the_source_the_example_lies_beside_it(
    command: str, example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "onnx").mkdir()
    monkeypatch.chdir(tmp_path / "onnx")
    assert main([command, ".", ".", "--force"]) == 2
    err = capsys.readouterr().err
    assert f"ldlm {command}: error: output directory '.' has no name of its own; " in err
    assert err.rstrip().endswith(f"allowed: a path ending in the new directory's name, e.g. {example}"), err


def test_an_export_named_like_the_example_gets_a_numbered_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "engines").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["build-engine", "engines", "engines", "--force"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("is the export engines; allowed: a directory outside it, e.g. ./engines-2")


def test_init_suggests_a_checkpoint_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["init", "..", "--quiet"]) == 2
    assert (
        capsys.readouterr()
        .err.rstrip()
        .endswith("has no name of its own; allowed: a path ending in the new directory's name, e.g. ./checkpoint")
    )


def test_the_example_avoids_each_input_and_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a" / "engines" / "deep").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "engines" / "deep")
    # the current directory lies inside "engines" under a: the example may neither hold it nor be the input
    assert example_directory("engines", {"export": None}) == "./engines"
    assert example_directory("engines", {"export": tmp_path / "a" / "engines"}) == "../../engines-2"
    assert example_directory("deep", {"export": "."}) == "../deep-2"
    assert example_directory("x", {"checkpoint": "/"}) == "./x"  # nowhere is outside the root: the name alone


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_writing_an_out_directory_names_its_example() -> None:
    missing = [
        name
        for name, parser in subcommands().items()
        if any(a.dest == "out" for a in parser._actions) and not parser.get_default("out_example")
    ]
    assert missing == [], f"commands with an output directory and no out_example default: {missing}"
