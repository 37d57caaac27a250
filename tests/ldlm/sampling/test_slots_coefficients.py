"""The coefficients the slot table tabulates for a sample's every step at admission, against the same steps computed
on the spot (a sampler that redefines ``step`` computes them each step from its times and the past it pushed):
over a grid whose first time is below 1, where a step's missing past (NaN) and a past at t = 1 (-inf) are no longer
alike, and for a grid handed in another precision than the table's, whose steps run at the times as the table holds
them."""

from __future__ import annotations

import pytest
import torch

from ldlm.sampling import SampleState
from ldlm.sampling.noise import NoiseStream
from ldlm.sampling.samplers import Sampler, get_sampler
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.slots import SlotTable
from tests.ldlm.sampling.test_slots import OnTheSpot  # the reference that computes its coefficients every step

SCHEDULE = TangentSchedule()
L, D = 6, 4


def context(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
    """A denoiser whose answer moves with its inputs, so each step's x0_hat differs from the last."""
    mean = x_t.mean(1, keepdim=True)
    return torch.tanh(0.7 * x_t + 0.9 * mean + 0.3 * x0_prev + t[:, None, None])


def latent(sampler: Sampler, times: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    prior = torch.randn(L, D, generator=torch.Generator().manual_seed(11)).to(dtype)
    one = SampleState(sampler, times, NoiseStream(1, (L, D)), prior)
    table = SlotTable(SCHEDULE, L)
    table.run([one])
    while table.running:
        table.step(context)
    assert one.latent is not None
    return one.latent


@pytest.mark.parametrize("name", ["dpm3m", "dpm3m-psc", "dpm3m-psc-unic"])
def test_a_grid_starting_below_t_1_steps_as_its_coefficients_computed_on_the_spot(name: str) -> None:
    """From t = 0.9 the first log-SNR is finite: the second step has one past step, not two, so it must stay at
    second order (a third-order step would divide by lambda_1 - lambda_2 = 0 against an x0_hat never given)."""
    times = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.1], dtype=torch.float64)
    tabulated = get_sampler(name)
    assert tabulated.tabulated
    reference = latent(OnTheSpot(**vars(tabulated)), times, torch.float64)
    assert reference.isfinite().all()
    torch.testing.assert_close(latent(tabulated, times, torch.float64), reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["ddim", "dpm3m-psc-unic"])
def test_a_grid_in_float64_steps_a_float32_sample_as_the_grid_rounded_to_float32(name: str) -> None:
    """The table holds a float32 sample's times in float32 and steps at those; its coefficients must come from the
    same rounded times, or they no longer match the t the denoiser and the update are given."""
    times = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.12, 0.031], dtype=torch.float64)
    assert not torch.equal(times.float().double(), times)  # rounding moves these times
    sampler = get_sampler(name)
    given = latent(sampler, times, torch.float32)
    torch.testing.assert_close(given, latent(sampler, times.float(), torch.float32), rtol=0, atol=0)
