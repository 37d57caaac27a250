"""``ldlm parity --save-inputs / --load-inputs / --save-outputs``: a case saved from the command line replays
with the same figures, and a replay given options that contradict its file, or no file, is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from ldlm.cli import main


def test_parity_saves_and_replays_its_inputs(tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case, outputs = tmp_path / "case.safetensors", tmp_path / "outputs.safetensors"
    run = ["parity", str(tiny_checkpoint), "--backend", "eager", "--quiet", "--out"]
    assert main([*run, str(tmp_path / "first"), "--seed", "5", "--steps", "1", "--save-inputs", str(case)]) == 0
    assert f"inputs: {case}" in capsys.readouterr().out
    with safe_open(str(case), framework="np") as f:  # read as any safetensors reader would
        header = json.loads(f.metadata()["ldlm_parity"])
    assert (header["seed"], header["end_to_end"]["steps"], header["saved_with"]["backend"]) == (5, 1, "eager")

    assert main([*run, str(tmp_path / "again"), "--load-inputs", str(case), "--save-outputs", str(outputs)]) == 0
    assert f"outputs: {outputs}" in capsys.readouterr().out
    first, again = (json.loads((tmp_path / name / "parity.json").read_text()) for name in ("first", "again"))
    assert again["graphs"] == first["graphs"] and again["token_agreement"] == first["token_agreement"] == 1.0
    with safe_open(str(outputs), framework="np") as f:
        assert {"reference/end_to_end/token_ids", "candidate/denoiser/padded/x0_hat"} <= set(f.keys())  # noqa: SIM118

    assert main([*run, str(tmp_path / "other-seed"), "--load-inputs", str(case), "--seed", "6"]) == 2
    said = capsys.readouterr().err
    assert f"ldlm parity: error: seed=6 disagrees with the parity inputs {case}, made with seed 5" in said
    assert main([*run, str(tmp_path / "none"), "--load-inputs", str(tmp_path / "missing.safetensors")]) == 2
    assert "missing.safetensors is not a file; allowed: a file written by `ldlm parity --save-inputs`" in capsys.readouterr().err
    assert not (tmp_path / "other-seed").exists() and not (tmp_path / "none").exists()
