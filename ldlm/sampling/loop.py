"""The sampling engine: each sample's description, and the loop that moves samples to t_min.

A sample starts as a ``SampleState``: its sampler, its time grid, its noise streams, its prior and, where
it has one, a prompt to inpaint. Its running state then lives in a slot of a persistent batch
(``SlotTable``, ldlm/sampling/slots.py), which moves every running sample one step per call: one
denoiser call for all of them, then each sampler's update over its own rows, whatever mix of samplers,
steps and lengths the batch holds. ``run_lockstep`` is that loop for samples that move together (the
pipeline, Triton's ``ldlm_generate``); the continuous-batching scheduler changes which slots run between
steps.

Every sample keeps its own noise stream, time grid, self-conditioning input and past, so a sample's
numbers do not depend on the batch it runs in: a request gets the same tokens alone, in a static
batch, or beside other samplers at other steps. State lives on the engine's device (grids, noise,
x, self-conditioning), so a step makes no host round trip.

Prefix inpainting, the training-free conditioning of diffusion models: the first P positions of a
sample's x_t are reset at every step to the prompt's latents forward-noised to that step's time
(with the sample's own prefix noise), and its final latent holds the prompt's latents exactly there.
How well the continuation follows the prompt depends on the trained model.

Prompt guidance (a plan's ``prompt_strength`` w, 1 by default: inpainting alone): a guided sample's
rows are denoised twice in the same call, as they are and blind to the prompt (its positions masked
out as keys, so the continuation sees only itself), and its continuation's x0_hat is extrapolated from
the blind one, x0_blind + w (x0_prompted - x0_blind), as classifier-free guidance does between
conditional and unconditional predictions. w > 1 moves the continuation further from where it would go
without the prompt, w < 1 nearer (0: the denoiser ignores the prompt); it costs a second row per
sample and step. What it buys on the reference checkpoint is in docs/sampling.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ldlm.model.config import DecodeFinal
from ldlm.sampling.noise import BatchNoiseRows, NoiseSource, NoiseStream, sample_seeds
from ldlm.sampling.request import SamplingPlan
from ldlm.sampling.samplers import Sampler, get_sampler
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.slots import SampleState, SlotTable
from ldlm.sampling.step import DenoiseFn, FusedStepFn, StepInputs, StepOutputs, fused_step, sampler_update

__all__ = [
    "DenoiseFn",
    "FusedStepFn",
    "SampleState",
    "SamplingEngine",
    "SlotTable",
    "StepInputs",
    "StepOutputs",
    "fused_step",
    "run_lockstep",
    "run_sampler",
    "sampler_update",
]


class SamplingEngine:
    def __init__(
        self,
        schedule: TangentSchedule,
        decode_final: DecodeFinal = "mean",
        device: str | torch.device = "cpu",
        noise_device: str | torch.device | None = None,
    ) -> None:
        self.schedule = schedule
        self.decode_final = decode_final
        self.device = torch.device(device)
        # Where noise is drawn: the engine's device by default (no copy per step); "cpu" makes a GPU
        # run use exactly the CPU run's noise, for parity.
        self.noise_device = self.device if noise_device is None else torch.device(noise_device)

    def start(self, plan: SamplingPlan, d_model: int, prefix: Tensor | None = None) -> list[SampleState]:
        """The plan's n samples at t = 1, each prior drawn from its own seeded stream, at the plan's
        prior temperature (x_1 = tau * eps; the sde sampler's per-step noise is not scaled).

        ``prefix`` (P, D), P < length: condition every sample on these latents at its first P positions."""
        if prefix is not None and not (prefix.ndim == 2 and prefix.shape[0] < plan.length and prefix.shape[1] == d_model):
            raise ValueError(f"prefix has shape {tuple(prefix.shape)}; allowed: (P, {d_model}) with P < length={plan.length}")
        times = plan.times(self.schedule).float()
        prefix = None if prefix is None else prefix.to(self.device)
        guidance = None if prefix is None else self.guidance(prefix.shape[0], plan.length, plan.prompt_strength)
        states = []
        for seed in sample_seeds(plan.seed, plan.n):
            stream = NoiseStream(seed, (plan.length, d_model), self.noise_device)
            prefix_noise = None if prefix is None else NoiseStream(seed ^ 1, tuple(prefix.shape), self.noise_device)
            prior = plan.prior_temperature * stream.draw().to(self.device)
            states.append(self.state(plan.sampler, times, stream, prior, prefix, prefix_noise, guidance))
        return states

    def guidance(self, prompt: int, length: int, strength: float) -> Tensor | None:
        """A prompt's guidance weights (length, 1): 1 at its ``prompt`` positions, ``strength`` after;
        None at strength 1, which is inpainting alone (no second row)."""
        if strength == 1.0:
            return None
        weights = torch.full((length, 1), float(strength), device=self.device)
        weights[:prompt] = 1.0
        return weights

    @staticmethod
    def state(
        sampler: Sampler,
        times: Tensor,
        noise: NoiseSource,
        prior: Tensor,
        prefix: Tensor | None = None,
        prefix_noise: NoiseSource | None = None,
        guidance: Tensor | None = None,
    ) -> SampleState:
        """One sample at t = 1 from ``prior`` (L, D); self-conditioning starts empty (zeros), with no past.
        ``guidance``: a prompt's weights (``SamplingEngine.guidance``), None for inpainting alone."""
        guidance = None if guidance is None else guidance.to(prior.dtype)
        return SampleState(sampler, times.to("cpu", prior.dtype), noise, prior, prefix, prefix_noise, guidance)

    def table(self, length: int) -> SlotTable:
        """An empty persistent batch for samples of up to ``length`` positions (a length bucket)."""
        return SlotTable(self.schedule, length, self.device, self.decode_final)

    @staticmethod
    def latent(state: SampleState) -> Tensor:
        """What is decoded of a finished sample (L, D): its last mean state or x0_hat (the config's
        ``decode_final``), with the prompt's latents exactly at the prompt's positions."""
        if state.latent is None:
            raise ValueError(f"the sample has taken {state.step} of its {state.steps} steps; its latent comes at the last")
        return state.latent


def run_lockstep(
    engine: SamplingEngine,
    states: list[SampleState],
    denoise: DenoiseFn,
    padded: int | None = None,
    progress: bool = False,
    desc: str = "denoising",
) -> Tensor:
    """Move ``states`` (one grid length) together to t_min in one persistent batch of ``padded`` positions
    (default: the longest), one denoiser call per step; their latents (B, L, D). ``progress``: a bar of the
    steps, labelled ``desc``."""
    table = engine.table(padded or max(s.length for s in states))
    table.run(states)
    for _ in tqdm(range(states[0].steps), desc=desc, unit="step", disable=not progress):
        table.step(denoise)
    return torch.stack([engine.latent(s) for s in states])


def run_sampler(
    denoise: Callable[[Tensor, Tensor, Tensor], Tensor],
    prior: Tensor,
    draw_noise: Callable[[], Tensor],
    grid: Tensor,
    schedule: TangentSchedule,
    sampler: str,
    decode_final: DecodeFinal = "mean",
    progress: bool = False,
) -> Tensor:
    """Integrate a batch of priors x_1 (B, N, D) along ``grid`` with an unmasked ``denoise(x_t, t, x0_prev)``
    and batch noise ``draw_noise()`` (B, N, D): the engine for callers that bring their own denoiser and
    noise (references such as a Gaussian oracle). The grid keeps the prior's dtype (float64 stays exact)."""
    engine = SamplingEngine(schedule, decode_final, prior.device)
    method, rows = get_sampler(sampler), BatchNoiseRows(draw_noise)
    states = [engine.state(method, grid, rows.row(i), prior[i]) for i in range(prior.shape[0])]
    return run_lockstep(engine, states, lambda x_t, t, x0_prev, mask: denoise(x_t, t, x0_prev), progress=progress)
