"""The samplers of the reverse process: the math of one step, for every path that generates.

A sampler turns the denoiser's x0_hat at time t into the state at t_next. Each call is batched with
per-sample times (B,), and everything a method remembers of earlier steps (``Past``: the previous
x0_hat and its log-SNR, most recent first) is passed in and handed back, never kept inside, so one
batch can hold samples of different samplers at different steps. ``ldlm.sampling.loop`` holds that
per-sample state and is the one caller of ``Sampler.step``.

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
- ``dpm3m-psc-unic``: dpm3m-psc with UniPC's corrector (Zhao et al. 2023, "UniPC", arXiv:2302.04867,
  UniC with B(h) = e^h - 1, "bh2", in data prediction form), which costs no denoiser call: the x0_hat
  the denoiser just gave at t (m_t, from the uncorrected state) redoes the last step, from the state
  x_prev at t_prev, with an x0 estimate that now includes the step's own end:
      x_t <- ddim_step(x_prev, m0 + rho0 D1 + rho1 (m_t - m0))     from t_prev to t,
  m0 and m1 the x0_hat at t_prev and the step before, h = lambda(t) - lambda(t_prev), r = (lambda_1 -
  lambda(t_prev)) / h, D1 = (m1 - m0) / r, phi1 = 1 - e^-h, and (rho0, rho1) solving
  [[1, 1], [r, 1]] rho = (b1, b2), b1 = (1 - phi1/h) / phi1, b2 = (1 - 2 (1 - phi1/h) / h) / phi1:
  at equal steps (r = -1, h -> 0) the weights of m_t, m0, m1 tend to Adams-Moulton's 5/12, 8/12,
  -1/12. Without m1 (or where r is not finite) it is the trapezoid, rho1 = 1/2, D1 = 0. The predictor
  then steps from the corrected state; the last step has no later x0_hat and is not corrected.
  Measured on the trained reference checkpoint: 10-15% lower latent error at 8 and 10 steps.

Every sampler ends with the state at t_min (``x_mean``, decoded when ``decode_final="mean"``) and the
last x0_hat.

The two first-order steps (``sde_step``, ``ddim_step``) are written out here too, as numbered
equations; ldlm/sampling/schedule.py holds the schedule they step along.

Each step is written in two parts: its coefficients (``Coefficients``: every value the step computes from
the times and the past's log-SNR alone, one per sample) and the update that applies them to the (B, L, D)
tensors. A step's coefficients depend on its sample's time grid and nothing else, so the persistent batch
(ldlm/sampling/slots.py) computes a sample's for all its steps once, at admission, and a step only looks
them up; ``Sampler.step`` and ``Sampler.correct`` compute them on the spot. The same operations on the same
values either way, so the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ldlm.model.config import SAMPLERS
from ldlm.sampling.schedule import TangentSchedule, per_sample, time_grid

Past = Sequence[tuple[Tensor, Tensor]]  # (x0_hat (B, L, D), lambda (B,) float64), most recent first
Coefficients = dict[str, Tensor]  # a step's values of one per sample (B,), by name (``Sampler.coefficient_names``)


@dataclass(frozen=True)
class StepResult:
    x: Tensor  # the state at t_next
    x_mean: Tensor  # its noise-free part: what is decoded after the last step (x for the ODE samplers)
    x0_prev: Tensor  # the self-conditioning input of the next denoiser call


@dataclass(frozen=True)
class Sampler:
    """One named method: how many past x0_hat it uses, its default time grid, and its step."""

    name: str
    order: int  # 1: first order (no past); 2 or 3: multistep, keeps order - 1 past x0_hat
    grid: str = "uniform"  # ldlm.sampling.schedule.time_grid's kind
    stochastic: bool = False  # draws noise each step (the sde sampler)
    predict_self_conditioning: bool = False
    corrector: bool = False  # UniC: each new x0_hat first redoes the last step (no extra denoiser call)

    @property
    def history(self) -> int:
        """How many past x0_hat the step needs (the engine keeps this many per sample)."""
        return max(self.order - 1, 2 if self.predict_self_conditioning else 0)

    def time_grid(self, steps: int, t_min: float, schedule: TangentSchedule) -> Tensor:
        return time_grid(steps, t_min, self.grid, schedule)

    def step(
        self, schedule: TangentSchedule, x: Tensor, x0_hat: Tensor, t: Tensor, t_next: Tensor, past: Past, noise: Tensor | None = None
    ) -> StepResult:
        """One step from t to t_next (B,) given this step's x0_hat and the past (most recent first)."""
        if self.stochastic and noise is None:
            raise ValueError(f"the {self.name} sampler draws noise every step; pass noise=")
        c = self.step_coefficients(schedule, t, t_next, [lam for _, lam in past], x0_hat.dtype)
        return self.apply_step(c, x, x0_hat, [m for m, _ in past], noise)

    def correct(
        self, schedule: TangentSchedule, x: Tensor, x_prev: Tensor, x0_hat: Tensor, t_prev: Tensor, t: Tensor, past: Past
    ) -> Tensor:
        """The state at t (B,) redone from ``x_prev`` at ``t_prev`` with this step's ``x0_hat`` (UniC; see the
        module docstring); ``x`` itself where the past is missing (the first step) or for a sampler without
        a corrector."""
        if not self.corrector or not past:
            return x
        c = self.correct_coefficients(schedule, t_prev, t, [lam for _, lam in past], x0_hat.dtype)
        return self.apply_correct(c, x, x_prev, x0_hat, [m for m, _ in past])

    # --- the two parts of a step: coefficients, then the update -----------------------------------

    @property
    def tabulated(self) -> bool:
        """Whether a step is these coefficients and updates (a subclass that redefines ``step`` or ``correct``
        computes its own: the persistent batch then steps it on the spot)."""
        return type(self).step is Sampler.step and type(self).correct is Sampler.correct

    @property
    def coefficient_names(self) -> tuple[str, ...]:
        """The names ``coefficients`` gives, in a fixed order (the columns of a table of them)."""
        if self.stochastic:
            return ("a", "s", "h_beta", "spread")
        names: tuple[str, ...] = ("a", "s", "a_next", "s_next")
        if self.history:
            names += ("has1", "r0", "c1") + (("has2", "r1", "w", "r01", "c2") if self.order > 2 else ())
            names += ("psc",) if self.predict_self_conditioning else ()
        if self.corrector:
            names += ("c_a", "c_s", "c_a_next", "c_s_next", "u_has1", "u_rho0", "u_r", "u_rho1", "valid")
        return names

    def coefficients(
        self, schedule: TangentSchedule, t: Tensor, t_next: Tensor, t_prev: Tensor, past_lam: Sequence[Tensor], dtype: torch.dtype
    ) -> Coefficients:
        """Everything a step (its correction included) computes from its times and the past's log-SNR, per sample."""
        c = self.step_coefficients(schedule, t, t_next, past_lam, dtype)
        if self.corrector:
            c |= self.correct_coefficients(schedule, t_prev, t, past_lam, dtype)
        return c

    def step_coefficients(
        self, schedule: TangentSchedule, t: Tensor, t_next: Tensor, past_lam: Sequence[Tensor], dtype: torch.dtype
    ) -> Coefficients:
        if self.stochastic:
            return sde_coefficients(schedule, t, t_next)
        c = ddim_coefficients(schedule, t, t_next)
        if not self.history:  # ddim: no log-SNR needed
            return c
        lam, lam_next = schedule.log_snr(t), schedule.log_snr(t_next)
        c |= multistep_coefficients(lam, lam_next, past_lam[: self.order - 1], dtype)
        if self.predict_self_conditioning:
            c |= psc_coefficients(lam, lam_next, past_lam, dtype)
        return c

    def correct_coefficients(
        self, schedule: TangentSchedule, t_prev: Tensor, t: Tensor, past_lam: Sequence[Tensor], dtype: torch.dtype
    ) -> Coefficients:
        """The corrector's: the step from t_prev to t redone (``c_``), UniC's weights (``u_``), and ``valid``
        where the sample has a past step (NaN: missing; -inf: t_prev = 1, kept)."""
        c = {f"c_{k}": v for k, v in ddim_coefficients(schedule, t_prev, t).items()}
        return c | corrector_coefficients(schedule.log_snr(t), past_lam, dtype) | {"valid": ~torch.isnan(past_lam[0])}

    def apply_step(self, c: Coefficients, x: Tensor, x0_hat: Tensor, past_x0: Sequence[Tensor], noise: Tensor | None) -> StepResult:
        """The step's update, given its coefficients and the past's x0_hat (most recent first)."""
        if self.stochastic:
            x_next, x_mean = sde_apply(c, x, x0_hat, noise)  # type: ignore[arg-type]
            return StepResult(x_next, x_mean, x0_hat)
        if not self.history:
            x_next = ddim_apply(c, x, x0_hat)
            return StepResult(x_next, x_next, x0_hat)
        x_next = ddim_apply(c, x, multistep_apply(c, x0_hat, past_x0[: self.order - 1]))
        x0_prev = psc_apply(c, x0_hat, past_x0) if self.predict_self_conditioning else x0_hat
        return StepResult(x_next, x_next, x0_prev)

    def apply_correct(self, c: Coefficients, x: Tensor, x_prev: Tensor, x0_hat: Tensor, past_x0: Sequence[Tensor]) -> Tensor:
        redone = ddim_apply({k[2:]: v for k, v in c.items() if k.startswith("c_")}, x_prev, corrector_apply(c, x0_hat, past_x0))
        return torch.where(per_sample(c["valid"]), redone, x)


