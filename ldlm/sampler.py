"""Sampler math: the tangent schedule, its time grids and the two first-order steps. Pure functions.

The solvers that use them (first order and multistep), and the sampling loop, are in ldlm/solvers.py.

Forward process (variance preserving):   x_t = alpha_t x0 + sigma_t eps,  alpha_t^2 + sigma_t^2 = 1
Tangent schedule (d = 3):                 alpha_t = (1 + d^2 tan^2(pi t / 2))^(-1/2)
As an SDE dx = -1/2 beta(t) x dt + sqrt(beta(t)) dW with beta(t) = -2 d log(alpha_t) / dt:
    beta(t) = pi d^2 u (1 + u^2) / (1 + d^2 u^2),   u = tan(pi t / 2).
beta grows without bound as t -> 1, so (as in the authors' earlier code) it is evaluated at
min(t, beta_clip_t); otherwise the first Euler-Maruyama steps from t = 1 diverge.

Every step takes per-sample times t, t_next of shape (B,), so one batch can hold samples at
different steps, and every random draw is an input tensor, so eager and engine runs can be fed
identical noise.

On a GPU the step loop makes no host round trip: the time grid is moved to the device once,
noise is drawn there by a per-sample device generator, and self-conditioning stays a device
tensor. On CPU the numbers are bitwise those of the host loop (tests/test_sampler_device.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ldlm.config import SAMPLERS  # noqa: F401  (re-exported: the names live with the config)


@dataclass(frozen=True)
class TangentSchedule:
    d: float = 3.0
    beta_clip_t: float = 0.95

    def alpha(self, t: Tensor) -> Tensor:
        u = torch.tan(math.pi * t / 2)
        return torch.rsqrt(1 + self.d**2 * u**2)

    def sigma(self, t: Tensor) -> Tensor:
        return torch.sqrt(1 - self.alpha(t) ** 2)

    def log_snr(self, t: Tensor) -> Tensor:
        """lambda_t = log(alpha_t / sigma_t) = -log(d tan(pi t / 2)); -inf at t = 1 (alpha = 0), exactly.

        Computed in float64 (the multistep coefficients take differences of lambda)."""
        t = t.double()
        lam = -torch.log(self.d * torch.tan(math.pi * t / 2))
        return torch.where(t >= 1, torch.full_like(lam, -math.inf), lam)

    def time_of_log_snr(self, lam: Tensor) -> Tensor:
        """The inverse of ``log_snr``: t = (2 / pi) atan(exp(-lambda) / d)."""
        return 2 / math.pi * torch.atan(torch.exp(-lam.double()) / self.d)

    def beta(self, t: Tensor) -> Tensor:
        u = torch.tan(math.pi * t.clamp(max=self.beta_clip_t) / 2)
        return math.pi * self.d**2 * u * (1 + u**2) / (1 + self.d**2 * u**2)


GRIDS: tuple[str, ...] = ("uniform", "power", "logsnr")
POWER_GRID_EXPONENT = 1.5  # the "power" grid's rho: measured best of 0.7, 1, 1.5, 2 (docs/measurements/solvers-*.json)
LOGSNR_GRID_T_MAX = 0.999  # the "logsnr" grid's first point after t = 1: lambda(1) = -inf cannot be spaced uniformly


def time_grid(steps: int, t_min: float, kind: str = "uniform", schedule: TangentSchedule | None = None) -> Tensor:
    """steps + 1 times from 1 down to t_min (float64 so the grid is exact across devices).

    - ``uniform``: uniform in t (the authors' grid);
    - ``power``: t = t_min + (1 - t_min) (1 - u)^rho for u uniform in [0, 1], rho = 1.5: steps shrink
      toward t_min, where x0_hat changes fastest;
    - ``logsnr``: 1, then uniform in lambda = log(alpha / sigma) from t = 0.999 to t_min (DPM-Solver's
      grid, clipped at the top because lambda(1) = -inf); needs ``schedule``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is invalid; allowed: an integer >= 1")
    if not 0.0 < t_min < 1.0:
        raise ValueError(f"t_min={t_min!r} is invalid; allowed: (0, 1)")
    if kind == "uniform":
        return torch.linspace(1.0, t_min, steps + 1, dtype=torch.float64)
    if kind == "power":
        u = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float64)
        grid = t_min + (1 - t_min) * (1 - u) ** POWER_GRID_EXPONENT
        grid[-1] = t_min  # exact end, whatever the rounding
        return grid
    if kind == "logsnr":
        if schedule is None:
            raise ValueError("the logsnr grid needs the schedule; pass schedule=")
        top = max(LOGSNR_GRID_T_MAX, t_min)
        ends = schedule.log_snr(torch.tensor([top, t_min], dtype=torch.float64))
        interior = schedule.time_of_log_snr(torch.linspace(float(ends[0]), float(ends[1]), steps, dtype=torch.float64))
        interior[-1] = t_min
        return torch.cat([torch.ones(1, dtype=torch.float64), interior])
    raise ValueError(f"grid={kind!r} is unknown; allowed: {', '.join(GRIDS)}")


