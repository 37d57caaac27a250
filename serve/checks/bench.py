"""``ldlm bench``: latency and throughput of every graph on every backend, side by side in one run,
end-to-end generation tokens/s, and continuous against static batching under mixed arrivals.

Backends alternate run by run so that noise on a shared machine hits them alike; every figure is a
median (p50) or p99 over ``runs`` runs. Results go to JSON, with PNG charts.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch

from ldlm.checkpoint import load_config
from ldlm.config import LDLMConfig
from ldlm.export.onnx_export import export_graphs
from ldlm.limits import MAX_STEPS
from ldlm.pipeline import LDLMPipeline, check_length
from ldlm.samplers import get_sampler
from ldlm.serve.runtime.backends import TORCH_BACKENDS, BackendGraphs, open_graphs, ort_providers
from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def graph_feed(config: LDLMConfig, graph: str, batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    gen = np.random.default_rng(seed)
    mask = np.ones((batch, length), dtype=np.int64)
    d = config.d_model
    if graph == "encoder":
        return {"input_ids": gen.integers(0, config.gpt2_vocab_size, (batch, length)), "attention_mask": mask}
    if graph == "denoiser":
        x = gen.standard_normal((batch, length, d)).astype(np.float32)
        return {"x_t": x, "t": np.full(batch, 0.5, dtype=np.float32), "x0_prev": x, "attention_mask": mask}
    return {"latents": gen.standard_normal((batch, length, d)).astype(np.float32), "attention_mask": mask}


def timed_call(backend: GraphBackend, feed: dict[str, np.ndarray]) -> Callable[[], Any]:
    """One graph call as a benchmark times it: backends that take device tensors (``run_tensors``:
    eager, compiled and TensorRT) get them put there once and are waited for; ONNX Runtime takes
    NumPy, as it is served."""
    if not hasattr(backend, "run_tensors"):
        return lambda: backend.run(feed)
    device = backend.device  # type: ignore[attr-defined]
    tensors = {n: torch.from_numpy(a).to(device) for n, a in feed.items()}

    def call() -> Any:
        out = backend.run_tensors(tensors)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    return call


def bench_graphs(
    backends: Mapping[str, Mapping[str, GraphBackend]], config: LDLMConfig, batches: Sequence[int], length: int, runs: int
) -> dict[str, Any]:
    """{graph/bN/LM: {backend: {p50_ms, p99_ms, samples_per_s}, speedup vs eager}}."""
    results: dict[str, Any] = {}
    for graph in ("encoder", "denoiser", "decoder"):
        for batch in batches:
            feed = graph_feed(config, graph, batch, length)
            calls = {name: timed_call(graphs[graph], feed) for name, graphs in backends.items()}
            times: dict[str, list[float]] = {name: [] for name in backends}
            for call in calls.values():
                call()  # warm-up (and, for the compiled backend, the capture of this bucket)
            for _ in range(runs):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[name].append((time.perf_counter() - start) * 1000)
            entry: dict[str, Any] = {}
            for name, values in times.items():
                p50 = statistics.median(values)
                entry[name] = {
                    "p50_ms": round(p50, 3),
                    "p99_ms": round(percentile(values, 99), 3),
                    "samples_per_s": round(1000 * batch / p50, 2),
                    "provider": backends[name][graph].provider,
                }
            if "eager" in entry:
                for name in entry:
                    if name != "eager":
                        entry[name]["speedup_vs_eager"] = round(entry["eager"]["p50_ms"] / entry[name]["p50_ms"], 3)
            results[f"{graph}/b{batch}/L{length}"] = entry
    return results


def busy_machine_warning(threads: int, load_average: float | None = None, cpus: int | None = None) -> str | None:
    """A warning when other work already keeps the CPUs busy: then ``threads`` threads per backend
    oversubscribe the machine and timings, and their ratios, are noise (eager slows far more than ONNX
    Runtime). None on a quiet machine."""
    load = os.getloadavg()[0] if load_average is None else load_average
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    if load + threads <= cpus + 0.5:
        return None
    fewer = max(1, cpus - round(load))
    advice = f"try --threads {fewer} or a quiet machine" if fewer < threads else "run it on a quiet machine"
    return (
        f"the machine is busy: 1-minute load average {load:.1f} on {cpus} CPUs, and the bench adds {threads} "
        f"thread{'s' if threads > 1 else ''}; timings will be noisy and oversubscribed ({advice})"
    )


def bench_generation(
    pipelines: Mapping[str, LDLMPipeline], n: int, length: int, steps: int, runs: int, sampler: str = "ddim"
) -> dict[str, Any]:
    results = {}
    times: dict[str, list[float]] = {name: [] for name in pipelines}
    for pipe in pipelines.values():
        pipe.generate(n, length, 2, 0, sampler)  # warm-up
    for run in range(runs):
        for name, pipe in pipelines.items():
            start = time.perf_counter()
            pipe.generate(n, length, steps, run, sampler)
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        p50 = statistics.median(values)
        results[name] = {
            "p50_s": round(p50, 6),
            "tokens_per_s": round(n * length / p50, 2),
            "n": n,
            "length": length,
            "steps": steps,
            "sampler": sampler,
        }
    return results


def parse_solver_specs(text: str) -> list[tuple[str, int]]:
    """'ddim@50,dpm3m-psc@20' -> [('ddim', 50), ('dpm3m-psc', 20)], each name checked."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, steps = item.partition("@")
        get_sampler(name)
        if not steps.isdigit() or int(steps) < 1:
            raise ValueError(f"solver spec {item!r} is invalid; allowed: NAME@STEPS with STEPS an integer >= 1")
        if int(steps) > MAX_STEPS:
            raise ValueError(f"solver spec {item!r} has {steps} steps; allowed: 1..{MAX_STEPS} denoising steps (as ldlm serve's max_steps)")
        specs.append((name, int(steps)))
    return specs


