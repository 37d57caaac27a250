#!/usr/bin/env python
"""Per-step solver coefficients searched with the grid: how far they take a few-step sampler on a
checkpoint, beyond the tuned grid that ``ldlm tune-schedule`` ships (a measurement of a method the
product does not ship: ldlm/sampling/samplers.py has no per-step coefficients).

For dpm3m-psc-unic at ``--steps`` N, the search is over 3N numbers, from the checkpoint's tuned grid
(its ``schedules.json``) with every coefficient at 1:
  - the grid's N step-size logits (ldlm/training/grid_search.py's ``grid_of``);
  - k_i, a multiplier on step i's multistep correction: the step's x0 is m0 + k_i (x0_multistep - m0);
  - c_i, a multiplier on the corrector's change at step i: x <- x + c_i (x_redone - x)
(S4S-style learned solver coefficients, without gradients: Nelder-Mead, ``--evaluations`` runs).
What it minimizes on the tuning samples (seed 101, 64 x 64 tokens), each against DDIM@1000:
  - ``pooled``: the relative latent error, as ``ldlm tune-schedule``;
  - ``count``: the larger of the latent error's and a smooth count of changed tokens' ratios to
    DDIM@50's on the same samples. The count is sum sigmoid(-margin / T), margin = the decoder's logit of
    the reference's token minus the largest other logit: 1 per changed token and 0 per kept one, as
    T -> 0 (the plain count is flat between changes, which stops a simplex search dead), less what the
    reference itself scores (its tokens whose margin is under a few T count half, for every run alike).
The result is scored on validation samples (seed 303) and on held-out samples (seed 202, 32 at each of
32, 64 and 128 tokens) beside the tuned grid alone and DDIM@50.

    python scripts/research/solver_coefficients.py models/ldlm-austen-tiny --steps 8 --evaluations 700 --objective count \
        --references runs/references.pt --out docs/measurements/solver-coefficients-reference-2026-12-05.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ldlm.files import write_atomically
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest, resolve, run_lockstep
from ldlm.sampling.samplers import Sampler, StepResult, ddim_step, get_sampler, multistep_x0, predicted_self_conditioning
from ldlm.sampling.schedule import per_sample
from ldlm.training.grid_search import Samples, Tuner, TuningSettings, grid_of, logits_of, nelder_mead

SAMPLER = "dpm3m-psc-unic"


@dataclass(frozen=True)
class ScaledSampler(Sampler):
    """dpm3m-psc-unic with multipliers k (multistep correction) and c (corrector change), one per step,
    looked up by the step's time in ``times``."""

    times: tuple[float, ...] = ()
    k: tuple[float, ...] = ()
    c: tuple[float, ...] = ()

    def at(self, values: tuple[float, ...], t: Tensor, like: Tensor) -> Tensor:
        grid = torch.tensor(self.times[:-1], dtype=t.dtype, device=t.device)
        index = (grid[None, :] - t[:, None]).abs().argmin(dim=1)
        return per_sample(torch.tensor(values, dtype=torch.float64, device=t.device)[index]).to(like.dtype)

    def step(self, schedule, x, x0_hat, t, t_next, past, noise=None):  # type: ignore[no-untyped-def]
        lam, lam_next = schedule.log_snr(t), schedule.log_snr(t_next)
        multistep = multistep_x0(x0_hat, lam, lam_next, past[: self.order - 1])
        x_next = ddim_step(schedule, x, x0_hat + self.at(self.k, t, x) * (multistep - x0_hat), t, t_next)
        return StepResult(x_next, x_next, predicted_self_conditioning(x0_hat, lam, lam_next, past))

    def correct(self, schedule, x, x_prev, x0_hat, t_prev, t, past):  # type: ignore[no-untyped-def]
        return x + self.at(self.c, t, x) * (super().correct(schedule, x, x_prev, x0_hat, t_prev, t, past) - x)


