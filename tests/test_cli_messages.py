"""What a newcomer sees on bad input: each error names the bad value and what is allowed, and the
command stops before doing any work. Expected messages are written out by hand here."""

from __future__ import annotations

from pathlib import Path

import pytest

import ldlm.checkpoint
from ldlm.cli import main


def parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["abc", "2.5", ""])
def test_steps_names_the_bad_value(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["generate", "CKPT", "--steps", value], capsys)
    assert f"argument --steps: expected a positive integer (1, 2, ...), got '{value}'" in err
    assert "_positive_int" not in err


@pytest.mark.parametrize("value", ["0", "-3"])
def test_steps_names_the_allowed_range(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["generate", "CKPT", "--steps", value], capsys)
    assert f"argument --steps: {value} is out of range; allowed: an integer >= 1" in err


@pytest.mark.parametrize("option", ["--batches", "--workload-lengths"])
@pytest.mark.parametrize("value", ["1,x", "8,0", "", "1,,8"])
def test_bench_integer_lists_name_the_bad_value(option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["bench", "CKPT", option, value], capsys)
    assert f"argument {option}: expected comma-separated positive integers (e.g. 1,8), got '{value}'" in err
    assert "int()" not in err


def test_bench_integer_lists_parse(tmp_path: Path) -> None:
    from ldlm.cli import build_parser

    args = build_parser().parse_args(["bench", "CKPT", "--batches", "2,16", "--workload-lengths", "8"])
    assert args.batches == [2, 16] and args.workload_lengths == [8]
    defaults = build_parser().parse_args(["bench", "CKPT"])
    assert defaults.batches == [1, 8] and defaults.workload_lengths == [16, 32, 64, 128]


def test_bench_length_above_max_seq_len_is_an_error(tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    argv = ["bench", str(tiny_checkpoint), "--length", "1000", "--out", str(out), "--quiet",
            "--backends", "eager", "--batches", "1", "--runs", "1", "--gen-n", "1", "--gen-steps", "1", "--workload-requests", "0"]
    assert main(argv) == 2
    assert "ldlm bench: error: length=1000 is out of range; allowed: 1..128 (config max_seq_len)" in capsys.readouterr().err
    assert not out.exists()


def test_init_on_an_existing_directory_refuses_before_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    built: list[object] = []
    monkeypatch.setattr(ldlm.checkpoint, "init_model", lambda *args: built.append(args))
    assert main(["init", str(out), "--quiet"]) == 2
    assert f"ldlm init: error: {out} already exists; pass overwrite=True (CLI: --force) to replace it" in capsys.readouterr().err
    assert built == [], "the model was built before the existing directory was refused"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_verify_onnx_on_a_plain_file_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    Path("README.md").write_text("# not an export\n")
    assert main(["verify-onnx", "README.md"]) == 2
    err = capsys.readouterr().err
    assert "README.md is a file, not an export directory or an .onnx file; allowed: a directory written by " \
           "`ldlm export`, or an .onnx file in one" in err
    assert ". has no" not in err

    Path("loose.onnx").write_bytes(b"")
    assert main(["verify-onnx", "loose.onnx"]) == 2
    assert f"loose.onnx is not inside an export: {tmp_path.resolve()} has no manifest.json" in capsys.readouterr().err


def test_probe_eps_checks_the_artifact_before_loading_the_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No checkpoint exists here: the artifact's error comes first, from the API as from the CLI."""
    from ldlm.serve.checks.eps_probe import probe_layer_norm_eps

    missing = tmp_path / "no-checkpoint"
    with pytest.raises(ValueError, match=r"an artifact is needed; allowed: --onnx-dir DIR \(ONNX Runtime\) or --engine-dir DIR \(TensorRT\)"):
        probe_layer_norm_eps(missing)
    with pytest.raises(ValueError, match=r"onnx_dir='.*no-export' is not a directory; allowed: a directory written by `ldlm export`"):
        probe_layer_norm_eps(missing, onnx_dir=tmp_path / "no-export")
    assert main(["probe-eps", str(missing)]) == 2
    assert "an artifact is needed; allowed: --onnx-dir DIR (ONNX Runtime) or --engine-dir DIR (TensorRT)" in capsys.readouterr().err
