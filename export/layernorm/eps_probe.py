"""Eps probes: every LayerNorm of an export or of an engine set, run alone where eps decides.

Whole-graph parity cannot see a wrong epsilon: at ordinary activations the variance is far above
1e-5. So each LayerNormalization node (ONNX Runtime: a one-node ONNX with the node's own
attributes, scale and bias) or INormalizationLayer (TensorRT: a one-layer engine with the parsed
layer's epsilon, axes, scale and bias) runs by itself on rows built so that eps decides the output:
  sweep       zero-mean rows with variance v from 1e-7 to 1e-4 (13 values x 3 draws);
  constant    rows of one value (0, 1, -3.25, 1e4): the output is the bias; eps 0 would give NaN;
  large-mean  1e4 + rows of variance 1e-4 .. 1, like GPT-2's outlier channels: they show how the
              backend computes the variance (E[x^2] - E[x]^2 in float32 is off by ~u*1e8 = 6).
The reference is torch.nn.functional.layer_norm in float64 with the module's own weight, bias and
eps, read from the checkpoint, never from the graph.
The backends' runners: ``eps_probe_ort`` and ``eps_probe_trt``; probing an artifact with them:
``eps_probe_artifact.probe_layer_norm_eps``.

Implied eps. A sweep row has mean m and variance v (float64, of the float32 input). With the node's
own g and b, z = (y - b)/g; the least-squares s = <x - m, z>/<z, z> estimates sqrt(v + eps), so
eps_row = s^2 - v. The implied eps is the median over the sweep rows.

Tolerance: float32 arithmetic. u = 2^-24. A float32 LayerNorm over n values gets z to a relative
error of at most k(n)*u, k(n) = 2*ceil(log2 n) + 8 (``float32_budget``): blocked or pairwise sums
for the mean and the variance (ceil(log2 n) u each), CUDA's rsqrtf (2 ulp), the products and the
final rounding. Hence, per element, |y - y_ref| <= k u (|g| (|z_ref| + mean|x|/sigma) + |b|), where
mean|x|/sigma carries the rounding of the mean (a sum's rounding scales with the sum of |x|, not with
|sum x|: a row of mean ~0 and large spread rounds its mean as much as one of large mean); and per sweep row |d eps| <= 2 (v + eps) k u, so the
implied eps may be off by at most eps_rtol = 2 (v_max + eps)/eps * k(n) * u relative: 2.6e-5 at
n = 64 and 3.7e-5 at n = 768 for eps 1e-5. An eps of 1e-6 is off by 0.9, one of 1e-4 by 9.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ldlm.export.layernorm.cases import FLOAT32_UNIT_ROUNDOFF, CaseProbe, check_case, float32_budget, layer_norm_cases
from ldlm.files import atomic_directory, command_writer

SWEEP_VARIANCES: tuple[float, ...] = tuple(float(v) for v in np.logspace(-7, -4, 13))
SWEEP_DRAWS = 3
CONSTANT_VALUES: tuple[float, ...] = (0.0, 1.0, -3.25, 1e4)
LARGE_MEAN = 1e4
LARGE_MEAN_VARIANCES: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
FAMILIES: tuple[str, ...] = ("sweep", "constant", "large-mean")
EPS_PROBE_WRITER = command_writer("probe-eps")  # what a report directory is recorded as written by (ldlm.files.OUTPUT_RECORD)


def eps_rtol(n: int, eps: float) -> float:
    return 2 * (max(SWEEP_VARIANCES) + eps) / eps * float32_budget(n) * FLOAT32_UNIT_ROUNDOFF


@dataclass
class ProbeRows:
    x: np.ndarray  # (rows, n) float32
    family: list[str]


def probe_rows(n: int, seed: int = 0) -> ProbeRows:
    gen = np.random.default_rng(seed)
    rows, family = [], []

    def unit_row() -> np.ndarray:
        r = gen.standard_normal(n)
        return (r - r.mean()) / r.std()  # mean 0, population variance 1, before float32 rounding

    for v in SWEEP_VARIANCES:
        for _ in range(SWEEP_DRAWS):
            rows.append(math.sqrt(v) * unit_row())
            family.append("sweep")
    for c in CONSTANT_VALUES:
        rows.append(np.full(n, c))
        family.append("constant")
    for v in LARGE_MEAN_VARIANCES:
        rows.append(LARGE_MEAN + math.sqrt(v) * unit_row())
        family.append("large-mean")
    return ProbeRows(np.stack(rows).astype(np.float32), family)


@dataclass
class LayerNormProbe:
    """One LayerNorm probed on one backend. ``ran`` is False when it could not execute here."""

    graph: str
    node: str  # ONNX node or TensorRT layer name
    module: str  # module path in the exported graph (``model.<component>...``)
    module_eps: float  # from the checkpoint's module
    node_eps: float | None  # the node's epsilon attribute / the layer's epsilon, as the backend holds it
    eps_rtol: float
    ran: bool = False
    implied_eps: float | None = None
    implied_eps_rel_error: float | None = None
    max_abs_error: dict[str, float] = field(default_factory=dict)  # per input family
    worst_error_over_bound: float | None = None  # max |y - y_ref| / bound; <= 1 passes
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.ran and not self.problems

    @property
    def status(self) -> str:
        return "FAILED" if self.problems else "PASSED" if self.ran else "NOT RUN"

    def summary(self) -> str:
        implied = (
            "not run"
            if self.implied_eps is None
            else f"{self.implied_eps:.6g} (rel err {self.implied_eps_rel_error:.2g}, tol {self.eps_rtol:.2g})"
        )
        line = f"{self.status} {self.graph}:{self.module} (node {self.node}): module eps {self.module_eps:g}, implied eps {implied}"
        return "\n  - ".join([line, *self.problems])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerNormProbe:
        return cls(**{k: v for k, v in data.items() if k != "passed"})


def analyse_outputs(
    probe: LayerNormProbe, rows: ProbeRows, y: np.ndarray, node_scale: np.ndarray | None, node_bias: np.ndarray | None, module: nn.LayerNorm
) -> None:
    """Fill ``probe`` from the backend's outputs ``y`` (rows, n): implied eps, errors, problems."""
    where = f"node {probe.node!r} (module {probe.module})"
    x64, y64 = rows.x.astype(np.float64), np.asarray(y, np.float64).reshape(rows.x.shape)
    n = x64.shape[1]
    probe.ran = True
    families = np.array(rows.family)
    finite = np.isfinite(y64)
    if not finite.all():
        bad = sorted({rows.family[i] for i in np.nonzero(~finite.all(axis=1))[0]})
        probe.problems.append(f"{where}: {int((~finite).sum())} NaN/Inf output(s) in the {', '.join(bad)} rows")
    # Implied eps from the sweep rows, with the node's own scale and bias (isolates eps).
    g = np.ones(n) if node_scale is None else node_scale.astype(np.float64).reshape(-1)
    b = np.zeros(n) if node_bias is None else node_bias.astype(np.float64).reshape(-1)
    use = np.abs(g) > 0.1 * np.abs(g).max()  # dividing by a tiny scale would amplify rounding
    sweep = (families == "sweep") & finite.all(axis=1)
    if sweep.any() and use.any():
        centered = x64[sweep] - x64[sweep].mean(axis=1, keepdims=True)
        z = (y64[sweep] - b)[:, use] / g[use]
        s = (centered[:, use] * z).sum(axis=1) / np.maximum((z * z).sum(axis=1), 1e-300)
        probe.implied_eps = float(np.median(s**2 - (centered**2).mean(axis=1)))
        probe.implied_eps_rel_error = abs(probe.implied_eps / probe.module_eps - 1)
        if probe.implied_eps_rel_error > probe.eps_rtol:
            probe.problems.append(
                f"{where}: implied eps {probe.implied_eps:.6g} != module eps {probe.module_eps:g} "
                f"(relative error {probe.implied_eps_rel_error:.3g} > {probe.eps_rtol:.2g}); node eps {_eps(probe.node_eps)}"
            )
    else:
        probe.problems.append(f"{where}: no finite sweep row: the implied eps cannot be solved")
    # Outputs against the module's own LayerNorm (weight, bias, eps from the checkpoint), in float64.
    weight = None if module.weight is None else module.weight.detach().double().cpu()
    bias = None if module.bias is None else module.bias.detach().double().cpu()
    reference = F.layer_norm(torch.from_numpy(x64), (n,), weight, bias, module.eps).numpy()
    mean = x64.mean(axis=1, keepdims=True)
    sigma = np.sqrt(((x64 - mean) ** 2).mean(axis=1, keepdims=True) + module.eps)
    gm = np.abs(weight.numpy()) if weight is not None else np.ones(n)
    bm = np.abs(bias.numpy()) if bias is not None else np.zeros(n)
    z_ref = (x64 - mean) / sigma
    mean_magnitude = np.abs(x64).mean(axis=1, keepdims=True)
    bound = float32_budget(n) * FLOAT32_UNIT_ROUNDOFF * (gm * (np.abs(z_ref) + mean_magnitude / sigma) + bm) + 1e-30
    error = np.where(finite, np.abs(y64 - reference), np.inf)
    probe.worst_error_over_bound = float((error / bound).max())
    for family in FAMILIES:
        probe.max_abs_error[family] = float(error[families == family].max())
    if probe.worst_error_over_bound > 1:
        i, j = np.unravel_index(int(np.argmax(error / bound)), error.shape)
        probe.problems.append(
            f"{where}: output differs from the module's LayerNorm in the {rows.family[i]} rows: "
            f"|y - y_ref| = {error[i, j]:.3g} > float32 bound {bound[i, j]:.3g} "
            f"(scale/bias not the module's, or eps {_eps(probe.node_eps)} != {probe.module_eps:g}?)"
        )


