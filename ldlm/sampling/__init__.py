"""Sampling: a request resolved into a plan (``request``), per-sample noise (``noise``), and the engine
that moves per-sample states one denoiser call at a time (``engine``). The samplers' math is in
ldlm/sampling/samplers.py, the schedule in ldlm/sampling/schedule.py."""

from ldlm.sampling.loop import DenoiseFn, SampleState, SamplingEngine, StepBatch, run_lockstep, run_sampler
from ldlm.sampling.noise import NoiseSource, NoiseStream, sample_seeds, to_device
from ldlm.sampling.request import GenerateRequest, RequestLimits, SamplingPlan, resolve

__all__ = [
    "DenoiseFn",
    "GenerateRequest",
    "NoiseSource",
    "NoiseStream",
    "RequestLimits",
    "SampleState",
    "SamplingEngine",
    "SamplingPlan",
    "StepBatch",
    "resolve",
    "run_lockstep",
    "run_sampler",
    "sample_seeds",
    "to_device",
]
