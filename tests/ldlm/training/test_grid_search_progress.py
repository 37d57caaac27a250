"""`ldlm tune-schedule`'s reference phase (DDIM at reference_steps on the tuning samples, minutes on a CPU) shows
a progress bar of its steps, labelled as the reference; --quiet shows none."""

from __future__ import annotations

import pytest

from ldlm.pipeline import LDLMPipeline
from ldlm.training.grid_search import Tuner, TuningSettings


def test_the_reference_solve_shows_its_steps(pipeline: LDLMPipeline, capsys: pytest.CaptureFixture[str]) -> None:
    settings = TuningSettings("ddim", steps=(2,), reference_steps=200)
    # a short reference, below what tuning accepts: the bar is under test here, not the reference's accuracy
    object.__setattr__(settings, "reference_steps", 6)
    tuner = Tuner(pipeline, settings, progress=True)
    tuner.samples(seed=7, n=1, length=4)
    shown = capsys.readouterr().err
    assert "reference ddim@6 (1 x 4 tokens, seed 7)" in shown and "6/6" in shown
    tuner.samples(seed=7, n=1, length=4)  # kept: no second solve, no second bar
    assert capsys.readouterr().err == ""
    tuner.progress = False  # --quiet
    tuner.samples(seed=8, n=1, length=4)
    assert capsys.readouterr().err == ""
