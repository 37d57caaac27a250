"""Sampler math: the schedule's identities, and both solvers against an exact Gaussian oracle."""

from __future__ import annotations

import math

import pytest
import torch

from ldlm.sampling import NoiseStream, run_sampler, sample_seeds
from ldlm.sampling.samplers import ddim_step
from ldlm.sampling.schedule import TangentSchedule, time_grid

SCHEDULE = TangentSchedule(d=3.0, beta_clip_t=0.95)
F64 = torch.float64


def test_schedule_is_variance_preserving_with_the_right_ends() -> None:
    t = torch.linspace(0, 1, 101, dtype=F64)
    alpha, sigma = SCHEDULE.alpha(t), SCHEDULE.sigma(t)
    torch.testing.assert_close(alpha**2 + sigma**2, torch.ones_like(t))
    assert alpha[0] == 1 and alpha[-1] < 1e-15  # alpha_0 = 1, alpha_1 = 0
    assert (alpha[1:] < alpha[:-1]).all()
    # alpha_t = (1 + d^2 tan^2(pi t / 2))^(-1/2) at t = 0.5: tan = 1
    assert SCHEDULE.alpha(torch.tensor(0.5, dtype=F64)).item() == pytest.approx(1 / math.sqrt(10))


def test_beta_is_minus_two_dlog_alpha_dt_below_the_clip() -> None:
    t = torch.linspace(0.05, 0.9, 18, dtype=F64)
    h = 1e-6
    numeric = -2 * (torch.log(SCHEDULE.alpha(t + h)) - torch.log(SCHEDULE.alpha(t - h))) / (2 * h)
    torch.testing.assert_close(SCHEDULE.beta(t), numeric, rtol=1e-6, atol=1e-9)
    above = torch.tensor([0.97, 1.0], dtype=F64)
    torch.testing.assert_close(SCHEDULE.beta(above), SCHEDULE.beta(torch.tensor([0.95, 0.95], dtype=F64)))


def test_time_grid_and_bad_steps() -> None:
    grid = time_grid(4, 0.2)
    torch.testing.assert_close(grid, torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2], dtype=F64))
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"steps={bad}"):
            time_grid(bad, 0.05)
    with pytest.raises(ValueError, match="t_min=1.0"):
        time_grid(5, 1.0)


def test_ddim_step_is_exact_given_the_true_x0() -> None:
    x0 = torch.randn(2, 3, 4, dtype=F64)
    eps = torch.randn(2, 3, 4, dtype=F64)
    t, t_next = torch.tensor([0.9, 0.5], dtype=F64), torch.tensor([0.7, 0.3], dtype=F64)
    x_t = SCHEDULE.alpha(t)[:, None, None] * x0 + SCHEDULE.sigma(t)[:, None, None] * eps
    x_next = ddim_step(SCHEDULE, x_t, x0, t, t_next)
    expected = SCHEDULE.alpha(t_next)[:, None, None] * x0 + SCHEDULE.sigma(t_next)[:, None, None] * eps
    torch.testing.assert_close(x_next, expected)


@pytest.mark.parametrize("sampler", ["sde", "ddim"])
def test_solvers_reach_the_data_distribution_of_a_gaussian(sampler: str) -> None:
    """For x0 ~ N(0, s^2) the exact denoiser is E[x0 | x_t] = alpha s^2 x_t / (alpha^2 s^2 + sigma^2).
    Driven by it, both solvers must end at the marginal N(0, alpha^2 s^2 + sigma^2) at t_min."""
    s, t_min, steps = 0.5, 0.05, 200

    def exact_denoiser(x_t, t, x0_prev):
        a, sg = SCHEDULE.alpha(t)[:, None, None], SCHEDULE.sigma(t)[:, None, None]
        return a * s**2 * x_t / (a**2 * s**2 + sg**2)

    gen = torch.Generator().manual_seed(0)
    prior = torch.randn(4, 2000, 4, generator=gen, dtype=F64)
    x = run_sampler(
        exact_denoiser,
        prior,
        lambda: torch.randn(4, 2000, 4, generator=gen, dtype=F64),
        time_grid(steps, t_min),
        SCHEDULE,
        sampler,
        decode_final="mean",
    )
    t = torch.tensor(t_min, dtype=F64)
    expected_std = math.sqrt(SCHEDULE.alpha(t) ** 2 * s**2 + SCHEDULE.sigma(t) ** 2)
    assert x.std().item() == pytest.approx(expected_std, rel=0.015)
    wrong_std = math.sqrt(SCHEDULE.alpha(t) ** 2 * 1.0 + SCHEDULE.sigma(t) ** 2)  # the prior's scale
    assert abs(x.std().item() - wrong_std) > 0.1


def test_unknown_sampler_is_named() -> None:
    with pytest.raises(ValueError, match="sampler='euler'"):
        run_sampler(lambda x, t, p: x, torch.zeros(1, 2, 2), lambda: torch.zeros(1, 2, 2), time_grid(2, 0.1), SCHEDULE, "euler")


def test_noise_streams_are_per_sample_and_seeded() -> None:
    a, b = NoiseStream(7, (2, 3)), NoiseStream(7, (2, 3))
    torch.testing.assert_close(a.draw(), b.draw())
    assert not torch.equal(a.draw(), NoiseStream(8, (2, 3)).draw())
    seeds = sample_seeds(0, 4)
    assert len(set(seeds)) == 4 and sample_seeds(0, 2) == seeds[:2]
    with pytest.raises(ValueError, match="seed=-1"):
        sample_seeds(-1, 2)
