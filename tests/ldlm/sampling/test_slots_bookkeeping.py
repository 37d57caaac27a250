"""The slot table's bookkeeping against values worked out by hand: which samples are due for a preview (``due``), the
rows a caller reads back (``rows``), freed slots handed to the next samples (``release``), and which state a finished
sample's latent is (``decode_final``, "mean" unless told), checked against DDIM's closed form for a constant denoiser."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ldlm.model.config import preset
from ldlm.sampling import GenerateRequest, SampleState, SamplingEngine, resolve
from ldlm.sampling.noise import NoiseStream
from ldlm.sampling.samplers import get_sampler
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.slots import SlotTable

CONFIG = preset("tiny")
SCHEDULE = TangentSchedule()
D = 4


def ddim_samples(n: int, length: int, steps: int, seed: int = 0) -> list[SampleState]:
    return SamplingEngine(SCHEDULE).start(resolve(GenerateRequest(n, length, steps, seed, "ddim"), CONFIG), D)


def zero(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
    return torch.zeros_like(x_t)


def test_due_names_each_watched_sample_at_every_multiple_of_its_watch_steps() -> None:
    """watch 0 (never), 1, 2 and 3 over 5 steps: after k steps, those whose watch divides k are due (k = 5 is the
    last: the sample has left by then)."""
    samples = [replace(s, watch=w) for s, w in zip(ddim_samples(4, 6, 5), (0, 1, 2, 3))]
    table = SlotTable(SCHEDULE, 8)
    table.run(samples)
    seen = []
    while table.running:
        seen.append(sorted(s.watch for s in table.due()))
        table.step(zero)
    assert seen == [[1, 2, 3], [1], [1, 2], [1, 3], [1, 2]]
    assert all(s.done for s in samples)


def test_due_is_empty_when_no_running_sample_is_watched() -> None:
    watched, unwatched = ddim_samples(1, 6, 5)[0], ddim_samples(1, 6, 5, seed=1)[0]
    table = SlotTable(SCHEDULE, 8)
    table.run([replace(watched, watch=1), unwatched])
    table.run([unwatched])  # the watched one keeps its slot but does not run
    assert table.due() == []


def test_rows_reads_each_named_tensor_back_in_the_order_asked() -> None:
    """After one step, x0_hat is what the denoiser answered at each row's real positions and zero at its padding."""
    long, short = ddim_samples(1, 7, 3)[0], ddim_samples(1, 5, 3, seed=1)[0]
    answered = []

    def denoise(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
        answered.append(torch.tanh(x_t) + 1.0)
        return answered[-1]

    table = SlotTable(SCHEDULE, 8)
    table.run([long, short])
    table.step(denoise)
    real = torch.tensor([[True] * 5 + [False] * 3, [True] * 7 + [False]])  # short first, as asked
    assert torch.equal(table.rows("mask", [short, long]), real)
    expected = answered[0][[1, 0]] * real[..., None]
    torch.testing.assert_close(table.rows("x0_hat", [short, long]), expected, rtol=0, atol=0)
    assert table.rows("x", [long]).shape == (1, 8, D)


def test_released_slots_are_freed_one_release_after_another_and_reused() -> None:
    """A full table of 8: two samples released in two calls leave two free slots, so two new samples take exactly
    those and the table does not grow."""
    samples = ddim_samples(8, 6, 3)
    table = SlotTable(SCHEDULE, 8)
    table.run(samples)
    assert table.capacity == 8
    first, second = samples[2], samples[5]
    freed = {first.slot, second.slot}
    table.release([first])
    table.release([second])
    assert table.owner[first.slot] is None and table.owner[second.slot] is None
    assert first.table is None and second.table is None
    newcomers = ddim_samples(2, 6, 3, seed=9)
    table.run([s for s in samples if s.table is not None] + newcomers)
    assert {s.slot for s in newcomers} == freed
    assert table.capacity == 8
    assert [table.owner[s.slot] for s in newcomers] == newcomers


def constant_ddim() -> tuple[SampleState, torch.Tensor, torch.Tensor]:
    """A DDIM sample in float64 (its closed form then holds to rounding), the x0_hat a constant denoiser gives it,
    and its grid."""
    times = resolve(GenerateRequest(1, 6, 4, 0, "ddim"), CONFIG).times(SCHEDULE).double()
    prior = torch.randn(6, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    const = torch.linspace(-1.0, 1.0, 6 * D, dtype=torch.float64).reshape(6, D)
    return SampleState(get_sampler("ddim"), times, NoiseStream(0, (6, D)), prior), const, times


@pytest.mark.parametrize("decode_final", [None, "mean", "x0"], ids=["default", "mean", "x0"])
def test_a_finished_sample_s_latent_is_its_last_mean_state_or_its_x0_hat(decode_final: str | None) -> None:
    """DDIM with x0_hat constant (D) telescopes: x(t_min) = alpha(t_min) D + sigma(t_min) (x_1 - alpha(1) D) / sigma(1).
    "mean" (the default) decodes that state, "x0" decodes D itself."""
    sample, const, times = constant_ddim()
    table = SlotTable(SCHEDULE, 6) if decode_final is None else SlotTable(SCHEDULE, 6, "cpu", decode_final)  # type: ignore[arg-type]
    assert table.device == torch.device("cpu")
    table.run([sample])
    while table.running:
        table.step(lambda x_t, t, x0_prev, mask: const.expand_as(x_t).clone())
    t1, t_min = times[:1], times[-1:]
    alpha1, sigma1, alpha, sigma = SCHEDULE.alpha(t1), SCHEDULE.sigma(t1), SCHEDULE.alpha(t_min), SCHEDULE.sigma(t_min)
    mean = alpha * const + sigma * (sample.prior - alpha1 * const) / sigma1
    assert not torch.allclose(mean, const, atol=1e-3)  # the two choices are told apart
    expected = const if decode_final == "x0" else mean
    torch.testing.assert_close(sample.latent, expected, rtol=1e-9, atol=1e-9)


def test_due_names_a_sample_watched_every_step_at_each_step_but_its_last() -> None:
    """watch 1 is the only watch in the table: the sample is due after 0, 1 and 2 of its 3 steps."""
    watched, unwatched = replace(ddim_samples(1, 6, 3)[0], watch=1), ddim_samples(1, 6, 3, seed=1)[0]
    table = SlotTable(SCHEDULE, 8)
    table.run([watched, unwatched])
    seen = []
    while table.running:
        seen.append(table.due())
        table.step(zero)
    assert seen == [[watched]] * 3


def test_the_storage_generation_counts_the_reallocations_of_the_state() -> None:
    """Nothing allocated at first (generation 0); 3 samples take the first 8 rows (1); 6 more double them (2); a
    release and a readmission into the freed slot reallocate nothing. Each table has its own serial."""
    table, other = SlotTable(SCHEDULE, 8), SlotTable(SCHEDULE, 8)
    serial = table.storage[0]
    assert table.storage == (serial, 0) and other.storage[0] != serial
    samples = ddim_samples(9, 6, 3)
    table.run(samples[:3])
    assert table.storage == (serial, 1) and table.capacity == 8
    table.run(samples)
    assert table.storage == (serial, 2) and table.capacity == 16
    table.release(samples[:1])
    table.run(samples[1:] + ddim_samples(1, 6, 3, seed=5))
    assert table.storage == (serial, 2)
