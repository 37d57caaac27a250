"""Executing one step of a generation batch: every running sample lives in the persistent batch of its length
bucket (``SlotTable``), and a step is one denoiser call per bucket and each sampler's update over its rows; or,
where the graph has them (``FusedSteps`` of a compiled denoiser), the denoiser call and the update as one fused
step. The executor knows no policy and no request: it is told which samples run (``run``, only when that set
changes), steps them, and hands back those that finished and those due a preview."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ldlm.sampling import DenoiseFn, SampleState, SamplingEngine, SlotTable
from ldlm.sampling.loop import FusedStepFn
from ldlm.serve.runtime.cost import CostModel
from ldlm.serve.runtime.generation import Sample

log = logging.getLogger("ldlm.serve")

StepObserver = Callable[[int, float, float], None]  # (batch size, 0, compute seconds) per denoiser call


@dataclass
class Stepped:
    """What one step produced: the samples that reached t_min (their ``state.latent`` set, their slots
    freed) and the running samples due a preview now."""

    finished: list[Sample] = field(default_factory=list)
    due: list[Sample] = field(default_factory=list)


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
        """``fused``: the denoiser call and the sampler's update as one step (``SlotTable.step_fused``), taken by
        every bucket whose rows it can take (``SlotTable.fusable``); the others call ``denoise``."""
        self.engine = engine
        self.denoise = denoise
        self.bucket_length = bucket_length
        self.cost = cost
        self.observer = observer
        self.fused = fused
        self.tables: dict[int, SlotTable] = {}  # one persistent batch per length bucket
        self._samples: dict[int, Sample] = {}  # by id of its state, while it holds a slot
        self.denoiser_calls = 0
        self.fused_steps = 0  # of denoiser_calls, those made inside a fused step
        self.samples_stepped = 0

    def run(self, samples: list[Sample]) -> None:
        """The samples the next steps move (the policy's choice; called when it changes): newcomers take free
        slots, admitted samples left out keep theirs and resume where they stopped."""
        by_bucket: dict[int, list[SampleState]] = {bucket: [] for bucket in self.tables}
        for sample in samples:
            by_bucket.setdefault(self.bucket_length(sample.state.length), []).append(sample.state)
            self._samples[id(sample.state)] = sample
        for bucket, states in by_bucket.items():
            if bucket not in self.tables:
                self.tables[bucket] = self.engine.table(bucket)
            self.tables[bucket].run(states)

    def release(self, samples: list[Sample]) -> None:
        """Samples that will not run again (their request ended) give their slots up."""
        holding = [s for s in samples if s.state.table is not None]
        for table in {id(s.state.table): s.state.table for s in holding}.values():
            table.release([s.state for s in holding if s.state.table is table])  # type: ignore[union-attr]
        for sample in samples:
            self._samples.pop(id(sample.state), None)

    @torch.inference_mode()
    def execute(self) -> Stepped:
        """Every running sample one step on. One denoiser call per length bucket: padding a 16-token sample to
        128 would cost more than the extra call."""
        result = Stepped()
        for bucket, table in self.tables.items():
            size = table.running
            if not size:
                continue
            started = time.perf_counter()
            finished = self._step(table, started)
            self.denoiser_calls += 1
            self.samples_stepped += size
            self.cost.observe(bucket, size, time.perf_counter() - started)
            result.finished += [self._samples.pop(id(state)) for state in finished]
            result.due += [self._samples[id(state)] for state in table.due()]
        return result

    def _step(self, table: SlotTable, started: float) -> list[SampleState]:
        """One step of ``table``'s running rows, fused where it can be. A fused step that fails (a capture the GPU
        refuses) changes no sample: this step and every later one take the unfused path, and the log says why."""
        size = table.running
        if self.fused is not None and table.fusable():
            try:
                done = table.step_fused(self.fused)
            except Exception:
                log.exception("the fused denoiser step failed; steps run unfused from now on")
                self.fused = None
            else:
                self.fused_steps += 1
                self._observe(size, started)
                return done
        done = table.step(self.denoise)
        self._observe(size, started)
        return done

    def _observe(self, size: int, started: float) -> None:
        if self.observer is not None:
            self.observer(size, 0.0, time.perf_counter() - started)
