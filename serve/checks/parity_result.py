"""The parity check's result: ``ParityReport`` (per output pass/fail with its tolerances, the LayerNorm
outputs, the decoder's token agreement, the end-to-end token agreement, the structural verifier and
the eps probes), its one PASSED/FAILED line and JSON form, ``ParityOutputs`` (both sides' outputs) and
``first_divergence`` for ``bisect``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ldlm.export.layernorm.compare import Comparison
from ldlm.export.layernorm.eps_probe import EpsProbeReport

# the gate lives in ldlm.export.layernorm.tolerances with the others; the checks import it from here
from ldlm.export.layernorm.tolerances import TOKEN_AGREEMENT_REQUIRED as TOKEN_AGREEMENT_REQUIRED
from ldlm.export.layernorm.verify import VerifyResult

END_TO_END_TOKENS = "end_to_end/token_ids"  # the end-to-end generation's outputs, in ``ParityOutputs``


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
        tokens = self.token_shortfall()
        return line + (f"; {tokens}" if tokens else "")

    def token_shortfall(self) -> str | None:
        """When the end-to-end or the decoder's token agreement is below the gate: the figure, the gate,
        and the ways out at this precision; None when the tokens pass (or none were compared)."""
        gate = self.token_agreement_required
        decoder = min(self.decoder_token_agreement.values(), default=None)
        measured = [(what, value) for what, value in (("token agreement", self.token_agreement), ("decoder token ids", decoder))]
        short = [(what, value) for what, value in measured if value is not None and value < gate]
        if not short:
            return None
        what, value = min(short, key=lambda item: item[1])
        said = f"{what} {100 * value:.2f}% is below the {self.precision} gate of {100 * gate:g}%"
        accept = f"--min-token-agreement {math.floor(100 * value) / 100:g}"  # the figure measured, rounded down
        if self.precision == "fp32":
            return f"{said}: fp32 should agree token for token, so look for the divergence (--bisect) rather than lower the gate"
        if self.precision != "int8":
            return f"{said}; to accept it, pass {accept}, or run in fp32 (--precision fp32)"
        if decoder is not None and decoder < gate:
            graph = (
                f"the decoder (its token ids agree {100 * decoder:.2f}% on its own inputs): export with --quantize int8 "
                "--quantize-graphs denoiser, which keeps the decoder fp32"
            )
        else:
            graph = (
                "the denoiser (the decoder's token ids agree on its own inputs, so the tokens are lost over the denoiser's "
                "steps): export with a higher --min-cosine, which keeps more of its weight nodes fp32, or serve fp32"
            )
        return f"{said}; to accept it, pass {accept}, or keep fp32 for the graph that costs the tokens, {graph}"

    def accept_token_agreement(self, required: float, why: str) -> None:
        """Judge the tokens by ``required`` in place of the precision's gate, and say so in the notes."""
        self.notes.append(
            f"token agreement required: {100 * required:g}% ({why}) in place of the {self.precision} gate of "
            f"{100 * self.token_agreement_required:g}%"
        )
        self.token_agreement_required = required

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


@dataclass
class ParityOutputs:
    """Both sides' outputs of a parity run (``--save-outputs``), by the name the report gives the comparison
    (``GRAPH/SET/OUTPUT``, ``GRAPH:MODULE/SET``), and the generated tokens as ``END_TO_END_TOKENS``."""

    reference: dict[str, np.ndarray] = field(default_factory=dict)
    candidate: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, name: str, reference: np.ndarray, candidate: np.ndarray) -> None:
        self.reference[name], self.candidate[name] = np.ascontiguousarray(reference), np.ascontiguousarray(candidate)


def first_divergence(report: ParityReport) -> str:
    """The first failing LayerNorm output in execution order (graphs in pipeline order), then the first
    LayerNorm failing its eps probe, else the first failing graph."""
    for comparison in report.layer_norms:
        if not comparison.passed:
            where = comparison.name.rsplit("/", 1)[0]
            if comparison.bounded:
                return f"LayerNorm {where} (max abs {comparison.max_abs:.3g} > atol {comparison.atol:g})"
            return f"LayerNorm {where} (cosine min {comparison.cosine_min:.6f} < {comparison.cosine_at_least:g} required)"
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
