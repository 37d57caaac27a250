"""Writes a ParityReport as JSON, Markdown and PNG plots (an error histogram per graph, the
largest error per LayerNorm against the tolerance, drawn only where LayerNorm outputs were compared), into a
report directory that gets the whole report or none of it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.artist import Artist
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ldlm.export.graphs import GRAPH_NAMES
from ldlm.export.layernorm.compare import HISTOGRAM_EDGES
from ldlm.export.layernorm.tolerances import bounded, gate_text
from ldlm.files import atomic_directory, command_writer, save_figure, write_atomically
from ldlm.serve.checks.parity_result import ParityReport

JSON_FILE, MARKDOWN_FILE, GRAPH_PLOT, LAYER_NORM_PLOT = "parity.json", "parity.md", "errors_by_graph.png", "errors_by_layernorm.png"
PARITY_WRITER = command_writer("parity")  # what a report directory is recorded as written by (ldlm.files.OUTPUT_RECORD)


def write_parity_report(report: ParityReport, out: str | os.PathLike[str], overwrite: bool = False) -> list[Path]:
    """``out``/parity.json, parity.md and the plots the report has data for (``errors_by_layernorm.png`` only
    with LayerNorm comparisons), all or none: every file is written in a temporary sibling of ``out`` first
    (the plots take seconds, and Ctrl-C may land there), then renamed into place, recorded as ``PARITY_WRITER``'s. An existing ``out`` is replaced only with ``overwrite``, and only an earlier report
    exactly as parity wrote it (``ldlm.files.refuse_existing``): never a directory of someone's files."""
    out = Path(out)
    with atomic_directory(out, overwrite, PARITY_WRITER) as tmp:
        names = _write_report_files(report, tmp)
    return [out / name for name in names]


def _write_report_files(report: ParityReport, out: Path) -> list[str]:
    """The report's files into the directory ``out``, by name."""
    write_atomically(out / JSON_FILE, json.dumps(report.to_dict(), indent=2) + "\n")
    write_atomically(out / MARKDOWN_FILE, markdown(report))
    return [JSON_FILE, MARKDOWN_FILE, *(path.name for path in plot(report, out))]


