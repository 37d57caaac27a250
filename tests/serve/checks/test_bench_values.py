"""The bench's arithmetic against hand-computed figures.

Timing itself is measured by real runs (tests/serve/checks/test_bench.py, `ldlm bench`); here the clock is a
counter that each stand-in backend advances by a known amount per run, so every percentile, rate
and ratio has one right value."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ldlm.serve.checks.bench_latency as bench
from ldlm.model.config import preset
from ldlm.serve.checks.bench_latency import bench_graphs, percentile
from ldlm.serve.checks.bench_report import bench_summary
from ldlm.serve.checks.bench_workload import WORKLOAD_STEPS, mixed_workload, workload_lengths_used


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedGraph:
    """A graph whose every run takes ``ms`` on the fake clock; with ``slow_ms``, its second timed run takes that."""

    def __init__(self, clock: Clock, ms: float, provider: str, slow_ms: float | None = None) -> None:
        self.clock, self.ms, self.provider, self.slow_ms, self.runs = clock, ms, provider, slow_ms, 0

    def run(self, feed: dict[str, Any]) -> dict[str, Any]:
        self.runs += 1
        slow = self.slow_ms is not None and self.runs == 3  # the second timed run (run 1 is warm-up)
        self.clock.now += (self.slow_ms if slow else self.ms) / 1000
        return {}


def test_graph_figures_and_speedup_direction(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    config = preset("tiny")
    backends = {
        "eager": {g: TimedGraph(clock, 8.0, "torch") for g in ("encoder", "denoiser", "decoder")},
        "ort": {g: TimedGraph(clock, 2.0, "CPUExecutionProvider", slow_ms=20.0) for g in ("encoder", "denoiser", "decoder")},
    }
    results = bench_graphs(backends, config, batches=[4], length=8, runs=5)
    assert set(results) == {"encoder/b4/L8", "denoiser/b4/L8", "decoder/b4/L8"}
    entry = results["denoiser/b4/L8"]
    assert entry["eager"]["p50_ms"] == pytest.approx(8.0)
    assert entry["ort"]["p50_ms"] == pytest.approx(2.0)  # the median ignores the one slow run
    # p99 of [2, 20, 2, 2, 2] by linear interpolation: sorted [2, 2, 2, 2, 20], rank 0.99 * 4 = 3.96
    assert entry["ort"]["p99_ms"] == pytest.approx(2 + 0.96 * 18, abs=1e-3)
    assert entry["eager"]["samples_per_s"] == pytest.approx(4 / 0.008)
    assert entry["ort"]["samples_per_s"] == pytest.approx(4 / 0.002)
    assert entry["ort"]["speedup_vs_eager"] == pytest.approx(4.0)  # eager takes 4x as long: ort is 4x faster
    assert "speedup_vs_eager" not in entry["eager"]
    assert entry["ort"]["provider"] == "CPUExecutionProvider"
    assert all(g.runs == 1 + 5 for graphs in backends.values() for g in graphs.values())  # warm-up + runs


def test_generation_tokens_per_second(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)

    class TimedPipeline:
        config = preset("tiny")

        def generate(self, n, length, steps, seed, sampler, prior_temperature=None):
            clock.now += 0.5 if steps != 2 else 10.0  # warm-up (2 steps) is slow and must not count

    results = bench.bench_generation({"ort": TimedPipeline()}, n=4, length=16, steps=10, runs=3)  # type: ignore[dict-item]
    assert results["ort"]["p50_s"] == pytest.approx(0.5)
    assert results["ort"]["tokens_per_s"] == pytest.approx(4 * 16 / 0.5)
    assert results["ort"]["prior_temperature"] == 1.0  # the config's, which sets none


def test_percentile_and_summary_lines() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    report = {
        "graphs": {"encoder/b1/L8": {"eager": {"p50_ms": 4.0}, "ort": {"p50_ms": 1.0, "speedup_vs_eager": 4.0}}},
        "generation": {"ort": {"tokens_per_s": 12.5, "n": 1, "length": 8, "steps": 2, "sampler": "ddim"}},
        "batching": {
            "continuous": {"tokens_per_s": 30, "latency_p99_s": 1.0},
            "static": {"tokens_per_s": 10, "latency_p99_s": 2.0},
            "throughput_ratio": 3.0,
        },
    }
    lines = bench_summary(report)
    assert "ort p50 1.00 ms (x4.00)" in lines[0]
    assert "continuous 30 vs static 10 tokens/s (x3.0)" in lines[-1]


def test_mixed_workload_is_seeded_and_within_bounds() -> None:
    config = preset("tiny")
    a, b = mixed_workload(config, 50, 10.0, seed=3), mixed_workload(config, 50, 10.0, seed=3)
    assert a == b and a != mixed_workload(config, 50, 10.0, seed=4)
    times = [x.at_s for x in a]
    assert times == sorted(times) and times[0] > 0
    # Poisson arrivals at 10/s: the mean gap is 0.1 s; 50 gaps have a standard error of 0.1/sqrt(50)
    assert abs(np.mean(np.diff([0.0, *times])) - 0.1) < 5 * 0.1 / np.sqrt(50)
    assert {x.request.length for x in a} <= {16, 32, 64, 128}
    assert all(5 <= x.request.steps <= 40 and x.request.seed == i for i, x in enumerate(a))
    assert {x.request.length for x in mixed_workload(config, 20, 10.0, lengths=(16, 4096))} == {16}


def test_workload_step_range_and_lengths_used_are_what_mixed_workload_draws() -> None:
    config = preset("tiny")  # max_seq_len 128
    workload = mixed_workload(config, 2000, 10.0, seed=1)
    steps = [x.request.steps for x in workload]
    assert WORKLOAD_STEPS == (5, 40) and (min(steps), max(steps)) == WORKLOAD_STEPS  # 2000 draws hit both ends
    assert abs(np.mean(steps) - 22.5) < 5 * np.std(steps) / np.sqrt(len(steps))  # uniform on 5..40: mean 22.5
    assert workload_lengths_used(config, (16, 4096, 64)) == [16, 64]
    assert workload_lengths_used(config, (4096,)) == [128]
    assert {x.request.length for x in mixed_workload(config, 50, 10.0, lengths=(4096,))} == {128}


def test_busy_machine_warning_names_the_load_and_a_thread_count() -> None:
    from ldlm.serve.checks.bench_latency import busy_machine_warning

    assert busy_machine_warning(2, load_average=0.1, cpus=2) is None  # quiet: the bench's own 2 threads fit
    assert busy_machine_warning(1, load_average=1.2, cpus=2) is None
    warning = busy_machine_warning(2, load_average=2.0, cpus=2)
    assert warning is not None and "load average 2.0 on 2 CPUs" in warning and "--threads 1" in warning
    assert busy_machine_warning(4, load_average=3.0, cpus=8) is None
    assert "run it on a quiet machine" in busy_machine_warning(1, load_average=2.7, cpus=2)  # type: ignore[operator]
    assert "--threads 5" in busy_machine_warning(8, load_average=3.0, cpus=8)  # type: ignore[operator]


def test_ort_precisions_become_columns_and_their_speedups_are_fp32_over_them() -> None:
    from ldlm.serve.checks.bench import ort_columns, precision_speedups

    assert ort_columns(["eager", "ort"], ["fp32", "int8"]) == ["eager", "ort", "ort-int8"]
    assert ort_columns(["ort", "trt"], ["int8"]) == ["ort-int8", "trt"]
    report = {
        "graphs": {
            "denoiser/b8/L128": {"ort": {"p50_ms": 30.0}, "ort-int8": {"p50_ms": 12.0}, "eager": {"p50_ms": 50.0}},
            "encoder/b8/L128": {"ort": {"p50_ms": 10.0}},
        },
        "generation": {"ort": {"p50_s": 2.0}, "ort-int8": {"p50_s": 1.6}},
    }
    assert precision_speedups(report) == {"denoiser/b8/L128:ort-int8": 2.5, "generation:ort-int8": 1.25}


def test_the_host_isa_names_the_flags_int8_speed_depends_on(tmp_path, monkeypatch) -> None:
    import ldlm.serve.checks.bench as bench_module

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx2 fma avx512f avx512_vnni\n")
    real_path = bench_module.Path
    monkeypatch.setattr(bench_module, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    isa = bench_module.host_isa()
    assert isa["cpu"] == "AMD EPYC 9R14"
    assert (isa["avx2"], isa["avx512f"], isa["avx512_vnni"], isa["amx_int8"], isa["avx_vnni"]) == (True, True, True, False, False)


def test_the_default_threads_fit_the_cpus_the_load_leaves_free() -> None:
    """Against the oversubscription rule itself: the default is the largest thread count that fits (at least 1)."""
    from ldlm.serve.checks.bench_latency import default_threads, oversubscription

    assert [default_threads(load, 2) for load in (0.0, 0.4, 0.6, 1.2, 5.6)] == [2, 2, 1, 1, 1]
    assert default_threads(3.0, 16) == 13 and default_threads(0.0, 1) == 1
    for cpus in (1, 2, 4, 16):
        for load in (tenths / 10 for tenths in range(0, 10 * cpus + 30)):
            chosen = default_threads(load, cpus)
            assert oversubscription(chosen + 1, load, cpus) is not None, (load, cpus)  # one more would not fit ...
            # ... and it fits, unless even one thread does not: then the least there is, 1
            assert oversubscription(chosen, load, cpus) is None or chosen == 1, (load, cpus)


def test_a_run_on_oversubscribed_cpus_is_unreliable_and_says_why() -> None:
    from ldlm.serve.checks.bench_latency import unreliable_reason

    assert unreliable_reason(2, 0.1, 2.2, 2) is None  # quiet: its own 2 threads at the end are no oversubscription
    start = unreliable_reason(2, 3.8, 5.9, 2)
    assert start == "at the start, 1-minute load average 3.8 on 2 CPUs, and the bench adds 2 threads: the CPUs are oversubscribed"
    end = unreliable_reason(1, 0.2, 3.1, 2)
    assert end is not None and end.startswith("at the end, 1-minute load average 3.1 on 2 CPUs")


def test_an_unreliable_run_leaves_out_its_speedup_ratios_and_keeps_its_timings() -> None:
    from ldlm.serve.checks.bench import withhold_ratios

    report: dict[str, Any] = {
        "reliable": False,
        "unreliable_reason": "at the start, 1-minute load average 5.6 on 2 CPUs, and the bench adds 2 threads: the CPUs are oversubscribed",
        "graphs": {"encoder/b1/L8": {"eager": {"p50_ms": 400.0}, "ort": {"p50_ms": 3.0, "speedup_vs_eager": 133.3}}},
        "generation": {"ort": {"tokens_per_s": 12.5, "n": 1, "length": 8, "steps": 2, "sampler": "ddim"}},
        "precision_speedups": {"generation:ort-int8": 1.3},
        "batching": {
            "continuous": {"tokens_per_s": 30, "latency_p99_s": 1.0},
            "static": {"tokens_per_s": 10, "latency_p99_s": 2.0},
            "throughput_ratio": 3.0,
            "p99_ratio": 0.5,
        },
    }
    withhold_ratios(report)
    assert report["graphs"]["encoder/b1/L8"] == {"eager": {"p50_ms": 400.0}, "ort": {"p50_ms": 3.0}}
    assert "precision_speedups" not in report and "throughput_ratio" not in report["batching"] and "p99_ratio" not in report["batching"]
    assert report["ratios_left_out"] == [
        "encoder/b1/L8:ort:speedup_vs_eager",
        "precision_speedups",
        "batching:throughput_ratio",
        "batching:p99_ratio",
    ]
    lines = bench_summary(report)
    assert lines[0].startswith("UNRELIABLE figures: at the start, 1-minute load average 5.6 on 2 CPUs")
    assert "ort p50 3.00 ms" in lines[1] and " (x" not in "\n".join(lines)
