"""``ldlm tune-schedule``'s output: the checkpoint's own schedules.json (its default step counts) is written only
with --force, a trial run goes to --out, the run says which defaults change, and a reference too coarse to score
the step counts it compares is refused before any work."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.model.checkpoint import load_config
from ldlm.sampling.tuned_grids import TunedGrid, TunedSchedules, load_schedules, weights_sha256
from ldlm.training.grid_search import TuningSettings, default_changes

# the smallest run the command accepts: one sample of 6 tokens, 4 evaluations
SMALL = ["--sampler", "ddim", "--evaluations", "4", "--tune-n", "1", "--tune-length", "6", "--held-out-n", "1"]
SMALL += ["--held-out-lengths", "6", "--quiet", "--json"]
TIMES = (1.0, 0.6, 0.25, 0.05)
MATCHING = {"held_out": {"6": {"error": 0.1, "tokens": 1.0}}, "ddim50_held_out": {"6": {"error": 0.2, "tokens": 0.9}}}


def checkpoint_with_schedules(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of the tiny checkpoint whose schedules.json makes 3 steps the ddim default."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    config = load_config(ckpt)
    grid = TunedGrid("ddim", 3, TIMES, MATCHING)
    TunedSchedules(weights_sha256(ckpt / "model.safetensors"), config.t_min, (grid,), {"ddim": 3}).save(ckpt / "schedules.json")
    return ckpt


def contents(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_the_checkpoints_own_schedules_are_written_only_with_force(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """Without --out, and with --out naming the checkpoint's file or any existing file, the run is refused
    before any work: the checkpoint and the other file are as they were, and nothing else is written."""
    ckpt = checkpoint_with_schedules(tiny_checkpoint, tmp_path)
    other = tmp_path / "mine.json"
    other.write_text("my own notes\n")
    before, around = contents(ckpt), contents(tmp_path)
    base = ["tune-schedule", str(ckpt), "--steps", "3", *SMALL]
    for extra, message in (
        ([], f"no --out: tune-schedule writes the checkpoint's own {ckpt / 'schedules.json'} (its default step counts) only with --force"),
        (["--out", str(ckpt / "schedules.json")], "is the checkpoint's own schedules.json; pass --force to replace it"),
        (["--out", str(other)], f"{other} was not written by `ldlm tune-schedule`; --force replaces only a file the same ldlm command"),
        (["--out", str(tmp_path)], f"--out {tmp_path} is a directory; allowed: a file path"),
    ):
        assert main(base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
        assert contents(ckpt) == before and contents(tmp_path) == around, extra


def tuned_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search replaced by one that returns a 2-step ddim grid matching DDIM@50: what is written where, and
    what the command says of it, do not depend on the search (tests/ldlm/training/test_grid_search.py runs it)."""
    import ldlm.training.grid_search

    monkeypatch.setattr(
        ldlm.training.grid_search, "tune_grid", lambda tuner, steps, progress=False: TunedGrid("ddim", 2, (1.0, 0.5, 0.05), MATCHING)
    )


def test_a_trial_run_writes_its_out_and_says_what_the_defaults_would_become(
    tiny_checkpoint: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = checkpoint_with_schedules(tiny_checkpoint, tmp_path)
    tuned_as_given(monkeypatch)
    before = contents(ckpt)
    out = tmp_path / "trial.json"
    assert main(["tune-schedule", str(ckpt), "--steps", "2", *SMALL, "--out", str(out)]) == 0
    assert contents(ckpt) == before
    written = TunedSchedules.from_json(out.read_text())
    assert written.steps_tuned("ddim") == [2] and written.defaults == {"ddim": 2}
    assert f"as {ckpt}'s schedules.json, default steps would be: ddim 3 -> 2" in capsys.readouterr().err


def test_a_forced_run_replaces_the_checkpoints_grids_and_says_which_defaults_change(
    tiny_checkpoint: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = checkpoint_with_schedules(tiny_checkpoint, tmp_path)
    tuned_as_given(monkeypatch)
    assert main(["tune-schedule", str(ckpt), "--steps", "2", *SMALL, "--force"]) == 0
    written = load_schedules(ckpt, weights=ckpt / "model.safetensors")
    assert written is not None and written.steps_tuned("ddim") == [2, 3]  # the 3-step grid kept, the 2-step one added
    assert written.defaults == {"ddim": 2}
    assert "the checkpoint's default steps: ddim 3 -> 2" in capsys.readouterr().err


def test_the_defaults_that_change_are_named_per_sampler() -> None:
    """Against the rule of ldlm.sampling.resolve: a sampler without a tuned default, and every sampler of grids tuned
    at another prior temperature, takes the config's default_steps."""
    config = load_config(Path(__file__).parents[3] / "models" / "ldlm-austen-tiny")
    grid = TunedGrid("ddim", 3, TIMES, MATCHING)
    old = TunedSchedules("0" * 64, config.t_min, (grid, TunedGrid("dpm2m", 3, TIMES, MATCHING)), {"ddim": 3, "dpm2m": 3})
    new = TunedSchedules("0" * 64, config.t_min, (grid,), {"ddim": 3})
    assert default_changes(config, old, new) == {"ddim": (3, 3), "dpm2m": (3, config.default_steps)}
    assert default_changes(config, None, new) == {"ddim": (config.default_steps, 3)}
    cooler = TunedSchedules("0" * 64, config.t_min, (grid,), {"ddim": 3}, prior_temperature=0.5)
    assert default_changes(config, cooler, new) == {"ddim": (config.default_steps, 3)}


def test_a_reference_too_coarse_for_the_step_counts_it_scores_is_refused(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """4x the largest step count compared, DDIM@50 included: at least 200, and 4x --steps above 50."""
    out = tmp_path / "schedules.json"
    for steps, reference, least in (("3", "199", 200), ("3", "50", 200), ("60", "200", 240)):
        args = ["tune-schedule", str(tiny_checkpoint), "--steps", steps, "--reference-steps", reference, *SMALL, "--out", str(out)]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"--reference-steps={reference} is too coarse for the reference; allowed: >= {least}" in err, err
        assert f"pass {least} or more" in err
        assert not out.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=re.escape("reference_steps=199 is too coarse for the reference; allowed: >= 200")):
        TuningSettings("ddim", reference_steps=199)
    assert TuningSettings("ddim", (60,), reference_steps=240).reference_steps == 240
