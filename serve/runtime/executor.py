"""Executing one step of a generation batch: one denoiser call per length bucket, then the sampling
engine's ``advance``; or, where the graph has them (``FusedSteps`` of a compiled denoiser), the denoiser call
and the sampler's update as one fused step. The executor knows no policy and no request: samples in, samples out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ldlm.sampling import DenoiseFn, SampleState, SamplingEngine, StepBatch
from ldlm.sampling.loop import FusedStepFn
from ldlm.serve.runtime.cost import CostModel
from ldlm.serve.runtime.generation import Sample

log = logging.getLogger("ldlm.serve")

StepObserver = Callable[[int, float, float], None]  # (batch size, 0, compute seconds) per denoiser call


class StepExecutor:
    def __init__(
        self,
        engine: SamplingEngine,
        denoise: DenoiseFn,
        bucket_length: Callable[[int], int],
        cost: CostModel,
        observer: StepObserver | None = None,
        fused: FusedStepFn | None = None,
    ) -> None:
        """``fused``: the denoiser call and the sampler's update as one step (``SamplingEngine.advance_fused``),
        taken by every batch it can take (``SamplingEngine.fusable``); the others call ``denoise``."""
        self.engine = engine
        self.denoise = denoise
        self.bucket_length = bucket_length
        self.cost = cost
        self.observer = observer
        self.fused = fused
        self.denoiser_calls = 0
        self.fused_steps = 0  # of denoiser_calls, those made inside a fused step
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
            done = {id(state) for state in self._step(batch, started)}
            self.denoiser_calls += 1
            self.samples_stepped += len(group)
            finished += [s for s in group if id(s.state) in done]
            self.cost.observe(bucket, len(group), time.perf_counter() - started)
            for sample in group:
                sample.request.work -= 1
        return finished

    def _step(self, batch: StepBatch, started: float) -> list[SampleState]:
        """One step of ``batch``, fused where it can be. A fused step that fails (a capture the GPU refuses)
        changes no sample: this batch and every later one take the unfused path, and the log says why."""
        if self.fused is not None and self.engine.fusable(batch):
            try:
                done = self.engine.advance_fused(batch, self.fused)
            except Exception:
                log.exception("the fused denoiser step failed; steps run unfused from now on")
                self.fused = None
            else:
                self.fused_steps += 1
                self._observe(len(batch.states), started)
                return done
        x0_hat = self.denoise(batch.x, batch.t, batch.x0_prev, batch.mask)
        self._observe(len(batch.states), started)
        return self.engine.advance(batch, x0_hat)

    def _observe(self, size: int, started: float) -> None:
        if self.observer is not None:
            self.observer(size, 0.0, time.perf_counter() - started)