def markdown(report: ParityReport) -> str:
    lines = [
        f"# Parity: {report.backend} ({report.precision}) against eager PyTorch",
        "",
        f"**{report.summary()}**",
        "",
        f"Reference: eager PyTorch. {report.precision} gate: {gate_text(report.precision)}. {element_rule(report)}",
        f"Providers that ran: {', '.join(f'{g}: {p}' for g, p in report.providers.items())}.",
        "",
        f"End to end (same solver, seed and noise on both sides): token agreement {100 * (report.token_agreement or 0):.2f}% "
        f"(required {100 * report.token_agreement_required:g}%).",
        "",
    ]
    shortfall = report.token_shortfall()
    if shortfall:
        lines += [f"**Tokens: {shortfall}.**", ""]
    if report.decoder_token_agreement:
        lines += ["Decoder token ids: " + ", ".join(f"{k} {100 * v:.2f}%" for k, v in report.decoder_token_agreement.items()), ""]
    for title, rows in (("Graph outputs", report.graphs), ("LayerNorm outputs", report.layer_norms)):
        if not rows:
            continue
        lines += [
            f"## {title}",
            "",
            "| output | result | max abs | p99 abs | max rel | cosine min | failed | min atol to pass | NaN/Inf |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        footnote = (
            "An element passes when its abs error is within atol or its rel error within rtol, so a passing row "
            "can show a large max rel: it comes from reference values near 0 (rel = abs / |reference|), where atol "
            "decides."
            if rows[0].bounded
            else "No elementwise bound: the failed and min-atol columns do not apply (n/a); the cosine decides."
        )
        for c in rows:
            failed, to_pass = (f"{c.failed_elements}/{c.elements}", f"{c.min_atol_to_pass:.3g}") if c.bounded else ("n/a", "n/a")
            lines.append(
                f"| `{c.name}` | {'pass' if c.passed else '**FAIL**'} | {c.max_abs:.3g} | {c.p99_abs:.3g} | {c.max_rel:.3g} | "
                f"{c.cosine_min:.6f} | {failed} | {to_pass} | {c.nonfinite_reference}/{c.nonfinite_candidate} |"
            )
        lines += ["", footnote, ""]
    if report.first_divergence:
        lines += [f"First divergence (bisect): {report.first_divergence}", ""]
    if report.verification:
        lines += ["## Structural verifier", "", *(f"- {v.summary()}" for v in report.verification), ""]
    if report.eps_probes is not None:
        probes = report.eps_probes
        lines += ["## Eps probes (each LayerNorm alone, where eps decides)", "", probes.summary(), "", probes.table(), ""]
        lines += [f"- {p}" for probe in probes.layer_norms for p in probe.problems]
        lines += [f"- not exercised: {n}" for n in probes.not_exercised] + [""]
    lines += [f"- {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


def element_rule(report: ParityReport) -> str:
    """How an element is judged, or that none is (int8's infinite tolerances bound nothing)."""
    if bounded(report.atol, report.rtol):
        return f"An element fails when its error exceeds atol {report.atol:g} and rtol {report.rtol:g}."
    return f"No element is held to a tolerance at {report.precision}: an output fails when a sample's cosine is below the gate."


def plot(report: ParityReport, out: Path) -> list[Path]:
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot fixes its backend on first import, for the whole process

    files = []
    if report.graphs:
        files.append(out / GRAPH_PLOT)
        fig = _plot_graphs(report, plt)
        save_figure(fig, files[-1])
        plt.close(fig)
    if report.layer_norms:
        files.append(out / LAYER_NORM_PLOT)
        fig = _plot_layer_norms(report, plt)
        save_figure(fig, files[-1])
        plt.close(fig)
    return files


def graphs_in_pipeline_order(report: ParityReport) -> list[str]:
    """The graphs compared, as the pipeline runs them (encoder, denoiser, decoder)."""
    present = {c.name.split("/", 1)[0] for c in report.graphs}
    return [g for g in GRAPH_NAMES if g in present] + sorted(present - set(GRAPH_NAMES))


def layer_norm_label(name: str) -> str:
    """``decoder:model.token_decoder.norm/random`` -> ``decoder  token_decoder.norm  (random inputs)``."""
    graph, _, rest = name.partition(":")
    module, _, inputs = rest.rpartition("/")
    return f"{graph}  {module.removeprefix('model.')}  ({inputs} inputs)"


def _plot_graphs(report: ParityReport, plt: Any) -> Any:
    graphs = graphs_in_pipeline_order(report)
    fig, axes = plt.subplots(1, len(graphs), figsize=(5 * len(graphs), 4.6), squeeze=False)
    labels = ["0"] + [f"{e:.0e}" for e in HISTOGRAM_EDGES[1:-1]]
    has_bound = math.isfinite(report.atol)  # int8 has no elementwise bound (it is judged by cosine): no atol line
    atol_bin = HISTOGRAM_EDGES.index(min(e for e in HISTOGRAM_EDGES[1:] if e >= report.atol)) if has_bound else 0
    for ax, graph in zip(axes[0], graphs):
        rows = [c for c in report.graphs if c.name.startswith(graph + "/")]
        for c, style in zip(rows, ["-", "--", ":", "-."] * len(rows)):  # the curves often coincide
            inputs, _, output = c.name.split("/", 1)[1].rpartition("/")  # graph/inputs/output
            ax.step(
                range(len(c.abs_error_histogram)),
                c.abs_error_histogram,
                where="post",
                linestyle=style,
                linewidth=1.6,
                label=f"{inputs} inputs -> {output}",
            )
        if has_bound:
            ax.axvline(atol_bin, color="red", linestyle="--", label=f"atol {report.atol:g}")
        ax.set_xticks(range(0, len(labels), 3), labels[::3], fontsize=8)
        ax.set_yscale("symlog")
        ax.set_ylim(0, 4 * max(max(c.abs_error_histogram) for c in rows))  # headroom above the highest bin
        ax.set_xlabel("absolute error (bin lower edge; 0 = exactly equal)")
        ax.set_ylabel("elements")
        ax.set_title(graph)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.suptitle(f"{report.backend} {report.precision} vs eager PyTorch: absolute error histogram per graph (pipeline order)")
    fig.tight_layout()
    return fig


def _plot_layer_norms(report: ParityReport, plt: Any) -> Any:
    rows = report.layer_norms
    nonzero = [c.max_abs for c in rows if c.max_abs > 0]
    bounds = [report.atol] if math.isfinite(report.atol) else []  # int8: no elementwise bound to draw
    floor = 10.0 ** (math.floor(math.log10(min(nonzero or bounds or [1.0]))) - 1)  # a decade below the smallest error
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.3 * len(rows)))
    for y, c in enumerate(rows):
        if c.max_abs == 0:  # no bar on a log axis: say it
            ax.text(floor * 1.3, y, "0 (exactly equal)", va="center", fontsize=8, color="tab:gray")
        else:
            ax.barh(y, c.max_abs - floor, left=floor, color="tab:blue" if c.passed else "tab:red")
    for bound in bounds:
        ax.axvline(bound, color="red", linestyle="--")
    ax.set_xscale("log")
    ax.set_xlim(left=floor, right=max([*bounds, *nonzero, floor * 10]) * 10)
    ax.set_yticks(range(len(rows)), [layer_norm_label(c.name) for c in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # execution order, top to bottom
    ax.set_xlabel("max abs error (log scale)")
    ax.set_title(f"{report.backend} {report.precision} vs eager PyTorch:\nmax abs error per LayerNorm output, in execution order")
    handles: list[Artist] = [Patch(color="tab:blue", label="passed"), Patch(color="tab:red", label="failed")]
    handles += [Line2D([], [], color="red", linestyle="--", label=f"atol {bound:g}") for bound in bounds]
    if len(nonzero) < len(rows):
        handles.append(Line2D([], [], color="tab:gray", marker="$0$", linestyle="none", label="error exactly 0: no bar"))
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
