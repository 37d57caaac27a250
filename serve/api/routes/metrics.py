"""GET /metrics: the service's Prometheus registry, its gauges (queue depths, step rates) read at each scrape."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from ldlm.serve.api.service import LDLMService


def create_router(service: LDLMService) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def metrics() -> Response:
        for name, batcher in service.batchers.items():
            service.metrics.queue_depth.labels(name).set(batcher.queued)
        for bucket, rate in service.scheduler.cost.rates().items():
            service.metrics.sample_step_rate.labels(str(bucket)).set(rate)
        service.metrics.queue_depth.labels("generate").set(service.scheduler.queued_samples)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    return router