def bench_solvers(
    pipeline: LDLMPipeline, specs: Sequence[tuple[str, int]], n: int, length: int, runs: int, reference_steps: int
) -> dict[str, Any]:
    """Latency per sample beside agreement, solver by solver, in one run: each ``(sampler, steps)`` is
    timed (p50 of ``runs``, specs alternating) and compared with DDIM at ``reference_steps`` from the same
    seeds (token agreement and the final latent's relative L2 error). The cheapest spec that agrees as
    well as the most expensive one is what a server should default to."""
    reference = pipeline.sample_latents(n, length, reference_steps, 0, "ddim")
    reference_tokens = pipeline.decode(reference).token_ids
    entries: dict[str, dict[str, Any]] = {}
    for sampler, steps in specs:  # quality, and the warm-up of the timing
        latents = pipeline.sample_latents(n, length, steps, 0, sampler)
        entries[f"{sampler}@{steps}"] = {
            "sampler": sampler,
            "steps": steps,
            "token_agreement": round(float((pipeline.decode(latents).token_ids == reference_tokens).float().mean()), 4),
            "latent_rel_error": round(float((latents - reference).norm() / reference.norm()), 5),
        }
    times: dict[str, list[float]] = {key: [] for key in entries}
    for run in range(runs):
        for sampler, steps in specs:
            start = time.perf_counter()
            pipeline.generate(n, length, steps, run, sampler)
            times[f"{sampler}@{steps}"].append(time.perf_counter() - start)
    for key, values in times.items():
        p50 = statistics.median(values)
        entries[key].update(p50_s=round(p50, 6), ms_per_sample=round(1000 * p50 / n, 3))
    return {"reference": f"ddim@{reference_steps}", "n": n, "length": length, "runs": runs, "entries": entries}


@dataclass(frozen=True)
class Arrival:
    at_s: float
    request: GenerateRequest


WORKLOAD_STEPS = (5, 40)  # a mixed workload's requests take from 5 to 40 steps (both included), uniformly


def workload_lengths_used(config: LDLMConfig, lengths: Sequence[int]) -> list[int]:
    """The request lengths a mixed workload draws from: those within the config's max_seq_len
    (max_seq_len alone when none is)."""
    return [n for n in lengths if n <= config.max_seq_len] or [config.max_seq_len]


