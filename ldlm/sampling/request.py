"""A generation request and its sampling plan: the one place where a request's settings (sampler,
steps, t_min, grid, prior temperature, seed, prompt strength) are filled in and checked, each refusal naming the value and
the allowed range.

Every generating path (``LDLMPipeline.generate``, the continuous-batching scheduler behind /v1/generate and
/v1/completions, Triton's ``ldlm_generate``, parity, bench) resolves its request here, and no front end
fills in a default of its own: what a request leaves out (None) is the config's default, or, where the
checkpoint has tuned step grids (``schedules``, ldlm/sampling/tuned_grids.py) tuned for the request's t_min
and prior temperature, the tuned default: the sampler's tuned step count and its tuned grid
(``grid="tuned"``). Per-request caps (``RequestLimits``) are those of the caller: the server's and
Triton's come from its settings; a Python caller of the pipeline has none. ``SamplingPlan.summary``
is what an answer reports as the plan that ran.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ldlm.limits import PRIOR_TEMPERATURE, PROMPT_STRENGTH, T_MIN
from ldlm.model.config import SAMPLERS, TUNED_GRID, LDLMConfig
from ldlm.sampling.noise import check_seed
from ldlm.sampling.samplers import Sampler, get_sampler
from ldlm.sampling.schedule import GRIDS, TangentSchedule, time_grid
from ldlm.sampling.tuned_grids import TunedSchedules

# A prompt's guidance weight when a request names none: inpainting alone, no second denoiser row (on the
# reference checkpoint no weight both moved the continuation and made the corpus's next words likelier:
# docs/sampling.md)
DEFAULT_PROMPT_STRENGTH = 1.0


@dataclass(frozen=True)
class GenerateRequest:
    """What a caller asks for; None: not given, filled in by ``resolve`` (the tuned or the config's
    ``default_steps``, ``default_sampler``, ``t_min``, ``prior_temperature``, seed 0, prompt strength 1; the
    grid is the tuned one where it applies, else the sampler's own)."""

    n: int
    length: int
    steps: int | None = None
    seed: int | None = None
    sampler: str | None = None
    t_min: float | None = None
    grid: str | None = None
    prior_temperature: float | None = None
    prompt_strength: float | None = None  # a prompt's guidance weight (ldlm/sampling/loop.py); no prompt: no effect


@dataclass(frozen=True)
class RequestLimits:
    """A caller's caps on one request (None: no cap beyond >= 1)."""

    max_n: int | None = None
    max_steps: int | None = None


@dataclass(frozen=True)
class SamplingPlan:
    """A request with every setting resolved and checked."""

    n: int
    length: int
    steps: int
    seed: int
    sampler: Sampler
    t_min: float
    grid: str  # a kind of ldlm.sampling.schedule.time_grid, or "tuned"
    tuned_times: tuple[float, ...] | None = None  # the tuned grid's times (grid="tuned")
    prior_temperature: float = 1.0  # x_1 ~ N(0, prior_temperature^2 I)
    prompt_strength: float = DEFAULT_PROMPT_STRENGTH  # a prompt's guidance weight w (1: inpainting alone)

    def summary(self) -> dict[str, str | int | float]:
        """What ran, as every answer names it: sampler, steps, grid ("tuned" or its kind), t_min, prior
        temperature, prompt strength."""
        return {
            "sampler": self.sampler.name,
            "steps": self.steps,
            "grid": self.grid,
            "t_min": self.t_min,
            "prior_temperature": self.prior_temperature,
            "prompt_strength": self.prompt_strength,
        }

    def times(self, schedule: TangentSchedule) -> Tensor:
        """The steps + 1 times from 1 down to t_min (float64)."""
        if self.tuned_times is not None:
            return torch.tensor(self.tuned_times, dtype=torch.float64)
        return time_grid(self.steps, self.t_min, self.grid, schedule)


TUNED = TUNED_GRID  # the grid tuned for the checkpoint (ldlm tune-schedule)
DEFAULT_SEED = 0  # a request that names no seed: the same noise every time, as a CLI run gives


def resolve(
    request: GenerateRequest,
    config: LDLMConfig,
    limits: RequestLimits = RequestLimits(),
    names: Mapping[str, str] | None = None,
    schedules: TunedSchedules | None = None,
) -> SamplingPlan:
    """``request`` against ``config``, ``limits`` and the checkpoint's tuned ``schedules``; ``names``: how
    the caller names each field in its messages (Triton's inputs are N, LENGTH, STEPS, SAMPLER)."""

    def name(field: str) -> str:
        return (names or {}).get(field, field)

    n = _count(request.n, name("n"), limits.max_n, "is out of range")
    length = request.length
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= config.max_seq_len:
        raise ValueError(f"{name('length')}={length!r} is out of range; allowed: 1..{config.max_seq_len} (config max_seq_len)")
    t_min = config.t_min if request.t_min is None else request.t_min
    T_MIN.check(name("t_min"), t_min)
    tau = config.prior_temperature_for(request.prior_temperature)
    PRIOR_TEMPERATURE.check(name("prior_temperature"), tau)
    tau = float(tau)
    strength = DEFAULT_PROMPT_STRENGTH if request.prompt_strength is None else request.prompt_strength
    PROMPT_STRENGTH.check(name("prompt_strength"), strength)
    strength = float(strength)
    # tuned grids, and the step counts they made the defaults, hold only for the runs they were tuned for
    here = schedules if schedules is not None and schedules.tuned_for(float(t_min), tau) else None
    sampler_name = config.default_sampler if request.sampler is None else request.sampler
    steps = request.steps if request.steps is not None else _default_steps(sampler_name, config, here, limits, name("steps"))
    steps = _count(steps, name("steps"), limits.max_steps, "is invalid")
    try:
        sampler = get_sampler(sampler_name)
    except ValueError:
        raise ValueError(f"{name('sampler')}={sampler_name!r} is unknown; allowed: {', '.join(SAMPLERS)}") from None
    seed = check_seed(DEFAULT_SEED if request.seed is None else request.seed, name("seed"))
    tuned = here.grid(sampler.name, steps) if here is not None else None
    if request.grid == TUNED and tuned is None:
        raise ValueError(_no_tuned_grid(sampler.name, steps, float(t_min), tau, schedules))
    if request.grid is None and tuned is not None or request.grid == TUNED:
        return SamplingPlan(n, length, steps, seed, sampler, float(t_min), TUNED, tuned.times, tau, strength)  # type: ignore[union-attr]
    grid = sampler.grid if request.grid is None else request.grid
    if grid not in GRIDS:
        raise ValueError(f"grid={grid!r} is unknown; allowed: {', '.join((*GRIDS, TUNED))}")
    return SamplingPlan(n, length, steps, seed, sampler, float(t_min), grid, prior_temperature=tau, prompt_strength=strength)


def _default_steps(sampler: str, config: LDLMConfig, here: TunedSchedules | None, limits: RequestLimits, name: str) -> int:
    """The step count of a request that names none: the sampler's tuned count, else the config's; refused
    (not cut) where it exceeds the caller's cap, so a plan never differs from what the rule gives."""
    steps = here.defaults.get(sampler, config.default_steps) if here is not None else config.default_steps
    if limits.max_steps is not None and steps > limits.max_steps:
        raise ValueError(
            f"{name} was not given, and the default for sampler {sampler} is {steps} steps, which is out of range; "
            f"allowed: 1..{limits.max_steps} (the caller's max_steps): give {name}"
        )
    return steps


def _no_tuned_grid(sampler: str, steps: int, t_min: float, tau: float, schedules: TunedSchedules | None) -> str:
    if schedules is None:
        return "grid='tuned' is unavailable: this checkpoint has no tuned schedules (run `ldlm tune-schedule`)"
    if t_min != schedules.t_min:
        return f"grid='tuned' is unavailable at t_min={t_min}: the grids were tuned for t_min={schedules.t_min}"
    if tau != schedules.prior_temperature:
        return (
            f"grid='tuned' is unavailable at prior_temperature={tau}: "
            f"the grids were tuned for prior_temperature={schedules.prior_temperature}"
        )
    return f"grid='tuned' has no {sampler} grid of {steps} steps; tuned: {schedules.steps_tuned(sampler) or 'none for this sampler'}"


def _count(value: object, name: str, cap: int | None, uncapped_word: str) -> int:
    """An integer >= 1 (and <= cap): refused as out of range (capped) or with ``uncapped_word``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (cap is not None and value > cap):
        if cap is not None:
            raise ValueError(f"{name}={value!r} is out of range; allowed: 1..{cap}")
        raise ValueError(f"{name}={value!r} {uncapped_word}; allowed: an integer >= 1")
    return value
