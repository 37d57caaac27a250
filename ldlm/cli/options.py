"""Argument types and option groups shared by the commands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ldlm.limits import MAX_STEPS, PRIOR_TEMPERATURE, SEED, T_MIN, Range, out_of_range
from ldlm.serve.runtime.registry import CUDA_DEFAULT_PRECISION, DEFAULT_PRECISION, RUN_PRECISIONS


def integer(text: str, expected: str = "an integer") -> int:
    """``text`` as an integer, or a refusal naming it and what was ``expected``."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def int_in(low: int, high: int, why: str = "", expected: str = "") -> Callable[[str], int]:
    """An argparse type for an integer in ``low..high``; ``why`` says where the upper limit comes from;
    ``expected``: what a text that is no integer is told (default: an integer in the range)."""
    allowed = Range(low, high)

    def parse(text: str) -> int:
        value = integer(text, expected or f"an integer in {allowed}")
        if value not in allowed:
            raise argparse.ArgumentTypeError(allowed.refusal(str(value), why))
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def capped_positive_int(high: int, why: str) -> Callable[[str], int]:
    """An integer in ``1..high``: the same caps as the HTTP API (``ldlm.limits``)."""
    parse = int_in(1, high, why, expected="a positive integer (1, 2, ...)")
    parse.__name__ = "positive integer"
    return parse


def seed_int(text: str) -> int:
    """A seed: 0..2**63 - 1 everywhere (CLI, HTTP, Triton), so a seed that works in one works in all."""
    return int(in_range(SEED)(text))


def float_in(low: float, high: float, why: str = "", low_open: bool = False, high_open: bool = False) -> Callable[[str], float]:
    """An argparse type for a finite number in the interval from ``low`` to ``high``; an open end is
    excluded. ``why`` names the unit or where the limit comes from."""
    interval = f"{'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if high_open else ']'}"
    excluded = {
        (False, False): "",
        (True, False): f", {_number(low)} excluded",
        (False, True): f", {_number(high)} excluded",
        (True, True): ", both ends excluded",
    }[low_open, high_open]
    allowed = f"a number in {interval}{why}{excluded}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        above_low = value > low if low_open else value >= low
        below_high = value < high if high_open else value <= high
        if not (above_low and below_high):  # also refuses nan, and inf beyond any finite end
            raise argparse.ArgumentTypeError(out_of_range(text, allowed))
        return value

    parse.__name__ = "number"  # argparse names the type in some messages
    return parse


def in_range(allowed: Range, why: str = "") -> Callable[[str], float] | Callable[[str], int]:
    """The argparse type of a value bounded in ``ldlm.limits``: the same range the server and the bodies check."""
    if allowed.number:
        return float_in(allowed.low, allowed.high, why, allowed.low_open, allowed.high_open)
    return int_in(int(allowed.low), int(allowed.high), why)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# Denoising steps, as ldlm serve caps them.
STEPS = capped_positive_int(MAX_STEPS, " denoising steps (as ldlm serve's max_steps)")
# A time of the diffusion grid, such as --t-min.
open_unit_float = in_range(T_MIN)
# The prior's standard deviation (ldlm.model.config's prior_temperature).
prior_temperature = in_range(PRIOR_TEMPERATURE)


def add_prior_temperature(p: argparse.ArgumentParser) -> None:
    """--prior-temperature, as every command that samples takes it."""
    p.add_argument(
        "--prior-temperature",
        type=prior_temperature,
        default=None,
        help="the prior's standard deviation tau, in (0, 1]: x_1 ~ N(0, tau^2 I); below 1 trades diversity for text "
        "nearer the training data; tuned grids hold only at the tau they were tuned at (default: the checkpoint "
        "config's prior_temperature, else 1)",
    )


def capped_positive_int_list(high: int, why: str) -> Callable[[str], list[int]]:
    """Comma-separated integers, each in ``1..high`` (batch sizes, lengths)."""
    allowed = Range(1, high)

    def parse(text: str) -> list[int]:
        try:
            values = [int(item) for item in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"expected comma-separated positive integers (e.g. 1,8), got {text!r}")
        for value in values:
            if value not in allowed:
                raise argparse.ArgumentTypeError(allowed.refusal(str(value), why))
        return values

    parse.__name__ = "list of positive integers"
    return parse


def device_options(p: argparse.ArgumentParser, precision: bool = True) -> None:
    """--device and --precision for the torch backends, --provider for ONNX Runtime."""
    p.add_argument("--device", default="cpu", help="torch backends (eager, compiled, inductor): cpu, cuda or cuda:N (default: cpu)")
    if precision:
        p.add_argument(
            "--precision",
            choices=RUN_PRECISIONS,
            default=None,
            help="torch backends' matmuls and attention; the residual stream, LayerNorm, RMSNorm, softmax and logits stay FP32 "
            f"(default: {CUDA_DEFAULT_PRECISION} for a torch backend on --device cuda, else {DEFAULT_PRECISION}). "
            "int8: ort only, the export's INT8 variants (ldlm export --quantize int8; a checkpoint is exported with them)",
        )
    p.add_argument(
        "--provider",
        choices=["cpu", "cuda", "tensorrt"],
        default="cpu",
        help="ONNX Runtime execution provider; cuda and tensorrt need onnxruntime-gpu (default: cpu)",
    )
