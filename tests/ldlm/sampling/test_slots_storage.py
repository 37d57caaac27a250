"""The slot table's storage as it grows: samples of every sampler, with and without a prompt (inpainted, guided),
watched or not, of different lengths and step counts, arrive while others are mid-run, so the table grows 8 -> 16
-> 32 slots under them and later samples take freed slots; each sample's latent and preview steps are those of the
same sample run alone. Also the storage's own shape (one spare row past the capacity), device and dtypes, a table
before anything runs, a first sample of one step, and the slot index a fused step is handed while the running set
holds."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from ldlm.model.config import preset
from ldlm.sampling import GenerateRequest, SampleState, resolve
from ldlm.sampling.loop import fused_step
from ldlm.sampling.noise import NoiseStream
from ldlm.sampling.samplers import Sampler, get_sampler
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.slots import SlotTable
from ldlm.sampling.step import SlotStep
from tests.ldlm.sampling.test_slots_step import context

CONFIG = preset("tiny")
SCHEDULE = TangentSchedule()
L, D = 8, 4
NAMES = ("ddim", "dpm2m", "sde", "dpm3m-psc", "dpm3m-psc-unic")
# Arrivals by step: 6, then 7 more (13 > 8 slots: 16), then 13 more (26 > 16: 32), none finished before the last
# growth (every sample takes at least 4 steps); the last 4 arrive once some have left and take their slots.
ARRIVALS = {0: range(0, 6), 1: range(6, 13), 3: range(13, 26), 6: range(26, 30)}


def make(i: int, dtype: torch.dtype) -> SampleState:
    """Sample i, from its own seeds: sampler NAMES[i % 5], length 3..8, 4..7 steps, watched every i % 4 steps; every
    third has a prompt of 2 to inpaint, every other one of those guided (strength 2 after the prompt)."""
    method, length, steps = get_sampler(NAMES[i % 5]), 3 + (3 * i) % 6, 4 + i % 4
    times = resolve(GenerateRequest(1, length, steps, 0, method.name), CONFIG).times(SCHEDULE).to(dtype)
    prior = torch.randn(length, D, generator=torch.Generator().manual_seed(1000 + i)).to(dtype)
    prefix = prefix_noise = guidance = None
    if i % 3 == 1:
        prefix = torch.randn(2, D, generator=torch.Generator().manual_seed(2000 + i)).to(dtype)
        prefix_noise = NoiseStream(3000 + i, (2, D))
        if i % 2 == 0:
            guidance = torch.tensor([1.0, 1.0] + [2.0] * (length - 2))[:, None]
    return SampleState(method, times, NoiseStream(i, (length, D)), prior, prefix, prefix_noise, guidance, watch=i % 4)


def expected_storage(capacity: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each state tensor's shape and dtype: a row per slot and one spare (the scratch slot); the past holds the two
    x0_hat and log-SNR dpm3m reads, its log-SNR in float64."""
    rows = capacity + 1
    storage = {n: ((rows, L, D), dtype) for n in ("x", "x_mean", "x0_hat", "x0_prev", "x_prev", "prefix")}
    storage["past_x0"] = ((rows, 2, L, D), dtype)
    storage["past_lam"] = ((rows, 2), torch.float64)
    storage["mask"] = storage["prefix_mask"] = ((rows, L), torch.bool)
    storage["guidance"] = ((rows, L, 1), dtype)
    return storage


def alone(i: int, dtype: torch.dtype) -> tuple[Tensor, list[int]]:
    """Sample i run in a table of its own: its latent and the steps at which it was due for a preview."""
    table, sample = SlotTable(SCHEDULE, L), make(i, dtype)
    table.run([sample])
    due = []
    while table.running:
        due += [s.step for s in table.due()]
        table.step(context)
    assert sample.latent is not None
    return sample.latent, due


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_samples_of_every_kind_get_their_alone_latents_while_the_table_grows_under_them(dtype: torch.dtype) -> None:
    table, samples, due = SlotTable(SCHEDULE, L), [], {}
    seen = []  # (capacity, storage) whenever the capacity changed
    for k in itertools.count():
        samples += [make(i, dtype) for i in ARRIVALS.get(k, ())]
        running = [s for s in samples if not s.done]
        if not running:
            break
        table.run(running)
        if not seen or seen[-1][0] != table.capacity:
            seen.append((table.capacity, {n: (tuple(t.shape), t.dtype) for n, t in table.state.items()}))
        for s in table.due():
            due.setdefault(samples.index(s), []).append(s.step)
        table.step(context)
    assert [c for c, _ in seen] == [8, 16, 32]
    for capacity, storage in seen:
        assert storage == expected_storage(capacity, dtype)
    for i, sample in enumerate(samples):
        latent, alone_due = alone(i, dtype)
        assert sample.latent is not None and sample.latent.shape == (3 + (3 * i) % 6, D)
        torch.testing.assert_close(sample.latent, latent, rtol=1e-6, atol=1e-6, msg=f"sample {i}")
        watch = i % 4
        assert due.get(i, []) == alone_due == (list(range(0, sample.steps, watch)) if watch else []), f"sample {i}"