SAMPLERS_BY_NAME: dict[str, Sampler] = {
    sampler.name: sampler
    for sampler in (
        Sampler("sde", 1, stochastic=True),
        Sampler("ddim", 1),
        Sampler("dpm2m", 2, grid="power"),
        Sampler("dpm3m", 3, grid="power"),
        Sampler("dpm3m-psc", 3, grid="power", predict_self_conditioning=True),
        Sampler("dpm3m-psc-unic", 3, grid="power", predict_self_conditioning=True, corrector=True),
    )
}
assert tuple(SAMPLERS_BY_NAME) == SAMPLERS, "ldlm.model.config.SAMPLERS must name exactly the samplers defined here"

PSC_FRACTION = 0.75  # dpm3m-psc: share of the linear extrapolation fed back (1 diverged on random weights)
BOOL_COEFFICIENTS = frozenset({"has1", "has2", "u_has1", "valid"})


def get_sampler(name: str) -> Sampler:
    if name not in SAMPLERS_BY_NAME:
        raise ValueError(f"sampler={name!r} is unknown; allowed: {', '.join(SAMPLERS_BY_NAME)}")
    return SAMPLERS_BY_NAME[name]


def multistep_x0(m0: Tensor, lam: Tensor, lam_next: Tensor, past: Past) -> Tensor:
    """The x0 that ``ddim_step`` must be given for DPM-Solver++ of order len(past) + 1 (see the module
    docstring); per sample, the order drops wherever a needed past lambda is missing (-inf or NaN)."""
    c = multistep_coefficients(lam, lam_next, [lam for _, lam in past], m0.dtype)
    return multistep_apply(c, m0, [m for m, _ in past])


