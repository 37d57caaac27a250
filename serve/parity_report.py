"""Writes a ParityReport as JSON, Markdown and PNG plots (an error histogram per graph, the
largest error per LayerNorm against the tolerance)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ldlm.serve.parity import ParityReport


def write_parity_report(report: ParityReport, out: str | os.PathLike[str]) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "parity.json", out / "parity.md"]
    _write_atomic(files[0], json.dumps(report.to_dict(), indent=2) + "\n")
    _write_atomic(files[1], markdown(report))
    files += plot(report, out)
    return files


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def markdown(report: ParityReport) -> str:
    lines = [
        f"# Parity: {report.backend} ({report.precision}) against eager PyTorch",
        "",
        f"**{report.summary()}**",
        "",
        f"Reference: eager PyTorch. An element fails when its error exceeds atol {report.atol:g} and rtol {report.rtol:g}.",
        f"Providers that ran: {', '.join(f'{g}: {p}' for g, p in report.providers.items())}.",
        "",
        f"End to end (deterministic sampler, same seed and noise): token agreement {100 * (report.token_agreement or 0):.2f}% "
        f"(required {100 * report.token_agreement_required:.0f}%).",
        "",
    ]
    if report.decoder_token_agreement:
        lines += ["Decoder token ids: " + ", ".join(f"{k} {100 * v:.2f}%" for k, v in report.decoder_token_agreement.items()), ""]
    for title, rows in (("Graph outputs", report.graphs), ("LayerNorm outputs", report.layer_norms)):
        if not rows:
            continue
        lines += [f"## {title}", "", "| output | result | max abs | p99 abs | max rel | cosine min | failed | min atol to pass | NaN/Inf |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in rows:
            lines.append(
                f"| `{c.name}` | {'pass' if c.passed else '**FAIL**'} | {c.max_abs:.3g} | {c.p99_abs:.3g} | {c.max_rel:.3g} | "
                f"{c.cosine_min:.6f} | {c.failed_elements}/{c.elements} | {c.min_atol_to_pass:.3g} | "
                f"{c.nonfinite_reference}/{c.nonfinite_candidate} |"
            )
        lines.append("")
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


def plot(report: ParityReport, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    graphs = sorted({c.name.split("/", 1)[0] for c in report.graphs})
    if graphs:
        from ldlm.serve.compare import HISTOGRAM_EDGES

        fig, axes = plt.subplots(1, len(graphs), figsize=(5 * len(graphs), 3.5), squeeze=False)
        labels = ["0"] + [f"{e:.0e}" for e in HISTOGRAM_EDGES[1:-1]]
        for ax, graph in zip(axes[0], graphs):
            for c in (c for c in report.graphs if c.name.startswith(graph + "/")):
                ax.step(range(len(c.abs_error_histogram)), c.abs_error_histogram, where="post", label=c.name.split("/", 1)[1])
            ax.axvline(HISTOGRAM_EDGES.index(min(e for e in HISTOGRAM_EDGES[1:] if e >= report.atol)), color="red", linestyle="--", label=f"atol {report.atol:g}")
            ax.set_xticks(range(0, len(labels), 3), labels[::3], fontsize=7)
            ax.set_yscale("symlog")
            ax.set_ylim(bottom=0)
            ax.set_xlabel("absolute error (bin lower edge)")
            ax.set_ylabel("elements")
            ax.set_title(graph)
            ax.legend(fontsize=6)
        fig.suptitle(f"{report.backend} {report.precision}: absolute error histogram per graph")
        fig.tight_layout()
        files.append(out / "errors_by_graph.png")
        fig.savefig(files[-1], dpi=100)
        plt.close(fig)
    if report.layer_norms:
        fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(report.layer_norms)), 4))
        colors = ["tab:blue" if c.passed else "tab:red" for c in report.layer_norms]
        ax.bar(range(len(report.layer_norms)), [max(c.max_abs, 1e-12) for c in report.layer_norms], color=colors)
        ax.axhline(report.atol, color="red", linestyle="--", label=f"atol {report.atol:g}")
        ax.set_yscale("log")
        ax.set_xlabel("LayerNorm (execution order; red = failed)")
        ax.set_ylabel("max abs error")
        ax.legend()
        fig.tight_layout()
        files.append(out / "errors_by_layernorm.png")
        fig.savefig(files[-1], dpi=100)
        plt.close(fig)
    return files
