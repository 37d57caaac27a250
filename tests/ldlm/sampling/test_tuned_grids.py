"""schedules.json records the weights it was tuned on. Without SHA256SUMS it is what catches damaged weights, so
its refusal names the weights as the suspect and the fixes that mend them, not the removal that hides it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.sampling.tuned_grids import ScheduleError, load_schedules, weights_sha256
from tests import REPO

REFERENCE = REPO / "models" / "ldlm-austen-tiny"


def damaged_copy(tmp_path: Path, keep_checksums: bool) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(REFERENCE, ckpt)
    if not keep_checksums:
        (ckpt / "SHA256SUMS").unlink()
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x40  # one bit of the last tensor: the file still reads as safetensors
    weights.write_bytes(bytes(data))
    return ckpt


def test_damaged_weights_without_checksums_are_named_the_suspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = damaged_copy(tmp_path, keep_checksums=False)
    weights, schedules = ckpt / "model.safetensors", ckpt / "schedules.json"
    with pytest.raises(ScheduleError) as refused:
        load_schedules(ckpt, weights=weights)
    message = str(refused.value)
    tuned_on = load_schedules(REFERENCE, weights=REFERENCE / "model.safetensors").weights_sha256  # type: ignore[union-attr]
    assert message.startswith(
        f"the weights {weights} do not match the weights {schedules} was tuned on (sha256 {weights_sha256(weights)}; "
        f"tuned on {tuned_on}): the weights may be corrupt, truncated or replaced. Restore the checkpoint's own weights"
    ), message
    assert f"tune their grids with `ldlm tune-schedule {ckpt} --force`" in message
    assert "Removing schedules.json would only hide the mismatch" in message
    assert main(["generate", str(ckpt), "--n", "1", "--length", "4", "--steps", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "the weights may be corrupt, truncated or replaced" in err and "Traceback" not in err


def test_with_checksums_the_damaged_file_is_named_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = damaged_copy(tmp_path, keep_checksums=True)
    assert main(["generate", str(ckpt), "--n", "1", "--length", "4", "--steps", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "SHA256SUMS" in err and "schedules.json" not in err


def test_an_exports_grids_point_at_the_checkpoint(tmp_path: Path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    shutil.copy(REFERENCE / "schedules.json", export / "schedules.json")
    with pytest.raises(ScheduleError, match=r"`ldlm tune-schedule CHECKPOINT --force` on their checkpoint, then export it again"):
        load_schedules(export, sha256="0" * 64)