def mixed_workload(
    config: LDLMConfig,
    requests: int,
    rate_per_s: float,
    seed: int = 0,
    lengths: Sequence[int] = (16, 32, 64, 128),
    samplers: Sequence[str] = ("ddim",),
) -> list[Arrival]:
    """Poisson arrivals of requests with mixed lengths (``workload_lengths_used``) and WORKLOAD_STEPS
    steps (a seeded, fixed list); request i uses ``samplers[i % len(samplers)]``."""
    gen = np.random.default_rng(seed)
    lengths = workload_lengths_used(config, lengths)
    at = np.cumsum(gen.exponential(1 / rate_per_s, requests))
    low, high = WORKLOAD_STEPS
    return [
        Arrival(
            float(t),
            GenerateRequest(
                n=1, length=int(gen.choice(lengths)), steps=int(gen.integers(low, high + 1)), seed=i, sampler=samplers[i % len(samplers)]
            ),
        )
        for i, t in enumerate(at)
    ]


def run_workload(pipeline: LDLMPipeline, workload: list[Arrival], policy: str, max_batch: int) -> dict[str, Any]:
    """Replay ``workload`` in real time against a scheduler; throughput and per-request latency."""
    scheduler = GenerationScheduler(pipeline, max_batch=max_batch, policy=policy)  # type: ignore[arg-type]
    latencies: list[float] = []
    done = threading.Event()
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = time.perf_counter()

    def on_done(submitted: float) -> Callable[[Any], None]:
        def callback(future: Any) -> None:
            with lock:
                if future.exception() is not None:
                    errors.append(future.exception())
                latencies.append(time.perf_counter() - submitted)
                if len(latencies) == len(workload):
                    done.set()

        return callback

    for arrival in workload:
        delay = start + arrival.at_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        scheduler.submit(arrival.request).add_done_callback(on_done(time.perf_counter()))
    done.wait()
    makespan = time.perf_counter() - start
    scheduler.close()
    tokens = sum(a.request.n * a.request.length for a in workload)
    return {
        "policy": policy,
        "requests": len(workload),
        "errors": len(errors),
        "makespan_s": round(makespan, 3),
        "tokens_per_s": round(tokens / makespan, 2),
        "requests_per_s": round(len(workload) / makespan, 3),
        "latency_p50_s": round(percentile(latencies, 50), 6),
        "latency_p99_s": round(percentile(latencies, 99), 6),
        "denoiser_calls": scheduler.denoiser_calls,
        "mean_batch": round(scheduler.samples_stepped / max(1, scheduler.denoiser_calls), 2),
    }


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
    solver_specs: Sequence[tuple[str, int]] = (),
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
        graphs_by_backend, pipelines, config = open_pipelines(backends, sources, precision, provider, threads, device)
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
        )
    return graphs_by_backend, pipelines, config


def bench_batching(
    pipeline: LDLMPipeline, backend: str, config: LDLMConfig, requests: int, rate: float, lengths: Sequence[int], max_batch: int
) -> dict[str, Any]:
    """One mixed-arrival workload under static and continuous batching, then with mixed solvers."""
    workload = mixed_workload(config, requests, rate, lengths=lengths)
    batching: dict[str, Any] = {
        "backend": backend,
        "max_batch": max_batch,
        "rate_per_s": rate,
        "requests": requests,
        "lengths": workload_lengths_used(config, lengths),
    }
    for policy in ("static", "continuous"):
        batching[policy] = run_workload(pipeline, workload, policy, max_batch)
    # The same arrivals, each request with another solver (cycling): one batch holds several solvers.
    mixed = mixed_workload(config, requests, rate, lengths=lengths, samplers=("ddim", "dpm3m-psc", "dpm2m", "sde"))
    batching["continuous_mixed_solvers"] = run_workload(pipeline, mixed, "continuous", max_batch)
    batching["mixed_solvers_throughput_ratio"] = round(
        batching["continuous_mixed_solvers"]["tokens_per_s"] / batching["continuous"]["tokens_per_s"], 3
    )
    batching["throughput_ratio"] = round(batching["continuous"]["tokens_per_s"] / batching["static"]["tokens_per_s"], 3)
    batching["p99_ratio"] = round(batching["continuous"]["latency_p99_s"] / batching["static"]["latency_p99_s"], 3)
    return batching


def bench_summary(report: dict[str, Any]) -> list[str]:
    lines = []
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
        lines.append(
            f"mixed arrivals: continuous {b['continuous']['tokens_per_s']} vs static {b['static']['tokens_per_s']} tokens/s "
            f"(x{b['throughput_ratio']}), p99 {b['continuous']['latency_p99_s']} vs {b['static']['latency_p99_s']} s"
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
    fig.savefig(path, dpi=100)
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
