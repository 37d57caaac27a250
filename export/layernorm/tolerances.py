"""What parity requires at each precision, in one place: the elementwise tolerances (atol, rtol), the
smallest cosine per sample where a precision is judged by direction instead (int8), and the end-to-end
token agreement; with the words ``ldlm parity --help`` and the report state them in. Free of NumPy and
torch, so that building the CLI's parser loads neither."""

from __future__ import annotations

import math

# (atol, rtol) per precision, for float outputs. FP32 is what ONNX Runtime or TensorRT with TF32
# off must reach; FP16/BF16 leave room for 10 and 7 mantissa bits.
TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-4),
    "fp16": (2e-2, 2e-2),
    "bf16": (1e-1, 5e-2),
    # INT8 weights with activations quantized per call: no elementwise bound holds at every element of a
    # stress input, so INT8 is judged by direction instead (MIN_COSINE) and by token agreement.
    "int8": (math.inf, math.inf),
}
# The smallest cosine per sample an output may have (every output of every input set, LayerNorm
# outputs included); -1 (no bound) where the elementwise tolerances decide.
MIN_COSINE: dict[str, float] = {"int8": 0.999}
# The share of end-to-end tokens (and of the decoder's token ids) that must equal eager's.
TOKEN_AGREEMENT_REQUIRED = {"fp32": 1.0, "fp16": 0.9, "bf16": 0.8, "int8": 0.99}


def tolerance(precision: str) -> tuple[float, float]:
    if precision not in TOLERANCES:
        raise ValueError(f"precision={precision!r} has no tolerances; allowed: {', '.join(TOLERANCES)}")
    return TOLERANCES[precision]


def min_cosine(precision: str) -> float:
    return MIN_COSINE.get(precision, -1.0)


def bounded(atol: float, rtol: float) -> bool:
    """Whether an elementwise bound applies: int8's infinite tolerances compare no element."""
    return math.isfinite(atol) or math.isfinite(rtol)


def output_gate_text(precision: str) -> str:
    """What every compared output must meet at ``precision``, in words."""
    atol, rtol = tolerance(precision)
    parts = [f"each element within atol {atol:g} or rtol {rtol:g}"] if bounded(atol, rtol) else []
    if min_cosine(precision) > -1:
        parts.append(f"cosine per sample >= {min_cosine(precision):g}" + ("" if parts else " (no elementwise bound)"))
    return " and ".join(parts)


def gate_text(precision: str) -> str:
    """The whole gate of ``precision``: its outputs' and its token agreement."""
    return f"{output_gate_text(precision)}, token agreement >= {TOKEN_AGREEMENT_REQUIRED[precision]:.0%}"


def gates_help() -> str:
    """Every precision's gate, for ``ldlm parity --help``."""
    return "; ".join(f"{precision}: {gate_text(precision)}" for precision in TOLERANCES)