def multistep_coefficients(lam: Tensor, lam_next: Tensor, past_lam: Sequence[Tensor], dtype: torch.dtype) -> Coefficients:
    if not past_lam:
        return {}
    h = lam_next - lam
    e = torch.exp(-h)
    phi1 = -torch.expm1(-h)
    c1 = ((e - 1) / h + 1) / phi1
    lam1 = past_lam[0]
    r0 = (lam - lam1) / h
    has1 = torch.isfinite(r0)
    r0 = torch.where(has1, r0, torch.ones_like(r0))
    c = {"has1": has1, "r0": r0.to(dtype), "c1": c1.to(dtype)}
    if len(past_lam) < 2:
        return c
    lam2 = past_lam[1]
    r1 = (lam1 - lam2) / h
    has2 = has1 & torch.isfinite(r1)
    r1 = torch.where(has2, r1, torch.ones_like(r1))
    c2 = (0.5 - (e - 1 + h) / h**2) / phi1
    return c | {"has2": has2, "r1": r1.to(dtype), "w": (r0 / (r0 + r1)).to(dtype), "r01": (r0 + r1).to(dtype), "c2": c2.to(dtype)}


def multistep_apply(c: Coefficients, m0: Tensor, past_x0: Sequence[Tensor]) -> Tensor:
    if not past_x0:
        return m0
    m1 = past_x0[0]
    d1_0 = (m0 - m1) / per_sample(c["r0"])
    second = m0 + per_sample(c["c1"]) * d1_0
    out = torch.where(per_sample(c["has1"]), second, m0)
    if len(past_x0) < 2:
        return out
    m2 = past_x0[1]
    d1_1 = (m1 - m2) / per_sample(c["r1"])
    d1 = d1_0 + per_sample(c["w"]) * (d1_0 - d1_1)
    d2 = (d1_0 - d1_1) / per_sample(c["r01"])
    third = m0 + per_sample(c["c1"]) * d1 + per_sample(c["c2"]) * d2
    return torch.where(per_sample(c["has2"]), third, out)


def predicted_self_conditioning(m0: Tensor, lam: Tensor, lam_next: Tensor, past: Past) -> Tensor:
    """m0 moved toward lambda(t_next) by PSC_FRACTION of the line through m0 and the x0_hat two steps
    back; m0 itself where that past is missing."""
    return psc_apply(psc_coefficients(lam, lam_next, [lam for _, lam in past], m0.dtype), m0, [m for m, _ in past])


def psc_coefficients(lam: Tensor, lam_next: Tensor, past_lam: Sequence[Tensor], dtype: torch.dtype) -> Coefficients:
    if len(past_lam) < 2:
        return {}
    slope_steps = (lam_next - lam) / (lam - past_lam[1])
    usable = torch.isfinite(slope_steps)
    return {"psc": torch.where(usable, PSC_FRACTION * slope_steps, torch.zeros_like(slope_steps)).to(dtype)}


def psc_apply(c: Coefficients, m0: Tensor, past_x0: Sequence[Tensor]) -> Tensor:
    if len(past_x0) < 2:
        return m0
    return m0 + per_sample(c["psc"]) * (m0 - past_x0[1])


