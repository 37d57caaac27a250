"""Prometheus metrics in Triton's style, on a registry of the server's own.

inference_count / execution_count is the average batch size, as in Triton.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


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
        self.previews_sent = Counter("ldlm_previews_sent", "Streamed previews decoded and sent", registry=r)
        self.previews_skipped = Counter(
            "ldlm_previews_skipped",
            "Streamed previews dropped undecoded: beyond the preview budget, or their request already answered",
            registry=r,
        )
        self.preview_seconds = Counter("ldlm_preview_decode_seconds", "Time spent decoding previews", registry=r)
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

    def observe_previews(self, decoded: int, skipped: int, seconds: float) -> None:
        """The scheduler's preview observer (serve/runtime/delivery.py): one decoder call for previews, or previews dropped."""
        self.previews_sent.inc(decoded)
        self.previews_skipped.inc(skipped)
        self.preview_seconds.inc(seconds)

    def observer(self, model: str) -> Callable[[int, float, float], None]:
        """A DynamicBatcher observer recording one execution of ``model``."""

        def observe(batch: int, queued_s: float, compute_s: float) -> None:
            self.execution_count.labels(model).inc()
            self.inference_count.labels(model).inc(batch)
            self.batch_size.labels(model).observe(batch)
            self.queue_seconds.labels(model).observe(queued_s)
            self.compute_seconds.labels(model).observe(compute_s)

        return observe

    def render(self) -> bytes:
        return generate_latest(self.registry)
