"""Argument types and option groups shared by the commands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1, 2, ...), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: an integer >= 1")
    return value


def positive_int_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers (e.g. 1,8), got {text!r}")
    return values


def device_options(p: argparse.ArgumentParser, precision: bool = True) -> None:
    """--device and --precision for the torch backends, --provider for ONNX Runtime."""
    p.add_argument("--device", default="cpu", help="torch backends (eager, compiled): cpu, cuda or cuda:N (default: cpu)")
    if precision:
        p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                       help="torch backends' dtype; LayerNorm, RMSNorm, softmax and logits stay FP32 (default: fp32)")
    p.add_argument("--provider", choices=["cpu", "cuda", "tensorrt"], default="cpu",
                   help="ONNX Runtime execution provider; cuda and tensorrt need onnxruntime-gpu (default: cpu)")
