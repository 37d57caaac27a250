"""Sampler math: the tangent schedule and two reverse-time solvers. Pure functions, no per-run state.

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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

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

    def beta(self, t: Tensor) -> Tensor:
        u = torch.tan(math.pi * t.clamp(max=self.beta_clip_t) / 2)
        return math.pi * self.d**2 * u * (1 + u**2) / (1 + self.d**2 * u**2)


def time_grid(steps: int, t_min: float) -> Tensor:
    """steps + 1 times from 1 down to t_min (float64 so the grid is exact across devices)."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is invalid; allowed: an integer >= 1")
    if not 0.0 < t_min < 1.0:
        raise ValueError(f"t_min={t_min!r} is invalid; allowed: (0, 1)")
    return torch.linspace(1.0, t_min, steps + 1, dtype=torch.float64)


def forward_noise(schedule: TangentSchedule, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """The forward process at per-sample times t (B,): x_t = alpha_t x0 + sigma_t eps."""
    return _bcast(schedule.alpha(t)) * x0 + _bcast(schedule.sigma(t)) * noise


def predicted_noise(schedule: TangentSchedule, x_t: Tensor, x0_hat: Tensor, t: Tensor) -> Tensor:
    """eps_hat = (x_t - alpha_t x0_hat) / sigma_t."""
    return (x_t - _bcast(schedule.alpha(t)) * x0_hat) / _bcast(schedule.sigma(t))


def sde_step(
    schedule: TangentSchedule, x_t: Tensor, x0_hat: Tensor, t: Tensor, t_next: Tensor, noise: Tensor
) -> tuple[Tensor, Tensor]:
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


DenoiseFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x_t, t, x0_prev) -> x0_hat


def run_sampler(
    denoise: DenoiseFn,
    prior: Tensor,
    draw_noise: Callable[[], Tensor],
    grid: Tensor,
    schedule: TangentSchedule,
    sampler: str = "sde",
    decode_final: str = "mean",
    progress: bool = False,
) -> Tensor:
    """Integrate from the prior x_1 (B, N, D) along ``grid`` and return the latent to decode.

    1. x0_prev = 0 (self-conditioning starts empty)
    2. for each (t, t_next) in the grid: x0_hat = denoise(x_t, t, x0_prev), then one solver step,
       then x0_prev = x0_hat
    3. return the last mean x (``decode_final="mean"``) or the last x0_hat (``"x0"``)
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r} is unknown; allowed: {', '.join(SAMPLERS)}")
    b = prior.shape[0]
    x = x_mean = prior
    x0_hat = torch.zeros_like(prior)
    times = to_device(grid.to(prior.dtype), prior.device)  # once: indexing it later needs no copy
    for i in tqdm(range(len(grid) - 1), desc="denoising", unit="step", disable=not progress):
        t = times[i].expand(b)
        t_next = times[i + 1].expand(b)
        x0_hat = denoise(x, t, x0_hat)
        if sampler == "sde":
            x, x_mean = sde_step(schedule, x, x0_hat, t, t_next, draw_noise())
        else:
            x = x_mean = ddim_step(schedule, x, x0_hat, t, t_next)
    return x_mean if decode_final == "mean" else x0_hat
