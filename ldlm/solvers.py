"""Solvers of the reverse process, one interface for every path that generates.

A solver turns the denoiser's x0_hat at time t into the state at t_next. Each call is batched with
per-sample times (B,), and everything a method remembers of earlier steps (``Past``: the previous
x0_hat and its log-SNR, most recent first) is passed in and handed back, never kept inside, so the
continuous-batching scheduler can hold it per sample and batch samples of different solvers at
different steps into one denoiser call. ``run_sampler`` is the loop for a batch that moves in
lockstep (the pipeline, Triton's ``ldlm_generate``).

Methods (lambda = log(alpha / sigma), h = lambda(t_next) - lambda(t) > 0, ``ddim_step(x, D)`` =
alpha' D + sigma' (x - alpha D) / sigma is the exact solution of the probability-flow ODE if x0_hat
stays D over the step):
- ``sde``: Euler-Maruyama on the reverse SDE (stochastic), ``ddim``: ``ddim_step(x, x0_hat)``.
- ``dpm2m``, ``dpm3m``: DPM-Solver++(2M) and (3M) in data prediction form (Lu et al. 2022,
  "DPM-Solver++", arXiv:2211.01095, Algorithm 2; the 3M form as diffusers'
  ``DPMSolverMultistepScheduler.multistep_dpm_solver_third_order_update``). With m0, m1, m2 the
  current and two previous x0_hat at lambda, lambda_1, lambda_2, r0 = (lambda - lambda_1) / h and
  r1 = (lambda_1 - lambda_2) / h, phi1 = 1 - e^-h:
      x' = ddim_step(x, m0 + c1 D1 + c2 D2)
      2M: D1 = (m0 - m1) / r0,  D2 = 0
      3M: D1_0 = (m0 - m1) / r0,  D1_1 = (m1 - m2) / r1,
          D1 = D1_0 + r0 / (r0 + r1) (D1_0 - D1_1),  D2 = (D1_0 - D1_1) / (r0 + r1)
      c1 = ((e^-h - 1) / h + 1) / phi1  (-> 1/2),   c2 = (1/2 - (e^-h - 1 + h) / h^2) / phi1  (-> 1/6)
  (the paper's eq. with x' = (sigma'/sigma) x + alpha' phi1 (m0 + c1 D1 + c2 D2), written through
  ``ddim_step``, which is the same expression). A step whose needed past is missing, or lies at
  t = 1 where lambda = -inf, falls back to the next lower order, down to DDIM: the first step from
  t = 1 is exactly DDIM.
- ``dpm3m-psc``: dpm3m with predicted self-conditioning. The denoiser's x0_prev input is the last
  x0_hat, so in a few-step run it lags the x0_hat of the current time by a whole step, an error
  of first order in the step that no multistep formula removes (measured: with x0_prev held at
  zero, dpm3m converges at third order; with self-conditioning, at about first). Here x0_prev is
  m0 moved toward lambda(t_next) by 3/4 of the linear extrapolation through m0 and m2 (two steps
  back: extrapolating through m1 amplifies the step-to-step oscillation of the self-conditioning
  feedback and diverged on random weights; 3/4 rather than 1 keeps that feedback damped). As the
  steps shrink it tends to m0, so the limit is the one of today's samplers.

Every sampler ends with the state at t_min (``x_mean``, decoded when ``decode_final="mean"``) and the
last x0_hat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ldlm.config import SAMPLERS
from ldlm.sampler import TangentSchedule, ddim_step, sde_step, time_grid, to_device

Past = Sequence[tuple[Tensor, Tensor]]  # (x0_hat (B, L, D), lambda (B,) float64), most recent first


@dataclass(frozen=True)
class StepResult:
    x: Tensor  # the state at t_next
    x_mean: Tensor  # its noise-free part: what is decoded after the last step (x for the ODE solvers)
    x0_prev: Tensor  # the self-conditioning input of the next denoiser call


@dataclass(frozen=True)
class Solver:
    """One named method: how many past x0_hat it uses, its time grid, and its step."""

    name: str
    order: int  # 1: first order (no past); 2 or 3: multistep, keeps order - 1 past x0_hat
    grid: str = "uniform"  # ldlm.sampler.time_grid's kind
    stochastic: bool = False  # draws noise each step (the sde solver)
    predict_self_conditioning: bool = False

    @property
    def history(self) -> int:
        """How many past x0_hat the step needs (the scheduler keeps this many per sample)."""
        return max(self.order - 1, 2 if self.predict_self_conditioning else 0)

    def time_grid(self, steps: int, t_min: float, schedule: TangentSchedule) -> Tensor:
        return time_grid(steps, t_min, self.grid, schedule)

    def step(
        self, schedule: TangentSchedule, x: Tensor, x0_hat: Tensor, t: Tensor, t_next: Tensor, past: Past, noise: Tensor | None = None
    ) -> StepResult:
        """One step from t to t_next (B,) given this step's x0_hat and the past (most recent first)."""
        if self.stochastic:
            if noise is None:
                raise ValueError(f"the {self.name} solver draws noise every step; pass noise=")
            x_next, x_mean = sde_step(schedule, x, x0_hat, t, t_next, noise)
            return StepResult(x_next, x_mean, x0_hat)
        if not self.history:  # ddim: no log-SNR needed
            x_next = ddim_step(schedule, x, x0_hat, t, t_next)
            return StepResult(x_next, x_next, x0_hat)
        lam, lam_next = schedule.log_snr(t), schedule.log_snr(t_next)
        target = multistep_x0(x0_hat, lam, lam_next, past[: self.order - 1])
        x_next = ddim_step(schedule, x, target, t, t_next)
        x0_prev = predicted_self_conditioning(x0_hat, lam, lam_next, past) if self.predict_self_conditioning else x0_hat
        return StepResult(x_next, x_next, x0_prev)


