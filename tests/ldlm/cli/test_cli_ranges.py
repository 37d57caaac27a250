"""Every numeric option of every subcommand has a range, refused by argparse before any work with a
message naming the option, the value and what is allowed. The expected ranges are written out by hand."""

from __future__ import annotations

import argparse

import pytest

from ldlm.cli import build_parser, main

# Subcommands whose parsers live in ldlm/cli/model.py; an option listed here parses without an upper
# limit and is checked later (against the checkpoint's max_seq_len), before any work.
NOT_CAPPED_AT_PARSE = {("generate", "--length")}
# What every capped option must refuse: too large for any range here, negative, not finite.
OUT_OF_EVERY_RANGE = ["1" + "0" * 30, "-1" + "0" * 30, "1e30", "-1e30", "nan", "inf"]


def parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def positionals(parser: argparse.ArgumentParser) -> list[str]:
    return ["X" for action in parser._actions if not action.option_strings and action.nargs != argparse.SUPPRESS]


def numeric_options() -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(command, its parser, option) for every option that takes a number (by its type or its default)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command, parser in sub.choices.items():
        for action in parser._actions:
            numeric_default = isinstance(action.default, (int, float, list)) and not isinstance(action.default, bool)
            if action.option_strings and action.nargs != 0 and (action.type is not None or numeric_default) and not action.choices:
                found.append((command, parser, action.option_strings[-1]))
    return found


