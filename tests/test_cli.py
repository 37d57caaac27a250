from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ldlm.cli import main


def test_init_generate_reconstruct(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "tiny"
    assert main(["init", str(ckpt), "--preset", "tiny", "--seed", "3", "--quiet"]) == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    capsys.readouterr()

    args = ["generate", str(ckpt), "--n", "2", "--length", "6", "--steps", "3", "--sampler", "ddim", "--json", "--quiet"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert len(first["texts"]) == 2 and [len(r) for r in first["token_ids"]] == [6, 6]
    assert first["token_ids"] == second["token_ids"]

    assert main(["reconstruct", str(ckpt), "Hello there", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["texts"]) == 1


def test_cli_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "tiny"
    assert main(["init", str(ckpt), "--quiet"]) == 0
    assert main(["init", str(ckpt), "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--length", "999", "--quiet"]) == 2
    assert "--length 999 is out of range; allowed: 1..128" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "missing"), "--quiet"]) == 2
    assert "missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", str(ckpt), "--steps", "0"])
    assert "--steps: 0 is out of range" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["init", "generate", "reconstruct"])
def test_console_script_help(command: str) -> None:
    out = subprocess.run([sys.executable, "-m", "ldlm.cli", command, "--help"], capture_output=True, text=True, check=True).stdout
    assert f"usage: ldlm {command}" in out
