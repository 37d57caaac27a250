"""The parity check's result: ``ParityReport`` (per output pass/fail with its tolerances, the LayerNorm
outputs, the decoder's token agreement, the end-to-end token agreement, the structural verifier and
the eps probes), its one PASSED/FAILED line and JSON form, and ``first_divergence`` for ``bisect``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ldlm.export.verify import VerifyResult
from ldlm.serve.checks.compare import Comparison
from ldlm.serve.checks.eps_probe import EpsProbeReport

TOKEN_AGREEMENT_REQUIRED = {"fp32": 1.0, "fp16": 0.9, "bf16": 0.8, "int8": 0.99}


@dataclass
class ParityReport:
    backend: str
    precision: str
    providers: dict[str, str]
    atol: float
    rtol: float
    graphs: list[Comparison] = field(default_factory=list)
    layer_norms: list[Comparison] = field(default_factory=list)
    decoder_token_agreement: dict[str, float] = field(default_factory=dict)
    token_agreement: float | None = None
    token_agreement_required: float = 1.0
    first_divergence: str | None = None
    notes: list[str] = field(default_factory=list)
    verification: list[VerifyResult] = field(default_factory=list)  # the artifact's structural check
    eps_probes: EpsProbeReport | None = None

    @property
    def passed(self) -> bool:
        compared = self.graphs or self.layer_norms
        ok = all(c.passed for c in self.graphs) and all(c.passed for c in self.layer_norms)
        e2e = self.token_agreement is not None and self.token_agreement >= self.token_agreement_required
        structure = all(v.passed for v in self.verification) and (self.eps_probes is None or self.eps_probes.passed)
        # The decoder's token ids are an output too: its argmax must agree as well as its logits.
        decoder = all(a >= self.token_agreement_required for a in self.decoder_token_agreement.values())
        return bool(compared) and ok and e2e and structure and decoder

    def summary(self) -> str:
        failed = [c.name for c in [*self.graphs, *self.layer_norms] if not c.passed]
        status = "PASSED" if self.passed else "FAILED"
        line = (
            f"{status} parity {self.backend} ({self.precision}) vs eager: {len(self.graphs)} graph outputs, "
            f"{len(self.layer_norms)} LayerNorm outputs, token agreement {100 * (self.token_agreement or 0):.2f}%"
        )
        if failed:
            line += f"; failing: {', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''}"
        if self.first_divergence:
            line += f"; first divergence: {self.first_divergence}"
        if any(not v.passed for v in self.verification):
            line += "; structural verifier FAILED: " + ", ".join(v.graph for v in self.verification if not v.passed)
        if self.eps_probes is not None:
            line += f"; eps probes {self.eps_probes.status}"
            failing = [f"{p.graph}:{p.module} (node {p.node})" for p in self.eps_probes.layer_norms if p.problems]
            if failing:
                line += f" ({', '.join(failing[:5])}{' ...' if len(failing) > 5 else ''})"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "backend": self.backend,
            "precision": self.precision,
            "providers": self.providers,
            "atol": self.atol,
            "rtol": self.rtol,
            "graphs": [c.to_dict() for c in self.graphs],
            "layer_norms": [c.to_dict() for c in self.layer_norms],
            "decoder_token_agreement": self.decoder_token_agreement,
            "token_agreement": self.token_agreement,
            "token_agreement_required": self.token_agreement_required,
            "first_divergence": self.first_divergence,
            "notes": self.notes,
            "verification": [v.to_dict() for v in self.verification],
            "eps_probes": None if self.eps_probes is None else self.eps_probes.to_dict(),
        }


def first_divergence(report: ParityReport) -> str:
    """The first failing LayerNorm output in execution order (graphs in pipeline order), then the first
    LayerNorm failing its eps probe, else the first failing graph."""
    for comparison in report.layer_norms:
        if not comparison.passed:
            where = comparison.name.rsplit("/", 1)[0]
            return f"LayerNorm {where} (max abs {comparison.max_abs:.3g} > atol {comparison.atol:g})"
    for probe in report.eps_probes.layer_norms if report.eps_probes is not None else []:
        if probe.problems:
            return f"LayerNorm {probe.graph}:{probe.module} run alone (eps probe, node {probe.node}): {probe.problems[0]}"
    for comparison in report.graphs:
        if not comparison.passed:
            graph = comparison.name.split("/", 1)[0]
            return f"graph {graph}: no LayerNorm output diverged, the error arises in its other blocks ({comparison.name})"
    if any(not v.passed for v in report.verification):
        return "no compared output failed; the structural verifier did (see its problems)"
    return "no compared output failed; the end-to-end token agreement is below the requirement"
