"""--force replaces only what the same command wrote, unchanged since: a directory of someone's own files, another
command's output, an export with a file added, a plain file, the current directory, a parent of the input or a
path without a name of its own is refused before any work, naming what is there. Expected messages are written
out by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ldlm.export.onnx_export
from ldlm.cli import main
from ldlm.files import OUTPUT_RECORD, atomic_directory

WAY_OUT = "--force replaces only the output of the same ldlm command, exactly as it wrote it; choose a new output directory"


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Records any checkpoint load or export: a refusal must come before either."""
    done: list[object] = []

    def record(*args: object, **kwargs: object) -> None:
        done.append(args)
        raise AssertionError("work started before the output was refused")

    monkeypatch.setattr(ldlm.export.onnx_export, "load_checkpoint", record)
    monkeypatch.setattr(ldlm.export.onnx_export, "export_graphs", record)
    return done


def export(checkpoint: Path | str, out: Path | str, *extra: str) -> int:
    return main(["export", str(checkpoint), str(out), "--graphs", "decoder", "--quiet", *extra])


def test_a_directory_of_the_users_files_is_not_replaced(
    tiny_checkpoint: Path, tmp_path: Path, no_work: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.txt").write_text("three years of work")
    for name in ("a.txt", "b.txt", "c.txt", "d.txt", "e.txt"):
        (out / name).write_text("")
    assert export(tiny_checkpoint, out, "--force") == 2
    err = capsys.readouterr().err
    assert (
        f"ldlm export: error: {out} was not written by ldlm (it holds a.txt, b.txt, c.txt, d.txt, e.txt and 1 more, "
        f"and no {OUTPUT_RECORD}); {WAY_OUT}, or delete {out} by hand if nothing in it is needed" in err
    ), err
    assert (out / "thesis.txt").read_text() == "three years of work"
    assert no_work == []


def test_a_plain_file_is_not_replaced_and_no_old_copy_is_left(
    tiny_checkpoint: Path, tmp_path: Path, no_work: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "notes.md"
    out.write_text("mine")
    assert export(tiny_checkpoint, out, "--force") == 2
    assert f"ldlm export: error: {out} is a file, not a directory that ldlm wrote;" in capsys.readouterr().err
    assert out.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]


@pytest.mark.parametrize(
    "out, problem",
    [
        (".", "has no name of its own; allowed: a path ending in the new directory's name, e.g. ./onnx"),
        ("", "has no name of its own; allowed: a path ending in the new directory's name, e.g. ./onnx"),
        ("/", "has no name of its own; allowed: a path ending in the new directory's name, e.g. ./onnx"),
        ("work/..", "has no name of its own; allowed: a path ending in the new directory's name, e.g. ./onnx"),
        ("../here", "is the current directory or holds it; allowed: a new directory, e.g. ./onnx"),
        ("ckpt-parent", "holds the checkpoint ckpt-parent/ckpt; allowed: a directory outside it, e.g. ./onnx"),
        ("ckpt-parent/ckpt", "is the checkpoint ckpt-parent/ckpt; allowed: a directory outside it, e.g. ./onnx"),
    ],
)
def test_paths_that_would_remove_the_input_or_the_cwd_fail_before_any_work(
    tiny_checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_work: list[object],
    capsys: pytest.CaptureFixture[str],
    out: str,
    problem: str,
) -> None:
    here = tmp_path / "here"
    (here / "work").mkdir(parents=True)
    (here / "ckpt-parent").mkdir()
    shutil.copytree(tiny_checkpoint, here / "ckpt-parent" / "ckpt")
    monkeypatch.chdir(here)
    assert export("ckpt-parent/ckpt", out, "--force") == 2
    err = capsys.readouterr().err
    assert f"ldlm export: error: output directory {out!r} {problem}" in err, err
    assert "empty name" not in err
    assert no_work == []
    assert sorted(p.name for p in (here / "ckpt-parent" / "ckpt").iterdir()) == [
        OUTPUT_RECORD,
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]


def test_an_export_is_replaced_and_nothing_is_left_beside_it(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "onnx"
    assert export(tiny_checkpoint, out) == 0
    (tmp_path / ".onnx.old").write_text("left by an older ldlm that replaced a plain file")
    assert export(tiny_checkpoint, out, "--force") == 0
    assert (out / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx"]


def test_an_export_with_a_file_added_or_another_commands_output_is_not_replaced(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "onnx"
    assert export(tiny_checkpoint, out) == 0
    (out / "notes.md").write_text("what I measured on this export")
    capsys.readouterr()
    assert export(tiny_checkpoint, out, "--force") == 2
    err = capsys.readouterr().err
    assert f"ldlm export: error: {out} holds files `ldlm export` did not write: notes.md; {WAY_OUT}" in err, err
    assert (out / "notes.md").read_text() == "what I measured on this export" and (out / "decoder.onnx").is_file()
    checkpoint = tmp_path / "ckpt"  # a checkpoint that ldlm wrote, given as OUT by mistake
    shutil.copytree(tiny_checkpoint, checkpoint)
    assert export(tiny_checkpoint, checkpoint, "--force") == 2
    err = capsys.readouterr().err
    assert f"ldlm export: error: {checkpoint} was written by `ldlm.save_checkpoint`, not `ldlm export`; {WAY_OUT}" in err, err
    assert (checkpoint / "model.safetensors").read_bytes() == (tiny_checkpoint / "model.safetensors").read_bytes()


def test_an_empty_directory_is_replaced(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "made-by-mkdir"
    out.mkdir()
    assert export(tiny_checkpoint, out, "--force") == 0
    assert (out / "decoder.onnx").is_file()


@pytest.mark.parametrize("command", ["build-engine", "triton-repo"])
def test_the_other_writers_refuse_the_same(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No export is needed: the output is refused before the source is read."""
    source = tmp_path / "onnx"
    source.mkdir()
    monkeypatch.chdir(tmp_path)
    assert main([command, "onnx", ".", "--force"]) == 2
    assert f"ldlm {command}: error: output directory '.' has no name of its own" in capsys.readouterr().err
    assert main([command, "onnx", "onnx", "--force"]) == 2
    named = "the source" if command == "triton-repo" else "the export"
    assert f"ldlm {command}: error: output directory 'onnx' is {named} onnx; allowed: a directory outside it" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.txt").write_text("")
    assert main([command, "onnx", "mine", "--force"]) == 2
    assert f"ldlm {command}: error: mine was not written by ldlm (it holds thesis.txt, and no {OUTPUT_RECORD});" in capsys.readouterr().err
    assert (tmp_path / "mine" / "thesis.txt").is_file()
    with atomic_directory(tmp_path / "exported", writer="ldlm export") as tmp:  # another command's output
        (tmp / "manifest.json").write_text("{}")
    assert main([command, "onnx", "exported", "--force"]) == 2
    assert f"ldlm {command}: error: exported was written by `ldlm export`, not `ldlm {command}`; {WAY_OUT}" in capsys.readouterr().err
    assert (tmp_path / "exported" / "manifest.json").read_text() == "{}"


@pytest.mark.parametrize("command", ["parity", "probe-eps", "bench"])
def test_report_directories_that_are_files_fail_before_any_work(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The checks write their reports into a new --out (an existing one only with --force); a file there is named before the run."""
    blocker = tmp_path / "report"
    blocker.write_text("mine")
    assert main([command, str(tmp_path / "no-checkpoint"), "--out", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert f"ldlm {command}: error: {blocker} already exists; pass --force to replace it, or choose another output directory" in err, err
    assert main([command, str(tmp_path / "no-checkpoint"), "--out", str(blocker), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"ldlm {command}: error: {blocker} is a file, not a directory that ldlm wrote; {WAY_OUT}" in err, err
    assert blocker.read_text() == "mine"


def test_the_python_api_refuses_before_loading(tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ldlm.export.onnx_export import export_graphs

    loads: list[object] = []
    monkeypatch.setattr(ldlm.export.onnx_export, "load_checkpoint", lambda *args: loads.append(args))
    parent = tiny_checkpoint.parent
    with pytest.raises(ValueError) as refused:
        export_graphs(tiny_checkpoint, parent, overwrite=True)
    assert f"output directory {str(parent)!r} holds the checkpoint {tiny_checkpoint}; allowed: a directory outside it" in str(refused.value)
    assert loads == []
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("")
    with (
        pytest.raises(FileExistsError, match=r"mine was not written by ldlm \(it holds thesis\.txt, and no \.ldlm-output\.json\)"),
        atomic_directory(mine, overwrite=True),
    ):
        pass
    assert (mine / "thesis.txt").is_file()
