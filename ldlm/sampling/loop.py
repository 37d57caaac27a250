"""The sampling engine: per-sample state and the one ``advance`` that moves any mix of samples,
samplers and steps by one step. The only code that calls a sampler's math.

A driver repeats three moves until its samples are done:
  1. ``batch = engine.batch(states)``: each sample's inputs at its own step, right-padded to one
     length and masked (a prompt's positions first reset by prefix inpainting);
  2. ``x0_hat = denoise(batch.x, batch.t, batch.x0_prev, batch.mask)``: one denoiser call;
  3. ``engine.advance(batch, x0_hat)``: each sample's own sampler step, its past kept per sample.
``run_lockstep`` is that loop for samples that move together (the pipeline, Triton's
``ldlm_generate``); the continuous-batching scheduler chooses a new set of states before every step.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ldlm.model.config import DecodeFinal
from ldlm.sampling.noise import BatchNoiseRows, NoiseSource, NoiseStream, sample_seeds, to_device
from ldlm.sampling.request import SamplingPlan
from ldlm.sampling.samplers import Sampler, get_sampler, push_past
from ldlm.sampling.schedule import TangentSchedule, forward_noise

DenoiseFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (x_t, t, x0_prev, mask) -> x0_hat


@dataclass(eq=False)  # a sample is itself, not its values (and tensors have no truth value)
class SampleState:
    sampler: Sampler
    times: Tensor  # (steps + 1,) on the engine's device, in the state's dtype
    noise: NoiseSource  # the prior came from it; the sde sampler draws from it every step
    x: Tensor  # (L, D) the state at times[step]
    x_mean: Tensor  # its noise-free part (decoded when decode_final="mean")
    x0_hat: Tensor  # the denoiser's last output (previews, decode_final="x0")
    x0_prev: Tensor  # the self-conditioning input of the next denoiser call
    past: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (x0_hat (L, D), lambda ()), newest first
    x_prev: Tensor | None = None  # the state the last step started from: a corrector redoes that step
    step: int = 0
    prefix: Tensor | None = None  # (P, D) prompt latents to inpaint
    prefix_noise: NoiseSource | None = None  # the forward noise of the inpainted prefix
    guidance: Tensor | None = None  # (L, 1) a guided prompt's weights: 1 at the prompt's positions, w after
    held_noise: Tensor | None = None  # this step's noise, drawn by a fused step that failed: its retry takes it

    @property
    def length(self) -> int:
        return self.x.shape[0]

    @property
    def steps(self) -> int:
        return len(self.times) - 1

    @property
    def done(self) -> bool:
        return self.step == self.steps


@dataclass(frozen=True)
class StepBatch:
    """The denoiser's inputs for ``states``, each at its own step; rows past a sample's length are padding."""

    states: list[SampleState]
    x: Tensor  # (B, padded, D)
    t: Tensor  # (B,)
    t_next: Tensor  # (B,)
    x0_prev: Tensor  # (B, padded, D)
    mask: Tensor  # (B, padded) bool, True at real positions
    # Rows past len(states) are prompt-blind copies of these states' rows (prompt guidance): the denoiser's
    # B is len(states) + len(blind).
    blind: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepInputs:
    """What one sampler step reads, every tensor batch-first with fixed shapes for a given (batch, length,
    sampler): a captured step's static inputs. The past and the noise are inputs, not state kept inside,
    so every sampler captures: the sde sampler's noise is drawn outside by each sample's own seeded stream
    (a draw inside a graph would come from one generator for the whole batch, and a sample's numbers would
    depend on its batch)."""

    x: Tensor  # (B, L, D) the state at t
    t: Tensor  # (B,)
    t_next: Tensor  # (B,)
    x0_prev: Tensor  # (B, L, D) the self-conditioning input
    mask: Tensor  # (B, L) bool, True at real positions
    past_x0: tuple[Tensor, ...] = ()  # sampler.history entries, each (B, L, D), most recent first
    past_lam: tuple[Tensor, ...] = ()  # their log-SNR, each (B,) float64, NaN where a sample has no such step
    noise: Tensor | None = None  # (B, L, D) the stochastic sampler's draw for this step
    x_prev: Tensor | None = None  # (B, L, D) the corrector's: the state the last step started from
    t_prev: Tensor | None = None  # (B,) its time

    def named(self) -> dict[str, Tensor]:
        """Every tensor by a flat name (the past's entries as past_x0.0, past_x0.1, ...), for static buffers."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}
        for kind in ("past_x0", "past_lam"):
            out |= {f"{kind}.{k}": value for k, value in enumerate(getattr(self, kind))}
        return out

    def with_named(self, tensors: Mapping[str, Tensor]) -> StepInputs:
        """These inputs with every tensor replaced by the one ``tensors`` holds under its ``named`` name."""
        changes: dict[str, Any] = {n: tensors[n] for n in self.named() if "." not in n}
        for kind in ("past_x0", "past_lam"):
            changes[kind] = tuple(tensors[f"{kind}.{k}"] for k in range(len(getattr(self, kind))))
        return replace(self, **changes)


@dataclass(frozen=True)
class StepOutputs:
    """What one sampler step gives back, batch-first: the next state, and what the sample keeps of this step."""

    x: Tensor  # (B, L, D) the state at t_next
    x_mean: Tensor  # its noise-free part
    x0_hat: Tensor  # the denoiser's output at t (previews, decode_final="x0", the next step's past)
    x0_prev: Tensor  # the next denoiser call's self-conditioning input
    x_start: Tensor  # the state the step started from (corrected where the sampler has a corrector)
    lam: Tensor | None  # (B,) float64 log-SNR at t, pushed onto the past; None for a sampler without one


FusedStepFn = Callable[[Sampler, TangentSchedule, StepInputs], StepOutputs]


def sampler_update(sampler: Sampler, schedule: TangentSchedule, inputs: StepInputs, x0_hat: Tensor) -> StepOutputs:
    """The sampler's update of one step given the denoiser's ``x0_hat``: the corrector (where the sampler
    has one) redoes the last step, then the step itself. Tensor operations only, no host sync: it runs
    inside a captured CUDA graph as it runs here."""
    past = list(zip(inputs.past_x0, inputs.past_lam))
    x = inputs.x
    if sampler.corrector:
        x = sampler.correct(schedule, x, inputs.x_prev, x0_hat, inputs.t_prev, inputs.t, past)  # type: ignore[arg-type]
    result = sampler.step(schedule, x, x0_hat, inputs.t, inputs.t_next, past, inputs.noise)
    lam = schedule.log_snr(inputs.t) if sampler.history else None
    return StepOutputs(result.x, result.x_mean, x0_hat, result.x0_prev, x, lam)


def fused_step(denoise: DenoiseFn) -> FusedStepFn:
    """One step as one callable: ``denoise`` then ``sampler_update``, uncaptured, at the inputs' own shape
    (the reference of a captured step; ``advance_fused`` takes it)."""

    def step(sampler: Sampler, schedule: TangentSchedule, inputs: StepInputs) -> StepOutputs:
        x0_hat = denoise(inputs.x, inputs.t, inputs.x0_prev, inputs.mask)
        return sampler_update(sampler, schedule, inputs, x0_hat)

    return step


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
        self._missing = torch.tensor(float("nan"), dtype=torch.float64, device=self.device)  # a past step not taken

    # --- starting -------------------------------------------------------------------------------

    def start(self, plan: SamplingPlan, d_model: int, prefix: Tensor | None = None) -> list[SampleState]:
        """The plan's n samples at t = 1, each prior drawn from its own seeded stream, at the plan's
        prior temperature (x_1 = tau * eps; the sde sampler's per-step noise is not scaled).

        ``prefix`` (P, D), P < length: condition every sample on these latents at its first P positions."""
        if prefix is not None and not (prefix.ndim == 2 and prefix.shape[0] < plan.length and prefix.shape[1] == d_model):
            raise ValueError(f"prefix has shape {tuple(prefix.shape)}; allowed: (P, {d_model}) with P < length={plan.length}")
        times = to_device(plan.times(self.schedule).float(), self.device)
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
        zeros = torch.zeros_like(prior)
        guidance = None if guidance is None else guidance.to(prior.dtype)
        return SampleState(
            sampler, times.to(prior.dtype), noise, prior, prior, zeros, zeros, prefix=prefix, prefix_noise=prefix_noise, guidance=guidance
        )

    # --- one step -------------------------------------------------------------------------------

    def batch(self, states: list[SampleState], padded: int | None = None) -> StepBatch:
        """The denoiser's inputs for ``states``, right-padded to ``padded`` (default: the longest), then
        a prompt-blind copy of each guided sample's row (``StepBatch.blind``)."""
        padded = max(s.length for s in states) if padded is None else padded
        for state in states:
            if state.prefix is not None:
                state.x = self._inpaint(state)
        blind = tuple(i for i, s in enumerate(states) if s.guidance is not None)
        rows = states + [states[i] for i in blind]
        mask = torch.zeros(len(rows), padded, dtype=torch.bool, device=self.device)
        for i, state in enumerate(rows):
            mask[i, : state.length] = True
        for k, i in enumerate(blind):
            mask[len(states) + k, : states[i].prefix.shape[0]] = False  # type: ignore[union-attr]
        t = torch.stack([s.times[s.step] for s in rows])  # device tensors: no host round trip
        t_next = torch.stack([s.times[s.step + 1] for s in rows])
        stack = self._stacker(padded)
        return StepBatch(states, stack([s.x for s in rows]), t, t_next, stack([s.x0_prev for s in rows]), mask, blind)

    def advance(self, batch: StepBatch, x0_hat: Tensor) -> list[SampleState]:
        """Each sample of ``batch`` one step on, given the denoiser's ``x0_hat`` (B, padded, D): one
        sampler step per sampler in the batch, over its own rows and their own pasts. Returns the
        samples that reached t_min."""
        if batch.blind:
            batch, x0_hat = self._guided(batch, x0_hat)
        by_sampler: dict[str, list[int]] = {}
        for i, state in enumerate(batch.states):
            by_sampler.setdefault(state.sampler.name, []).append(i)
        for rows in by_sampler.values():
            index = slice(None) if len(by_sampler) == 1 else to_device(torch.tensor(rows), self.device)
            self._step_group([batch.states[i] for i in rows], index, batch, x0_hat)
        for state in batch.states:
            state.step += 1
        return [s for s in batch.states if s.done]

    def latent(self, state: SampleState) -> Tensor:
        """What is decoded of a finished sample (L, D): its last mean state or x0_hat (the config's
        ``decode_final``), with the prompt's latents exactly at the prompt's positions."""
        latent = state.x_mean if self.decode_final == "mean" else state.x0_hat
        if state.prefix is not None:
            latent = torch.cat([state.prefix.to(latent.dtype), latent[state.prefix.shape[0] :]])
        return latent

    def advance_fused(self, batch: StepBatch, step: FusedStepFn) -> list[SampleState]:
        """``advance`` with the denoiser call inside ``step``: ``step(sampler, schedule, inputs)`` is the
        denoiser and the sampler's update together (``fused_step``; on CUDA one captured graph per bucket and
        sampler), so the host only gathers the samples' state and hands the results back. Same numbers as
        ``batch``'s denoiser call followed by ``advance``. One sampler per batch and no prompt guidance (the
        blind rows' extrapolation sits between the denoiser and the step): ``fusable`` says which batches. A ``step``
        that raises changes no sample: this step's noise is held for whatever runs the step instead."""
        if not self.fusable(batch):
            raise ValueError(
                f"advance_fused takes one sampler and no prompt-guided rows; this batch has samplers "
                f"{sorted({s.sampler.name for s in batch.states})} and {len(batch.blind)} blind rows: use advance"
            )
        group, sampler = batch.states, batch.states[0].sampler
        inputs = self._gather(group, StepInputs(batch.x, batch.t, batch.t_next, batch.x0_prev, batch.mask))
        try:
            out = step(sampler, self.schedule, inputs)
        except Exception:
            if inputs.noise is not None:  # the step is not taken: whatever runs it again must draw the same noise
                for state, row in zip(group, inputs.noise):
                    state.held_noise = row[: state.length]
            raise
        self._scatter(group, out)
        for state in group:
            state.step += 1
        return [s for s in group if s.done]

    @staticmethod
    def fusable(batch: StepBatch) -> bool:
        """Whether ``advance_fused`` takes ``batch``: its samples share one sampler and none is prompt-guided."""
        return not batch.blind and len({s.sampler.name for s in batch.states}) == 1

    def _step_group(self, group: list[SampleState], rows: Tensor | slice, batch: StepBatch, x0_hat: Tensor) -> None:
        """The sampler step of the samples in ``group`` (one sampler; their ``rows`` of the batch)."""
        rowwise = StepInputs(batch.x[rows], batch.t[rows], batch.t_next[rows], batch.x0_prev[rows], batch.mask[rows])
        self._scatter(group, sampler_update(group[0].sampler, self.schedule, self._gather(group, rowwise), x0_hat[rows]))

    def _gather(self, group: list[SampleState], inputs: StepInputs) -> StepInputs:
        """``inputs`` with what the group's sampler reads of each sample's own state: its past (a sample with
        fewer past steps gets zeros and a missing (NaN) lambda there), the state the corrector redoes, and
        this step's noise, each stacked over the group's rows."""
        sampler, stack = group[0].sampler, self._stacker(inputs.x.shape[1])
        past_x0 = tuple(stack([s.past[k][0] if k < len(s.past) else torch.zeros_like(s.x) for s in group]) for k in range(sampler.history))
        past_lam = tuple(torch.stack([s.past[k][1] if k < len(s.past) else self._missing for s in group]) for k in range(sampler.history))
        noise = stack([self._draw(s) for s in group]) if sampler.stochastic else None
        x_prev = t_prev = None
        if sampler.corrector:
            x_prev = stack([s.x_prev if s.x_prev is not None else torch.zeros_like(s.x) for s in group])
            t_prev = torch.stack([s.times[max(s.step - 1, 0)] for s in group])  # the first step has no past: not redone
        return replace(inputs, past_x0=past_x0, past_lam=past_lam, noise=noise, x_prev=x_prev, t_prev=t_prev)

    @staticmethod
    def _draw(state: SampleState) -> Tensor:
        """This step's noise: the draw a failed fused step held back, else the stream's next."""
        held, state.held_noise = state.held_noise, None
        return held if held is not None else state.noise.draw()

    @staticmethod
    def _scatter(group: list[SampleState], out: StepOutputs) -> None:
        """Each sample's own rows of ``out`` (cut to its length) become its state."""
        sampler = group[0].sampler
        for i, state in enumerate(group):
            n = state.length
            if sampler.corrector:
                state.x_prev = out.x_start[i, :n]
            state.x, state.x_mean = out.x[i, :n], out.x_mean[i, :n]
            state.x0_hat, state.x0_prev = out.x0_hat[i, :n], out.x0_prev[i, :n]
            if out.lam is not None:
                state.past = push_past(state.past, state.x0_hat, out.lam[i], sampler.history)

    def _guided(self, batch: StepBatch, x0_hat: Tensor) -> tuple[StepBatch, Tensor]:
        """The batch without its blind rows, and each guided sample's x0_hat extrapolated from its blind
        row's by its weights: x0_blind + w (x0_hat - x0_blind) (the prompt's own positions: x0_hat)."""
        b = len(batch.states)
        rows = to_device(torch.tensor(batch.blind), self.device)
        weights = self._stacker(x0_hat.shape[1])([batch.states[i].guidance for i in batch.blind])  # type: ignore[misc]
        blind = x0_hat[b:]
        guided = blind + weights * (x0_hat[rows] - blind)
        kept = replace(
            batch, x=batch.x[:b], t=batch.t[:b], t_next=batch.t_next[:b], x0_prev=batch.x0_prev[:b], mask=batch.mask[:b], blind=()
        )
        return kept, x0_hat[:b].index_copy(0, rows, guided.to(x0_hat.dtype))

    def _inpaint(self, state: SampleState) -> Tensor:
        """x_t with its first P positions reset to the prompt's latents forward-noised to the sample's time."""
        prefix, noise = state.prefix, state.prefix_noise.draw().to(self.device)  # type: ignore[union-attr]
        t = state.times[state.step].to(prefix.dtype).reshape(1)  # type: ignore[union-attr]  # a device scalar stays there
        noised = forward_noise(self.schedule, prefix[None], t, noise[None])[0]  # type: ignore[index]
        return torch.cat([noised.to(state.x.dtype), state.x[prefix.shape[0] :]])  # type: ignore[union-attr]

    def _stacker(self, padded: int) -> Callable[[list[Tensor]], Tensor]:
        def stack(tensors: list[Tensor]) -> Tensor:
            return torch.stack([F.pad(t, (0, 0, 0, padded - t.shape[0])) for t in tensors]).to(self.device)

        return stack


def run_lockstep(
    engine: SamplingEngine, states: list[SampleState], denoise: DenoiseFn, padded: int | None = None, progress: bool = False
) -> Tensor:
    """Move ``states`` (one grid length) together to t_min, one denoiser call per step; their latents (B, L, D)."""
    for _ in tqdm(range(states[0].steps), desc="denoising", unit="step", disable=not progress):
        batch = engine.batch(states, padded)
        engine.advance(batch, denoise(batch.x, batch.t, batch.x0_prev, batch.mask))
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
    times = to_device(grid, prior.device)
    states = [engine.state(method, times, rows.row(i), prior[i]) for i in range(prior.shape[0])]
    return run_lockstep(engine, states, lambda x_t, t, x0_prev, mask: denoise(x_t, t, x0_prev), progress=progress)
