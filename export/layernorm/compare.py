"""One result type for parity: the comparison of one output against its reference.

Conventions (Polygraphy's, made explicit): the reference is eager PyTorch; an element fails only
when its absolute error exceeds ``atol`` AND its relative error exceeds ``rtol``; NaN or Inf on
either side always fails; comparing nothing is an error, not a pass. A precision with a
``MIN_COSINE`` (int8) also fails any sample whose cosine to the reference is below it.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

import numpy as np

# the gates live with their words in tolerances, free of NumPy for the CLI's help; the checks import them from here
from ldlm.export.layernorm.tolerances import MIN_COSINE as MIN_COSINE
from ldlm.export.layernorm.tolerances import TOLERANCES as TOLERANCES
from ldlm.export.layernorm.tolerances import bounded
from ldlm.export.layernorm.tolerances import min_cosine as min_cosine
from ldlm.export.layernorm.tolerances import tolerance as tolerance

# Histogram of absolute errors: one bin per decade, [0, 1e-12), [1e-12, 1e-11), ..., [1e3, inf).
HISTOGRAM_EDGES: list[float] = [0.0, *(10.0**e for e in range(-12, 4)), float("inf")]


@dataclass
class Comparison:
    name: str
    passed: bool
    atol: float
    rtol: float
    shape: list[int]
    elements: int
    failed_elements: int
    max_abs: float
    mean_abs: float
    median_abs: float
    p99_abs: float
    max_rel: float
    mean_rel: float
    p99_rel: float
    min_atol_to_pass: float  # the smallest atol that would pass at this rtol
    nonfinite_reference: int
    nonfinite_candidate: int
    cosine_min: float  # per sample (first axis)
    cosine_mean: float
    reference_max_abs: float
    abs_error_histogram: list[int]  # counts per HISTOGRAM_EDGES bin
    cosine_at_least: float = -1.0  # the smallest cosine per sample it passes with; -1: no bound

    @property
    def bounded(self) -> bool:
        """Whether elements were held to atol and rtol (int8's are not: its outputs are judged by cosine)."""
        return bounded(self.atol, self.rtol)

    def summary(self) -> str:
        status = "PASSED" if self.passed else "FAILED"
        cosine = f"cosine min {self.cosine_min:.6f}"
        if self.cosine_at_least > -1:
            cosine += f" {'<' if self.cosine_min < self.cosine_at_least else '>='} {self.cosine_at_least:g} required"
        elements = (
            f"{self.failed_elements}/{self.elements} elements over atol {self.atol:g} and rtol {self.rtol:g}"
            if self.bounded
            else f"no elementwise bound ({self.elements} elements judged by cosine)"
        )
        nonfinite = self.nonfinite_reference or self.nonfinite_candidate
        return (
            f"{status} {self.name}: max abs {self.max_abs:.3g}, p99 abs {self.p99_abs:.3g}, max rel {self.max_rel:.3g}, "
            f"{cosine}, {elements}" + (f", NaN/Inf {self.nonfinite_reference}/{self.nonfinite_candidate}" if nonfinite else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Comparison:
        """From ``to_dict``'s form; a field with a default may be absent (reports written before it existed)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data or f.default is MISSING})


def compare_outputs(
    name: str, reference: np.ndarray, candidate: np.ndarray, atol: float, rtol: float, cosine_at_least: float = -1.0
) -> Comparison:
    """Compare ``candidate`` against ``reference`` elementwise, and (``cosine_at_least``) per sample by
    direction; see the module docstring."""
    reference = np.asarray(reference)
    candidate = np.asarray(candidate)
    if reference.shape != candidate.shape:
        raise ValueError(f"{name}: candidate shape {candidate.shape} != reference shape {reference.shape}")
    if reference.size == 0:
        raise ValueError(f"{name}: nothing to compare (empty output)")
    ref = reference.astype(np.float64)
    cand = candidate.astype(np.float64)
    bad_ref, bad_cand = ~np.isfinite(ref), ~np.isfinite(cand)
    finite = ~(bad_ref | bad_cand)
    diff = np.where(finite, np.abs(cand - ref), np.inf)
    rel = diff / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)
    failing = (diff > atol) & (rel > rtol)
    rtol_failing = diff[rel > rtol]
    finite_diff = diff[finite] if finite.any() else np.array([np.inf])
    finite_rel = rel[finite] if finite.any() else np.array([np.inf])
    cos = sample_cosines(ref, cand)
    return Comparison(
        name=name,
        passed=bool(not failing.any() and cos.min() >= cosine_at_least),
        atol=atol,
        rtol=rtol,
        shape=list(reference.shape),
        elements=int(reference.size),
        failed_elements=int(failing.sum()),
        max_abs=float(diff.max()),
        mean_abs=float(finite_diff.mean()),
        median_abs=float(np.median(finite_diff)),
        p99_abs=float(np.percentile(finite_diff, 99)),
        max_rel=float(rel.max()),
        mean_rel=float(finite_rel.mean()),
        p99_rel=float(np.percentile(finite_rel, 99)),
        min_atol_to_pass=float(rtol_failing.max()) if rtol_failing.size else 0.0,
        nonfinite_reference=int(bad_ref.sum()),
        nonfinite_candidate=int(bad_cand.sum()),
        cosine_min=float(cos.min()),
        cosine_mean=float(cos.mean()),
        reference_max_abs=float(np.abs(ref[np.isfinite(ref)]).max()) if np.isfinite(ref).any() else math.inf,
        abs_error_histogram=[int(c) for c in np.histogram(diff, bins=HISTOGRAM_EDGES)[0]],
        cosine_at_least=cosine_at_least,
    )


def sample_cosines(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Cosine similarity per sample (first axis); NaN (non-finite input) counts as -1."""
    a = ref.reshape(ref.shape[0], -1) if ref.ndim > 1 else ref.reshape(1, -1)
    b = cand.reshape(a.shape)
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(den > 0, num / np.where(den > 0, den, 1), np.where(np.linalg.norm(a - b, axis=1) == 0, 1.0, 0.0))
    return np.nan_to_num(cos, nan=-1.0)