def forward_noise(schedule: TangentSchedule, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """The forward process at per-sample times t (B,): x_t = alpha_t x0 + sigma_t eps."""
    return _bcast(schedule.alpha(t)) * x0 + _bcast(schedule.sigma(t)) * noise


def predicted_noise(schedule: TangentSchedule, x_t: Tensor, x0_hat: Tensor, t: Tensor) -> Tensor:
    """eps_hat = (x_t - alpha_t x0_hat) / sigma_t."""
    return (x_t - _bcast(schedule.alpha(t)) * x0_hat) / _bcast(schedule.sigma(t))


def sde_step(schedule: TangentSchedule, x_t: Tensor, x0_hat: Tensor, t: Tensor, t_next: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
    """One Euler-Maruyama step of the reverse SDE from t to t_next < t. Returns (x_next, x_mean).

    Reverse SDE:  dx = [-1/2 beta x - beta score] dt + sqrt(beta) dW_bar,  score = -eps_hat / sigma_t.
    With h = t - t_next > 0:
      1. eps_hat = (x_t - alpha_t x0_hat) / sigma_t
      2. x_mean  = x_t + h beta (x_t / 2 - eps_hat / sigma_t)
      3. x_next  = x_mean + sqrt(beta h) z,   z = noise ~ N(0, I)
    """
    h = _bcast(t - t_next)
    beta = _bcast(schedule.beta(t))
    eps_hat = predicted_noise(schedule, x_t, x0_hat, t)
    x_mean = x_t + h * beta * (x_t / 2 - eps_hat / _bcast(schedule.sigma(t)))
    return x_mean + torch.sqrt(beta * h) * noise, x_mean


def ddim_step(schedule: TangentSchedule, x_t: Tensor, x0_hat: Tensor, t: Tensor, t_next: Tensor) -> Tensor:
    """Deterministic DDIM step (the probability-flow ODE's exponential-integrator form):
    x_next = alpha_{t_next} x0_hat + sigma_{t_next} eps_hat."""
    eps_hat = predicted_noise(schedule, x_t, x0_hat, t)
    return _bcast(schedule.alpha(t_next)) * x0_hat + _bcast(schedule.sigma(t_next)) * eps_hat


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device`` without a host sync: through pinned memory on CUDA (a
    pageable copy would wait for the GPU to drain)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _bcast(per_sample: Tensor) -> Tensor:
    return per_sample[:, None, None]  # (B,) -> (B, 1, 1)


class NoiseStream:
    """The noise of one sample: its prior x_1, then one draw per step, all from its own seed.

    One stream per sample makes a sample's noise independent of the batch it runs in, so
    static batches, continuous batches and single runs all see the same numbers. The stream draws
    on ``device`` (no host-to-device copy per step); a CUDA generator gives other numbers than the
    CPU one for the same seed, so runs that must share noise across devices draw on the CPU.
    """

    def __init__(self, seed: int, shape: tuple[int, ...], device: str | torch.device = "cpu") -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def draw(self) -> Tensor:
        return torch.randn(self.shape, generator=self.generator, device=self.device)


def sample_seeds(seed: int, n: int) -> list[int]:
    """n independent per-sample seeds derived from one user seed."""
    if not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed={seed!r} is invalid; allowed: an integer in [0, 2**63)")
    states = np.random.SeedSequence(seed).generate_state(n, dtype=np.uint64)
    return [int(s) >> 1 for s in states]