def _eps(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.8g}"  # float32 eps: 1e-5 shows as 9.9999997e-06


@dataclass
class EpsProbeReport:
    """All eps probes of one artifact on one backend, plus the fixed cases. JSON round trip."""

    backend: str  # the backend that ran the probes: ldlm.serve.runtime.registry.PROBE_BACKENDS, passed in
    runtime: str  # what really ran, e.g. "onnxruntime 1.22.0 CPUExecutionProvider"
    artifact: str
    layer_norms: list[LayerNormProbe] = field(default_factory=list)
    cases: list[CaseProbe] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # artifact-level: counts, pairing, files
    not_exercised: list[str] = field(default_factory=list)  # what could not run here, and why
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        probes: list[LayerNormProbe | CaseProbe] = [*self.layer_norms, *self.cases]
        return bool(self.layer_norms) and not self.problems and all(p.passed for p in probes)

    @property
    def status(self) -> str:
        probes: list[LayerNormProbe | CaseProbe] = [*self.layer_norms, *self.cases]
        if self.problems or any(p.problems for p in probes) or not self.layer_norms:
            return "FAILED"
        return "PASSED" if self.passed else "NOT RUN"

    def summary(self) -> str:
        failed = [p for p in self.layer_norms if p.problems]
        cases_ok = sum(c.passed for c in self.cases)
        line = (
            f"{self.status} eps probes {self.backend} ({self.runtime}): {len(self.layer_norms)} LayerNorm(s), "
            f"{len(failed)} failing; fixed cases {cases_ok}/{len(self.cases)} passed; {self.seconds:.1f} s"
        )
        if failed:
            line += "; failing: " + ", ".join(f"{p.graph}:{p.module} (node {p.node})" for p in failed[:5])
        return line

    def table(self) -> str:
        """A Markdown table: one row per LayerNorm."""
        head = "| graph | module | node | module eps | node eps | implied eps | rel. error | tolerance | status |\n|---|---|---|---|---|---|---|---|---|"
        rows = [
            f"| {p.graph} | {p.module} | {p.node} | {p.module_eps:g} | {_eps(p.node_eps)} | "
            f"{'-' if p.implied_eps is None else f'{p.implied_eps:.8e}'} | "
            f"{'-' if p.implied_eps_rel_error is None else f'{p.implied_eps_rel_error:.2g}'} | {p.eps_rtol:.2g} | {p.status} |"
            for p in self.layer_norms
        ]
        return "\n".join([head, *rows])

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "status": self.status,
            "backend": self.backend,
            "runtime": self.runtime,
            "artifact": self.artifact,
            "layer_norms": [p.to_dict() for p in self.layer_norms],
            "cases": [c.to_dict() for c in self.cases],
            "problems": self.problems,
            "not_exercised": self.not_exercised,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpsProbeReport:
        return cls(
            data["backend"],
            data["runtime"],
            data["artifact"],
            [LayerNormProbe.from_dict(p) for p in data["layer_norms"]],
            [CaseProbe.from_dict(c) for c in data["cases"]],
            list(data["problems"]),
            list(data["not_exercised"]),
            float(data["seconds"]),
        )


