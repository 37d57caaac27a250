"""Executing one step of a generation batch: one denoiser call per length bucket, then the sampling
engine's ``advance``. The executor knows no policy and no request: samples in, samples out."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ldlm.sampling import DenoiseFn, SamplingEngine
from ldlm.serve.runtime.cost import CostModel
from ldlm.serve.runtime.generation import Sample

StepObserver = Callable[[int, float, float], None]  # (batch size, 0, compute seconds) per denoiser call


class StepExecutor:
    def __init__(
        self,
        engine: SamplingEngine,
        denoise: DenoiseFn,
        bucket_length: Callable[[int], int],
        cost: CostModel,
        observer: StepObserver | None = None,
    ) -> None:
        self.engine = engine
        self.denoise = denoise
        self.bucket_length = bucket_length
        self.cost = cost
        self.observer = observer
        self.denoiser_calls = 0
        self.samples_stepped = 0

    @torch.inference_mode()
    def execute(self, samples: list[Sample]) -> list[Sample]:
        """Every sample one step on; returns those that finished. One denoiser call per length bucket:
        padding a 16-token sample to 128 would cost more than the extra call."""
        buckets: dict[int, list[Sample]] = {}
        for sample in samples:
            buckets.setdefault(self.bucket_length(sample.state.length), []).append(sample)
        finished: list[Sample] = []
        for bucket, group in buckets.items():
            started = time.perf_counter()
            batch = self.engine.batch([s.state for s in group], bucket)
            x0_hat = self.denoise(batch.x, batch.t, batch.x0_prev, batch.mask)
            if self.observer is not None:
                self.observer(len(group), 0.0, time.perf_counter() - started)
            self.denoiser_calls += 1
            self.samples_stepped += len(group)
            done = {id(state) for state in self.engine.advance(batch, x0_hat)}
            finished += [s for s in group if id(s.state) in done]
            self.cost.observe(bucket, len(group), time.perf_counter() - started)
            for sample in group:
                sample.request.work -= 1
        return finished
