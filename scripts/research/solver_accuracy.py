#!/usr/bin/env python
"""How close each solver gets, step count by step count, to a long DDIM run: the table the server's
default sampler and step count are chosen from.

For each preset (random-init checkpoint with random norms, as ``ldlm init --norm-init random``), every
deterministic solver runs from the same priors at each step count, and is compared with DDIM at
``--reference-steps`` (2,000: today's sampler in its limit) on the final latent's relative L2 error and
on the decoded tokens' agreement. Self-conditioning is on, as the model is trained and served. The
stochastic ``sde`` solver samples another path by design and is left out.

A Gaussian oracle section gives the same errors against the exact ODE solution, and each solver's
observed order (log-log slope over 50..200 steps); see tests/ldlm/sampling/test_samplers.py.

    python scripts/research/solver_accuracy.py --out docs/measurements/solvers-2026-12-01.json

Writes the JSON and, beside it, a PNG (error and agreement against denoiser calls, log-log).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ldlm.files import save_figure, write_atomically
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import run_sampler
from ldlm.sampling.samplers import SAMPLERS_BY_NAME
from ldlm.sampling.schedule import TangentSchedule

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from scripts.harness.models import preset_or_checkpoint  # noqa: E402

DETERMINISTIC = [name for name, solver in SAMPLERS_BY_NAME.items() if not solver.stochastic]
SHAPES = {"tiny": (8, 64), "base": (2, 32)}  # (samples, tokens) per preset: base runs 2,000 steps on a CPU


def compare_on_model(
    name: str, steps: list[int], reference_steps: int, seed: int, cache: Path | None = None, solvers: list[str] = DETERMINISTIC
) -> dict[str, Any]:
    pipe = LDLMPipeline(*preset_or_checkpoint(name, seed))
    n, length = SHAPES["base" if pipe.config.d_model >= 768 else "tiny"]
    started = time.perf_counter()
    cached = None if cache is None else cache / f"{Path(name).name}-n{n}-L{length}-ddim{reference_steps}-seed{seed}.safetensors"
    if cached is not None and cached.is_file():  # the reference of an earlier run (base: 20 minutes on 2 cores)
        reference = load_file(cached)["latents"]
    else:
        reference = pipe.sample_latents(n, length, reference_steps, seed, "ddim", progress=True)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            save_file({"latents": reference.contiguous()}, str(cached))
    reference_tokens = pipe.decode(reference).token_ids
    rows: dict[str, list[dict[str, float]]] = {}
    for solver in solvers:
        rows[solver] = []
        for count in tqdm(steps, desc=f"{name} {solver}", unit="run"):
            latents = pipe.sample_latents(n, length, count, seed, solver)
            rows[solver].append(
                {
                    "steps": count,
                    "latent_rel_error": round(float((latents - reference).norm() / reference.norm()), 5),
                    "token_agreement": round(float((pipe.decode(latents).token_ids == reference_tokens).float().mean()), 4),
                }
            )
    return {
        "preset": name,
        "n": n,
        "length": length,
        "reference": f"ddim@{reference_steps}",
        "seed": seed,
        "seconds": round(time.perf_counter() - started, 1),
        "solvers": rows,
        "verdict": verdict(rows),
    }


def verdict(rows: dict[str, list[dict[str, float]]], baseline: tuple[str, int] = ("ddim", 50)) -> dict[str, Any]:
    """For each solver, the fewest steps at which it agrees with the reference at least as well as the
    baseline, in tokens and in latent error at once."""
    base = next((r for r in rows.get(baseline[0], []) if r["steps"] == baseline[1]), None)
    if base is None:
        return {}
    out: dict[str, Any] = {"baseline": f"{baseline[0]}@{baseline[1]}", **{k: base[k] for k in ("latent_rel_error", "token_agreement")}}
    for solver, entries in rows.items():
        good = [
            r["steps"]
            for r in entries
            if r["latent_rel_error"] <= base["latent_rel_error"] and r["token_agreement"] >= base["token_agreement"]
        ]
        out[solver] = {
            "fewest_steps_as_good": min(good) if good else None,
            "fewer_calls": round(baseline[1] / min(good), 2) if good else None,
        }
    return out


def oracle(steps: list[int]) -> dict[str, Any]:
    """Errors against the exact ODE solution for Gaussian data x0 ~ N(mu, s^2 I) (closed-form denoiser)."""
    schedule, mu, s, t_min = TangentSchedule(3.0, 0.95), 0.3, 0.5, 0.05
    prior = torch.randn(2, 256, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def denoise(x: torch.Tensor, t: torch.Tensor, x0_prev: torch.Tensor) -> torch.Tensor:
        a, sg = schedule.alpha(t)[:, None, None], schedule.sigma(t)[:, None, None]
        return mu + a * s**2 * (x - a * mu) / (a**2 * s**2 + sg**2)

    t = torch.tensor(t_min, dtype=torch.float64)
    exact = schedule.alpha(t) * mu + torch.sqrt(schedule.alpha(t) ** 2 * s**2 + schedule.sigma(t) ** 2) * prior
    out: dict[str, Any] = {}
    for name in DETERMINISTIC:
        solver = SAMPLERS_BY_NAME[name]
        errors = []
        for count in steps:
            x = run_sampler(denoise, prior, lambda: prior, solver.time_grid(count, t_min, schedule), schedule, name)
            errors.append(float((x - exact).norm() / exact.norm()))
        tail = [i for i, c in enumerate(steps) if c >= 50]
        slope = -float(np.polyfit(np.log([steps[i] for i in tail]), np.log([errors[i] for i in tail]), 1)[0]) if len(tail) > 1 else None
        out[name] = {
            "grid": solver.grid,
            "steps": steps,
            "rel_error": [round(e, 8) for e in errors],
            "observed_order": None if slope is None else round(slope, 2),
        }
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    fig, axes = plt.subplots(2, len(models) + 1, figsize=(5 * (len(models) + 1), 8), squeeze=False)
    for col, model in enumerate(models):
        for solver, rows in model["solvers"].items():
            calls = [r["steps"] for r in rows]
            axes[0][col].loglog(calls, [r["latent_rel_error"] for r in rows], "o-", label=solver)
            axes[1][col].semilogx(calls, [100 * r["token_agreement"] for r in rows], "o-", label=solver)
        axes[0][col].set_title(f"{model['preset']}: latent error vs {model['reference']}")
        axes[1][col].set_title(f"{model['preset']}: token agreement (%)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("denoiser calls")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    for solver, entry in report["oracle"].items():
        axes[0][-1].loglog(entry["steps"], entry["rel_error"], "o-", label=f"{solver} (order {entry['observed_order']})")
    axes[0][-1].set_title("Gaussian oracle: error vs exact ODE solution")
    axes[0][-1].set_xlabel("denoiser calls")
    axes[0][-1].legend()
    axes[0][-1].grid(True, which="both", alpha=0.3)
    axes[1][-1].axis("off")
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--presets",
        default="tiny,base",
        help="comma-separated presets (random init, random norms) or checkpoint directories (default: tiny,base)",
    )
    parser.add_argument("--steps", default="5,10,15,20,30,50,100", help="step counts (default: 5,10,15,20,30,50,100)")
    parser.add_argument("--reference-steps", type=int, default=2000, help="DDIM steps of the reference (default: 2000)")
    parser.add_argument("--seed", type=int, default=0, help="checkpoint and noise seed (default: 0)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--out", default="runs/solvers.json", help="JSON path; the PNG goes beside it")
    parser.add_argument(
        "--solvers", default=",".join(DETERMINISTIC), help=f"deterministic solvers to run (default: {','.join(DETERMINISTIC)})"
    )
    parser.add_argument("--reference-cache", help="directory to keep each reference in (safetensors) and reuse it from")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    if any(s < 1 for s in steps) or args.reference_steps < 1:
        parser.error(f"--steps {args.steps} / --reference-steps {args.reference_steps}: allowed: integers >= 1")
    solvers = args.solvers.split(",")
    bad = [name for name in solvers if name not in DETERMINISTIC]
    if bad:
        parser.error(f"--solvers {','.join(bad)}: allowed: {', '.join(DETERMINISTIC)}")
    cache = Path(args.reference_cache) if args.reference_cache else None
    torch.set_num_threads(args.threads)
    report = {
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "oracle": oracle(sorted(set(steps + [200]))),
        "models": [compare_on_model(name, steps, args.reference_steps, args.seed, cache, solvers) for name in args.presets.split(",")],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    for model in report["models"]:
        print(f"{model['preset']}: {json.dumps(model['verdict'])}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
