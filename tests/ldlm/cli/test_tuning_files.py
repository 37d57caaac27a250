"""``ldlm tune-schedule --out FILE``: a file the command did not write is never replaced, --force or not, and
neither is any file of a checkpoint but its schedules.json; a file an earlier tune-schedule wrote is replaced
with --force. Every refusal comes before the search (minutes to hours), naming the file and the way out."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.sampling.tuned_grids import TunedGrid, TunedSchedules
from tests.ldlm.cli.test_tuning import SMALL, checkpoint_with_schedules, tuned_as_given

WAY_OUT = "--force replaces only a file the same ldlm command wrote; choose another file, or delete"


def sha256s(*paths: Path) -> dict[Path, str]:
    return {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}


def no_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """A search that fails the test if it starts: a refusal must come before any work."""
    import ldlm.training.grid_search

    def searched(*_: object, **__: object) -> TunedGrid:
        raise AssertionError("the search ran before the output was checked")

    monkeypatch.setattr(ldlm.training.grid_search, "tune_grid", searched)


def test_a_checkpoints_config_is_never_the_output_even_with_force(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = checkpoint_with_schedules(tiny_checkpoint, tmp_path)
    no_search(monkeypatch)
    before = sha256s(*(p for p in ckpt.iterdir() if p.is_file()))
    for name in ("config.json", "model.safetensors", "new.json"):
        assert main(["tune-schedule", str(ckpt), "--steps", "3", *SMALL, "--out", str(ckpt / name), "--force"]) == 2, name
        err = capsys.readouterr().err
        assert f"ldlm tune-schedule: error: {ckpt / name} is inside {ckpt}, a checkpoint" in err, err
        assert f"allowed: a path outside {ckpt}" in err
    assert sha256s(*before) == before and not (ckpt / "new.json").exists()


def test_someone_elses_file_is_not_replaced_even_with_force(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_search(monkeypatch)
    notes = tmp_path / "mine" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("my notes\n")
    before = sha256s(notes)
    for force in ([], ["--force"]):
        assert main(["tune-schedule", str(tiny_checkpoint), "--steps", "3", *SMALL, "--out", str(notes), *force]) == 2
        err = capsys.readouterr().err
        assert f"ldlm tune-schedule: error: {notes} was not written by `ldlm tune-schedule`; {WAY_OUT} {notes} by hand" in err, err
    assert sha256s(notes) == before


def test_force_replaces_a_file_an_earlier_tune_schedule_wrote(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tuned_as_given(monkeypatch)
    out = tmp_path / "trial.json"
    run = ["tune-schedule", str(tiny_checkpoint), "--steps", "2", *SMALL, "--out", str(out)]
    assert main(run) == 0
    first = out.read_bytes()
    assert main(run) == 2
    assert f"{out} already exists; pass overwrite=True (CLI: --force) to replace it, or choose another file" in capsys.readouterr().err
    out.write_bytes(first.replace(b'"t_min"', b'"note": "tuned by hand",\n "t_min"'))  # still a schedules file
    assert main([*run, "--force"]) == 0
    assert TunedSchedules.from_json(out.read_text()).steps_tuned("ddim") == [2] and b"tuned by hand" not in out.read_bytes()
