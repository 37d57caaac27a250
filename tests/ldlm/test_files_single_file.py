"""The guard of every single file a command writes (``refuse_existing_file``): an existing file is replaced only
on request and only when its own header names the same writer; none is written into a checkpoint or a recorded
output directory, but for the file a command owns in a checkpoint. Each refusal names the file and the way out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ldlm.files import OUTPUT_RECORD, atomic_directory, refuse_existing_file

WAY_OUT = "--force replaces only a file the same ldlm command wrote; choose another file, or delete"
WRITER = "ldlm tune-schedule"


def header_writer(path: Path) -> str | None:
    """A stand-in format: the first line names the writer."""
    first = path.read_text().partition("\n")[0]
    return first.removeprefix("writer: ") if first.startswith("writer: ") else None


def refuse(path: Path, overwrite: bool = False, owned: tuple[str, ...] = ()) -> None:
    refuse_existing_file(path, overwrite, WRITER, header_writer, owned)


def test_a_new_file_is_written_and_its_own_writers_only_on_request(tmp_path: Path) -> None:
    refuse(tmp_path / "new" / "grids.json")  # nothing there: nothing to lose
    mine = tmp_path / "grids.json"
    mine.write_text(f"writer: {WRITER}\n")
    with pytest.raises(FileExistsError, match=f"^{mine} already exists; pass overwrite=True \\(CLI: --force\\) to replace it, or choose"):
        refuse(mine)
    refuse(mine, overwrite=True)


@pytest.mark.parametrize("overwrite", [False, True])
def test_someone_elses_file_or_another_writers_is_refused_naming_it_and_the_way_out(tmp_path: Path, overwrite: bool) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(FileExistsError, match=f"^{notes} was not written by `{WRITER}`; {WAY_OUT} {notes} by hand if it is not needed$"):
        refuse(notes, overwrite)
    other = tmp_path / "case.safetensors"
    other.write_text("writer: ldlm parity --save-inputs\n")
    with pytest.raises(FileExistsError, match=f"^{other} was written by `ldlm parity --save-inputs`, not `{WRITER}`; {WAY_OUT}"):
        refuse(other, overwrite)
    assert notes.read_text() == "my notes\n"


def test_no_file_goes_into_a_checkpoint_or_a_recorded_output_but_the_one_a_command_owns(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_text("weights")
    for target in (ckpt / "model.safetensors", ckpt / "config.json", ckpt / "sub" / "new.json", ckpt / "schedules.json"):
        with pytest.raises(FileExistsError, match=f"^{target} is inside {ckpt}, a checkpoint: .* allowed: a path outside {ckpt}$"):
            refuse(target, overwrite=True)
    refuse(ckpt / "schedules.json", owned=("schedules.json",))
    with pytest.raises(FileExistsError, match="is inside"):
        refuse(ckpt / "sub" / "schedules.json", owned=("schedules.json",))  # owned in the checkpoint itself, not below it
    with atomic_directory(tmp_path / "onnx", writer="ldlm export") as tmp:
        (tmp / "schedules.json").write_text(f"writer: {WRITER}\n")
    for target in (tmp_path / "onnx" / "schedules.json", tmp_path / "onnx" / "new.bin"):
        with pytest.raises(FileExistsError, match=f"^{target} is inside {tmp_path / 'onnx'}, the output of `ldlm export`"):
            refuse(target, overwrite=True, owned=("schedules.json",))
    assert (tmp_path / "onnx" / OUTPUT_RECORD).is_file() and not (tmp_path / "onnx" / "new.bin").exists()


def test_a_directory_or_a_link_is_not_a_file_to_replace(tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match=f"^{tmp_path} is a directory; allowed: a file path"):
        refuse(tmp_path, overwrite=True)
    target = tmp_path / "grids.json"
    target.write_text(f"writer: {WRITER}\n")
    link = tmp_path / "link.json"
    os.symlink(target, link)
    with pytest.raises(FileExistsError, match=f"^{link} is a symbolic link \\(to {target}\\), not a file `{WRITER}` wrote; {WAY_OUT}"):
        refuse(link, overwrite=True)