class Search:
    def __init__(self, pipeline: LDLMPipeline, steps: int, objective: str, temperature: float, cache: Path | None) -> None:
        self.pipeline, self.steps, self.objective, self.temperature, self.cache = pipeline, steps, objective, temperature, cache
        self.tuner = Tuner(pipeline, TuningSettings(SAMPLER, reference_steps=1000))
        if cache is not None and cache.is_file():
            self.tuner.references.update({key: Samples(*value) for key, value in torch.load(cache).items()})
        self.floor: dict[tuple[int, int], float] = {}  # what the reference's own latents score
        self.start = pipeline.schedules.grid(SAMPLER, steps).times  # type: ignore[union-attr]

    def save_references(self) -> None:
        if self.cache is not None:
            references = {key: (s.seed, s.n, s.length, s.reference, s.tokens) for key, s in self.tuner.references.items()}
            torch.save(references, self.cache)

    def sampler(self, z: np.ndarray) -> ScaledSampler:
        n = self.steps
        times = grid_of(logits_of(self.start) + z[2 * n :], self.pipeline.config.t_min)
        base = get_sampler(SAMPLER)
        return ScaledSampler(**{**vars(base), "times": times, "k": tuple(1 + z[:n]), "c": tuple(1 + z[n : 2 * n])})

    def latents(self, samples: Samples, sampler: Sampler, steps: int) -> Tensor:
        config = self.pipeline.config
        plan = resolve(GenerateRequest(samples.n, samples.length, steps, samples.seed, "ddim", config.t_min), config)
        if isinstance(sampler, ScaledSampler):
            plan = replace(plan, sampler=sampler, grid="tuned", tuned_times=sampler.times)
        engine = self.pipeline.engine
        with torch.inference_mode():
            states = engine.start(plan, config.d_model)
            return run_lockstep(engine, states, self.pipeline.graphs.denoise, self.pipeline.bucket_length(samples.length))

    def soft_changes(self, x: Tensor, tokens: Tensor) -> float:
        """sum sigmoid(-margin / T) over positions, per position."""
        total = 0.0
        with torch.inference_mode():
            for i in range(0, x.shape[0], 8):  # (8, L, V) logits at a time: the vocabulary is 50k wide
                logits = self.pipeline.graphs.decode_logits(x[i : i + 8], torch.ones(x[i : i + 8].shape[:2], dtype=torch.bool)).float()
                ref = tokens[i : i + 8, :, None]
                at_ref = logits.gather(-1, ref)[..., 0]
                margin = at_ref - logits.scatter(-1, ref, -torch.inf).max(dim=-1).values
                total += float(torch.sigmoid(-margin / self.temperature).sum())
        return total / tokens.numel()

    def score(self, samples: Samples, sampler: Sampler, steps: int, tokens: bool = True) -> dict[str, float]:
        """Latent error, soft changes (objective count) and, with ``tokens``, the token agreement: a search
        evaluation leaves it out: its value needs no argmax decode (2.35 s against 1.75 s per 64 x 64 evaluation)."""
        x = self.latents(samples, sampler, steps)
        if self.objective == "count" and (samples.seed, samples.length) not in self.floor:
            self.floor[(samples.seed, samples.length)] = self.soft_changes(samples.reference, samples.tokens)
        error = float((x - samples.reference).norm() / samples.reference.norm())
        agreement = float((self.pipeline.decode(x).token_ids == samples.tokens).double().mean()) if tokens else float("nan")
        soft = (
            self.soft_changes(x, samples.tokens) - self.floor[(samples.seed, samples.length)] if self.objective == "count" else float("nan")
        )
        return {"error": error, "tokens": agreement, "soft_changes": soft}

    def value(self, scored: dict[str, float], ddim50: dict[str, float]) -> float:
        if self.objective == "pooled":
            return scored["error"]
        return max(scored["error"] / ddim50["error"], scored["soft_changes"] / ddim50["soft_changes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory with a schedules.json tuned for dpm3m-psc-unic at --steps")
    parser.add_argument("--steps", type=int, default=8, help="steps (default: 8)")
    parser.add_argument("--evaluations", type=int, default=700, help="sampling runs of the search (default: 700)")
    parser.add_argument("--objective", choices=("pooled", "count"), default="count", help="what the search minimizes (default: count)")
    parser.add_argument("--temperature", type=float, default=0.1, help="T of the smooth count, in logits (default: 0.1)")
    parser.add_argument("--references", type=Path, default=None, help="a file to keep the DDIM@1000 references in between runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipeline = LDLMPipeline.from_checkpoint(args.checkpoint)
    search = Search(pipeline, args.steps, args.objective, args.temperature, args.references)
    ddim = get_sampler("ddim")
    tuning, validation = search.tuner.samples(101, 64, 64), search.tuner.samples(303, 64, 64)
    held_out = {length: search.tuner.samples(202, 32, length) for length in (32, 64, 128)}
    search.save_references()
    ddim50 = {"tuning": search.score(tuning, ddim, 50), "validation": search.score(validation, ddim, 50)}
    z0 = np.zeros(3 * args.steps)
    started = time.perf_counter()
    z, value = nelder_mead(
        lambda z: search.value(search.score(tuning, search.sampler(z), args.steps, tokens=False), ddim50["tuning"]),
        z0,
        args.evaluations,
        step=0.2,
    )
    search_s = time.perf_counter() - started
    result: dict = {
        "checkpoint": args.checkpoint, "sampler": SAMPLER, "steps": args.steps, "objective": args.objective,
        "temperature": args.temperature, "evaluations": args.evaluations, "search_s": round(search_s, 1),
        "reference": "ddim@1000", "tuning": {"seed": 101, "n": 64, "length": 64}, "validation": {"seed": 303, "n": 64, "length": 64},
        "held_out_samples": {"seed": 202, "n": 32, "lengths": [32, 64, 128]},
        "searched": {"times": list(search.sampler(z).times), "k": list(1 + z[: args.steps]), "c": list(1 + z[args.steps : 2 * args.steps])},
        "search_value": {"tuned_grid": search.value(search.score(tuning, search.sampler(z0), args.steps), ddim50["tuning"]), "searched": value},
    }  # fmt: skip
    for name, samples in (("tuning", tuning), ("validation", validation), *((f"held_out_{n}", s) for n, s in held_out.items())):
        result[name + "_scores"] = {
            "ddim50": ddim50.get(name) or search.score(samples, ddim, 50),
            "tuned_grid": search.score(samples, search.sampler(z0), args.steps),
            "searched": search.score(samples, search.sampler(z), args.steps),
        }
        print(name, json.dumps(result[name + "_scores"]), flush=True)
    write_atomically(args.out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