@pytest.mark.parametrize("command, parser, option", numeric_options(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_numeric_option_has_a_range(command: str, parser: argparse.ArgumentParser, option: str) -> None:
    if (command, option) in NOT_CAPPED_AT_PARSE:
        pytest.skip(f"{command} {option} is checked against the checkpoint after parsing")
    action = next(a for a in parser._actions if option in a.option_strings)
    assert action.type is not None, f"{command} {option} has a numeric default but parses any string"
    for value in OUT_OF_EVERY_RANGE:
        with pytest.raises(SystemExit):
            parser.parse_args([*positionals(parser), f"{option}={value}"])


@pytest.mark.parametrize(
    "command, option, value, allowed",
    [
        # bench: what made RSS reach 21.8 GB, and its neighbours
        ("bench", "--batches", "100000", "1..64 samples per execution (as ldlm serve's max_n)"),
        ("bench", "--batches", "1,8,65", "1..64 samples per execution (as ldlm serve's max_n)"),
        ("bench", "--runs", "100001", "1..10000 timed runs per cell"),
        ("bench", "--length", "65537", "1..65536 tokens (the largest max_seq_len a config may have)"),
        ("bench", "--threads", "1025", "1..1024 threads"),
        ("bench", "--threads", "0", "1..1024 threads"),
        ("bench", "--gen-n", "65", "1..64 samples per run (as ldlm serve's max_n)"),
        ("bench", "--gen-steps", "1001", "1..1000 denoising steps (as ldlm serve's max_steps)"),
        ("bench", "--solver-reference-steps", "1001", "1..1000 denoising steps (as ldlm serve's max_steps)"),
        ("bench", "--workload-requests", "-1", "0..10000 requests (0 skips the workload)"),
        ("bench", "--workload-requests", "10001", "0..10000 requests (0 skips the workload)"),
        ("bench", "--workload-rate", "0", "a number in (0, 1000000] arrivals per second, 0 excluded"),
        ("bench", "--workload-lengths", "16,70000", "1..65536 tokens (the largest max_seq_len a config may have)"),
        ("bench", "--max-batch", "65537", "1..65536 samples per execution (as ldlm serve's max_batch)"),
        # generate: the request fields' ranges (ldlm.limits), as the server's bodies check them
        ("generate", "--prompt-strength", "4.5", "a number in [0, 4]"),
        ("generate", "--prompt-strength", "-0.5", "a number in [0, 4]"),
        # serve: the server's own ranges (ServerSettings)
        ("serve", "--threads", "-3", "1..1024 threads"),
        ("serve", "--port", "65536", "0..65535"),
        ("serve", "--max-batch", "65537", "1..65536 samples per execution (as ldlm serve's max_batch)"),
        ("serve", "--max-queue", "1048577", "1..1048576"),
        ("serve", "--max-body-mb", "2049", "1..2048 MiB"),
        ("serve", "--max-request-samples", "1048577", "1..1048576"),
        ("serve", "--max-request-tokens", "1073741825", "1..1073741824"),
        ("serve", "--max-connections", "1048577", "1..1048576"),
        ("serve", "--max-delay-ms", "-1", "a number in [0, 60000] ms"),
        ("serve", "--preview-budget", "0", "a number in (0, 1], 0 excluded"),
        ("serve", "--preview-budget", "1.5", "a number in (0, 1], 0 excluded"),
        ("serve", "--timeout-s", "0", "a number in (0, 86400] s, 0 excluded"),
        ("serve", "--header-timeout-s", "inf", "a number in (0, 86400] s, 0 excluded"),
        ("serve", "--body-timeout-s", "nan", "a number in (0, 86400] s, 0 excluded"),
        ("serve", "--replicas", "4097", "1..4096 replicas"),
        ("serve", "--replica-cpus", "-1", "a number in [0, 1024] CPUs per replica"),
        ("serve", "--replica-gpus", "65", "a number in [0, 64] GPUs per replica"),
        # the artifact commands
        ("build-engine", "--optimization-level", "6", "0..5"),
        ("build-engine", "--workspace-mb", "0", "1..1048576 MiB"),
        ("triton-repo", "--max-batch", "65537", "1..65536"),
        ("triton-repo", "--max-n", "65537", "1..65536"),
        ("triton-repo", "--queue-delay-us", "-1", "0..60000000 microseconds"),
        # the checks
        ("parity", "--steps", "1001", "1..1000 denoising steps (as ldlm serve's max_steps)"),
        ("parity", "--seed", "-1", "0..9223372036854775807"),
        ("probe-eps", "--seed", "9223372036854775808", "0..9223372036854775807"),
    ],
)
def test_the_message_names_option_value_and_range(
    command: str, option: str, value: str, allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    two_positionals = command in ("export", "build-engine", "triton-repo")
    argv = [command, "A", *(["B"] if two_positionals else []), f"{option}={value}"]
    err = parse_error(argv, capsys)
    worst = value.split(",")[-1]
    assert f"argument {option}: {worst} is out of range; allowed: {allowed}" in err, err


@pytest.mark.parametrize(
    "command, option, value",
    [
        ("bench", "--batches", "64"),
        ("bench", "--threads", "1024"),
        ("bench", "--workload-requests", "0"),
        ("generate", "--prompt-strength", "0"),
        ("generate", "--prompt-strength", "4"),
        ("serve", "--port", "0"),
        ("serve", "--threads", "1"),
        ("serve", "--max-delay-ms", "0"),
        ("serve", "--preview-budget", "1"),
        ("serve", "--max-body-mb", "2048"),
        ("serve", "--replica-gpus", "0.5"),
        ("export", "--opset", "20"),
        ("triton-repo", "--queue-delay-us", "0"),
    ],
)
def test_the_ends_of_each_range_are_accepted(command: str, option: str, value: str) -> None:
    two_positionals = command in ("export", "build-engine", "triton-repo")
    build_parser().parse_args([command, "A", *(["B"] if two_positionals else []), option, value])


def test_export_takes_the_exporters_opsets(capsys: pytest.CaptureFixture[str]) -> None:
    from ldlm.export.onnx_export import SUPPORTED_OPSETS

    err = parse_error(["export", "A", "B", "--opset", "19"], capsys)
    assert "argument --opset: invalid choice: 19 (choose from 18, 20)" in err
    action = next(a for a in build_parser()._subparsers._group_actions[0].choices["export"]._actions if "--opset" in a.option_strings)
    assert tuple(action.choices) == SUPPORTED_OPSETS


def test_serve_ranges_are_the_servers() -> None:
    """The CLI refuses exactly what ServerSettings refuses, at both ends of every range."""
    from ldlm.cli.serving import setting
    from ldlm.limits import SETTINGS
    from ldlm.serve.api.service import ServerSettings

    assert set(SETTINGS) >= {"port", "max_batch", "max_queue", "max_request_samples", "max_request_tokens", "max_connections"}
    for name, allowed in SETTINGS.items():
        parse = setting(name)
        for inside in (allowed.low, allowed.high):
            if inside in allowed:  # an open end is no value of the range
                ServerSettings(**{name: type(parse(str(inside)))(inside)})
        step = 1 if not allowed.number else 1e-9 * max(1.0, allowed.high)
        for outside in (allowed.low - step, allowed.high + step):
            with pytest.raises(ValueError, match=f"{name}=.* is out of range; allowed: "):
                ServerSettings(**{name: type(allowed.low)(outside) if not allowed.number else float(outside)})
            with pytest.raises(argparse.ArgumentTypeError, match="is out of range; allowed: "):
                parse(str(outside))


def test_bench_solver_steps_have_the_servers_cap(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """NAME@STEPS is parsed by the bench, before anything is loaded (no checkpoint exists here)."""
    out = tmp_path / "bench"
    assert main(["bench", str(tmp_path / "no-checkpoint"), "--solvers", "ddim@50,dpm3m-psc@100000", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "solver spec 'dpm3m-psc@100000' has 100000 steps; allowed: 1..1000 denoising steps (as ldlm serve's max_steps)" in err
    assert not out.exists()
