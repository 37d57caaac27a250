"""scripts/research/solver_coefficients.py's ScaledSampler, the sampler its search varies: with every multiplier at 1
it is dpm3m-psc-unic exactly, and with every multiplier at 0 it is DDIM (against a denoiser that ignores
the self-conditioning input, the only other thing that sampler changes), so the search starts from the
shipped sampler and its numbers mean what they say."""

from __future__ import annotations

from types import ModuleType

import torch

from ldlm.model.config import preset
from ldlm.sampling import SamplingEngine, run_lockstep
from ldlm.sampling.noise import NoiseStream
from ldlm.sampling.samplers import Sampler, get_sampler
from ldlm.sampling.schedule import TangentSchedule, power_grid
from tests import REPO, import_script

MU, S = 0.3, 0.5
CONFIG = preset("tiny")
GRID = tuple(power_grid(6, CONFIG.t_min, 2.0).tolist())


def load_script() -> ModuleType:
    return import_script(REPO / "scripts" / "research" / "solver_coefficients.py")


def run(sampler: Sampler, schedule: TangentSchedule) -> torch.Tensor:
    """Two samples of 8 x 4 along GRID, the denoiser the ideal one for data N(MU, S^2 I) (x0_prev unused)."""

    def denoise(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
        a, sg = schedule.alpha(t)[:, None, None], schedule.sigma(t)[:, None, None]
        return (MU + a * S**2 * (x_t - a * MU) / (a**2 * S**2 + sg**2)).to(x_t.dtype)

    engine = SamplingEngine(schedule)
    times = torch.tensor(GRID, dtype=torch.float64)
    states = [engine.state(sampler, times, NoiseStream(seed, (8, 4)), NoiseStream(seed, (8, 4)).draw().double()) for seed in (1, 2)]
    return run_lockstep(engine, states, denoise)


def test_the_scaled_sampler_is_the_shipped_one_at_one_and_ddim_at_zero() -> None:
    script = load_script()
    schedule = TangentSchedule(CONFIG.schedule_d, CONFIG.beta_clip_t)
    base = get_sampler("dpm3m-psc-unic")

    def scaled(value: float):  # type: ignore[no-untyped-def]
        return script.ScaledSampler(**{**vars(base), "times": GRID, "k": (value,) * 6, "c": (value,) * 6})

    shipped, ddim = run(base, schedule), run(get_sampler("ddim"), schedule)
    torch.testing.assert_close(run(scaled(1.0), schedule), shipped, rtol=0, atol=1e-12)
    torch.testing.assert_close(run(scaled(0.0), schedule), ddim, rtol=0, atol=1e-12)
    assert (shipped - ddim).abs().max() > 1e-3  # the two differ, so each comparison can fail
    halfway = run(scaled(0.5), schedule)
    assert (halfway - shipped).abs().max() > 1e-4 and (halfway - ddim).abs().max() > 1e-4  # the multipliers act
