"""The noise schedule: the tangent schedule, its log-SNR, the time grids and the forward process.

Pure functions of t; the samplers that step along a grid are in ``ldlm.sampling.samplers``, the loop that
runs them in ``ldlm.sampling.loop``.

Forward process (variance preserving):   x_t = alpha_t x0 + sigma_t eps,  alpha_t^2 + sigma_t^2 = 1
Tangent schedule (d = 3):                 alpha_t = (1 + d^2 tan^2(pi t / 2))^(-1/2)
As an SDE dx = -1/2 beta(t) x dt + sqrt(beta(t)) dW with beta(t) = -2 d log(alpha_t) / dt:
    beta(t) = pi d^2 u (1 + u^2) / (1 + d^2 u^2),   u = tan(pi t / 2).
beta grows without bound as t -> 1, so (as in the authors' earlier code) it is evaluated at
min(t, beta_clip_t); otherwise the first Euler-Maruyama steps from t = 1 diverge.

Every function takes per-sample times t of shape (B,), so one batch can hold samples at different
steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ldlm.model.config import GRIDS


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
        return power_grid(steps, t_min, POWER_GRID_EXPONENT)
    if kind == "logsnr":
        if schedule is None:
            raise ValueError("the logsnr grid needs the schedule; pass schedule=")
        top = max(LOGSNR_GRID_T_MAX, t_min)
        ends = schedule.log_snr(torch.tensor([top, t_min], dtype=torch.float64))
        interior = schedule.time_of_log_snr(torch.linspace(float(ends[0]), float(ends[1]), steps, dtype=torch.float64))
        interior[-1] = t_min
        return torch.cat([torch.ones(1, dtype=torch.float64), interior])
    raise ValueError(f"grid={kind!r} is unknown; allowed: {', '.join(GRIDS)}")


def power_grid(steps: int, t_min: float, exponent: float) -> Tensor:
    """t = t_min + (1 - t_min) (1 - u)^exponent for u uniform in [0, 1]: steps + 1 times, 1 to t_min."""
    u = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float64)
    grid = t_min + (1 - t_min) * (1 - u) ** exponent
    grid[-1] = t_min  # exact end, whatever the rounding
    return grid


def forward_noise(schedule: TangentSchedule, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """The forward process at per-sample times t (B,): x_t = alpha_t x0 + sigma_t eps."""
    return per_sample(schedule.alpha(t)) * x0 + per_sample(schedule.sigma(t)) * noise


def predicted_noise(schedule: TangentSchedule, x_t: Tensor, x0_hat: Tensor, t: Tensor) -> Tensor:
    """eps_hat = (x_t - alpha_t x0_hat) / sigma_t."""
    return (x_t - per_sample(schedule.alpha(t)) * x0_hat) / per_sample(schedule.sigma(t))


def per_sample(values: Tensor) -> Tensor:
    """(B,) -> (B, 1, 1): one value per sample, broadcast over its (L, D) positions (one view, not two indexings)."""
    return values.view(-1, 1, 1)
