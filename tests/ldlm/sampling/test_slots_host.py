"""The slot table's host tables and a slot's reset at admission: samples that each take more steps than any before
them arrive while the table grows 8 -> 16 -> 32 slots and after others left (their slots reused), and each gets the
latent it gets alone; a sample admitted into a used slot starts with empty self-conditioning (zeros, as a fresh
sample does); samples admitted without being run wait while the running ones step on, also when their admission grew
the table; and a float16 sample handed a float64 grid steps at the grid as the sample itself converts it to float16
(what the engine hands the table), including a time whose rounding to float16 through float32 differs from its
direct rounding."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ldlm.sampling import SampleState
from ldlm.sampling.noise import NoiseStream
from ldlm.sampling.samplers import get_sampler
from ldlm.sampling.schedule import TangentSchedule, time_grid
from ldlm.sampling.slots import SlotTable
from tests.ldlm.sampling.test_slots_step import context

SCHEDULE = TangentSchedule()
L, D = 8, 4
NAMES = ("ddim", "dpm3m-psc", "dpm2m", "dpm3m-psc-unic")
# Sample i takes 2 + i steps, more than every sample before it, so each arrival widens the host tables: 3 at first,
# 6 more at step 1 (9 > 8 slots: 16), 9 more at step 2 (the first has left: 17 > 16, so 32), then 3 once more have
# left, into their freed slots.
ARRIVALS = {0: range(0, 3), 1: range(3, 9), 2: range(9, 18), 6: range(18, 21)}


def make(i: int, dtype: torch.dtype = torch.float64) -> SampleState:
    """Sample i from its own seeds: sampler NAMES[i % 4], length 3..8, 2 + i steps on the uniform grid."""
    length = 3 + (5 * i) % 6
    prior = torch.randn(length, D, generator=torch.Generator().manual_seed(500 + i), dtype=torch.float64).to(dtype)
    times = time_grid(2 + i, 1e-3).to(dtype)
    return SampleState(get_sampler(NAMES[i % 4]), times, NoiseStream(i, (length, D)), prior)


def alone(sample: SampleState) -> Tensor:
    table = SlotTable(SCHEDULE, L)
    table.run([sample])
    while table.running:
        table.step(context)
    assert sample.latent is not None
    return sample.latent


def test_each_longer_sample_arriving_as_the_table_grows_and_reuses_slots_gets_its_alone_latent() -> None:
    table, samples, capacities, reused = SlotTable(SCHEDULE, L), [], [], []
    for k in itertools.count():
        arriving = [make(i) for i in ARRIVALS.get(k, ())]
        freed = {s.slot for s in samples if s.done}
        samples += arriving
        running = [s for s in samples if not s.done]
        if not running:
            break
        table.run(running)
        capacities.append(table.capacity)
        reused += [s.slot for s in arriving if s.slot in freed]
        table.step(context)
    assert sorted(set(capacities)) == [8, 16, 32]
    assert reused, "no later sample took a freed slot"
    for i, sample in enumerate(samples):
        assert sample.final_step == 2 + i
        torch.testing.assert_close(sample.latent, alone(make(i)), rtol=1e-12, atol=1e-12, msg=f"sample {i}")


def test_a_sample_admitted_into_a_used_slot_starts_with_empty_self_conditioning() -> None:
    """The first occupant leaves its x0_hat in the slot; the next one's first denoiser call must see x0_prev = 0, as
    a sample run in a fresh table does, and its second call its own first answer (zero past its length)."""
    seen: list[tuple[Tensor, Tensor]] = []

    def denoise(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
        out = context(x_t, t, x0_prev, mask)
        seen.append((x0_prev.clone(), out.clone()))
        return out

    first, second = make(5), make(2)  # dpm3m-psc, 7 steps; then ddim, 4 steps, length 5
    table = SlotTable(SCHEDULE, L)
    table.run([first])
    for _ in range(3):
        table.step(denoise)
    assert seen[-1][1].abs().sum() > 0  # the slot now holds a nonzero x0_hat
    slot = first.slot
    table.release([first])
    table.run([second])
    assert second.slot == slot
    seen.clear()
    while table.running:
        table.step(denoise)
    assert torch.equal(seen[0][0], torch.zeros(1, L, D, dtype=torch.float64))
    real = (torch.arange(L) < second.length)[None, :, None]
    torch.testing.assert_close(seen[1][0], seen[0][1] * real, rtol=0, atol=0)
    torch.testing.assert_close(second.latent, alone(make(2)), rtol=1e-12, atol=1e-12)


def test_samples_admitted_without_run_wait_while_the_running_ones_step_on_even_when_the_table_grew() -> None:
    """Two samples run a step; nine more are admitted (11 > 8 slots: the table doubles) but not run, so the next
    step moves only the first two; once run, every sample ends at its alone latent."""
    running, waiting = [make(i) for i in (4, 5)], [make(i) for i in range(9)]
    table = SlotTable(SCHEDULE, L)
    table.run(running)
    table.step(context)
    table.admit(waiting)
    assert table.capacity == 16 and table.running == 2
    table.step(context)
    assert [s.step for s in running] == [2, 2] and [s.step for s in waiting] == [0] * 9
    everyone = running + waiting
    while table.running or not all(s.done for s in everyone):
        table.run([s for s in everyone if not s.done])
        table.step(context)
    for i, sample in zip((4, 5, *range(9)), everyone):
        torch.testing.assert_close(sample.latent, alone(make(i)), rtol=1e-12, atol=1e-12, msg=f"sample {i}")


def half_sample(times: Tensor) -> SampleState:
    prior = torch.randn(L, D, generator=torch.Generator().manual_seed(7)).half()
    return SampleState(get_sampler("dpm3m-psc-unic"), times, NoiseStream(3, (L, D)), prior)


def test_a_float64_grid_steps_a_float16_sample_at_the_grid_as_the_sample_converts_it() -> None:
    """0.5 + 2^-12 + 2^-41 rounds to 0.5 through float32 (a tie, to even) but to 0.5 + 2^-11 directly. Tensor.to,
    which gives the sample's coefficients their times and the engine's grids their dtype, goes through float32: the
    denoiser must be handed that same 0.5, and the sample must end where the same grid converted beforehand does."""
    times = torch.tensor([1.0, 0.5 + 2**-12 + 2**-41, 0.3, 0.1, 0.02], dtype=torch.float64)
    converted = times.to(torch.float16)
    assert converted[1].item() == 0.5 and torch.from_numpy(times.numpy().astype("float16"))[1].item() == 0.5 + 2**-11
    handed: list[Tensor] = []

    def denoise(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
        handed.append(t.clone())
        return context(x_t, t, x0_prev, mask)

    latents = []
    for grid in (times, converted):
        table, sample = SlotTable(SCHEDULE, L), half_sample(grid)
        table.run([sample])
        while table.running:
            table.step(denoise)
        latents.append(sample.latent)
    assert torch.equal(torch.cat(handed[:4]), converted[:-1]) and torch.equal(torch.cat(handed[4:]), converted[:-1])
    torch.testing.assert_close(latents[0], latents[1], rtol=0, atol=0)
