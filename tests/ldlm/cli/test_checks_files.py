"""``ldlm parity``'s files and report directory: a file it did not write is never replaced, --force or not, and
no file is written inside a checkpoint, another command's output or its own --out; an existing report directory
is replaced only with --force and only when parity wrote it. Every refusal comes before any work, names the
file and the way out, and leaves every byte as it was."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.files import OUTPUT_RECORD, ldlm_output
from ldlm.serve.checks import parity

FILE_WAY_OUT = "--force replaces only a file the same ldlm command wrote; choose another file, or delete"
DIRECTORY_WAY_OUT = "--force replaces only the output of the same ldlm command, exactly as it wrote it; choose a new output directory"
FAST = ["--backend", "eager", "--steps", "1", "--quiet"]


def sha256s(*paths: Path) -> dict[Path, str]:
    return {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint load that fails the test: a refusal must come before any work."""

    def loaded(*_: object, **__: object) -> None:
        raise AssertionError("parity loaded the checkpoint before its files were checked")

    monkeypatch.setattr(parity, "load_checkpoint", loaded)


@pytest.mark.parametrize("option", ["--save-outputs", "--save-inputs"])
@pytest.mark.usefixtures("no_work")
def test_no_file_is_written_over_or_into_a_checkpoint(
    option: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = shutil.copytree(tiny_checkpoint, tmp_path / "other")  # another checkpoint than the one checked
    weights = [tiny_checkpoint / "model.safetensors", other / "model.safetensors", other / "config.json"]
    before = sha256s(*weights)
    for target in [*weights, other / "case.safetensors"]:
        for force in ([], ["--force"]):
            argv = ["parity", str(tiny_checkpoint), *FAST, "--out", str(tmp_path / "report"), option, str(target), *force]
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert f"ldlm parity: error: {target} is inside {target.parent}, a checkpoint" in err, err
            assert f"allowed: a path outside {target.parent}" in err
    assert sha256s(*weights) == before and not (other / "case.safetensors").exists() and not (tmp_path / "report").exists()


@pytest.mark.parametrize("option", ["--save-outputs", "--save-inputs"])
@pytest.mark.usefixtures("no_work")
def test_someone_elses_file_is_not_replaced_even_with_force(
    option: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    before = sha256s(notes)
    writer = f"ldlm parity {option}"
    for force in ([], ["--force"]):
        assert main(["parity", str(tiny_checkpoint), *FAST, "--out", str(tmp_path / "report"), option, str(notes), *force]) == 2
        err = capsys.readouterr().err
        assert f"ldlm parity: error: {notes} was not written by `{writer}`; {FILE_WAY_OUT} {notes} by hand" in err, err
    assert sha256s(notes) == before


def test_force_replaces_parities_own_files_and_report_and_nothing_else(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case, report = tmp_path / "case.safetensors", tmp_path / "report"
    run = ["parity", str(tiny_checkpoint), *FAST, "--out", str(report)]
    assert main([*run, "--seed", "1", "--save-inputs", str(case)]) == 0
    assert ldlm_output(report) is not None and ldlm_output(report).writer == "ldlm parity"  # type: ignore[union-attr]
    first = sha256s(case, report / "parity.json")
    capsys.readouterr()

    assert main([*run, "--seed", "2", "--save-inputs", str(case)]) == 2  # the report directory first: it exists
    assert f"ldlm parity: error: {report} already exists; pass --force to replace it" in capsys.readouterr().err
    assert main([*run, "--seed", "2", "--save-inputs", str(case), "--out", str(tmp_path / "second")]) == 2
    assert f"ldlm parity: error: {case} already exists; pass overwrite=True (CLI: --force) to replace it" in capsys.readouterr().err
    assert main([*run, "--seed", "2", "--save-outputs", str(case), "--force"]) == 2  # parity's, but an inputs file
    err = capsys.readouterr().err
    assert f"{case} was written by `ldlm parity --save-inputs`, not `ldlm parity --save-outputs`; {FILE_WAY_OUT}" in err, err
    assert sha256s(*first) == first

    assert main([*run, "--seed", "2", "--save-inputs", str(case), "--force"]) == 0
    assert sha256s(*first) != first and (report / OUTPUT_RECORD).is_file()


@pytest.mark.usefixtures("no_work")
def test_an_existing_report_directory_is_replaced_only_when_parity_wrote_it(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("chapter 1\n")
    before = sha256s(mine / "thesis.txt")
    assert main(["parity", str(tiny_checkpoint), *FAST, "--out", str(mine)]) == 2
    assert (
        f"ldlm parity: error: {mine} already exists; pass --force to replace it, or choose another output directory"
        in capsys.readouterr().err
    )
    assert main(["parity", str(tiny_checkpoint), *FAST, "--out", str(mine), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"ldlm parity: error: {mine} was not written by ldlm (it holds thesis.txt, and no {OUTPUT_RECORD}); {DIRECTORY_WAY_OUT}" in err
    assert (
        main(["parity", str(tiny_checkpoint), *FAST, "--out", str(tmp_path / "new"), "--save-inputs", str(tmp_path / "new" / "case")]) == 2
    )
    assert (
        f"--save-inputs {tmp_path / 'new' / 'case'} is inside the output directory {tmp_path / 'new'}, which is written whole"
        in capsys.readouterr().err
    )
    assert sha256s(mine / "thesis.txt") == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_parity_report_is_named_as_parities_by_the_guard(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "report"
    assert main(["parity", str(tiny_checkpoint), *FAST, "--out", str(report)]) == 0
    before = sha256s(*(p for p in report.iterdir()))
    assert main(["export", str(tiny_checkpoint), str(report), "--force"]) == 2
    assert f"ldlm export: error: {report} was written by `ldlm parity`, not `ldlm export`; {DIRECTORY_WAY_OUT}" in capsys.readouterr().err
    assert sha256s(*before) == before


@pytest.mark.parametrize("command", ["parity", "probe-eps", "bench"])
def test_every_report_directory_is_guarded_before_any_work(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "report"
    mine.mkdir()
    (mine / "bench.json").write_text("my figures\n")
    before = sha256s(mine / "bench.json")
    for force in ([], ["--force"]):
        assert main([command, str(tmp_path / "no-checkpoint"), "--out", str(mine), *force]) == 2
        err = capsys.readouterr().err
        assert f"ldlm {command}: error: {mine} " in err and ("pass --force" in err if not force else DIRECTORY_WAY_OUT in err), err
    assert sha256s(mine / "bench.json") == before


def test_a_timing_cache_inside_the_engine_directory_is_refused_before_the_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The engine directory is written whole (and replaced whole with --force): a cache inside it would be lost."""
    engines = tmp_path / "engines"
    assert main(["build-engine", str(tmp_path / "onnx"), str(engines), "--timing-cache", str(engines / "timing.cache")]) == 2
    err = capsys.readouterr().err
    assert f"--timing-cache {engines / 'timing.cache'} is inside the output directory {engines}, which is written whole" in err, err
