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
    assert sorted(p.name for p in ckpt.iterdir()) == [".ldlm-output.json", "config.json", "model.safetensors", "tokenizer.json"]
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


def test_generate_with_a_prompt_conditions_every_sample(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--prompt``: the samples are those of ``LDLMPipeline.generate(prompt=...)`` (prefix inpainting), not the
    unprompted ones of the same seed; a prompt as long as ``--length`` is refused with its token count."""
    from ldlm.pipeline import LDLMPipeline

    base = ["generate", str(tiny_checkpoint), "--n", "2", "--length", "10", "--steps", "3", "--json", "--quiet"]
    assert main([*base, "--prompt", "Once upon a time"]) == 0
    prompted = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    pipeline = LDLMPipeline.from_checkpoint(tiny_checkpoint)
    assert prompted == pipeline.generate(2, 10, 3, prompt="Once upon a time").ids() and prompted != plain
    assert main([*base[:4], "--length", "4", "--prompt", "Once upon a time", "--quiet"]) == 2
    assert "the prompt is 4 tokens long; allowed: 1..3 tokens (fewer than length=4)" in capsys.readouterr().err


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
