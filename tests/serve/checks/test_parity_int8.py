"""Parity of the INT8 variants against eager fp32: judged by cosine and tokens under the served sampler."""

from __future__ import annotations

from pathlib import Path

from ldlm.export.layernorm.compare import min_cosine
from ldlm.model.config import preset
from ldlm.serve.checks.parity import run_parity


def test_int8_parity_compares_the_variants_by_cosine_and_probes_their_layer_norms(tiny_checkpoint: Path, int8_export_dir: Path) -> None:
    report = run_parity(tiny_checkpoint, "ort", "int8", int8_export_dir)
    assert report.precision == "int8" and report.token_agreement_required == 0.99
    config = preset("tiny")
    assert f"{config.default_steps} steps of the {config.default_sampler} sampler" in " ".join(report.notes)
    by_graph = {g: [c for c in report.graphs if c.name.startswith(g + "/")] for g in ("encoder", "denoiser", "decoder")}
    assert all(c.max_abs <= 1e-4 for c in by_graph["encoder"])  # no variant: it ran fp32, within fp32 parity of eager
    denoiser = by_graph["denoiser"]
    assert denoiser and all(c.passed == (c.cosine_min >= min_cosine("int8")) for c in denoiser)
    assert all(c.max_abs > 0.0 and c.cosine_min > 0.999 for c in denoiser)  # another computation, same direction
    decoder_norms = [c for c in report.layer_norms if c.name.startswith("decoder:")]
    assert decoder_norms and any(c.max_abs > 0 for c in decoder_norms)  # the LayerNorms of the int8 file, not the fp32 one
    probed = {p.graph for p in report.eps_probes.layer_norms}
    assert {"decoder", "decoder.int8", "encoder"} <= probed and report.eps_probes.passed