def test_a_table_before_any_sample_runs_nothing() -> None:
    """Nothing admitted: no running sample, none due, and a step (fused or not) is refused with the reason."""
    table = SlotTable(SCHEDULE, L)
    assert table.running == 0 and table.capacity == 0
    assert table.due() == []
    with pytest.raises(ValueError, match="no sample is running in this table"):
        table.step(context)
    with pytest.raises(ValueError, match="no sample is running in this table"):
        table.fusable()
    table.run([])
    assert table.running == 0 and table.due() == []


def test_the_state_is_allocated_on_the_table_s_device_and_again_when_it_grows() -> None:
    """A table on the meta device (placement without data): the first admission allocates its state there, and so
    does the growth that 9 samples make (8 -> 16 slots)."""
    samples = [make(15 * i, torch.float32) for i in range(9)]  # plain ddim samples, their priors on the host
    table = SlotTable(SCHEDULE, L, "meta")
    for count, capacity in ((3, 8), (9, 16)):
        table.run(samples[:count])
        assert table.capacity == capacity
        assert {n: t.device.type for n, t in table.state.items()} == dict.fromkeys(expected_storage(8, torch.float32), "meta")
        assert table.rows("x", samples[:count]).device.type == "meta"


def ddim(steps: int, seed: int) -> tuple[SampleState, Tensor]:
    """A float64 DDIM sample of ``steps`` steps and where a constant denoiser takes it: DDIM telescopes to
    x(t_min) = alpha(t_min) C + sigma(t_min) (x_1 - alpha(1) C) / sigma(1)."""
    times = resolve(GenerateRequest(1, L, steps, 0, "ddim"), CONFIG).times(SCHEDULE).double()
    prior = torch.randn(L, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    t1, t_min = times[:1], times[-1:]
    end = SCHEDULE.alpha(t_min) * CONST + SCHEDULE.sigma(t_min) * (prior - SCHEDULE.alpha(t1) * CONST) / SCHEDULE.sigma(t1)
    return SampleState(get_sampler("ddim"), times, NoiseStream(seed, (L, D)), prior), end


CONST = torch.linspace(-1.0, 1.0, L * D, dtype=torch.float64).reshape(L, D)


def test_a_one_step_sample_first_in_its_table_then_a_longer_one_land_at_ddim_s_closed_form() -> None:
    """The first sample's grid has two times (one step); a 3-step sample admitted after it widens the table's grids."""
    table = SlotTable(SCHEDULE, L)
    for steps, seed in ((1, 3), (3, 4)):
        sample, end = ddim(steps, seed)
        table.run([sample])
        while table.running:
            table.step(lambda x_t, t, x0_prev, mask: CONST.expand_as(x_t).clone())
        assert sample.final_step == steps
        torch.testing.assert_close(sample.latent, end, rtol=1e-9, atol=1e-9)


def test_a_fused_step_is_handed_the_same_slot_index_while_the_running_set_holds() -> None:
    """A fused step copies the slot index into its static buffers only when it is handed a new one, so the table
    hands the same index while the same samples run (a scheduler calls run before every step) and a new one, of
    the new set's slots, once a sample leaves."""
    samples = [make(15 * i, torch.float32) for i in range(3)]
    handed: list[SlotStep] = []
    step = fused_step(context)

    def keeping(sampler: Sampler, schedule: TangentSchedule, rows: SlotStep) -> None:
        handed.append(rows)
        step(sampler, schedule, rows)

    table = SlotTable(SCHEDULE, L)
    for running in (samples, samples, samples, samples[:2]):
        table.run(list(running))
        table.step_fused(keeping)
    first = handed[0]
    assert first.slots_host.tolist() == [s.slot for s in samples]
    assert all(h.slots_host is first.slots_host and h.slots is first.slots for h in handed[1:3])
    assert handed[3].slots_host is not first.slots_host
    assert handed[3].slots_host.tolist() == handed[3].slots.tolist() == [s.slot for s in samples[:2]]
