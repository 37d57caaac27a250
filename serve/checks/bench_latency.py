"""The latency half of ``ldlm bench``: each graph per backend (p50, p99, samples/s, speedup against
eager), end-to-end generation tokens/s, and solvers side by side (latency per sample beside agreement).

Backends alternate run by run so that noise on a shared machine hits them alike; every figure is a
median (p50) or p99 over ``runs`` runs.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ldlm.limits import MAX_STEPS, MAX_THREADS
from ldlm.model.config import GRIDS, TUNED_GRID, LDLMConfig
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling.samplers import get_sampler
from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.registry import REFERENCE_BACKEND


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
            if REFERENCE_BACKEND in entry:  # speedup_vs_eager: over the reference, eager fp32
                for name in entry:
                    if name != REFERENCE_BACKEND:
                        entry[name]["speedup_vs_eager"] = round(entry[REFERENCE_BACKEND]["p50_ms"] / entry[name]["p50_ms"], 3)
            results[f"{graph}/b{batch}/L{length}"] = entry
    return results


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity where the OS has one (a container or taskset may allow
    fewer than the machine has), else os.cpu_count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average: runnable threads, others' and ours, averaged over the last minute."""
    return os.getloadavg()[0]


def default_threads(load: float | None = None, cpus: int | None = None) -> int:
    """Threads for the bench that do not oversubscribe the CPUs: those the 1-minute load average leaves
    free (the rule of ``oversubscription``), at least 1. On a busy machine a fixed 2 threads slowed eager
    50-100x more than ONNX Runtime, and their ratio said so."""
    load = load_average() if load is None else load
    cpus = available_cpus() if cpus is None else cpus
    return max(1, min(MAX_THREADS, math.floor(cpus + 0.5 - load)))


def oversubscription(threads: int, load: float, cpus: int) -> str | None:
    """Why ``threads`` more threads oversubscribe ``cpus`` CPUs at 1-minute load average ``load``, or None
    when they fit (load + threads <= cpus + 0.5: the half absorbs a load average's drift)."""
    if load + threads <= cpus + 0.5:
        return None
    return (
        f"1-minute load average {load:.1f} on {cpus} CPUs, and the bench adds {threads} "
        f"thread{'s' if threads > 1 else ''}: the CPUs are oversubscribed"
    )


def busy_machine_warning(threads: int, load_average: float | None = None, cpus: int | None = None) -> str | None:
    """A warning when other work already keeps the CPUs busy: then ``threads`` threads per backend
    oversubscribe the machine and timings, and their ratios, are noise (eager slows far more than ONNX
    Runtime). None on a quiet machine."""
    load = os.getloadavg()[0] if load_average is None else load_average
    cpus = available_cpus() if cpus is None else cpus
    why = oversubscription(threads, load, cpus)
    if why is None:
        return None
    fewer = default_threads(load, cpus)
    advice = f"try --threads {fewer} or a quiet machine" if fewer < threads else "run it on a quiet machine"
    return f"the machine is busy: {why}; timings will be noisy and their ratios unreliable ({advice})"


def unreliable_reason(threads: int, load_start: float, load_end: float, cpus: int) -> str | None:
    """Why a run's timings are unreliable, or None: the CPUs were oversubscribed at its start (others' load
    plus its threads), or at its end (the load average then counts its own threads too)."""
    at_start = oversubscription(threads, load_start, cpus)
    if at_start is not None:
        return f"at the start, {at_start}"
    if load_end > cpus + 0.5:
        return f"at the end, 1-minute load average {load_end:.1f} on {cpus} CPUs (the bench's {threads} thread(s) included): the CPUs were oversubscribed"
    return None


