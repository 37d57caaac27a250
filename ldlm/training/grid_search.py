"""Tuning a checkpoint's step grids: the times a sampler steps through, searched so that N steps land
where a fine reference run lands (``ldlm tune-schedule``; the result is ldlm/sampling/tuned_grids.py's
``schedules.json``).

For each step count N:
  1. the reference: DDIM at ``reference_steps`` (1000) on the tuning samples (seeded priors);
  2. a scan of the power family t = t_min + (1 - t_min) (1 - u)^rho over ``POWER_EXPONENTS`` (one
     number, so it cannot overfit the tuning samples), minimizing the search error below;
  3. the grid is then parametrized by N free numbers z: the step sizes are (1 - t_min) softmax(z), so
     every z gives a strictly decreasing grid from 1 to t_min (no constraint to enforce); Nelder-Mead
     over z from the best power grid, minimizing the final latent's relative error
     ||x - x_ref|| / ||x_ref|| on the tuning samples, within ``evaluations`` runs of N denoiser calls
     (the scan's included): by default all samples' pooled (``objective="pooled"``), else the worst
     sample's (``"worst"``);
  4. validation: the sampler's default grid, the best power grid and the searched grid are scored by the
     same error on validation samples (another seed, the tuning length), and the lowest is kept;
  5. the kept grid is scored on held-out samples (other seeds, and other lengths), beside DDIM@50 and
     the default grid: relative latent error and token agreement with the reference.
Why pooled: with validation, its grids landed closer held out than the worst sample's at every step count
tried on the trained reference and at 3 of 4 on random-norm tiny (docs/measurements/schedules-*-pooled-*).
"worst" keeps out grids that throw the odd sample off (without validation, a pooled 8-step grid once threw
one held-out sample of 8 to 3-5x the default grid's error).
Why validation: a search over N free numbers can fit its tuning samples, and a few held-out samples
cannot tell (on the reference checkpoint, 8 held-out samples per length showed searched grids worse
than the default grid, because one sample of the 8 was thrown off; 64 samples of the same seed showed
them better). A grid is kept only where 64 samples the search never saw confirm it, so the tuned grid
is never one that validation finds worse than the default.
The default step count is the fewest N whose held-out error and token agreement, at every held-out
length, are at least DDIM@50's. Derivative-free, as in image-diffusion grid searches (DM-NonUniform,
Optimal Stepsize): each evaluation is a whole sampling run, which the engine gives without gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from ldlm.model.config import DEFAULT_TUNING_OBJECTIVE, TUNING_OBJECTIVES, LDLMConfig
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest, resolve, run_lockstep
from ldlm.sampling.samplers import get_sampler
from ldlm.sampling.schedule import power_grid
from ldlm.sampling.tuned_grids import TunedGrid, TunedSchedules, check_times

POWER_EXPONENTS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)  # the power grids scanned before the full search
DDIM_BASELINE_STEPS = 50  # every tuned grid is scored beside DDIM at this many steps, and must match it to be a default
# The reference takes this many times the steps of any run it scores: a reference barely finer than DDIM@50 would
# carry an error of DDIM@50's order, and "matches DDIM@50" would then compare two runs against a third as coarse.
REFERENCE_MARGIN = 4


def min_reference_steps(steps: Sequence[int]) -> int:
    """The fewest reference steps that score ``steps`` and DDIM@50: ``REFERENCE_MARGIN`` times the largest."""
    return REFERENCE_MARGIN * max((*steps, DDIM_BASELINE_STEPS))


def check_reference_steps(reference_steps: int, steps: Sequence[int], name: str = "reference_steps") -> None:
    """Refuse a reference too coarse to score ``steps`` and DDIM@50; ``name``: how the caller names the value."""
    least = min_reference_steps(steps)
    if reference_steps < least:
        compared = ", ".join(str(n) for n in sorted({*steps, DDIM_BASELINE_STEPS}))
        raise ValueError(
            f"{name}={reference_steps} is too coarse for the reference; allowed: >= {least} ({REFERENCE_MARGIN}x the largest "
            f"step count it scores, of {compared}, DDIM@{DDIM_BASELINE_STEPS} included); pass {least} or more"
        )


@dataclass(frozen=True)
class TuningSettings:
    sampler: str
    steps: tuple[int, ...] = (6, 8, 10, 12)
    reference_steps: int = 1000
    tune_seed: int = 101
    tune_n: int = 64  # many: the worst of a few samples misses the one a fragile grid throws off
    tune_length: int = 64
    held_out_seed: int = 202
    held_out_n: int = 32  # per length: of 8, one sample a grid throws off decided the verdict (measured)
    held_out_lengths: tuple[int, ...] = (32, 64, 128)
    evaluations: int = 600  # per step count
    objective: str = DEFAULT_TUNING_OBJECTIVE  # of the samples' relative errors: "pooled" (one over all) or "worst" (the largest)
    validation_seed: int = 303  # the validation samples: tune_n of them at tune_length

    def __post_init__(self) -> None:
        if self.objective not in TUNING_OBJECTIVES:
            raise ValueError(f"objective={self.objective!r}; allowed: {', '.join(TUNING_OBJECTIVES)}")
        check_reference_steps(self.reference_steps, self.steps)


@dataclass
class Samples:
    """One fixed set of samples (seed, n, length) with its reference latents and tokens."""

    seed: int
    n: int
    length: int
    reference: Tensor  # (n, length, D)
    tokens: Tensor  # (n, length)


@dataclass
class Score:
    error: float  # relative latent error against the reference, all samples pooled
    tokens: float  # share of positions whose token equals the reference's
    search_error: float  # what the search minimizes (Tuner.objective_of), from the same run

    def to_dict(self) -> dict[str, float]:
        return {"error": round(self.error, 6), "tokens": round(self.tokens, 6)}


@dataclass
class Tuner:
    pipeline: LDLMPipeline
    settings: TuningSettings
    references: dict[tuple[int, int, int], Samples] = field(default_factory=dict)
    # held-out scores by (sampler, steps, times): DDIM@50's and a default grid's are asked for at every step count
    held_out_scores: dict[tuple[str, int, tuple[float, ...] | None], dict[str, dict[str, float]]] = field(default_factory=dict)
    # a bar per reference solve: at reference_steps (1000) each takes minutes, and the search shows nothing before it
    progress: bool = False

    def samples(self, seed: int, n: int, length: int) -> Samples:
        key = (seed, n, length)
        if key not in self.references:
            desc = f"reference ddim@{self.settings.reference_steps} ({n} x {length} tokens, seed {seed})"
            ref = self.latents(seed, n, length, "ddim", self.settings.reference_steps, None, desc if self.progress else None)
            self.references[key] = Samples(seed, n, length, ref, self.pipeline.decode(ref).token_ids)
        return self.references[key]

    def latents(
        self, seed: int, n: int, length: int, sampler: str, steps: int, times: Sequence[float] | None, progress: str | None = None
    ) -> Tensor:
        """The final latents of one run; ``times`` None: the sampler's default grid; ``progress``: a bar of its steps
        with this label (None: no bar)."""
        plan = resolve(GenerateRequest(n, length, steps, seed, sampler, self.pipeline.config.t_min), self.pipeline.config)
        if times is not None:
            plan = replace(plan, grid="tuned", tuned_times=tuple(times))
        engine = self.pipeline.engine
        states = engine.start(plan, self.pipeline.config.d_model)
        padded = self.pipeline.bucket_length(length)
        with torch.inference_mode():
            return run_lockstep(engine, states, self.pipeline.graphs.denoise, padded, progress is not None, progress or "denoising")

    def score(self, samples: Samples, sampler: str, steps: int, times: Sequence[float] | None, tokens: bool = True) -> Score:
        x = self.latents(samples.seed, samples.n, samples.length, sampler, steps, times)
        error = float((x - samples.reference).norm() / samples.reference.norm())
        agree = float((self.pipeline.decode(x).token_ids == samples.tokens).double().mean()) if tokens else math.nan
        return Score(error, agree, self.objective_of(x, samples))

    def search_error(self, samples: Samples, sampler: str, steps: int, times: Sequence[float]) -> float:
        """What the search minimizes, for one run of ``samples`` on ``times``."""
        return self.objective_of(self.latents(samples.seed, samples.n, samples.length, sampler, steps, times), samples)

    def objective_of(self, x: Tensor, samples: Samples) -> float:
        """The worst sample's relative error of latents ``x``, or all samples' pooled."""
        distance, size = (x - samples.reference).flatten(1).norm(dim=1), samples.reference.flatten(1).norm(dim=1)
        if self.settings.objective == "pooled":
            return float(distance.norm() / size.norm())  # = ||x - x_ref|| / ||x_ref|| over all samples
        return float((distance / size).max())

    def held_out(self, sampler: str, steps: int, times: Sequence[float] | None) -> dict[str, dict[str, float]]:
        s, key = self.settings, (sampler, steps, None if times is None else tuple(times))
        if key not in self.held_out_scores:
            self.held_out_scores[key] = {
                str(n): self.score(self.samples(s.held_out_seed, s.held_out_n, n), sampler, steps, times).to_dict()
                for n in s.held_out_lengths
            }
        return self.held_out_scores[key]


def grid_of(z: np.ndarray, t_min: float) -> tuple[float, ...]:
    """The grid whose step sizes are (1 - t_min) softmax(z): 1, decreasing strictly, to t_min exactly."""
    w = np.exp(z - z.max())
    w /= w.sum()
    times = 1.0 - (1.0 - t_min) * np.cumsum(w)
    return (1.0, *[float(t) for t in times[:-1]], t_min)


def logits_of(times: Sequence[float]) -> np.ndarray:
    """The z of ``grid_of`` for a given grid (its step sizes' logarithms)."""
    return np.log(-np.diff(np.asarray(times, dtype=np.float64)))


def nelder_mead(
    f: Callable[[np.ndarray], float], x0: np.ndarray, budget: int, step: float = 0.5, on_eval: Callable[[], None] | None = None
) -> tuple[np.ndarray, float]:
    """Minimize ``f`` from ``x0`` within ``budget`` evaluations (Nelder & Mead 1965; the standard
    coefficients: reflect 1, expand 2, contract 1/2, shrink 1/2). Returns the best point and value."""
    calls = 0

    def value(x: np.ndarray) -> float:
        nonlocal calls
        calls += 1
        if on_eval is not None:
            on_eval()
        return f(x)

    simplex = [x0] + [x0 + step * np.eye(len(x0))[i] for i in range(len(x0))]
    values = [value(x) for x in simplex]
    while calls < budget:
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = value(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = value(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = value(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best point
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [value(x) for x in simplex[1:]]
    best = int(np.argmin(values))
    return simplex[best], values[best]


def tune_grid(tuner: Tuner, steps: int, progress: bool = False) -> TunedGrid:
    """The tuned grid of ``steps`` steps (the lowest validation error of the default grid, the best power
    grid and the searched one), with its held-out scores beside DDIM@50's and the default grid's."""
    s, t_min = tuner.settings, tuner.pipeline.config.t_min
    sampler = get_sampler(s.sampler)
    if steps < sampler.order:
        raise ValueError(f"steps={steps} is below the {sampler.name} sampler's order {sampler.order}; allowed: >= {sampler.order}")
    tuning = tuner.samples(s.tune_seed, s.tune_n, s.tune_length)
    default = tuple(
        resolve(GenerateRequest(1, 1, steps, 0, s.sampler, t_min), tuner.pipeline.config).times(tuner.pipeline.schedule).tolist()
    )
    candidates: dict[str, tuple[float, ...]] = {"default": default}
    best: dict[str, object] = {"error": math.inf, "times": default}

    def error_of(times: tuple[float, ...]) -> float:
        error = tuner.search_error(tuning, s.sampler, steps, times)
        if error < best["error"]:  # type: ignore[operator]
            best.update(error=error, times=times)  # kept as it improves: an interrupted search keeps it
        return error

    with tqdm(total=s.evaluations, desc=f"tuning {s.sampler}@{steps}", unit="run", disable=not progress) as bar:
        try:
            scan = POWER_EXPONENTS[: max(s.evaluations - 1, 1)]  # a budget too small for all leaves the search a run
            powers = {rho: tuple(power_grid(steps, t_min, rho).tolist()) for rho in scan}
            scores = {rho: error_of(times) for rho, times in powers.items()}
            bar.update(len(scan))
            rho = min(scores, key=scores.__getitem__)
            candidates[f"power {rho:g}"] = powers[rho]
            budget = s.evaluations - len(scan)
            if budget > 0:
                nelder_mead(lambda z: error_of(grid_of(z, t_min)), logits_of(powers[rho]), budget, on_eval=bar.update)
        except KeyboardInterrupt:
            if best["error"] == math.inf:
                raise
            bar.set_postfix_str("interrupted: the best grid so far is kept")
            candidates["searched"] = best["times"]  # type: ignore[assignment]
            raise TuningInterrupted(grid_with_scores(tuner, steps, candidates)) from None
    candidates["searched"] = best["times"]  # type: ignore[assignment]
    return grid_with_scores(tuner, steps, candidates)


class TuningInterrupted(KeyboardInterrupt):
    """Ctrl-C during a search: ``grid`` is the best found so far, validated and scored."""

    def __init__(self, grid: TunedGrid) -> None:
        super().__init__()
        self.grid = grid


def grid_with_scores(tuner: Tuner, steps: int, candidates: dict[str, tuple[float, ...]]) -> TunedGrid:
    """The candidate grid with the lowest validation error (the first of equals: the default grid comes
    first), measured on the tuning, validation and held-out samples."""
    s, t_min = tuner.settings, tuner.pipeline.config.t_min
    for name, times in candidates.items():
        check_times(times, steps, t_min, f"the {name} {s.sampler} grid of {steps} steps")
    validation = tuner.samples(s.validation_seed, s.tune_n, s.tune_length)
    by_times: dict[tuple[float, ...], float] = {}  # the default grid may be a power grid, the search may not improve
    for times in candidates.values():
        if times not in by_times:
            by_times[times] = tuner.search_error(validation, s.sampler, steps, times)
    validated = {name: by_times[times] for name, times in candidates.items()}
    kept = min(validated, key=validated.__getitem__)
    times = candidates[kept]
    train = tuner.score(tuner.samples(s.tune_seed, s.tune_n, s.tune_length), s.sampler, steps, times)
    measured = {
        "reference": f"ddim@{s.reference_steps}",
        "tuning": {"seed": s.tune_seed, "n": s.tune_n, "length": s.tune_length, "evaluations": s.evaluations, "objective": s.objective},
        "validation": {
            "seed": s.validation_seed,
            "n": s.tune_n,
            "length": s.tune_length,
            "errors": {name: round(error, 6) for name, error in validated.items()},
            "kept": kept,
        },
        "held_out_samples": {"seed": s.held_out_seed, "n": s.held_out_n, "lengths": list(s.held_out_lengths)},
        "train": {**train.to_dict(), "search_error": round(train.search_error, 6)},
        "held_out": tuner.held_out(s.sampler, steps, times),
        "default_grid_held_out": tuner.held_out(s.sampler, steps, None),
        "ddim50_held_out": tuner.held_out("ddim", DDIM_BASELINE_STEPS, None),
    }
    return TunedGrid(s.sampler, steps, times, measured)


def matches_ddim50(grid: TunedGrid) -> bool:
    """Held-out error no larger and tokens no fewer than DDIM@50's, at every held-out length."""
    ours, ddim = grid.measured["held_out"], grid.measured["ddim50_held_out"]
    return all(ours[n]["error"] <= ddim[n]["error"] and ours[n]["tokens"] >= ddim[n]["tokens"] for n in ours)


def schedules_of(grids: Sequence[TunedGrid], sha256: str, config: LDLMConfig, earlier: TunedSchedules | None = None) -> TunedSchedules:
    """``grids`` (replacing ``earlier``'s of the same sampler and steps), tuned at ``config``'s t_min and prior
    temperature, with each sampler's default: the fewest tuned steps that match DDIM@50."""
    kept = [
        g for g in (earlier.grids if earlier is not None else ()) if not any(g.sampler == n.sampler and g.steps == n.steps for n in grids)
    ]
    every = tuple(sorted((*kept, *grids), key=lambda g: (g.sampler, g.steps)))
    defaults: dict[str, int] = {}
    for g in every:
        if g.sampler not in defaults and matches_ddim50(g):
            defaults[g.sampler] = g.steps
    return TunedSchedules(sha256, config.t_min, every, defaults, config.effective_prior_temperature)


def default_changes(config: LDLMConfig, before: TunedSchedules | None, after: TunedSchedules) -> dict[str, tuple[int, int]]:
    """Per sampler that either names, the default step count generation takes with ``before`` and with
    ``after`` (a sampler without a tuned default, or grids tuned for another t_min or prior temperature, takes
    the config's ``default_steps``, as ``ldlm.sampling.resolve`` does)."""

    def defaults(schedules: TunedSchedules | None) -> dict[str, int]:
        if schedules is None or not schedules.tuned_for(config.t_min, config.effective_prior_temperature):
            return {}
        return dict(schedules.defaults)

    old, new = defaults(before), defaults(after)
    samplers = sorted({*old, *new, *(g.sampler for g in after.grids)})
    return {s: (old.get(s, config.default_steps), new.get(s, config.default_steps)) for s in samplers}
