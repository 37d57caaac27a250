"""One sampler step as tensors in and tensors out: what a step reads (``StepInputs``), what it gives back
(``StepOutputs``), and the sampler's update between them (``sampler_update``). Batch-first with fixed
shapes for a given (batch, length, sampler), so a step can be captured as one CUDA graph; the persistent
batch (ldlm/sampling/slots.py) gathers them from its slots and scatters the outputs back."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from torch import Tensor

from ldlm.sampling.samplers import BOOL_COEFFICIENTS, Sampler
from ldlm.sampling.schedule import TangentSchedule

DenoiseFn = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]  # (x_t, t, x0_prev, mask or None: no padding) -> x0_hat


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
    mask: Tensor | None  # (B, L) bool, True at real positions; None: every position is real (no padding)
    past_x0: tuple[Tensor, ...] = ()  # sampler.history entries, each (B, L, D), most recent first
    past_lam: tuple[Tensor, ...] = ()  # their log-SNR, each (B,) float64, NaN where a sample has no such step
    noise: Tensor | None = None  # (B, L, D) the stochastic sampler's draw for this step
    x_prev: Tensor | None = None  # (B, L, D) the corrector's: the state the last step started from
    t_prev: Tensor | None = None  # (B,) its time
    coef: Tensor | None = None  # (B, C) the step's coefficients, tabulated at admission (Sampler.coefficient_names)

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
    inside a captured CUDA graph as it runs here.

    x0_hat is first zeroed at padded positions (mask False), so every output is zero there, as in a freshly
    padded batch: the persistent batch keeps its rows between steps, and padding must not drift."""
    if inputs.mask is not None:
        x0_hat = x0_hat * inputs.mask[..., None]
    if inputs.coef is not None:
        return _tabulated_update(sampler, inputs, x0_hat)
    past = list(zip(inputs.past_x0, inputs.past_lam))
    x = inputs.x
    if sampler.corrector:
        x = sampler.correct(schedule, x, inputs.x_prev, x0_hat, inputs.t_prev, inputs.t, past)  # type: ignore[arg-type]
    result = sampler.step(schedule, x, x0_hat, inputs.t, inputs.t_next, past, inputs.noise)
    lam = schedule.log_snr(inputs.t) if sampler.history else None
    return StepOutputs(result.x, result.x_mean, x0_hat, result.x0_prev, x, lam)


def _tabulated_update(sampler: Sampler, inputs: StepInputs, x0_hat: Tensor) -> StepOutputs:
    """``sampler_update`` with the step's coefficients looked up (``inputs.coef``), not computed: the same numbers."""
    columns = inputs.coef.unbind(1)  # type: ignore[union-attr]
    c = {name: columns[i] != 0 if name in BOOL_COEFFICIENTS else columns[i] for i, name in enumerate(sampler.coefficient_names)}
    x = inputs.x
    if sampler.corrector:
        x = sampler.apply_correct(c, x, inputs.x_prev, x0_hat, inputs.past_x0)  # type: ignore[arg-type]
    result = sampler.apply_step(c, x, x0_hat, inputs.past_x0, inputs.noise)
    return StepOutputs(result.x, result.x_mean, x0_hat, result.x0_prev, x, None)


def fused_step(denoise: DenoiseFn) -> FusedStepFn:
    """One step as one callable: ``denoise`` then ``sampler_update``, uncaptured, at the inputs' own shape
    (the reference of a captured step; ``SlotTable.step_fused`` takes it)."""

    def step(sampler: Sampler, schedule: TangentSchedule, inputs: StepInputs) -> StepOutputs:
        x0_hat = denoise(inputs.x, inputs.t, inputs.x0_prev, inputs.mask)
        return sampler_update(sampler, schedule, inputs, x0_hat)

    return step
