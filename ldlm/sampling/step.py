"""One sampler step as tensors in and tensors out: what a step reads (``StepInputs``), what it gives back
(``StepOutputs``), and the sampler's update between them (``sampler_update``). Batch-first with fixed
shapes for a given (batch, length, sampler), so a step can be captured as one CUDA graph.

The persistent batch (ldlm/sampling/slots.py) keeps every sample's state in rows ("slots") of a few tensors:
``gather_inputs`` and ``gather_past`` read a step's rows from them and ``scatter_outputs`` writes the results
back, in a fixed number of tensor operations whatever the batch holds. A fused step (``FusedStepFn``) takes
the rows as a ``SlotStep`` and does all three itself, so a captured graph holds the gather, the denoiser, the
update and the scatter, and the host only copies the step's times in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ldlm.sampling.noise import to_device
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


@dataclass(frozen=True)
class SlotStep:
    """One fused step's rows, where they live: the callable gathers them from ``state`` at ``slots``, steps them
    and scatters the results back into the same slots, in place (``fused_step``)."""

    state: Mapping[str, Tensor]  # the persistent batch's tensors, slot first, read and written in place
    slots: Tensor  # (B,) the running slots in row order, on the state's device
    slots_host: np.ndarray  # the same on the host: one object while the running set holds (a new one: it changed)
    sent: np.ndarray  # (3 + C, B) each row's t, t_next, t_prev, then its step's coefficients (Sampler.coefficient_names)
    noise: Tensor | None  # (B, L, D) the stochastic sampler's draws for this step
    full: bool  # no row has padding: the step passes mask=None
    scratch: int  # a slot no sample holds: extra rows of a padded batch bucket may write there
    storage: tuple[int, int]  # (table, generation): a new generation when the state tensors were reallocated

    def rows(self, start: int, stop: int) -> SlotStep:
        """The step of rows ``start:stop`` alone."""
        noise = None if self.noise is None else self.noise[start:stop]
        part = self.slots_host[start:stop]
        return replace(self, slots=self.slots[start:stop], slots_host=part, sent=self.sent[:, start:stop], noise=noise)


FusedStepFn = Callable[[Sampler, TangentSchedule, SlotStep], None]  # one step of a SlotStep's rows, in place


def gather_inputs(state: Mapping[str, Tensor], slots: Tensor, sent: Tensor, full: bool) -> StepInputs:
    """The step inputs of the rows at ``slots`` (one index_select each); ``sent`` (3 + C, B) on the device holds
    their times and coefficients (``SlotStep.sent``). ``full``: no padding, so no mask (attention may take its
    mask-free kernels)."""
    x, x0_prev = state["x"].index_select(0, slots), state["x0_prev"].index_select(0, slots)
    mask = None if full else state["mask"].index_select(0, slots)
    return StepInputs(x, sent[0], sent[1], x0_prev, mask, t_prev=sent[2], coef=sent[3:].T)


Past = tuple[Tensor, Tensor | None]  # the rows' gathered past x0_hat (B, H, L, D) and log-SNR (B, H) (None: tabulated)


def gather_past(
    state: Mapping[str, Tensor], sampler: Sampler, slots: Tensor, rows: StepInputs, noise: Tensor | None
) -> tuple[StepInputs, Past | None]:
    """``rows`` (at ``slots``) with what ``sampler`` reads of them: its past x0_hat (zeros where a sample has no
    such step yet), the state the corrector redoes, and this step's noise. Coefficients came with the times; a
    sampler that computes its own (``Sampler.tabulated`` false) gets the past's lambdas (NaN: missing) and the
    times instead. Returns the inputs and the gathered past, which ``scatter_outputs`` pushes this step onto."""
    past = None
    changes: dict[str, object] = {"t_prev": None} if sampler.tabulated else {"t_prev": None, "coef": None}
    if sampler.history:
        lam = None if sampler.tabulated else state["past_lam"].index_select(0, slots)
        past = state["past_x0"].index_select(0, slots), lam
        changes["past_x0"] = tuple(past[0][:, j] for j in range(sampler.history))
        changes["past_lam"] = () if lam is None else tuple(lam[:, j] for j in range(sampler.history))
    if sampler.corrector:
        changes["x_prev"] = state["x_prev"].index_select(0, slots)
        changes["t_prev"] = None if sampler.tabulated else rows.t_prev
    if sampler.stochastic:
        changes["noise"] = noise
    return replace(rows, **changes), past  # type: ignore[arg-type]


def scatter_outputs(state: Mapping[str, Tensor], sampler: Sampler, slots: Tensor, out: StepOutputs, past: Past | None) -> None:
    """The update's outputs into the rows at ``slots`` (one index_copy_ each); this step's x0_hat (and its lambda,
    where the sampler reads lambdas) pushed onto the past."""
    dtype = state["x"].dtype

    def own(value: Tensor) -> Tensor:
        return value if value.dtype == dtype else value.to(dtype)

    for name, value in (("x", out.x), ("x_mean", out.x_mean), ("x0_hat", out.x0_hat), ("x0_prev", out.x0_prev)):
        state[name].index_copy_(0, slots, own(value))
    if sampler.corrector:
        state["x_prev"].index_copy_(0, slots, own(out.x_start))
    if past is None:
        return
    kept = past[0].shape[1] - 1
    state["past_x0"].index_copy_(0, slots, torch.cat([own(out.x0_hat)[:, None], past[0][:, :kept]], 1))
    if past[1] is not None and out.lam is not None:
        state["past_lam"].index_copy_(0, slots, torch.cat([out.lam[:, None], past[1][:, :kept]], 1))


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
    """One step as one callable: gather, ``denoise``, ``sampler_update``, scatter, uncaptured, at the rows' own
    shape (the reference of a captured step; ``SlotTable.step_fused`` takes it)."""

    def step(sampler: Sampler, schedule: TangentSchedule, rows: SlotStep) -> None:
        sent = to_device(torch.from_numpy(rows.sent), rows.slots.device)
        inputs, past = gather_past(rows.state, sampler, rows.slots, gather_inputs(rows.state, rows.slots, sent, rows.full), rows.noise)
        x0_hat = denoise(inputs.x, inputs.t, inputs.x0_prev, inputs.mask)
        scatter_outputs(rows.state, sampler, rows.slots, sampler_update(sampler, schedule, inputs, x0_hat), past)

    return step
