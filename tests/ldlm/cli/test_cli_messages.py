"""What a newcomer sees on bad input: each error names the bad value and what is allowed, and the
command stops before doing any work. Expected messages are written out by hand here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ldlm.model.checkpoint
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
    assert f"argument --steps: {value} is out of range; allowed: 1..1000 denoising steps (as ldlm serve's max_steps)" in err


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
    argv = [
        "bench",
        str(tiny_checkpoint),
        "--length",
        "1000",
        "--out",
        str(out),
        "--quiet",
        "--backends",
        "eager",
        "--batches",
        "1",
        "--runs",
        "1",
        "--gen-n",
        "1",
        "--gen-steps",
        "1",
        "--workload-requests",
        "0",
    ]
    assert main(argv) == 2
    assert "ldlm bench: error: length=1000 is out of range; allowed: 1..128 (config max_seq_len)" in capsys.readouterr().err
    assert not out.exists()


def test_init_into_an_empty_directory_needs_no_force(tmp_path: Path) -> None:
    """An empty directory is a new one (a mount point, a directory made for it), as for the Python API."""
    out = tmp_path / "ckpt"
    out.mkdir()
    assert main(["init", str(out), "--preset", "tiny", "--quiet"]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_init_on_an_existing_directory_refuses_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    built: list[object] = []
    monkeypatch.setattr(ldlm.model.checkpoint, "init_model", lambda *args: built.append(args))
    assert main(["init", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"ldlm init: error: {out} already exists; pass --force to replace it, or choose another output directory" in err
    assert "overwrite=True" not in err  # the Python API's words, not the CLI's
    assert built == [], "the model was built before the existing directory was refused"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_verify_onnx_on_a_plain_file_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    Path("README.md").write_text("# not an export\n")
    assert main(["verify-onnx", "README.md"]) == 2
    err = capsys.readouterr().err
    assert (
        "README.md is a file, not an export directory or an .onnx file; allowed: a directory written by "
        "`ldlm export`, or an .onnx file in one" in err
    )
    assert ". has no" not in err

    Path("loose.onnx").write_bytes(b"")
    assert main(["verify-onnx", "loose.onnx"]) == 2
    assert f"loose.onnx is not inside an export: {tmp_path.resolve()} has no manifest.json" in capsys.readouterr().err


def test_probe_eps_checks_the_artifact_before_loading_the_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No checkpoint exists here: the artifact's error comes first, from the API as from the CLI."""
    from ldlm.serve.checks.eps_probe_artifact import probe_layer_norm_eps

    missing = tmp_path / "no-checkpoint"
    with pytest.raises(
        ValueError, match=r"an artifact is needed; allowed: --onnx-dir DIR \(ONNX Runtime\) or --engine-dir DIR \(TensorRT\)"
    ):
        probe_layer_norm_eps(missing)
    with pytest.raises(ValueError, match=r"onnx_dir='.*no-export' is not a directory; allowed: a directory written by `ldlm export`"):
        probe_layer_norm_eps(missing, onnx_dir=tmp_path / "no-export")
    assert main(["probe-eps", str(missing)]) == 2
    assert "an artifact is needed; allowed: --onnx-dir DIR (ONNX Runtime) or --engine-dir DIR (TensorRT)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, value, allowed",
    [
        ("--steps", "1000000000", "1..1000 denoising steps (as ldlm serve's max_steps)"),  # was 12 GB of time grid
        ("--steps", "1001", "1..1000 denoising steps (as ldlm serve's max_steps)"),
        ("--n", "1000000000", "1..64 samples per run (as ldlm serve's max_n)"),  # was 4.2 GB of noise
        ("--n", "65", "1..64 samples per run (as ldlm serve's max_n)"),
        ("--seed", "-1", "0..9223372036854775807"),
        ("--seed", "9223372036854775808", "0..9223372036854775807"),
        ("--t-min", "5", "a number in (0, 1), both ends excluded"),
        ("--t-min", "nan", "a number in (0, 1), both ends excluded"),
        ("--prior-temperature", "0", "a number in (0, 1], 0 excluded"),
        ("--prior-temperature", "1.5", "a number in (0, 1], 0 excluded"),
    ],
)
def test_generate_has_the_servers_caps(option: str, value: str, allowed: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["generate", "CKPT", option, value], capsys)
    assert f"argument {option}: {value} is out of range; allowed: {allowed}" in err


def test_the_caps_are_the_servers_numbers() -> None:
    """One source: the server's defaults and the CLI's limits are the same constants."""
    from ldlm.cli import build_parser
    from ldlm.serve.api.service import ServerSettings

    settings = ServerSettings()
    assert (settings.max_n, settings.max_steps) == (64, 1000)
    parser = build_parser()
    assert parser.parse_args(["generate", "CKPT", "--n", "64", "--steps", "1000"]).n == 64
    for option, above in (("--n", settings.max_n + 1), ("--steps", settings.max_steps + 1)):
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "CKPT", option, str(above)])


def test_init_and_generate_take_the_same_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["init", "OUT", "--seed", "-5"], capsys)
    assert "argument --seed: -5 is out of range; allowed: 0..9223372036854775807" in err
    from ldlm.cli import build_parser

    assert build_parser().parse_args(["init", "OUT", "--seed", "9223372036854775807"]).seed == 2**63 - 1


def test_generate_length_above_the_checkpoints_limit_in_cli_words(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_checkpoint), "--length", "129", "--quiet"]) == 2
    assert "ldlm generate: error: --length 129 is out of range; allowed: 1..128 (the checkpoint's max_seq_len)" in capsys.readouterr().err


