"""The prior temperature tau (x_1 ~ N(0, tau^2 I)) against closed forms: one DDIM step from t = 1, and the
exact probability-flow ODE of Gaussian data, whose map from x_1 to x_t is affine; then where tau comes
from (the request, else the config, else 1), the refusals, and the tuned grids it binds."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from ldlm.model.config import LDLMConfig, preset
from ldlm.sampling import GenerateRequest, NoiseStream, SamplingEngine, resolve, run_lockstep, sample_seeds
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.tuned_grids import ScheduleError, TunedGrid, TunedSchedules

SCHEDULE = TangentSchedule(3.0, 0.95)
CONFIG = preset("tiny")
MU, S = 0.3, 0.5  # the Gaussian data: every coordinate ~ N(MU, S^2)


def priors(seed: int, n: int, length: int, d: int) -> torch.Tensor:
    """The engine's unit-variance prior draws, from each sample's own stream."""
    return torch.stack([NoiseStream(s, (length, d)).draw() for s in sample_seeds(seed, n)])


def run(request: GenerateRequest, denoise, config: LDLMConfig = CONFIG) -> torch.Tensor:
    plan = resolve(request, config)
    engine = SamplingEngine(SCHEDULE)
    return run_lockstep(engine, engine.start(plan, config.d_model), denoise)


@pytest.mark.parametrize("tau", [1.0, 0.6, 0.25])
def test_one_ddim_step_from_t1_scales_the_priors_part_by_tau(tau: float) -> None:
    """At t = 1, alpha = 0 and sigma = 1: one DDIM step to t_min from x_1 = tau eps gives
    alpha(t_min) D + sigma(t_min) tau eps."""
    length, d, t_min = 5, CONFIG.d_model, 0.3
    value = torch.randn(length, d, generator=torch.Generator().manual_seed(1))
    latents = run(GenerateRequest(2, length, 1, 7, "ddim", t_min, prior_temperature=tau), lambda x, t, x0, m: value.expand_as(x).clone())
    alpha = 1 / math.sqrt(1 + 9 * math.tan(math.pi * t_min / 2) ** 2)
    expected = alpha * value + math.sqrt(1 - alpha**2) * tau * priors(7, 2, length, d)
    torch.testing.assert_close(latents, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_the_ode_carries_a_cooler_prior_to_a_narrower_sample(tau: float) -> None:
    """Gaussian data: the exact x0-predictor is E[x0 | x_t], and the probability-flow ODE maps x_1 to
    x_t = alpha_t MU + sqrt(alpha_t^2 S^2 + sigma_t^2) x_1, so x_1 = tau eps ends at alpha MU +
    sqrt(alpha^2 S^2 + sigma^2) tau eps: the sample's spread around the mean is tau times the data's."""
    length, d, t_min = 64, CONFIG.d_model, 0.05

    def oracle(x_t, t, x0_prev, mask):
        a, sg = SCHEDULE.alpha(t.double())[:, None, None], SCHEDULE.sigma(t.double())[:, None, None]
        return (MU + a * S**2 * (x_t.double() - a * MU) / (a**2 * S**2 + sg**2)).to(x_t.dtype)

    latents = run(GenerateRequest(3, length, 200, 11, "dpm3m", t_min, prior_temperature=tau), oracle).double()
    t = torch.tensor(t_min, dtype=torch.float64)
    alpha, sigma = SCHEDULE.alpha(t), SCHEDULE.sigma(t)
    exact = alpha * MU + torch.sqrt(alpha**2 * S**2 + sigma**2) * tau * priors(11, 3, length, d).double()
    assert ((latents - exact).norm() / exact.norm()).item() < 1e-3


def test_tau_comes_from_the_request_else_the_config_else_1() -> None:
    assert resolve(GenerateRequest(1, 4), CONFIG).prior_temperature == 1.0
    cooled = replace(CONFIG, prior_temperature=0.6)
    assert resolve(GenerateRequest(1, 4), cooled).prior_temperature == 0.6
    assert resolve(GenerateRequest(1, 4, prior_temperature=0.9), cooled).prior_temperature == 0.9
    assert resolve(GenerateRequest(1, 4, prior_temperature=1), cooled).prior_temperature == 1.0


@pytest.mark.parametrize("tau", [0, 0.0, -0.5, 1.5, math.nan, math.inf, True, "0.5"])
def test_a_bad_tau_is_refused_naming_it(tau: object) -> None:
    with pytest.raises(ValueError, match=r"^PRIOR_TEMPERATURE=.* is out of range; allowed: a number in \(0, 1\]$"):
        resolve(GenerateRequest(1, 4, prior_temperature=tau), CONFIG, names={"prior_temperature": "PRIOR_TEMPERATURE"})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"config field prior_temperature=.* is invalid; allowed: unset \(null, meaning 1\) or a number in \(0, 1\]"
    ):
        replace(CONFIG, prior_temperature=tau)


def test_an_unset_tau_leaves_the_configs_hash_as_it_was() -> None:
    assert "prior_temperature" not in CONFIG.to_dict()
    assert replace(CONFIG, prior_temperature=0.6).to_dict()["prior_temperature"] == 0.6
    assert LDLMConfig.from_json(replace(CONFIG, prior_temperature=0.6).to_json()).prior_temperature == 0.6


def tuned_at(tau: float) -> TunedSchedules:
    times = (1.0, 0.5, 0.2, CONFIG.t_min)
    return TunedSchedules("0" * 64, CONFIG.t_min, (TunedGrid("ddim", 3, times),), {"ddim": 3}, tau)


def test_tuned_grids_run_only_at_the_tau_they_were_tuned_at() -> None:
    schedules = tuned_at(0.6)
    cooled = replace(CONFIG, prior_temperature=0.6)
    plan = resolve(GenerateRequest(1, 4, sampler="ddim"), cooled, schedules=schedules)
    assert (plan.grid, plan.steps, plan.tuned_times) == ("tuned", 3, (1.0, 0.5, 0.2, CONFIG.t_min))
    other = resolve(GenerateRequest(1, 4, sampler="ddim", prior_temperature=1.0), cooled, schedules=schedules)
    # neither the tuned grid nor the step count it made the default: the config's, on the sampler's grid
    assert other.grid != "tuned" and other.tuned_times is None and other.steps == cooled.default_steps
    with pytest.raises(
        ValueError, match=r"^grid='tuned' is unavailable at prior_temperature=1.0: the grids were tuned for prior_temperature=0.6$"
    ):
        resolve(GenerateRequest(1, 4, sampler="ddim", grid="tuned", prior_temperature=1.0), cooled, schedules=schedules)


def test_schedules_json_keeps_tau_and_reads_1_where_it_has_none() -> None:
    text = tuned_at(0.6).to_json()
    assert TunedSchedules.from_json(text).prior_temperature == 0.6
    assert TunedSchedules.from_json(text.replace('"prior_temperature": 0.6,', "")).prior_temperature == 1.0
    for bad in ("0", "1.5", "NaN"):
        with pytest.raises(
            ScheduleError, match=rf"prior_temperature={bad if bad != 'NaN' else 'nan'}.* is invalid; allowed: a number in \(0, 1\]"
        ):
            TunedSchedules.from_json(text.replace('"prior_temperature": 0.6', f'"prior_temperature": {bad}'))
