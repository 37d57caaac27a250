"""Sampling: the samplers' math (``samplers``) on the noise schedule (``schedule``), a request resolved into a plan
(``request``) with per-sample noise (``noise``), the loop that moves any mix of samples one denoiser call at a time
(``loop``), tuned step grids (``tuned_grids``) and the choice of tokens from logits (``tokens``)."""

from ldlm.sampling.loop import DenoiseFn, SampleState, SamplingEngine, SlotTable, run_lockstep, run_sampler
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
    "SlotTable",
    "resolve",
    "run_lockstep",
    "run_sampler",
    "sample_seeds",
    "to_device",
]