def bench_generation(
    pipelines: Mapping[str, LDLMPipeline],
    n: int,
    length: int,
    steps: int,
    runs: int,
    sampler: str = "ddim",
    prior_temperature: float | None = None,
) -> dict[str, Any]:
    results = {}
    times: dict[str, list[float]] = {name: [] for name in pipelines}
    for pipe in pipelines.values():
        pipe.generate(n, length, 2, 0, sampler, prior_temperature=prior_temperature)  # warm-up
    for run in range(runs):
        for name, pipe in pipelines.items():
            start = time.perf_counter()
            pipe.generate(n, length, steps, run, sampler, prior_temperature=prior_temperature)
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
            "prior_temperature": pipelines[name].config.prior_temperature_for(prior_temperature),
        }
    return results


def parse_solver_specs(text: str) -> list[tuple[str, int, str | None]]:
    """'ddim@50,dpm3m-psc@10:tuned' -> [('ddim', 50, None), ('dpm3m-psc', 10, 'tuned')], each name checked
    (a grid after ':' is one of ldlm.model.config's GRIDS or 'tuned'; None: the default for that sampler and step count)."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        spec, _, grid = item.partition(":")
        name, _, steps = spec.partition("@")
        get_sampler(name)
        if grid and grid not in (TUNED_GRID, *GRIDS):
            raise ValueError(f"solver spec {item!r} names the grid {grid!r}; allowed: {', '.join((TUNED_GRID, *GRIDS))}")
        if not steps.isdigit() or int(steps) < 1:
            raise ValueError(f"solver spec {item!r} is invalid; allowed: NAME@STEPS with STEPS an integer >= 1")
        if int(steps) > MAX_STEPS:
            raise ValueError(f"solver spec {item!r} has {steps} steps; allowed: 1..{MAX_STEPS} denoising steps (as ldlm serve's max_steps)")
        specs.append((name, int(steps), grid or None))
    return specs


def bench_solvers(
    pipeline: LDLMPipeline,
    specs: Sequence[tuple[str, int, str | None]],
    n: int,
    length: int,
    runs: int,
    reference_steps: int,
    prior_temperature: float | None = None,
) -> dict[str, Any]:
    """Latency per sample beside agreement, solver by solver, in one run: each ``(sampler, steps)`` is
    timed (p50 of ``runs``, specs alternating) and compared with DDIM at ``reference_steps`` from the same
    seeds (token agreement and the final latent's relative L2 error). The cheapest spec that agrees as
    well as the most expensive one is what a server should default to. Every run, the reference's too,
    starts from the prior at ``prior_temperature`` (default: the config's)."""
    tau = pipeline.config.prior_temperature_for(prior_temperature)
    reference = pipeline.sample_latents(n, length, reference_steps, 0, "ddim", prior_temperature=tau)
    reference_tokens = pipeline.decode(reference).token_ids
    entries: dict[str, dict[str, Any]] = {}
    for sampler, steps, grid in specs:  # quality, and the warm-up of the timing
        latents = pipeline.sample_latents(n, length, steps, 0, sampler, grid=grid, prior_temperature=tau)
        entries[spec_name(sampler, steps, grid)] = {
            "sampler": sampler,
            "steps": steps,
            "grid": grid or "default",
            "token_agreement": round(float((pipeline.decode(latents).token_ids == reference_tokens).float().mean()), 4),
            "latent_rel_error": round(float((latents - reference).norm() / reference.norm()), 5),
        }
    times: dict[str, list[float]] = {key: [] for key in entries}
    for run in range(runs):
        for sampler, steps, grid in specs:
            start = time.perf_counter()
            pipeline.generate(n, length, steps, run, sampler, grid=grid, prior_temperature=tau)
            times[spec_name(sampler, steps, grid)].append(time.perf_counter() - start)
    for key, values in times.items():
        p50 = statistics.median(values)
        entries[key].update(p50_s=round(p50, 6), ms_per_sample=round(1000 * p50 / n, 3))
    return {"reference": f"ddim@{reference_steps}", "n": n, "length": length, "runs": runs, "prior_temperature": tau, "entries": entries}


def spec_name(sampler: str, steps: int, grid: str | None) -> str:
    return f"{sampler}@{steps}" + (f":{grid}" if grid else "")