def corrected_x0(m_t: Tensor, lam: Tensor, past: Past) -> Tensor:
    """UniC's x0 estimate over the last step (to lambda ``lam``, from past[0]'s): m_t, m0 and, where
    its log-SNR is finite, m1 (see the module docstring)."""
    return corrector_apply(corrector_coefficients(lam, [lam for _, lam in past], m_t.dtype), m_t, [m for m, _ in past])


def corrector_coefficients(lam: Tensor, past_lam: Sequence[Tensor], dtype: torch.dtype) -> Coefficients:
    if len(past_lam) < 2:
        return {}
    lam0, lam1 = past_lam[0], past_lam[1]
    h = lam - lam0
    phi1 = -torch.expm1(-h)
    b1 = (1 - phi1 / h) / phi1
    b2 = (1 - 2 * (1 - phi1 / h) / h) / phi1
    r = (lam1 - lam0) / h
    has1 = torch.isfinite(r)
    r = torch.where(has1, r, torch.full_like(r, -1.0))
    rho0, rho1 = (b1 - b2) / (1 - r), (b2 - r * b1) / (1 - r)
    return {"u_has1": has1, "u_rho0": rho0.to(dtype), "u_r": r.to(dtype), "u_rho1": rho1.to(dtype)}


def corrector_apply(c: Coefficients, m_t: Tensor, past_x0: Sequence[Tensor]) -> Tensor:
    m0 = past_x0[0]
    trapezoid = m0 + 0.5 * (m_t - m0)
    if len(past_x0) < 2 or "u_has1" not in c:
        return trapezoid
    m1 = past_x0[1]
    third = m0 + per_sample(c["u_rho0"]) * (m1 - m0) / per_sample(c["u_r"]) + per_sample(c["u_rho1"]) * (m_t - m0)
    return torch.where(per_sample(c["u_has1"]), third, trapezoid)


def push_past(past: Past, x0_hat: Tensor, lam: Tensor, keep: int) -> list[tuple[Tensor, Tensor]]:
    """The past after this step: (x0_hat, lambda) in front, at most ``keep`` entries."""
    return [(x0_hat, lam), *past][:keep]


def sde_step(schedule: TangentSchedule, x_t: Tensor, x0_hat: Tensor, t: Tensor, t_next: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
    """One Euler-Maruyama step of the reverse SDE from t to t_next < t. Returns (x_next, x_mean).

    Reverse SDE:  dx = [-1/2 beta x - beta score] dt + sqrt(beta) dW_bar,  score = -eps_hat / sigma_t.
    With h = t - t_next > 0:
      1. eps_hat = (x_t - alpha_t x0_hat) / sigma_t
      2. x_mean  = x_t + h beta (x_t / 2 - eps_hat / sigma_t)
      3. x_next  = x_mean + sqrt(beta h) z,   z = noise ~ N(0, I)
    """
    return sde_apply(sde_coefficients(schedule, t, t_next), x_t, x0_hat, noise)


def sde_coefficients(schedule: TangentSchedule, t: Tensor, t_next: Tensor) -> Coefficients:
    h, beta = t - t_next, schedule.beta(t)
    return {"a": schedule.alpha(t), "s": schedule.sigma(t), "h_beta": h * beta, "spread": torch.sqrt(beta * h)}


def sde_apply(c: Coefficients, x_t: Tensor, x0_hat: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
    eps_hat = (x_t - per_sample(c["a"]) * x0_hat) / per_sample(c["s"])
    x_mean = x_t + per_sample(c["h_beta"]) * (x_t / 2 - eps_hat / per_sample(c["s"]))
    return x_mean + per_sample(c["spread"]) * noise, x_mean


def ddim_step(schedule: TangentSchedule, x_t: Tensor, x0_hat: Tensor, t: Tensor, t_next: Tensor) -> Tensor:
    """Deterministic DDIM step (the probability-flow ODE's exponential-integrator form):
    x_next = alpha_{t_next} x0_hat + sigma_{t_next} eps_hat."""
    return ddim_apply(ddim_coefficients(schedule, t, t_next), x_t, x0_hat)


def ddim_coefficients(schedule: TangentSchedule, t: Tensor, t_next: Tensor) -> Coefficients:
    return {"a": schedule.alpha(t), "s": schedule.sigma(t), "a_next": schedule.alpha(t_next), "s_next": schedule.sigma(t_next)}


def ddim_apply(c: Coefficients, x_t: Tensor, x0_hat: Tensor) -> Tensor:
    eps_hat = (x_t - per_sample(c["a"]) * x0_hat) / per_sample(c["s"])  # predicted noise, (x_t - alpha x0_hat) / sigma
    return per_sample(c["a_next"]) * x0_hat + per_sample(c["s_next"]) * eps_hat