def test_generate_defaults_come_from_the_checkpoint_config(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import ldlm.pipeline
    from ldlm.sampling import resolve

    plans: list = []

    def resolved(*args, **kwargs):  # the real resolution, recorded, then the run stops
        plans.append(resolve(*args, **kwargs))
        raise ValueError("stop")

    monkeypatch.setattr(ldlm.pipeline, "resolve", resolved)
    assert main(["generate", str(tiny_checkpoint), "--quiet"]) == 2
    assert (plans[0].steps, plans[0].sampler.name) == (21, "dpm3m-psc")  # the tiny preset's default_steps and default_sampler
    assert plans[0].prior_temperature == 1.0
    assert main(["generate", str(tiny_checkpoint), "--quiet", "--prior-temperature", "0.4"]) == 2
    assert plans[1].prior_temperature == 0.4


def test_an_os_error_names_the_users_path_not_a_temporary_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "read-only" / "ckpt"
    out.parent.mkdir()
    out.parent.chmod(0o500)
    try:
        if os.access(out.parent, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root): the permission error cannot happen here")
        assert main(["init", str(out), "--quiet"]) == 2
    finally:
        out.parent.chmod(0o700)
    err = capsys.readouterr().err
    assert err == f"ldlm init: error: {out}: Permission denied\n", err


def test_an_os_error_under_proc_names_the_users_path(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: /proc takes no new files, for root too."""
    assert main(["init", "/proc/nope", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ldlm init: error: /proc/nope: ") and ".tmp" not in err and err.count("\n") == 1, err


def test_ctrl_c_ends_a_command_with_one_line_and_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ldlm.cli import model

    def interrupted(args) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "_cmd_generate", interrupted)  # the parser is built per call, with this
    try:
        code = main(["generate", "CKPT"])
    except KeyboardInterrupt:  # escaping, it would also end this pytest run
        pytest.fail("the KeyboardInterrupt escaped main() (a traceback for the user)")
    assert code == 130
    assert capsys.readouterr().err.strip() == "ldlm generate: interrupted"


def test_ctrl_c_during_a_real_export(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """SIGINT to ``ldlm export`` once its progress bar is up: one line, exit code 130, nothing left in OUT."""
    out = tmp_path / "onnx"
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "ldlm.cli", "export", str(tiny_checkpoint), str(out)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        seen = b""
        while b"%|" not in seen:  # tqdm's bar: the export is under way
            chunk = process.stderr.read1(4096)  # type: ignore[union-attr]
            assert chunk, f"export ended before its progress bar: {seen.decode(errors='replace')}"
            seen += chunk
        process.send_signal(signal.SIGINT)
        rest = process.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
        assert process.wait(120) == 130
    finally:
        if process.poll() is None:
            process.kill()
    lines = [line for line in rest.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    assert lines == ["ldlm export: interrupted"], rest[-3000:]
    assert not out.exists()


def serve_process(source: Path, port: int, cache: Path | None = None) -> subprocess.Popen:
    """``ldlm serve source``; a checkpoint's export is cached under ``cache`` (never the user's own cache)."""
    environ = {**os.environ, "PYTHONUNBUFFERED": "1"} | ({"LDLM_CACHE_DIR": str(cache)} if cache is not None else {})
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "ldlm.cli", "serve", str(source), "--port", str(port), "--log-level", "warning"],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=environ,
        text=True,
    )


def first_line(stream, timeout_s: float) -> str:
    """The first line of a child's pipe, or '' when none comes within ``timeout_s`` (the child keeps running)."""
    import select

    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if ready else ""


def test_serve_says_what_it_prepares_and_ctrl_c_stops_it_in_one_line(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint served by ONNX Runtime is exported first (tens of seconds): the person waiting is told
    so while it happens (nothing listens yet), and Ctrl-C then ends it with one line and 130, leaving
    no cache entry behind."""
    import httpx

    from tests.servers import free_port

    port = free_port()
    process = serve_process(tiny_checkpoint, port, tmp_path)
    try:
        first = first_line(process.stderr, 60)
        assert first.startswith(f"ldlm serve: exporting the checkpoint {tiny_checkpoint} to ONNX in {tmp_path / 'exports'}/"), first
        assert first.endswith(" (cached for the next start)\n"), first
        with pytest.raises(httpx.TransportError):  # told while preparing: not serving yet
            httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=2)
        process.send_signal(signal.SIGINT)
        _, rest = process.communicate(timeout=300)  # the export may finish its current phase first on a loaded machine
        assert process.returncode == 130, rest[-3000:]  # where a Ctrl-C that ended the process by the signal escaped
    finally:
        if process.poll() is None:
            process.kill()
    lines = [line for line in rest.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    assert lines == ["ldlm serve: interrupted"], rest[-3000:]
    assert [p.name for p in (tmp_path / "exports").iterdir() if not p.name.endswith(".lock")] == []  # an interrupted export is not cached


def test_serve_reports_loading_then_ready(export_dir: Path) -> None:
    from tests.servers import free_port, wait_ready

    port = free_port()
    process = serve_process(export_dir, port)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", 120)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert err.splitlines()[:3] == [
        f"ldlm serve: loading the graphs of {export_dir} (ort)",
        "ldlm serve: no tuned step grids (no schedules.json; `ldlm tune-schedule` makes one): each sampler's default grid",
        "ldlm serve: ready",
    ], err
    assert out.startswith(f"ldlm serving {export_dir} (ort;")
