"""``ldlm bench``: latency and throughput of every graph on every backend, side by side in one run,
end-to-end generation tokens/s, and continuous against static batching under mixed arrivals.

Backends alternate run by run so that noise on a shared machine hits them alike; every figure is a
median (p50) or p99 over ``runs`` runs. Results go to JSON, with PNG charts. The measurements are in
``bench_latency`` (graphs, generation, solvers) and ``bench_workload`` (batching), the summary and the
chart in ``bench_report``; here ``run_bench`` opens each backend and runs every section.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ldlm.export.onnx_export import export_graphs
from ldlm.model.checkpoint import load_config
from ldlm.model.config import LDLMConfig
from ldlm.pipeline import LDLMPipeline, check_length
from ldlm.sampling.tuned_grids import TunedSchedules, checkpoint_schedules
from ldlm.serve.checks.bench_latency import (
    available_cpus,
    bench_generation,
    bench_graphs,
    bench_solvers,
    default_threads,
    load_average,
    unreliable_reason,
)
from ldlm.serve.checks.bench_workload import bench_batching
from ldlm.serve.runtime.backends import BackendGraphs, info_of, open_graphs, ort_providers
from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.registry import DEFAULT_BACKEND, REGISTRY, BackendInfo, backend_names


def run_bench(
    checkpoint: str,
    backends: list[str],
    onnx_dir: str | None = None,
    engine_dir: str | None = None,
    batches: Sequence[int] = (1, 8),
    length: int = 128,
    runs: int = 10,
    threads: int | None = None,
    gen_n: int = 4,
    gen_steps: int = 10,
    workload_requests: int = 60,
    workload_rate: float = 20.0,
    workload_backend: str = DEFAULT_BACKEND,
    max_batch: int = 8,
    progress: bool = False,
    workload_lengths: Sequence[int] = (16, 32, 64, 128),
    device: str = "cpu",
    precision: str = "fp32",
    provider: str = "cpu",
    gen_sampler: str = "ddim",
    solver_specs: Sequence[tuple[str, int, str | None]] = (),
    solver_reference_steps: int = 500,
    ort_precisions: Sequence[str] = ("fp32",),
    prior_temperature: float | None = None,
) -> dict[str, Any]:
    """Every section of ``ldlm bench``; ort exports the checkpoint when no ``onnx_dir`` is given.
    The torch backends (eager, compiled, inductor) run on ``device`` in ``precision``; ort on ``provider``, once
    per ``ort_precisions`` entry (a column ``ort`` for fp32, ``ort-int8`` for the INT8 variants; the same for every
    backend that runs an export). Generation and
    the solvers start from the prior at ``prior_temperature`` (default: the config's); ``threads``: ``default_threads``."""
    check_length(length, load_config(checkpoint).max_seq_len)  # before any export or timing
    backends = ort_columns(backends, ort_precisions)
    load_start, cpus = load_average(), available_cpus()  # before the export, which is this run's own load
    threads = default_threads(load_start, cpus) if threads is None else threads
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="ldlm-bench-") as tmp:
        sources = bench_sources(checkpoint, backends, onnx_dir, engine_dir, ort_precisions, Path(tmp), progress)
        schedules = checkpoint_schedules(checkpoint)  # tuned grids, where tuned
        graphs_by_backend, pipelines, config = open_pipelines(backends, sources, precision, provider, threads, device, schedules)
        report: dict[str, Any] = {"checkpoint": str(checkpoint), "threads": threads, "runs": runs, "torch": torch.__version__}
        report.update(config_sha256=config.config_hash(), load_average_1m=round(load_start, 2), cpus=cpus, host=host_isa())
        report["graphs"] = bench_graphs(graphs_by_backend, config, batches, length, runs)
        report["generation"] = bench_generation(pipelines, gen_n, length, gen_steps, max(3, runs // 3), gen_sampler, prior_temperature)
        report["precision_speedups"] = precision_speedups(report)
        chosen = workload_backend if workload_backend in pipelines else backends[-1]
        if solver_specs:
            report["solvers"] = bench_solvers(
                pipelines[chosen], solver_specs, gen_n, min(length, 64), max(3, runs // 3), solver_reference_steps, prior_temperature
            )
            report["solvers"]["backend"] = chosen
        if workload_requests > 0:
            report["batching"] = bench_batching(
                pipelines[chosen], chosen, config, workload_requests, workload_rate, workload_lengths, max_batch
            )
        for graphs in graphs_by_backend.values():
            for graph in graphs.values():
                graph.close()
    mark_reliability(report, threads, load_start, cpus)
    return report


def mark_reliability(report: dict[str, Any], threads: int, load_start: float, cpus: int) -> None:
    """Record the load at the end of the run and whether its figures are reliable; an unreliable run says why
    and leaves out its speed-up ratios (``withhold_ratios``)."""
    report["load_average_1m_end"] = round(load_average(), 2)
    reason = unreliable_reason(threads, load_start, report["load_average_1m_end"], cpus)
    report["reliable"] = reason is None
    if reason is not None:
        report["unreliable_reason"] = reason
        withhold_ratios(report)


# Ratios of two timings: on oversubscribed CPUs the backends slow unequally (eager far more than ONNX
# Runtime), so a ratio then measures the machine's load, not the backends.
RATIO_KEYS = ("speedup_vs_eager", "throughput_ratio", "p99_ratio", "mixed_solvers_throughput_ratio")


def withhold_ratios(report: dict[str, Any]) -> None:
    """Leave out every speed-up ratio of an unreliable run, and say so in ``ratios_left_out``: the timings
    stay (with ``reliable: false``), the ratios would read as findings."""
    left_out = []
    for key, entry in report["graphs"].items():
        for name, cell in entry.items():
            if cell.pop("speedup_vs_eager", None) is not None:
                left_out.append(f"{key}:{name}:speedup_vs_eager")
    if report.pop("precision_speedups", None):
        left_out.append("precision_speedups")
    batching = report.get("batching", {})
    left_out += [f"batching:{key}" for key in RATIO_KEYS if batching.pop(key, None) is not None]
    report["ratios_left_out"] = left_out


def open_pipelines(
    backends: Sequence[str],
    sources: Mapping[str, str | None],
    precision: str,
    provider: str,
    threads: int,
    device: str,
    schedules: TunedSchedules | None = None,
) -> tuple[dict[str, dict[str, GraphBackend]], dict[str, LDLMPipeline], LDLMConfig]:
    """Each backend's graphs (from its source) and a pipeline on them; the config of the last one opened."""
    graphs_by_backend, pipelines = {}, {}
    for name in backends:
        info, column_precision = column(name)
        source = sources.get(name)
        if source is None:
            raise ValueError(f"backend {info.name!r} needs an engine directory (--engine-dir)")
        graphs, config, tokenizer = open_graphs(
            info.name,
            source,
            precision if info.runs_checkpoint else column_precision,
            ort_providers(provider, info.name),
            threads,
            device if info.runs_checkpoint else "cpu",
        )
        graphs_by_backend[name] = graphs
        buckets = (16, 32, 64, 128, config.max_seq_len)
        pipelines[name] = LDLMPipeline(
            BackendGraphs(graphs),
            tokenizer,
            getattr(graphs["denoiser"], "device", "cpu"),
            config=config,
            buckets=[b for b in buckets if b <= config.max_seq_len],
            schedules=schedules,
        )
    return graphs_by_backend, pipelines, config


def bench_sources(
    checkpoint: str,
    backends: Sequence[str],
    onnx_dir: str | None,
    engine_dir: str | None,
    ort_precisions: Sequence[str],
    scratch: Path,
    progress: bool,
) -> dict[str, str | None]:
    """What each column opens: the checkpoint (torch), an export (every export backend's precision: exported into
    ``scratch``, with the INT8 variants when asked, if no ``onnx_dir`` is given), the engines."""
    export = onnx_dir
    if export is None and any(column(b)[0].opens == "export" for b in backends):
        quantize = "int8" if "int8" in ort_precisions else None
        export = str(export_graphs(checkpoint, scratch / "onnx", progress=progress, quantize=quantize).out)
    opened = {"checkpoint": checkpoint, "export": export, "engines": engine_dir}
    return {name: opened[column(name)[0].opens] for name in backends}


def column(name: str) -> tuple[BackendInfo, str]:
    """A bench column's backend and precision: a backend's name (fp32), or an export backend's name and one of its
    precisions (``ort-int8``)."""
    if name in REGISTRY:
        return info_of(name), "fp32"
    backend, _, precision = name.rpartition("-")
    if backend in backend_names("export") and precision in REGISTRY[backend].precisions:
        return REGISTRY[backend], precision
    raise ValueError(f"backend={name!r} is unknown; allowed: {', '.join(REGISTRY)}")


def ort_columns(backends: Sequence[str], ort_precisions: Sequence[str]) -> list[str]:
    """``backends`` with each export backend replaced by one column per precision: ort (fp32), ort-int8, ..."""
    for name in backends:
        info, _ = column(name)
        if info.opens == "export" and (not ort_precisions or any(p not in info.precisions for p in ort_precisions)):
            allowed = ", ".join(info.precisions)
            raise ValueError(f"precisions {list(ort_precisions)} are invalid for {name}; allowed: a non-empty subset of {allowed}")
    out: list[str] = []
    for name in backends:
        out += [name if p == "fp32" else f"{name}-{p}" for p in ort_precisions] if column(name)[0].opens == "export" else [name]
    return out


def precision_speedups(report: dict[str, Any]) -> dict[str, float]:
    """An export backend's fp32 median over each of its other precisions' (``ort`` over ``ort-int8``), per graph
    cell and for generation, measured side by side in this run."""
    out = {}
    for key, entry in [*report["graphs"].items(), ("generation", report["generation"])]:
        for name, cell in entry.items():
            if name in REGISTRY or not isinstance(cell, dict):
                continue
            fp32 = column(name)[0].name
            unit = "p50_ms" if "p50_ms" in cell else "p50_s"
            if fp32 in entry and unit in cell and unit in entry[fp32]:
                out[f"{key}:{name}"] = round(entry[fp32][unit] / cell[unit], 3)
    return out


def host_isa() -> dict[str, Any]:
    """The CPU and the vector extensions INT8 and fp32 speed depend on (Linux /proc/cpuinfo; {} elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
    return {"cpu": model, **{flag: flag in flags for flag in wanted}}
