"""``ldlm bench``: latency and throughput of every graph on every backend, side by side in one run,
end-to-end generation tokens/s, and continuous against static batching under mixed arrivals.

Backends alternate run by run so that noise on a shared machine hits them alike; every figure is a
median (p50) or p99 over ``runs`` runs. Results go to JSON, with PNG charts. The measurements are in
``bench_latency`` (graphs, generation, solvers) and ``bench_workload`` (batching), the summary and the
chart in ``bench_report``; here ``run_bench`` opens each backend and runs every section.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ldlm.checkpoint import WEIGHTS_FILE, load_config
from ldlm.config import LDLMConfig
from ldlm.export.onnx_export import export_graphs
from ldlm.pipeline import LDLMPipeline, check_length
from ldlm.sampling.schedules import TunedSchedules, load_schedules
from ldlm.serve.checks.bench_latency import bench_generation, bench_graphs, bench_solvers
from ldlm.serve.checks.bench_workload import bench_batching
from ldlm.serve.runtime.backends import TORCH_BACKENDS, BackendGraphs, open_graphs, ort_providers
from ldlm.serve.runtime.graph_backend import GraphBackend


def run_bench(
    checkpoint: str,
    backends: list[str],
    onnx_dir: str | None = None,
    engine_dir: str | None = None,
    batches: Sequence[int] = (1, 8),
    length: int = 128,
    runs: int = 10,
    threads: int = 2,
    gen_n: int = 4,
    gen_steps: int = 10,
    workload_requests: int = 60,
    workload_rate: float = 20.0,
    workload_backend: str = "ort",
    max_batch: int = 8,
    progress: bool = False,
    workload_lengths: Sequence[int] = (16, 32, 64, 128),
    device: str = "cpu",
    precision: str = "fp32",
    provider: str = "cpu",
    gen_sampler: str = "ddim",
    solver_specs: Sequence[tuple[str, int, str | None]] = (),
    solver_reference_steps: int = 500,
) -> dict[str, Any]:
    """Every section of ``ldlm bench``; ort exports the checkpoint when no ``onnx_dir`` is given.
    The torch backends (eager, compiled) run on ``device`` in ``precision``; ort on ``provider``."""
    check_length(length, load_config(checkpoint).max_seq_len)  # before any export or timing
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="ldlm-bench-") as tmp:
        sources = {"eager": checkpoint, "compiled": checkpoint, "ort": onnx_dir, "trt": engine_dir}
        if "ort" in backends and onnx_dir is None:
            sources["ort"] = str(export_graphs(checkpoint, Path(tmp) / "onnx", progress=progress).out)
        schedules = load_schedules(checkpoint, weights=Path(checkpoint) / WEIGHTS_FILE)  # tuned grids, where tuned
        graphs_by_backend, pipelines, config = open_pipelines(backends, sources, precision, provider, threads, device, schedules)
        report: dict[str, Any] = {
            "checkpoint": str(checkpoint),
            "threads": threads,
            "runs": runs,
            "torch": torch.__version__,
            "config_sha256": config.config_hash(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(),
        }
        report["graphs"] = bench_graphs(graphs_by_backend, config, batches, length, runs)
        report["generation"] = bench_generation(pipelines, gen_n, length, gen_steps, max(3, runs // 3), gen_sampler)
        chosen = workload_backend if workload_backend in pipelines else backends[-1]
        if solver_specs:
            report["solvers"] = bench_solvers(
                pipelines[chosen], solver_specs, gen_n, min(length, 64), max(3, runs // 3), solver_reference_steps
            )
            report["solvers"]["backend"] = chosen
        if workload_requests > 0:
            report["batching"] = bench_batching(
                pipelines[chosen], chosen, config, workload_requests, workload_rate, workload_lengths, max_batch
            )
        for graphs in graphs_by_backend.values():
            for graph in graphs.values():
                graph.close()
    return report


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
        if name not in sources:
            raise ValueError(f"backend={name!r} is unknown; allowed: {', '.join(sources)}")
        source = sources[name]
        if source is None:
            raise ValueError("backend 'trt' needs an engine directory (--engine-dir)")
        torch_backend = name in TORCH_BACKENDS
        graphs, config, tokenizer = open_graphs(
            name,
            source,
            precision if torch_backend else "fp32",
            ort_providers(provider),
            threads,
            device if torch_backend else "cpu",
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
