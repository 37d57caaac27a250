"""The ``ldlm`` command line: one thin subcommand per stage of the Python API, grouped by role
(``model``: checkpoints; ``artifacts``: export, engines, Triton; ``checks``: parity, probes, bench;
``serving``: the HTTP service). Each group module holds its commands' parsers next to their code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ldlm import __version__
from ldlm.cli import artifacts, checks, model, serving


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ldlm",
        description="LDLM latent diffusion language model, from PyTorch to production inference: checkpoints, "
        "generation, ONNX export and verification, TensorRT engines, parity checks, benchmarks and serving. "
        "Typical flow: init -> export -> build-engine -> parity -> serve (or triton-repo).",
    )
    parser.add_argument("--version", action="version", version=f"ldlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (model, artifacts, checks, serving):
        group.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, RuntimeError, FileExistsError, FileNotFoundError) as error:
        print(f"ldlm {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0
