"""The ``ldlm`` command line: one thin subcommand per stage of the Python API, grouped by role
(``model``: checkpoints; ``tuning``: step grids; ``artifacts``: export, engines, Triton; ``checks``: parity, probes; ``bench``: benchmarks;
``serving``: the HTTP service). Each group module holds its commands' parsers next to their code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ldlm import __version__
from ldlm.cli import artifacts, bench, checks, model, serving, tuning
from ldlm.files import command_writer, empty_directory, refuse_existing, refuse_unsafe_target
from ldlm.interrupts import remembered_interrupts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ldlm",
        description="LDLM latent diffusion language model, from PyTorch to production inference: checkpoints, "
        "generation, ONNX export and verification, TensorRT engines, parity checks, benchmarks and serving. "
        "Typical flow: init -> export -> build-engine -> parity -> serve (or triton-repo).",
    )
    parser.add_argument("--version", action="version", version=f"ldlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (model, tuning, artifacts, checks, bench, serving):
        group.add_commands(sub)
    return parser


# Arguments that name the user's files: an OS error is reported with the path the user typed, not
# the temporary sibling a command was writing through (ldlm.files.atomic_directory).
PATH_ARGUMENTS = (
    "out",
    "checkpoint",
    "source",
    "path",
    "onnx_dir",
    "engine_dir",
    "gpt2_dir",
    "tokenizer_dir",
    "timing_cache",
    "save_inputs",
    "load_inputs",
    "save_outputs",
)
INTERRUPTED = 130  # 128 + SIGINT, as shells report a command ended by Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with remembered_interrupts():
            refuse_existing_out(args)
            args.func(args)
    except KeyboardInterrupt:
        # one line, however deep the interrupted stage was (an export, a build, a running server);
        # the stages write through temporary names, so an interrupted one leaves no partial output
        print(f"\nldlm {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (FileExistsError, FileNotFoundError) as error:
        print(f"ldlm {args.command}: error: {os_error_message(error, args) if error.errno else error}", file=sys.stderr)
        return 2
    except OSError as error:  # permissions, a full disk, a read-only or special file system
        print(f"ldlm {args.command}: error: {os_error_message(error, args)}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as error:
        print(f"ldlm {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


# What a writer reads, in the words an error names it by; its output may neither be nor hold one.
INPUT_ARGUMENTS = {
    "checkpoint": "checkpoint",
    "source": "source",
    "onnx_dir": "export",
    "engine_dir": "engine directory",
    "gpt2_dir": "GPT-2 directory",
    "tokenizer_dir": "tokenizer directory",
}


# Files a command writes beside its output directory: never inside it, where replacing the directory removes them.
FILE_OUTPUTS = {"save_inputs": "--save-inputs", "save_outputs": "--save-outputs", "timing_cache": "--timing-cache"}


def refuse_existing_out(args: argparse.Namespace) -> None:
    """Before any work, in CLI words: a command that writes the directory OUT refuses an OUT that it may not
    replace (ldlm.files.refuse_existing: without --force any that is not empty, with it all but its own
    earlier output), and a file it writes inside OUT."""
    out = getattr(args, "out", None)
    if out is None:
        return
    inputs = {words: getattr(args, name) for name, words in INPUT_ARGUMENTS.items() if isinstance(getattr(args, name, None), str)}
    refuse_unsafe_target(out, inputs, example=args.out_example)  # each command's own kind of directory (its parser's default)
    if not args.force and Path(out).exists() and not empty_directory(Path(out)):  # an empty directory is a new one
        raise FileExistsError(f"{out} already exists; pass --force to replace it, or choose another output directory")
    for name, option in FILE_OUTPUTS.items():
        path = getattr(args, name, None)
        if path is not None and Path(out).resolve() in Path(path).resolve().parents:
            raise ValueError(f"{option} {path} is inside the output directory {out}, which is written whole; allowed: a file outside it")
    refuse_existing(out, args.force, inputs, writer=command_writer(args.command))


def os_error_message(error: OSError, args: argparse.Namespace) -> str:
    """``PATH: reason``, naming the argument the user gave when the failing file is it, inside it, or a
    temporary sibling of it (``.NAME.<pid>.tmp``)."""
    reason = error.strerror or str(error)
    if error.filename is None:
        return reason
    failing = Path(os.fsdecode(error.filename))
    for name in PATH_ARGUMENTS:
        given = getattr(args, name, None)
        if not isinstance(given, str):
            continue
        mine = Path(given)
        if failing == mine or mine in failing.parents or (failing.parent == mine.parent and failing.name.startswith(f".{mine.name}.")):
            return f"{given}: {reason}"
    return f"{failing}: {reason}"
