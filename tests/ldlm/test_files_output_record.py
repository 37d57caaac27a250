"""The one guard of every ``--force``: a directory is replaced only when it is the output of the same writer,
exactly as that writer left it (``OUTPUT_RECORD``), and an empty one needs no asking. Each refusal names the
files and the way out, and leaves the directory as it was. Expected records and messages are written out here
from hashlib and by hand, not from the code under test."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ldlm.files import OUTPUT_RECORD, atomic_directory, refuse_existing

WAY_OUT = "--force replaces only the output of the same ldlm command, exactly as it wrote it; choose a new output directory, or delete"


def write(out: Path, writer: str | None, files: dict[str, str], overwrite: bool = False) -> None:
    with atomic_directory(out, overwrite=overwrite, writer=writer) as tmp:
        for name, text in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text)


def contents(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_the_record_names_the_writer_and_every_file_with_its_size_and_sha256(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write(out, "ldlm export", {"manifest.json": "{}", "sub/graph.onnx": "graph bytes"})
    record = json.loads((out / OUTPUT_RECORD).read_text())
    assert record["writer"] == "ldlm export"
    assert record["files"] == {
        "manifest.json": {"bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()},
        "sub/graph.onnx": {"bytes": 11, "sha256": hashlib.sha256(b"graph bytes").hexdigest()},
    }


def test_a_writer_replaces_its_own_output_as_it_left_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write(out, "ldlm export", {"a.onnx": "first", "sub/b.onnx": "first"})
    write(out, "ldlm export", {"a.onnx": "second"}, overwrite=True)
    assert contents(out) == {OUTPUT_RECORD: (out / OUTPUT_RECORD).read_bytes(), "a.onnx": b"second"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no old copy, no temporary directory


def test_another_writers_output_is_refused_by_name(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write(out, "ldlm import-checkpoint", {"model.safetensors": "imported weights"})
    before = contents(out)
    with pytest.raises(FileExistsError) as refused:
        write(out, "ldlm init", {"model.safetensors": "random weights"}, overwrite=True)
    assert str(refused.value) == (
        f"{out} was written by `ldlm import-checkpoint`, not `ldlm init`; {WAY_OUT} {out} by hand if nothing in it is needed"
    )
    assert contents(out) == before


def test_files_added_or_changed_since_are_refused_by_name(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write(out, "ldlm init", {"config.json": "{}", "model.safetensors": "random weights"})
    (out / "notes.txt").write_text("mine")
    (out / "runs").mkdir()
    (out / "runs" / "log.txt").write_text("mine too")
    (out / "model.safetensors").write_text("trained weights")  # the same name, other bytes
    before = contents(out)
    with pytest.raises(FileExistsError) as refused:
        refuse_existing(out, overwrite=True, writer="ldlm init")
    assert str(refused.value) == (
        f"{out} holds files `ldlm init` did not write: notes.txt, runs/log.txt; and files changed since `ldlm init` wrote "
        f"them: model.safetensors; {WAY_OUT} {out} by hand if nothing in it is needed"
    )
    assert contents(out) == before


def test_a_changed_file_of_the_same_size_is_found_by_its_sha256(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write(out, "ldlm init", {"model.safetensors": "weights at step 0"})
    (out / "model.safetensors").write_text("weights at step 9")  # as long as the recorded file, other bytes
    with pytest.raises(FileExistsError, match="files changed since `ldlm init` wrote them: model.safetensors;"):
        refuse_existing(out, overwrite=True, writer="ldlm init")


def test_a_directory_without_a_record_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    out = tmp_path / "thesis"
    out.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt", "e.txt", "f.txt"):
        (out / name).write_text("mine")
    with pytest.raises(FileExistsError) as refused:
        refuse_existing(out, overwrite=True, writer="ldlm export")
    assert str(refused.value) == (
        f"{out} was not written by ldlm (it holds a.txt, b.txt, c.txt, d.txt, e.txt and 1 more, and no {OUTPUT_RECORD}); "
        f"{WAY_OUT} {out} by hand if nothing in it is needed"
    )


def test_a_link_inside_is_not_a_file_ldlm_wrote(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write(out, "ldlm export", {"a.onnx": "graph"})
    (tmp_path / "thesis").mkdir()
    (out / "thesis").symlink_to(tmp_path / "thesis")
    with pytest.raises(FileExistsError, match="holds files `ldlm export` did not write: thesis;"):
        refuse_existing(out, overwrite=True, writer="ldlm export")


def test_an_empty_or_missing_directory_needs_no_force(tmp_path: Path) -> None:
    refuse_existing(tmp_path / "missing")
    empty = tmp_path / "made-by-mkdir"
    empty.mkdir()
    write(empty, "ldlm export", {"a.onnx": "graph"})
    assert (empty / "a.onnx").read_text() == "graph"
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        write(empty, "ldlm export", {"a.onnx": "again"})


def test_a_check_before_the_writer_is_known_takes_any_writers_unchanged_output(tmp_path: Path) -> None:
    """The CLI's check before a command runs names no writer: any recorded output passes it, and the command's own
    check (with its name) decides; files added or changed are refused whoever asks."""
    out = tmp_path / "out"
    write(out, "ldlm build-engine", {"encoder.plan": "plan"})
    refuse_existing(out, overwrite=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="did not write: notes.txt"):
        refuse_existing(out, overwrite=True)
