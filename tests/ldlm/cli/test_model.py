"""``ldlm init --force``: it replaces what init wrote, and refuses a directory holding anything else, a trained
checkpoint above all, naming the files and leaving the directory as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ldlm.cli import main
from tests import REPO

REFERENCE = REPO / "models" / "ldlm-austen-tiny"


def contents(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_init_force_refuses_a_trained_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trained = tmp_path / "trained"
    shutil.copytree(REFERENCE, trained)
    before = contents(tmp_path)
    assert main(["init", str(trained), "--preset", "tiny", "--force", "--quiet"]) == 2
    err = capsys.readouterr().err
    extra = "README.md, SHA256SUMS, schedules.json, training.json"
    assert f"ldlm init: error: {trained} holds files a new checkpoint does not have: {extra}" in err
    assert "--force replaces only a directory holding nothing but config.json, tokenizer.json, model.safetensors" in err
    assert contents(tmp_path) == before  # the weights, the README and the rest as they were, and nothing beside them


def test_init_force_replaces_what_init_wrote(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    assert main(["init", str(out), "--preset", "tiny", "--seed", "1", "--quiet"]) == 0
    first = contents(out)
    assert main(["init", str(out), "--preset", "tiny", "--seed", "2", "--force", "--quiet"]) == 0
    second = contents(out)
    assert sorted(second) == sorted(first) and second["model.safetensors"] != first["model.safetensors"]
    (out / "notes.txt").write_text("mine\n")
    assert main(["init", str(out), "--preset", "tiny", "--force", "--quiet"]) == 2
    assert contents(out) == {**second, "notes.txt": b"mine\n"}
