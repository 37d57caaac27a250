"""The persistent batch: every admitted sample's state in preallocated rows ("slots") of one length bucket.

A step's host work must not grow with its batch. So the state lives in tensors allocated once per table
(grown by doubling when full): admission writes a sample into a free slot, finishing frees it, and a
step works on the slots as they stand. What changes between steps is which slots run, an index tensor
made again only when that set changes, never a copy of every sample's state. A step is a fixed number
of tensor operations whatever the batch holds:

  times    each running slot's t, t_next and t_prev and the step's coefficients (everything the sampler
           computes from times alone, tabulated per sample at admission), read on the host, sent in one copy;
  gather   the running rows of x, x0_prev and the mask (one index_select each; ``gather_inputs``);
  denoise  one call for the rows, plus a prompt-blind copy of each guided row (prompt guidance);
  update   one ``sampler_update`` per sampler in the batch, over its rows, its past gathered the same way;
  scatter  the results back into their slots (one index_copy_ each; ``scatter_outputs``).

A fused step (``step_fused``) hands the gather, the denoiser call, the update and the scatter to one callable
(``SlotStep``): on CUDA one captured graph whose static inputs are the slot index and the sent times, so the
host's part of a step is one copy and one replay. A padded batch bucket's extra rows read the first row's slot
and write to a scratch slot no sample holds (each table keeps one past its capacity).

Per-sample work is left only where a sample's own random stream draws: the sde sampler's noise and an
inpainted prompt's forward noise, one draw per such sample and step (a generator per sample is what keeps a
sample's numbers independent of its batch). The host's bookkeeping (step counters, step totals, samplers,
lengths) is NumPy over slots, so the samples that finished, or are due to be watched (previews), are found
by a few vectorized operations, not a loop over the batch.

Positions past a sample's length are padding: masked out of the denoiser's keys and held at zero (the
sampler's update zeroes x0_hat there), exactly the zeros a freshly padded batch would hold, so a sample's
numbers do not depend on the bucket or the other rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ldlm.model.config import DecodeFinal
from ldlm.sampling.noise import NoiseSource, to_device
from ldlm.sampling.samplers import SAMPLERS_BY_NAME, Sampler
from ldlm.sampling.schedule import TangentSchedule, forward_noise
from ldlm.sampling.step import (
    DenoiseFn,
    FusedStepFn,
    SlotStep,
    StepInputs,
    gather_inputs,
    gather_past,
    sampler_update,
    scatter_outputs,
)

HISTORY = max(s.history for s in SAMPLERS_BY_NAME.values())  # past x0_hat kept per slot: the most any sampler reads
FIRST_CAPACITY = 8
COEFFICIENTS = max(len(s.coefficient_names) for s in SAMPLERS_BY_NAME.values())  # columns of a slot's coefficient table
_TABLES = itertools.count()  # each table's serial: with its storage generation, what a captured step is keyed by


@dataclass(eq=False)  # a sample is itself, not its values (and tensors have no truth value)
class SampleState:
    """One sample: what it was started with, and where its running state lives (a ``SlotTable``'s slot)."""

    sampler: Sampler
    times: Tensor  # (steps + 1,) on the host, in the state's dtype: a step's times are read there (SlotTable)
    noise: NoiseSource  # the prior came from it; the sde sampler draws from it every step
    prior: Tensor  # (L, D) the state at t = 1
    prefix: Tensor | None = None  # (P, D) prompt latents to inpaint
    prefix_noise: NoiseSource | None = None  # the forward noise of the inpainted prefix
    guidance: Tensor | None = None  # (L, 1) a guided prompt's weights: 1 at the prompt's positions, w after
    watch: int = 0  # its x0_hat is looked at every this many steps (previews; SlotTable.due); 0: never
    table: SlotTable | None = None  # where its state lives while it is admitted
    slot: int = -1
    final_step: int = 0  # the steps it had taken when it left its table
    latent: Tensor | None = None  # (L, D) what is decoded, once it reached t_min (SamplingEngine.latent)

    @property
    def length(self) -> int:
        return self.prior.shape[0]

    @property
    def steps(self) -> int:
        return len(self.times) - 1

    @property
    def step(self) -> int:
        """Steps taken so far."""
        return int(self.table.k[self.slot]) if self.table is not None else self.final_step

    @property
    def done(self) -> bool:
        return self.step == self.steps


@dataclass(frozen=True)
class _Group:
    """The running slots of one sampler: their positions in the step's rows (None: every row) and the slots."""

    sampler: Sampler
    pos: Tensor | None
    slots: Tensor
    slots_np: np.ndarray


@dataclass(frozen=True)
class _Layout:
    """Which slots run and how they split, made when that set changes and kept while it holds."""

    slots_np: np.ndarray
    slots: Tensor
    groups: tuple[_Group, ...]
    prompted: np.ndarray  # positions (in the step's rows) of the samples with a prompt to inpaint
    prompted_pos: Tensor | None  # the same on the device; None where every row has a prompt
    prompted_slots: Tensor | None
    guided_pos: Tensor | None  # rows with prompt guidance: each gets a blind copy
    blind_mask: Tensor | None  # the blind copies' mask: the prompt's positions out
    weights: Tensor | None  # (G, L, 1) the guided rows' guidance weights
    full: bool  # no padding: every running sample fills the table's length and no row is blind
    watched: bool  # some running sample's x0_hat is watched (previews)


class SlotTable:
    """The persistent state of the samples of one row length (see the module's docstring)."""

    def __init__(
        self, schedule: TangentSchedule, length: int, device: torch.device | str = "cpu", decode_final: DecodeFinal = "mean"
    ) -> None:
        self.schedule = schedule
        self.length = length
        self.device = torch.device(device)
        self.decode_final = decode_final
        self.capacity = 0
        self.state: dict[str, Tensor] = {}  # per slot, batch first; one row more than capacity: the scratch slot
        self.storage = (next(_TABLES), 0)  # (table, generation): the generation counts reallocations of self.state
        self.owner: list[SampleState | None] = []
        self._free: list[int] = []
        self.k = np.zeros(0, dtype=np.int64)  # steps taken
        self.steps = np.zeros(0, dtype=np.int64)  # steps to take
        self.lengths = np.zeros(0, dtype=np.int64)
        self.codes = np.zeros(0, dtype=np.int64)  # each slot's sampler, as its index in self.samplers
        self.samplers: list[Sampler] = []  # every sampler this table has held (its own objects: a caller may bring one)
        self.watch = np.zeros(0, dtype=np.int64)  # look at x0_hat every this many steps (previews); 0: never
        self.prompted = np.zeros(0, dtype=bool)
        self.guided = np.zeros(0, dtype=bool)
        self.times = np.zeros((0, 1))  # each slot's grid, in the state's precision
        self.coef = np.zeros((0, 1, COEFFICIENTS))  # each slot's steps' coefficients (Sampler.coefficient_names)
        self._running = np.zeros(0, dtype=np.int64)
        self._layout: _Layout | None = None
        self._drawn: dict[tuple[str, int], Tensor] = {}  # this step's draws, by (stream, slot)
        self._held: dict[tuple[str, int], Tensor] = {}  # the draws of a fused step that failed: its retry takes them
        self.dtype: torch.dtype | None = None

    # --- admission and release --------------------------------------------------------------------

    def admit(self, states: list[SampleState]) -> None:
        """Write each of ``states`` (not yet in a table) into a free slot, at its step 0."""
        if not states:
            return
        for state in states:
            if state.table is not None:
                raise ValueError("a sample is admitted once; it already holds a slot")
            if state.length > self.length:
                raise ValueError(f"a sample of length {state.length} does not fit this table; allowed: <= {self.length}")
        self._reserve(len(states), states[0])
        slots = [self._free.pop() for _ in states]
        self._write_rows(states, slots)
        self._write_host(states, slots)

    def run(self, states: list[SampleState]) -> None:
        """The samples the next steps move (admitted here if new); admitted ones left out keep their slots."""
        self.admit([s for s in states if s.table is None])
        running = np.fromiter((s.slot for s in states), dtype=np.int64, count=len(states))
        if not np.array_equal(running, self._running):
            self._running, self._layout = running, None

    def release(self, states: list[SampleState]) -> None:
        """Free ``states``' slots (they finished, or their request ended); they leave the running set."""
        slots = [s.slot for s in states]
        for state, slot in zip(states, slots):
            if state.table is not self:
                raise ValueError("a sample is released by the table that holds it")
            state.final_step, state.table = int(self.k[slot]), None
            self.owner[slot] = None
            self._held.pop(("noise", slot), None)
            self._held.pop(("prefix", slot), None)
        self._free += slots
        leaving = np.isin(self._running, slots)
        if leaving.any():
            self._running, self._layout = self._running[~leaving], None

    @property
    def running(self) -> int:
        return len(self._running)

    def fusable(self) -> bool:
        """Whether ``step_fused`` takes the running rows: one sampler and no prompt guidance."""
        layout = self._current()
        return len(layout.groups) == 1 and layout.guided_pos is None

    # --- one step -------------------------------------------------------------------------------

    def step(self, denoise: DenoiseFn) -> list[SampleState]:
        """Every running sample one step on: one denoiser call, then each sampler's update over its rows.
        Returns the samples that reached t_min (their slots freed, each ``latent`` set)."""
        layout = self._current()
        inputs = self._inputs(layout)
        x, t, x0_prev, mask = inputs.x, inputs.t, inputs.x0_prev, inputs.mask
        if layout.guided_pos is not None:
            g = layout.guided_pos
            x, t, x0_prev = torch.cat([x, x[g]]), torch.cat([t, t[g]]), torch.cat([x0_prev, x0_prev[g]])
            mask = torch.cat([mask, layout.blind_mask])  # type: ignore[list-item]  # guided: never full, so a mask
        x0_hat = denoise(x, t, x0_prev, mask)
        if layout.guided_pos is not None:
            x0_hat = self._guide(layout, x0_hat)
        for group in layout.groups:
            rows = inputs if group.pos is None else _rows(inputs, group.pos)
            group_x0 = x0_hat if group.pos is None else x0_hat[group.pos]
            noise = self._noise(group.slots_np) if group.sampler.stochastic else None
            group_inputs, past = gather_past(self.state, group.sampler, group.slots, rows, noise)
            out = sampler_update(group.sampler, self.schedule, group_inputs, group_x0)
            scatter_outputs(self.state, group.sampler, group.slots, out, past)
        return self._advance(layout)

    def step_fused(self, fused: FusedStepFn) -> list[SampleState]:
        """``step`` with the gather, the denoiser call, the update and the scatter inside ``fused(sampler,
        schedule, rows)`` (on CUDA one captured graph per bucket and sampler): the same numbers. Takes what
        ``fusable`` says. A ``fused`` that raises changes no sample: this step's noise is held for whatever runs
        it instead."""
        layout = self._current()
        if not self.fusable():
            names = sorted({g.sampler.name for g in layout.groups})
            blind = 0 if layout.guided_pos is None else len(layout.guided_pos)
            raise ValueError(
                f"a fused step takes one sampler and no prompt-guided rows; these rows have samplers {names} and {blind} guided"
            )
        group = layout.groups[0]
        sent = self._sent(layout)
        if len(layout.prompted):
            self._inpaint(layout, to_device(torch.from_numpy(sent[0][layout.prompted]), self.device))
        noise = self._noise(layout.slots_np) if group.sampler.stochastic else None
        rows = SlotStep(self.state, layout.slots, layout.slots_np, sent, noise, layout.full, self.capacity, self.storage)
        try:
            fused(group.sampler, self.schedule, rows)
        except Exception:
            self._held.update(self._drawn)  # the step is not taken: whatever runs it again must draw the same noise
            raise
        return self._advance(layout)

    def due(self) -> list[SampleState]:
        """The running samples whose x0_hat is due to be watched now: a multiple of their ``watch`` steps, not the last."""
        slots = self._running
        if not len(slots) or not self._current().watched:  # none watched: no per-step arithmetic
            return []
        every, k = self.watch[slots], self.k[slots]
        hit = slots[(every > 0) & (k < self.steps[slots]) & (k % np.maximum(every, 1) == 0)]
        return [self.owner[s] for s in hit.tolist()]

    def rows(self, name: str, states: list[SampleState]) -> Tensor:
        """Copies of ``states``' rows of one state tensor (``x0_hat``, ``x_mean``, ``mask``, ...), in their order."""
        index = to_device(torch.tensor([s.slot for s in states]), self.device)
        return self.state[name].index_select(0, index)

    # --- the step's parts -------------------------------------------------------------------------

    def _sent(self, layout: _Layout) -> np.ndarray:
        """(3 + C, B) the running rows' t, t_next, t_prev and step coefficients, read on the host (``SlotStep.sent``).
        A new step: its draws are not yet made."""
        slots = layout.slots_np
        k = self.k[slots]
        self._drawn = {}
        sent = np.empty((3 + self.coef.shape[2], len(slots)), dtype=self.times.dtype)
        sent[0], sent[1], sent[2] = self.times[slots, k], self.times[slots, k + 1], self.times[slots, np.maximum(k - 1, 0)]
        sent[3:] = self.coef[slots, k].T
        return sent

    def _inputs(self, layout: _Layout) -> StepInputs:
        """The running rows' step inputs; a prompt's positions first reset by prefix inpainting."""
        sent = to_device(torch.from_numpy(self._sent(layout)), self.device)  # one copy
        if len(layout.prompted):
            t = sent[0]
            self._inpaint(layout, t if layout.prompted_pos is None else t.index_select(0, layout.prompted_pos))
        return gather_inputs(self.state, layout.slots, sent, layout.full)  # mask None: attention may take flash kernels

    def _advance(self, layout: _Layout) -> list[SampleState]:
        """Count the step; the samples that finished leave with their latents (one gather for all of them)."""
        slots = layout.slots_np
        self.k[slots] += 1
        done = slots[self.k[slots] >= self.steps[slots]]
        if not len(done):
            return []
        index = to_device(torch.from_numpy(done), self.device)
        s = self.state
        latents = s["x_mean" if self.decode_final == "mean" else "x0_hat"].index_select(0, index)
        if self.prompted[done].any():  # the prompt's latents exactly at the prompt's positions
            latents = torch.where(s["prefix_mask"].index_select(0, index)[..., None], s["prefix"].index_select(0, index), latents)
        finished: list[SampleState] = [self.owner[slot] for slot in done.tolist()]
        for i, state in enumerate(finished):
            state.latent = latents[i, : state.length]
        self.release(finished)
        return finished

    def _guide(self, layout: _Layout, x0_hat: Tensor) -> Tensor:
        """Each guided row's x0_hat extrapolated from its blind copy's: x0_blind + w (x0_hat - x0_blind)."""
        b, g = len(layout.slots_np), layout.guided_pos
        blind = x0_hat[b:]
        guided = blind + layout.weights * (x0_hat[g] - blind)  # type: ignore[operator]
        return x0_hat[:b].index_copy(0, g, guided.to(x0_hat.dtype))  # type: ignore[arg-type]

    def _inpaint(self, layout: _Layout, t: Tensor) -> None:
        """x_t of the prompted slots with the prompt's positions reset to its latents forward-noised to t."""
        slots, s = layout.prompted_slots, self.state
        draws = [self._draw("prefix", slot) for slot in layout.slots_np[layout.prompted].tolist()]
        noise = self._pad(draws).to(self.device)
        noised = forward_noise(self.schedule, s["prefix"].index_select(0, slots), t, noise)  # type: ignore[arg-type]
        x = torch.where(s["prefix_mask"].index_select(0, slots)[..., None], noised.to(self.dtype), s["x"].index_select(0, slots))  # type: ignore[arg-type]
        s["x"].index_copy_(0, slots, x)  # type: ignore[arg-type]

    def _noise(self, slots: np.ndarray) -> Tensor:
        """This step's noise of each of ``slots`` (the stochastic sampler's)."""
        return self._pad([self._draw("noise", slot) for slot in slots.tolist()]).to(self.device, self.dtype)

    def _draw(self, stream: str, slot: int) -> Tensor:
        """The next draw of a slot's ``stream`` ("noise" or the prompt's "prefix"): a failed fused step's held
        draw, else the stream's next; kept for this step, in case it fails."""
        held = self._held.pop((stream, slot), None)
        owner = self.owner[slot]
        source = owner.noise if stream == "noise" else owner.prefix_noise  # type: ignore[union-attr]
        self._drawn[(stream, slot)] = draw = held if held is not None else source.draw()  # type: ignore[union-attr]
        return draw

    def _pad(self, rows: list[Tensor]) -> Tensor:
        return torch.stack([F.pad(r, (0, 0, 0, self.length - r.shape[0])) for r in rows])

    # --- the layout -----------------------------------------------------------------------------

    def _current(self) -> _Layout:
        if self._layout is None:
            if not len(self._running):
                raise ValueError("no sample is running in this table; run() some first")
            self._layout = self._make_layout()
        return self._layout

    def _make_layout(self) -> _Layout:
        """Index tensors of the running set: its slots, its sampler groups, its prompted and guided rows."""
        device, slots = self.device, self._running
        codes = self.codes[slots]
        groups = []
        for code in np.unique(codes).tolist():
            pos = np.flatnonzero(codes == code)
            whole = len(pos) == len(slots)
            group_slots = to_device(torch.from_numpy(slots[pos]), device)
            pos_t = None if whole else to_device(torch.from_numpy(pos), device)
            groups.append(_Group(self.samplers[code], pos_t, group_slots, slots[pos]))
        prompted = np.flatnonzero(self.prompted[slots])
        guided = np.flatnonzero(self.guided[slots])
        prompted_slots = to_device(torch.from_numpy(slots[prompted]), device) if len(prompted) else None
        prompted_pos = to_device(torch.from_numpy(prompted), device) if 0 < len(prompted) < len(slots) else None
        guided_pos = blind_mask = weights = None
        if len(guided):
            guided_pos = to_device(torch.from_numpy(guided), device)
            index = to_device(torch.from_numpy(slots[guided]), device)
            s = self.state
            blind_mask = s["mask"].index_select(0, index) & ~s["prefix_mask"].index_select(0, index)
            weights = s["guidance"].index_select(0, index)
        full = bool((self.lengths[slots] == self.length).all()) and not len(guided)
        all_slots = to_device(torch.from_numpy(slots.copy()), device)
        watched = bool((self.watch[slots] > 0).any())
        return _Layout(
            slots.copy(), all_slots, tuple(groups), prompted, prompted_pos, prompted_slots, guided_pos, blind_mask, weights, full, watched
        )

    # --- storage ----------------------------------------------------------------------------------

    def _reserve(self, more: int, like: SampleState) -> None:
        """At least ``more`` free slots, the storage doubled as often as needed (its rows kept)."""
        if self.dtype is None:
            self.dtype = like.prior.dtype
            kind = torch.empty(0, dtype=self.dtype).numpy().dtype  # a step's times and coefficients sent as they are
            self.times, self.coef = self.times.astype(kind), self.coef.astype(kind)
        elif like.prior.dtype != self.dtype:
            raise ValueError(f"a table holds one dtype; this one holds {self.dtype}, not {like.prior.dtype}")
        capacity = max(self.capacity, FIRST_CAPACITY)
        while capacity - self.capacity + len(self._free) < more:
            capacity *= 2
        if capacity == self.capacity:
            return
        self._grow(capacity, like.prior.shape[1])

    def _grow(self, capacity: int, d_model: int) -> None:
        old, self.capacity = self.capacity, capacity
        length, dtype, device = self.length, self.dtype, self.device
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype, float | bool]] = {
            **{n: ((length, d_model), dtype, 0.0) for n in ("x", "x_mean", "x0_hat", "x0_prev", "x_prev", "prefix")},  # type: ignore[misc]
            "past_x0": ((HISTORY, length, d_model), dtype, 0.0),  # type: ignore[dict-item]
            "past_lam": ((HISTORY,), torch.float64, float("nan")),  # a past step not taken: NaN
            "mask": ((length,), torch.bool, False),
            "prefix_mask": ((length,), torch.bool, False),
            "guidance": ((length, 1), dtype, 0.0),  # type: ignore[dict-item]
        }
        for name, (shape, kind, fill) in shapes.items():
            grown = torch.full((capacity + 1, *shape), fill, dtype=kind, device=device)  # the last row: the scratch slot
            if name in self.state:
                grown[:old] = self.state[name][:old]
            self.state[name] = grown
        self.storage = (self.storage[0], self.storage[1] + 1)
        more = capacity - old
        for name in ("k", "steps", "lengths", "codes", "watch", "prompted", "guided"):
            column = getattr(self, name)
            setattr(self, name, np.concatenate([column, np.zeros(more, dtype=column.dtype)]))
        self.times = np.concatenate([self.times, np.zeros((more, self.times.shape[1]), dtype=self.times.dtype)])
        self.coef = np.concatenate([self.coef, np.zeros((more, *self.coef.shape[1:]), dtype=self.coef.dtype)])
        self.owner += [None] * more
        self._free += range(capacity - 1, old - 1, -1)  # lowest slot first
        self._layout = None

    def _write_rows(self, states: list[SampleState], slots: list[int]) -> None:
        """The device state of new samples at step 0: the prior, empty self-conditioning, no past."""
        s, device = self.state, self.device
        index = to_device(torch.tensor(slots), device)
        prior = self._pad([st.prior for st in states]).to(self.device)
        for name in ("x", "x_mean"):
            s[name].index_copy_(0, index, prior)
        for name in ("x0_hat", "x0_prev", "x_prev", "past_x0", "prefix", "guidance"):
            s[name].index_fill_(0, index, 0.0)
        s["past_lam"].index_fill_(0, index, float("nan"))
        lengths = to_device(torch.tensor([st.length for st in states]), device)
        s["mask"].index_copy_(0, index, torch.arange(self.length, device=device)[None] < lengths[:, None])
        s["prefix_mask"].index_fill_(0, index, False)
        for slot, st in zip(slots, states):  # a prompt's rows: only where there is one
            if st.prefix is not None:
                p = st.prefix.shape[0]
                s["prefix"][slot, :p] = st.prefix.to(self.dtype)
                s["prefix_mask"][slot, :p] = True
            if st.guidance is not None:
                s["guidance"][slot, : st.length] = st.guidance

    def _write_host(self, states: list[SampleState], slots: list[int]) -> None:
        longest = max(st.steps for st in states) + 1
        if longest > self.times.shape[1]:
            self.times = np.pad(self.times, ((0, 0), (0, longest - self.times.shape[1])))
            self.coef = np.pad(self.coef, ((0, 0), (0, longest - 1 - self.coef.shape[1]), (0, 0)))
        for st, slot in zip(states, slots):
            grid = st.times.detach().to("cpu", self.dtype).numpy()  # a host tensor: no copy
            self.times[slot, : len(grid)] = grid
            if st.sampler.tabulated:
                self.coef[slot, : st.steps] = self._coefficients(st)
            self.k[slot], self.steps[slot], self.lengths[slot] = 0, st.steps, st.length
            self.codes[slot], self.watch[slot] = self._code(st.sampler), st.watch
            self.prompted[slot], self.guided[slot] = st.prefix is not None, st.guidance is not None
            self.owner[slot], st.table, st.slot = st, self, slot

    def _coefficients(self, state: SampleState) -> np.ndarray:
        """(steps, COEFFICIENTS) the sample's every step's coefficients, from its grid: step k's past log-SNR are
        those of its grid's times k-1 and k-2 (NaN before the first), as its steps would push them."""
        times, sampler = state.times.to(self.dtype), state.sampler
        k = torch.arange(state.steps)
        lam = self.schedule.log_snr(times)
        past = [torch.where(k - 1 - j >= 0, lam[(k - 1 - j).clamp(min=0)], torch.full_like(lam[:-1], float("nan"))) for j in range(HISTORY)]
        c = sampler.coefficients(self.schedule, times[:-1], times[1:], times[(k - 1).clamp(min=0)], past, self.dtype)  # type: ignore[arg-type]
        columns = [c[name].to(self.dtype) for name in sampler.coefficient_names]
        return torch.stack(columns + [torch.zeros(state.steps, dtype=self.dtype)] * (COEFFICIENTS - len(columns)), 1).numpy()

    def _code(self, sampler: Sampler) -> int:
        for code, known in enumerate(self.samplers):
            if known is sampler:
                return code
        self.samplers.append(sampler)
        return len(self.samplers) - 1


def _rows(inputs: StepInputs, pos: Tensor) -> StepInputs:
    """``inputs`` at the rows ``pos`` (batch-first tensors; the mask, t_prev and coefficients where there are)."""

    def pick(value: Tensor | None) -> Tensor | None:
        return None if value is None else value.index_select(0, pos)

    x, t, t_next, x0_prev = (v.index_select(0, pos) for v in (inputs.x, inputs.t, inputs.t_next, inputs.x0_prev))
    return replace(
        inputs, x=x, t=t, t_next=t_next, x0_prev=x0_prev, mask=pick(inputs.mask), t_prev=pick(inputs.t_prev), coef=pick(inputs.coef)
    )
