"""``ldlm bench``: latency and throughput of every graph on every backend, side by side in one run,
end-to-end generation tokens/s, and continuous against static batching under mixed arrivals.

Backends alternate run by run so that noise on a shared machine hits them alike; every figure is a
median (p50) or p99 over ``runs`` runs. Results go to JSON, with PNG charts.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ldlm.config import LDLMConfig
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.backends import GraphBackend
from ldlm.serve.scheduler import GenerateRequest, GenerationScheduler


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


def bench_graphs(
    backends: Mapping[str, Mapping[str, GraphBackend]], config: LDLMConfig, batches: list[int], length: int, runs: int
) -> dict[str, Any]:
    """{graph/bN/LM: {backend: {p50_ms, p99_ms, samples_per_s}, speedup vs eager}}."""
    results: dict[str, Any] = {}
    for graph in ("encoder", "denoiser", "decoder"):
        for batch in batches:
            feed = graph_feed(config, graph, batch, length)
            times: dict[str, list[float]] = {name: [] for name in backends}
            for graphs in backends.values():
                graphs[graph].run(feed)  # warm-up
            for _ in range(runs):
                for name, graphs in backends.items():
                    start = time.perf_counter()
                    graphs[graph].run(feed)
                    times[name].append((time.perf_counter() - start) * 1000)
            entry: dict[str, Any] = {}
            for name, values in times.items():
                p50 = statistics.median(values)
                entry[name] = {"p50_ms": round(p50, 3), "p99_ms": round(percentile(values, 99), 3),
                               "samples_per_s": round(1000 * batch / p50, 2), "provider": backends[name][graph].provider}
            if "eager" in entry:
                for name in entry:
                    if name != "eager":
                        entry[name]["speedup_vs_eager"] = round(entry["eager"]["p50_ms"] / entry[name]["p50_ms"], 3)
            results[f"{graph}/b{batch}/L{length}"] = entry
    return results


def bench_generation(pipelines: Mapping[str, LDLMPipeline], n: int, length: int, steps: int, runs: int) -> dict[str, Any]:
    results = {}
    times: dict[str, list[float]] = {name: [] for name in pipelines}
    for pipe in pipelines.values():
        pipe.generate(n, length, 2, 0, "ddim")  # warm-up
    for run in range(runs):
        for name, pipe in pipelines.items():
            start = time.perf_counter()
            pipe.generate(n, length, steps, run, "ddim")
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        p50 = statistics.median(values)
        results[name] = {"p50_s": round(p50, 4), "tokens_per_s": round(n * length / p50, 2), "n": n, "length": length, "steps": steps}
    return results


@dataclass(frozen=True)
class Arrival:
    at_s: float
    request: GenerateRequest


def mixed_workload(config: LDLMConfig, requests: int, rate_per_s: float, seed: int = 0) -> list[Arrival]:
    """Poisson arrivals of requests with mixed lengths and step counts (a seeded, fixed list)."""
    gen = np.random.default_rng(seed)
    lengths = [n for n in (16, 32, 64, 128) if n <= config.max_seq_len] or [config.max_seq_len]
    at = np.cumsum(gen.exponential(1 / rate_per_s, requests))
    return [
        Arrival(float(t), GenerateRequest(n=1, length=int(gen.choice(lengths)), steps=int(gen.integers(5, 41)),
                                          seed=i, sampler="ddim"))
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
        "latency_p50_s": round(percentile(latencies, 50), 4),
        "latency_p99_s": round(percentile(latencies, 99), 4),
        "denoiser_calls": scheduler.denoiser_calls,
        "mean_batch": round(scheduler.samples_stepped / max(1, scheduler.denoiser_calls), 2),
    }


def plot_bench(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graphs = report.get("graphs", {})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    keys = list(graphs)
    backends = sorted({b for entry in graphs.values() for b in entry})
    width = 0.8 / max(1, len(backends))
    for i, backend in enumerate(backends):
        axes[0].bar([k + i * width for k in range(len(keys))], [graphs[key].get(backend, {}).get("p50_ms", 0) for key in keys], width, label=backend)
    axes[0].set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys, rotation=30, ha="right", fontsize=7)
    axes[0].set_ylabel("p50 latency (ms)")
    axes[0].set_yscale("log")
    axes[0].legend()
    axes[0].set_title("graph latency")
    workload = report.get("batching", {})
    policies = [p for p in ("static", "continuous") if p in workload]
    if policies:
        axes[1].bar([f"{p}\ntokens/s" for p in policies], [workload[p]["tokens_per_s"] for p in policies], color="tab:green")
        twin = axes[1].twinx()
        twin.plot([f"{p}\ntokens/s" for p in policies], [workload[p]["latency_p99_s"] for p in policies], "o-", color="tab:red")
        twin.set_ylabel("p99 latency (s)", color="tab:red")
        axes[1].set_title("mixed arrivals: static vs continuous batching")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
