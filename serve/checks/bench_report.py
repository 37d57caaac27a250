"""What ``ldlm bench`` shows of its report: one summary line per figure, and the PNG chart (graph
latency per backend; with a mixed-arrival workload, its throughput and latency per policy)."""

from __future__ import annotations

from typing import Any

import matplotlib

from ldlm.files import save_figure


def bench_summary(report: dict[str, Any]) -> list[str]:
    lines = []
    if report.get("reliable") is False:
        lines.append(f"UNRELIABLE figures: {report['unreliable_reason']}; speed-up ratios are left out (bench.json: reliable false)")
    for key, entry in report["graphs"].items():
        cells = ", ".join(
            f"{b} p50 {v['p50_ms']:.2f} ms" + (f" (x{v['speedup_vs_eager']:.2f})" if "speedup_vs_eager" in v else "")
            for b, v in entry.items()
        )
        lines.append(f"{key:22s} {cells}")
    for name, entry in report["generation"].items():
        lines.append(
            f"generate {name}: {entry['tokens_per_s']:.1f} tokens/s ({entry['n']} x {entry['length']}, "
            f"{entry['steps']} steps of {entry['sampler']})"
        )
    if "solvers" in report:
        solvers = report["solvers"]
        lines.append(f"solvers on {solvers['backend']} against {solvers['reference']} ({solvers['n']} x {solvers['length']}):")
        for key, entry in solvers["entries"].items():
            lines.append(
                f"  {key:16s} {entry['ms_per_sample']:9.2f} ms/sample  tokens {100 * entry['token_agreement']:5.1f}%  "
                f"latent error {entry['latent_rel_error']:.4f}"
            )
    if "batching" in report:
        b = report["batching"]
        ratio = f" (x{b['throughput_ratio']})" if "throughput_ratio" in b else ""
        lines.append(
            f"mixed arrivals: continuous {b['continuous']['tokens_per_s']} vs static {b['static']['tokens_per_s']} tokens/s"
            f"{ratio}, p99 {b['continuous']['latency_p99_s']} vs {b['static']['latency_p99_s']} s"
        )
        if "mixed_solvers_throughput_ratio" in b:
            lines.append(
                f"mixed solvers in one batch: {b['continuous_mixed_solvers']['tokens_per_s']} tokens/s "
                f"(x{b['mixed_solvers_throughput_ratio']} of one solver)"
            )
    return lines


def plot_bench(report: dict[str, Any], path: str) -> None:
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot fixes its backend on first import, for the whole process

    fig = bench_figure(report, plt)
    save_figure(fig, path)
    plt.close(fig)


def bench_figure(report: dict[str, Any], plt: Any) -> Any:
    """Graph latency per backend; with a mixed-arrival workload, its throughput and latency per policy."""

    workload = report.get("batching", {})
    policies = [p for p in ("static", "continuous") if p in workload]
    panels = 3 if policies else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 + 4 * (panels - 1), 4.5), squeeze=False, width_ratios=[2] + [1] * (panels - 1))
    ax = axes[0][0]
    graphs = report.get("graphs", {})
    keys = list(graphs)
    backends = sorted({b for entry in graphs.values() for b in entry})
    width = 0.8 / max(1, len(backends))
    for i, backend in enumerate(backends):
        ax.bar(
            [k + i * width for k in range(len(keys))], [graphs[key].get(backend, {}).get("p50_ms", 0) for key in keys], width, label=backend
        )
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("p50 latency (ms)")
    # headroom above the tallest bar for the legend, which would otherwise cover it (log axis: x 6)
    tallest = max((v.get("p50_ms", 0) for entry in graphs.values() for v in entry.values()), default=1.0)
    ax.set_ylim(top=max(tallest, 1e-3) * 6)
    ax.legend(title="backend", loc="upper left", ncols=max(1, len(backends)), fontsize=8)
    ax.set_title("graph latency per call (graph/batch/length)\nlog scale: bars do not start at 0", fontsize=10)
    if policies:
        colors = {"static": "tab:gray", "continuous": "tab:green"}
        ax = axes[0][1]
        ax.bar(policies, [workload[p]["tokens_per_s"] for p in policies], color=[colors[p] for p in policies])
        ax.set_ylabel("tokens/s (axis from 0)")
        ax.set_title(f"throughput ({workload['backend']}, {workload['requests']} requests)")
        ax = axes[0][2]
        ticks, labels = [], []
        for i, p in enumerate(policies):
            for dx, q in ((-0.22, "p50"), (0.22, "p99")):
                ax.bar(i + dx, workload[p][f"latency_{q}_s"], 0.4, color=colors[p], alpha=1.0 if q == "p99" else 0.6)
                ticks.append(i + dx)
                labels.append(f"{p}\n{q}")
        ax.set_xticks(ticks, labels, fontsize=8)
        ax.set_ylabel("request latency (s, axis from 0)")
        ax.set_title("latency per request: p50, p99")
        fig.suptitle(
            f"mixed arrivals at {workload['rate_per_s']:g}/s: static vs continuous batching (max batch {workload['max_batch']})",
            x=0.7,
            fontsize=10,
        )
    fig.tight_layout()
    return fig