# A backend runs one LayerNorm: (x, axis, scale, bias, eps) -> y, or None when it cannot execute
# here (the reason is then in the report's ``not_exercised``).
LayerNormRunner = Callable[[np.ndarray, int, "np.ndarray | None", "np.ndarray | None", float], "np.ndarray | None"]


def run_cases(run: LayerNormRunner, dtypes: Sequence[str]) -> list[CaseProbe]:
    """The 8 design-page cases through ``run``, each in every dtype the backend takes."""
    results = []
    for case in layer_norm_cases():
        for dtype in dtypes:
            scale = None if case.scale is None else case.scale.astype(dtype)
            bias = None if case.bias is None else case.bias.astype(dtype)
            got = run(case.x.astype(dtype), -case.normalized_ndim, scale, bias, case.eps)
            results.append(CaseProbe(case.name, dtype, False) if got is None else check_case(case, dtype, got))
    return results


def write_eps_report(report: EpsProbeReport, out: str | os.PathLike[str], overwrite: bool = False) -> list[Path]:
    """OUT/eps_probes.json (the report) and OUT/eps_probes.md (summary, table, what did not run), both or neither,
    recorded as ``EPS_PROBE_WRITER``'s. An existing ``out`` is replaced only with ``overwrite``, and only an earlier
    report exactly as probe-eps wrote it (``ldlm.files.refuse_existing``)."""
    out = Path(out)
    lines = [f"# {report.summary()}", "", report.table(), ""]
    lines += [
        f"- fixed case {c.case} ({c.dtype}): {'PASSED' if c.passed else 'NOT RUN' if not c.ran else 'FAILED'}"
        + (f", max abs {c.max_abs_error:.3g} (atol {c.atol:.2g})" if c.max_abs_error is not None else "")
        for c in report.cases
    ]
    lines += [f"- problem: {p}" for p in report.problems] + [f"- not exercised: {n}" for n in report.not_exercised]
    texts = {"eps_probes.json": json.dumps(report.to_dict(), indent=2) + "\n", "eps_probes.md": "\n".join(lines) + "\n"}
    with atomic_directory(out, overwrite, EPS_PROBE_WRITER) as tmp:
        for name, text in texts.items():
            (tmp / name).write_text(text)
    return [out / name for name in texts]
