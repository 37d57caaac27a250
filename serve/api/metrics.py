"""Prometheus metrics in Triton's style, on a registry of the server's own, and Triton's statistics
extension (``model_statistics``) read from the same counters.

inference_count / execution_count is the average batch size, as in Triton.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class InferClock:
    """Marks along one infer request (``time.perf_counter``): started, its tensors decoded and checked
    (``decoded``), its graph's answer in (``computed``); the request sets the last two as it passes them."""

    started: float = field(default_factory=time.perf_counter)
    decoded: float = 0.0
    computed: float = 0.0


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_success = Counter("ldlm_request_success", "Requests answered with 2xx", ["model"], registry=r)
        self.request_failure = Counter("ldlm_request_failure", "Requests answered with an error", ["model", "code"], registry=r)
        self.inference_count = Counter("ldlm_inference_count", "Samples inferred (batch entries)", ["model"], registry=r)
        self.execution_count = Counter("ldlm_execution_count", "Graph executions (batches run)", ["model"], registry=r)
        self.queue_seconds = Histogram(
            "ldlm_queue_duration_seconds", "Time a batch's oldest request waited", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.compute_seconds = Histogram(
            "ldlm_compute_duration_seconds", "Graph execution time per batch", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.request_seconds = Histogram(
            "ldlm_request_duration_seconds", "End-to-end request latency", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram("ldlm_batch_size", "Samples per execution", ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge(
            "ldlm_queue_depth",
            "Waiting now: a graph's requests in its batcher, or generate's samples in the scheduler",
            ["model"],
            registry=r,
        )
        self.active_samples = Gauge("ldlm_generate_active_samples", "Generation samples in the running batch now", registry=r)
        self.in_flight = Gauge("ldlm_generate_in_flight", "Generation requests submitted and not yet answered", registry=r)
        # Cancelled work: requests whose client left (reason "disconnect") or whose deadline passed
        # ("timeout"), and the samples that were dropped unfinished because of them (a graph request's
        # rows before its batch ran; a generation's samples still queued or mid-denoising).
        self.request_cancelled = Counter(
            "ldlm_request_cancelled", "Requests cancelled before their answer", ["model", "reason"], registry=r
        )
        self.request_refused = Counter(
            "ldlm_request_refused",
            "Generations refused up front: estimated past their deadline behind the "
            "work queued ahead (deadline: 503) or even alone (too_large: 413)",
            ["model", "reason"],
            registry=r,
        )
        self.sample_step_rate = Gauge(
            "ldlm_generate_sample_steps_per_second",
            "Measured generation throughput at a full batch, per length bucket (the scheduler's cost model)",
            ["bucket"],
            registry=r,
        )
        self.graph_info = Gauge(
            "ldlm_graph_info", "1 per served graph, labelled with what runs it", ["model", "backend", "provider", "precision"], registry=r
        )
        self.cancelled_samples = Counter(
            "ldlm_cancelled_samples", "Samples dropped unfinished because their request was cancelled (or failed)", ["model"], registry=r
        )
        self._previews(r)
        self._statistics(r)

    def _previews(self, r: CollectorRegistry) -> None:
        """Streamed previews: how soon the first comes, how many are sent or dropped, and their decoding time."""
        self.first_preview_seconds = Histogram(
            "ldlm_time_to_first_preview_seconds",
            "Time from a streamed generation's start (its request read) to its first preview sent",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.previews_sent = Counter("ldlm_previews_sent", "Streamed previews decoded and sent", registry=r)
        self.previews_skipped = Counter(
            "ldlm_previews_skipped",
            "Streamed previews dropped undecoded: beyond the preview budget, or their request already answered",
            registry=r,
        )
        self.preview_seconds = Counter("ldlm_preview_decode_seconds", "Time spent decoding previews", registry=r)

    def _statistics(self, r: CollectorRegistry) -> None:
        """KServe v2 infer requests (HTTP and gRPC) stage by stage, and executions by batch size: what Triton's
        statistics extension reports beside the counters above (``model_statistics``)."""
        self.infer_seconds = Summary(
            "ldlm_infer_duration_seconds",
            "KServe v2 infer requests, from decoding their tensors to their encoded answer, by outcome",
            ["model", "outcome"],
            registry=r,
        )
        self.infer_input_seconds = Summary(
            "ldlm_infer_input_duration_seconds",
            "Decoding and checking the tensors of successful KServe v2 infer requests",
            ["model"],
            registry=r,
        )
        self.infer_output_seconds = Summary(
            "ldlm_infer_output_duration_seconds", "Encoding the answers of successful KServe v2 infer requests", ["model"], registry=r
        )
        self.batch_compute_seconds = Summary(
            "ldlm_batch_compute_duration_seconds", "Graph execution time per batch, by batch size", ["model", "batch_size"], registry=r
        )
        self.last_inference = Gauge(
            "ldlm_last_inference_timestamp_seconds", "When a graph last ran a batch (Unix time)", ["model"], registry=r
        )
        self._infer_series: dict[str, tuple[Any, Any, Any]] = {}  # a served graph's successful infer series

    def observe_previews(self, decoded: int, skipped: int, seconds: float) -> None:
        """The scheduler's preview observer (serve/runtime/delivery.py): one decoder call for previews, or previews dropped."""
        self.previews_sent.inc(decoded)
        self.previews_skipped.inc(skipped)
        self.preview_seconds.inc(seconds)

    def observer(self, model: str) -> Callable[[int, float, float], None]:
        """A DynamicBatcher observer recording one execution of ``model``."""

        # the model's series, looked up once: this runs on the batcher's thread as its answer goes back
        executions, inferences, batch_size = (
            self.execution_count.labels(model),
            self.inference_count.labels(model),
            self.batch_size.labels(model),
        )
        queued, computed, last = self.queue_seconds.labels(model), self.compute_seconds.labels(model), self.last_inference.labels(model)

        def observe(batch: int, queued_s: float, compute_s: float) -> None:
            executions.inc()
            inferences.inc(batch)
            batch_size.observe(batch)
            queued.observe(queued_s)
            computed.observe(compute_s)
            self.batch_compute_seconds.labels(model, str(batch)).observe(compute_s)
            last.set(time.time())

        return observe

    def count_request(self, model: str, status: int, seconds: float, disconnected: bool = False) -> None:
        """One answered request of ``model`` by its HTTP status (a gRPC call by the status its error maps to):
        success or failure, its latency, and why it was cancelled if it was (its client left, its time ran out)."""
        if disconnected:
            self.request_cancelled.labels(model, "disconnect").inc()
        if status == 504:
            self.request_cancelled.labels(model, "timeout").inc()
        if status < 400:
            self.request_success.labels(model).inc()
        else:
            self.request_failure.labels(model, str(status)).inc()
        self.request_seconds.labels(model).observe(seconds)

    @contextlib.contextmanager
    def timed_infer(self, model: str) -> Iterator[InferClock]:
        """Time one KServe v2 infer request of ``model``, a served graph (never a name from the request: the label
        set stays bounded). A block that raises counts as a failure; one that ends as a success, with its stages."""
        clock = InferClock()
        try:
            yield clock
        except BaseException:  # cancelled too (the client left): a request that got no answer
            self.infer_seconds.labels(model, "failure").observe(time.perf_counter() - clock.started)
            raise
        ended = time.perf_counter()
        series = self._infer_series.get(model)
        if series is None:  # looked up once per model: every infer request passes here
            series = self._infer_series[model] = (
                self.infer_seconds.labels(model, "success"),
                self.infer_input_seconds.labels(model),
                self.infer_output_seconds.labels(model),
            )
        series[0].observe(ended - clock.started)
        series[1].observe(clock.decoded - clock.started)
        series[2].observe(ended - clock.computed)

    def model_statistics(self, model: str, version: str) -> dict[str, Any]:
        """Triton's statistics of ``model`` (its statistics extension's JSON). Requests count in success and fail,
        compute_input (decoding) and compute_output (encoding); queue and compute_infer count executions, as the
        queue and compute histograms above do: a batch's queue time is its oldest request's wait, and
        compute_infer is the whole graph call, input assembly and output copies included."""
        labels = {"model": model}
        batches = {
            int(sample.labels["batch_size"]): sample.labels
            for metric in self.batch_compute_seconds.collect()
            for sample in metric.samples
            if sample.labels["model"] == model and sample.name.endswith("_count")
        }
        last = self.registry.get_sample_value("ldlm_last_inference_timestamp_seconds", labels)
        return {
            "name": model,
            "version": version,
            "last_inference": round(last * 1000) if last else 0,  # ms since the epoch, as Triton's
            "inference_count": round(self._value("ldlm_inference_count_total", labels)),
            "execution_count": round(self._value("ldlm_execution_count_total", labels)),
            "inference_stats": {
                "success": self._duration("ldlm_infer_duration_seconds", {**labels, "outcome": "success"}),
                "fail": self._duration("ldlm_infer_duration_seconds", {**labels, "outcome": "failure"}),
                "queue": self._duration("ldlm_queue_duration_seconds", labels),
                "compute_input": self._duration("ldlm_infer_input_duration_seconds", labels),
                "compute_infer": self._duration("ldlm_compute_duration_seconds", labels),
                "compute_output": self._duration("ldlm_infer_output_duration_seconds", labels),
                "cache_hit": {"count": 0, "ns": 0},  # no response cache
                "cache_miss": {"count": 0, "ns": 0},
            },
            "batch_stats": [self._batch_statistics(size, labels) for size, labels in sorted(batches.items())],
        }

    def _batch_statistics(self, size: int, labels: dict[str, str]) -> dict[str, Any]:
        """The executions of one batch size: their graph calls, input assembly and output copies included, are
        compute_infer; compute_input and compute_output count the same executions with no time of their own."""
        infer = self._duration("ldlm_batch_compute_duration_seconds", labels)
        none = {"count": infer["count"], "ns": 0}
        return {"batch_size": size, "compute_input": none, "compute_infer": infer, "compute_output": dict(none)}

    def _value(self, sample: str, labels: dict[str, str]) -> float:
        """A sample's value; 0 for a label set not seen yet."""
        return self.registry.get_sample_value(sample, labels) or 0.0

    def _duration(self, metric: str, labels: dict[str, str]) -> dict[str, int]:
        """A histogram's or summary's count and sum, as Triton's StatisticDuration (count, ns)."""
        return {"count": round(self._value(f"{metric}_count", labels)), "ns": round(self._value(f"{metric}_sum", labels) * 1e9)}

    def render(self) -> bytes:
        return generate_latest(self.registry)
