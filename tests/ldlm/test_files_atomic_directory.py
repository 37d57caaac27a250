"""``atomic_directory``, which every command that writes a directory goes through: a block that fails
leaves nothing behind, neither OUT nor its temporary directory, and a replace that fails (``--force``)
leaves the earlier OUT as it was; a block that completes appears whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ldlm.files import OUTPUT_RECORD, atomic_directory

MANIFEST = json.dumps({"ldlm_version": "0", "graphs": {}})


def write_export(out: Path, note: str, overwrite: bool = False, fail: bool = False) -> None:
    with atomic_directory(out, overwrite=overwrite) as tmp:
        (tmp / "manifest.json").write_text(MANIFEST)
        (tmp / "note.txt").write_text(note)
        if fail:
            raise RuntimeError("the writer failed halfway")


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="halfway"):
        write_export(tmp_path / "out", "first", fail=True)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_replace_leaves_the_earlier_output_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_export(out, "first")
    with pytest.raises(RuntimeError, match="halfway"):
        write_export(out, "second", overwrite=True, fail=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_RECORD, "manifest.json", "note.txt"]
    assert (out / "note.txt").read_text() == "first"
    write_export(out, "second", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "note.txt").read_text() == "second"
