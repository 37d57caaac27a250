"""``--force`` on the checkpoint writers, ``ldlm init`` and ``ldlm import-checkpoint``: each replaces only what the
same command wrote, unchanged since. The shipped reference checkpoint, an import's output and a directory with a
file of the user's are refused, naming the files and the way out, and left byte for byte as they were."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ldlm.cli import main
from tests import REPO

REFERENCE = REPO / "models" / "ldlm-austen-tiny"
WAY_OUT = "--force replaces only the output of the same ldlm command, exactly as it wrote it; choose a new output directory"
RECORD = ".ldlm-output.json"  # ldlm.files.OUTPUT_RECORD, as the user sees it


def contents(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def init(out: Path, *extra: str) -> int:
    return main(["init", str(out), "--preset", "tiny", "--quiet", *extra])


def import_reference(out: Path, *extra: str) -> int:
    """The reference's own weights through import-checkpoint (ldlm's parameter names), without the parity round."""
    return main(["import-checkpoint", str(REFERENCE), str(out), "--preset", "tiny", "--skip-parity", "--quiet", *extra])


@pytest.fixture
def trained(tmp_path: Path) -> Path:
    """A copy of the shipped reference checkpoint: trained weights, its README, SHA256SUMS, schedules and training log."""
    copy = tmp_path / "trained"
    shutil.copytree(REFERENCE, copy)
    return copy


@pytest.mark.parametrize("command", ["init", "import-checkpoint"])
def test_force_refuses_the_reference_checkpoint(command: str, trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = contents(trained.parent)
    writer = init if command == "init" else import_reference
    assert writer(trained, "--force") == 2
    err = capsys.readouterr().err
    held = "README.md, SHA256SUMS, config.json, model.safetensors, schedules.json and 2 more"
    assert f"ldlm {command}: error: {trained} was not written by ldlm (it holds {held}, and no {RECORD}); {WAY_OUT}" in err, err
    assert f"or delete {trained} by hand if nothing in it is needed" in err
    assert contents(trained.parent) == before  # the weights, the README and the rest as they were, and nothing beside them


def test_init_force_refuses_an_imports_output_and_import_replaces_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "imported"
    assert import_reference(out) == 0
    assert import_reference(out, "--force") == 0  # its own output, unchanged: replaced
    before = contents(tmp_path)
    capsys.readouterr()
    assert init(out, "--force") == 2
    err = capsys.readouterr().err
    assert f"ldlm init: error: {out} was written by `ldlm import-checkpoint`, not `ldlm init`; {WAY_OUT}" in err, err
    assert contents(tmp_path) == before  # the imported weights were not replaced by random ones


def test_init_force_replaces_what_init_wrote_and_nothing_a_user_added(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    assert init(out, "--seed", "1") == 0
    first = contents(out)
    assert init(out, "--seed", "2", "--force") == 0
    second = contents(out)
    assert sorted(second) == sorted(first) == sorted([RECORD, "config.json", "model.safetensors", "tokenizer.json"])
    assert second["model.safetensors"] != first["model.safetensors"]
    (out / "notes.txt").write_text("mine\n")
    capsys.readouterr()
    assert init(out, "--force") == 2
    err = capsys.readouterr().err
    assert f"ldlm init: error: {out} holds files `ldlm init` did not write: notes.txt; {WAY_OUT}" in err, err
    assert contents(out) == {**second, "notes.txt": b"mine\n"}


def test_import_force_refuses_an_inits_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    assert init(out) == 0
    before = contents(out)
    capsys.readouterr()
    assert import_reference(out, "--force") == 2
    err = capsys.readouterr().err
    assert f"ldlm import-checkpoint: error: {out} was written by `ldlm init`, not `ldlm import-checkpoint`; {WAY_OUT}" in err, err
    assert contents(out) == before
