"""Eight fixed LayerNorm cases, each with the first values of its known output, as probes for any backend.

Each case is one LayerNorm call: an input, the normalized axes, scale, bias and eps. A backend runs
it as one node or layer (``export/layernorm/eps_probe.py`` supplies the runner); the reference is plain NumPy
in float64, written here and independent of torch and of every backend. Cases that are about the
module rather than the op reduce to the op the backend must compute:
  5 (train vs eval): the module in either mode computes the same op, so one call covers both;
  6 (NCHW): the channel LayerNorm is permute -> LayerNorm(C) -> permute back, and the permutes are
    not the backend's LayerNorm: the backend gets the NHWC tensor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def float32_budget(n: int) -> int:
    """k(n): how many float32 roundings (units of 2^-24, relative) a LayerNorm over n values may spend."""
    return 2 * math.ceil(math.log2(max(n, 2))) + 8


@dataclass(frozen=True)
class LayerNormCase:
    name: str
    x: np.ndarray  # float64; backends run it in their dtype
    normalized_ndim: int  # the last axes normalized; ONNX axis = -normalized_ndim
    scale: np.ndarray | None
    bias: np.ndarray | None
    eps: float = 1e-5
    golden: tuple[float, ...] | None = None  # the first output values (flattened), known ahead

    def reference(self) -> np.ndarray:
        return numpy_layer_norm(self.x, self.normalized_ndim, self.scale, self.bias, self.eps)


def numpy_layer_norm(
    x: np.ndarray, normalized_ndim: int, scale: np.ndarray | None = None, bias: np.ndarray | None = None, eps: float = 1e-5
) -> np.ndarray:
    """LayerNorm over the last ``normalized_ndim`` axes with the population variance, in float64."""
    x = x.astype(np.float64)
    axes = tuple(range(x.ndim - normalized_ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def _case7() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x = randn(4, 128)*3 + 5, gamma = 1 + 0.1 randn, beta = 0.1 randn, torch seed 0 (the seed's draw)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 128, generator=gen) * 3 + 5
    gamma, beta = 1 + 0.1 * torch.randn(128, generator=gen), 0.1 * torch.randn(128, generator=gen)
    return x.double().numpy(), gamma.double().numpy(), beta.double().numpy()


def layer_norm_cases() -> list[LayerNormCase]:
    a = np.array
    x1 = a([[[1, 2, 4], [10, 20, 40]], [[3, 5, 9], [2, 3, 8]]], float)
    x6 = np.arange(12, dtype=float).reshape(1, 2, 2, 3)  # NCHW
    x7, gamma7, beta7 = _case7()
    return [
        LayerNormCase("1-last-axis", x1, 1, None, None, golden=(-1.069, -0.2673, 1.3363)),
        LayerNormCase("1-two-axes", x1, 2, None, None, golden=(-0.8612, -0.7884, -0.6429)),
        LayerNormCase("2-population-variance", a([[1, 2, 4], [8, 8, 8]], float), 1, None, None),
        LayerNormCase("3-affine", a([[1, 2, 4], [2, 4, 8]], float), 1, a([2, 0.5, -1]), a([1, -2, 3])),
        LayerNormCase("3-scale-only", a([[1, 2, 4], [2, 4, 8]], float), 1, a([2, 0.5, -1]), None),
        LayerNormCase("4-eps-1e-5", a([[1, 1.001, 0.999], [7, 7, 7]], float), 1, None, None, 1e-5, golden=(0.0, 0.306186, -0.306186)),
        LayerNormCase("4-eps-0.1", a([[1, 1.001, 0.999], [7, 7, 7]], float), 1, None, None, 0.1, golden=(0.0, 0.003162, -0.003162)),
        LayerNormCase("5-train-or-eval", a([[1, 2, 4], [3, 7, 8]], float), 1, np.ones(3), np.zeros(3)),
        # NHWC: the first pixel's two channels (values 0 and 6) come first.
        LayerNormCase("6-channels-nhwc", x6.transpose(0, 2, 3, 1), 1, np.ones(2), np.zeros(2), golden=(-0.999999, 0.999999)),
        LayerNormCase("7-hand-written", x7, 1, gamma7, beta7),
        LayerNormCase(
            "8-default-init",
            a([[8, -3, 0, 1, 5, -2]], float),
            1,
            np.ones(6),
            np.zeros(6),
            golden=(1.6830, -1.1651, -0.3884, -0.1295, 0.9062, -0.9062),
        ),
    ]


GOLDEN_ATOL = 1e-4  # the golden values have 4-6 significant digits


@dataclass
class CaseProbe:
    """One case on one backend. ``ran`` is False when the backend could not execute here."""

    case: str
    dtype: str
    ran: bool
    max_abs_error: float | None = None
    atol: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.ran and not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaseProbe:
        return cls(**{k: v for k, v in data.items() if k != "passed"})


def case_atol(case: LayerNormCase, dtype: str) -> float:
    """float64: 1e-12. float32: the probe's float32 budget (``float32_budget``) applied to the
    largest reference term, plus the input's own rounding to float32 amplified by 1/sigma."""
    if dtype == "float64":
        return 1e-12
    n = int(np.prod(case.x.shape[-case.normalized_ndim :]))
    axes = tuple(range(case.x.ndim - case.normalized_ndim, case.x.ndim))
    sigma = np.sqrt(case.x.var(axis=axes) + case.eps).min()
    scale = 1.0 if case.scale is None else float(np.abs(case.scale).max())
    bias = 0.0 if case.bias is None else float(np.abs(case.bias).max())
    big = float(np.abs(case.x).max())
    return float(float32_budget(n) * FLOAT32_UNIT_ROUNDOFF * (scale * (np.sqrt(n) + big / sigma) + bias))


def check_case(case: LayerNormCase, dtype: str, got: np.ndarray) -> CaseProbe:
    """Compare a backend's output against the NumPy reference; the reference sees the same
    (rounded) input as the backend, and eps as float32, the only way an ONNX attribute or a
    TensorRT layer can hold it (1e-5 becomes 9.99999975e-06). NaN or Inf always fails."""
    rounded = LayerNormCase(
        case.name,
        case.x.astype(dtype).astype(np.float64),
        case.normalized_ndim,
        None if case.scale is None else case.scale.astype(dtype).astype(np.float64),
        None if case.bias is None else case.bias.astype(dtype).astype(np.float64),
        float(np.float32(case.eps)),
    )
    reference = rounded.reference()
    atol = case_atol(case, dtype)
    got64 = np.asarray(got, np.float64)
    problems = []
    if got64.shape != reference.shape:
        return CaseProbe(case.name, dtype, True, None, atol, [f"output shape {got64.shape} != {reference.shape}"])
    if not np.isfinite(got64).all():
        problems.append(f"{int((~np.isfinite(got64)).sum())} NaN/Inf output(s)")
    error = float(np.nanmax(np.abs(got64 - reference))) if np.isfinite(got64).any() else float("inf")
    if error > atol:
        problems.append(f"max abs error {error:.3g} > atol {atol:.3g} against NumPy")
    if case.golden is not None:
        first = got64.reshape(-1)[: len(case.golden)]
        off = float(np.abs(first - np.array(case.golden)).max())
        if off > GOLDEN_ATOL:
            problems.append(f"first values {np.round(first, 6).tolist()} differ from the golden {list(case.golden)} by {off:.3g}")
    return CaseProbe(case.name, dtype, True, error, atol, problems)
