"""The batching half of ``ldlm bench``: one seeded mixed-arrival workload (Poisson arrivals, mixed
lengths and steps) replayed in real time against the scheduler, static against continuous batching,
then with a mix of solvers in one batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ldlm.model.config import LDLMConfig
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.checks.bench_latency import percentile
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler


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