SOLVERS: dict[str, Solver] = {
    solver.name: solver
    for solver in (
        Solver("sde", 1, stochastic=True),
        Solver("ddim", 1),
        Solver("dpm2m", 2, grid="power"),
        Solver("dpm3m", 3, grid="power"),
        Solver("dpm3m-psc", 3, grid="power", predict_self_conditioning=True),
    )
}
assert tuple(SOLVERS) == SAMPLERS, "ldlm.config.SAMPLERS must name exactly the solvers defined here"

PSC_FRACTION = 0.75  # dpm3m-psc: share of the linear extrapolation fed back (1 diverged on random weights)


def get_solver(name: str) -> Solver:
    if name not in SOLVERS:
        raise ValueError(f"sampler={name!r} is unknown; allowed: {', '.join(SOLVERS)}")
    return SOLVERS[name]


def multistep_x0(m0: Tensor, lam: Tensor, lam_next: Tensor, past: Past) -> Tensor:
    """The x0 that ``ddim_step`` must be given for DPM-Solver++ of order len(past) + 1 (see the module
    docstring); per sample, the order drops wherever a needed past lambda is missing (-inf or NaN)."""
    if not past:
        return m0
    h = lam_next - lam
    e = torch.exp(-h)
    phi1 = -torch.expm1(-h)
    c1 = ((e - 1) / h + 1) / phi1
    m1, lam1 = past[0]
    r0 = (lam - lam1) / h
    has1 = torch.isfinite(r0)
    r0 = torch.where(has1, r0, torch.ones_like(r0))
    d1_0 = (m0 - m1) / _bcast(r0, m0)
    second = m0 + _bcast(c1, m0) * d1_0
    out = torch.where(_bcast(has1, m0), second, m0)
    if len(past) < 2:
        return out
    m2, lam2 = past[1]
    r1 = (lam1 - lam2) / h
    has2 = has1 & torch.isfinite(r1)
    r1 = torch.where(has2, r1, torch.ones_like(r1))
    d1_1 = (m1 - m2) / _bcast(r1, m0)
    d1 = d1_0 + _bcast(r0 / (r0 + r1), m0) * (d1_0 - d1_1)
    d2 = (d1_0 - d1_1) / _bcast(r0 + r1, m0)
    c2 = (0.5 - (e - 1 + h) / h**2) / phi1
    third = m0 + _bcast(c1, m0) * d1 + _bcast(c2, m0) * d2
    return torch.where(_bcast(has2, m0), third, out)


def predicted_self_conditioning(m0: Tensor, lam: Tensor, lam_next: Tensor, past: Past) -> Tensor:
    """m0 moved toward lambda(t_next) by PSC_FRACTION of the line through m0 and the x0_hat two steps
    back; m0 itself where that past is missing."""
    if len(past) < 2:
        return m0
    m2, lam2 = past[1]
    slope_steps = (lam_next - lam) / (lam - lam2)
    usable = torch.isfinite(slope_steps)
    weight = torch.where(usable, PSC_FRACTION * slope_steps, torch.zeros_like(slope_steps))
    return m0 + _bcast(weight, m0) * (m0 - m2)


def push_past(past: Past, x0_hat: Tensor, lam: Tensor, keep: int) -> list[tuple[Tensor, Tensor]]:
    """The past after this step: (x0_hat, lambda) in front, at most ``keep`` entries."""
    return [(x0_hat, lam), *past][:keep]


def _bcast(per_sample: Tensor, like: Tensor) -> Tensor:
    """(B,) float64 or bool -> (B, 1, 1) in ``like``'s dtype (bool stays bool)."""
    out = per_sample[:, None, None]
    return out if out.dtype == torch.bool else out.to(like.dtype)


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

    1. x0_prev = 0 (self-conditioning starts empty), no past
    2. for each (t, t_next) in the grid: x0_hat = denoise(x_t, t, x0_prev), then one solver step,
       which also gives the next x0_prev; the past gains (x0_hat, lambda_t)
    3. return the last mean x (``decode_final="mean"``) or the last x0_hat (``"x0"``)

    ``grid`` is usually ``get_solver(sampler).time_grid(steps, t_min, schedule)``.
    """
    solver = get_solver(sampler)
    b = prior.shape[0]
    x = x_mean = prior
    x0_prev = x0_hat = torch.zeros_like(prior)
    past: list[tuple[Tensor, Tensor]] = []
    times = to_device(grid.to(prior.dtype), prior.device)  # once: indexing it later needs no copy
    for i in tqdm(range(len(grid) - 1), desc="denoising", unit="step", disable=not progress):
        t = times[i].expand(b)
        t_next = times[i + 1].expand(b)
        x0_hat = denoise(x, t, x0_prev)
        step = solver.step(schedule, x, x0_hat, t, t_next, past, draw_noise() if solver.stochastic else None)
        x, x_mean, x0_prev = step.x, step.x_mean, step.x0_prev
        if solver.history:
            past = push_past(past, x0_hat, schedule.log_snr(t), solver.history)
    return x_mean if decode_final == "mean" else x0_hat
