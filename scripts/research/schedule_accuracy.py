#!/usr/bin/env python
"""Tuned step grids against the default grid and DDIM, on held-out samples: the measurement behind
``ldlm tune-schedule``'s defaults.

For each preset (a random-init checkpoint with random norms, as ``ldlm init --norm-init random``, or a
checkpoint directory) and each sampler of ``--samplers``, the grids of ``--steps`` are tuned as
``ldlm tune-schedule`` tunes them (ldlm/training/grid_search.py: power scan, search on the tuning seed and length,
the lowest validation error of the default, best power and searched grids kept; DDIM@--reference-steps
as the reference), then every kept grid is scored on held-out seeds at every held-out length: the
relative error of the final latent and the token agreement with the reference, beside the sampler's
default grid at the same step count and DDIM at 10..100 steps. The tuning time is recorded per step
count, and the references are computed once per model for all samplers.

    python scripts/research/schedule_accuracy.py --presets tiny --samplers dpm3m-psc,dpm3m-psc-unic --steps 8,10 --evaluations 400 --threads 2 \
        --out docs/measurements/schedules-tiny-pooled-2026-12-05.json

Writes the JSON and, beside it, a PNG (held-out error against denoiser calls: DDIM, default grid, tuned).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ldlm.device import resolve_device
from ldlm.files import save_figure, write_atomically
from ldlm.model.config import DEFAULT_TUNING_OBJECTIVE, TUNING_OBJECTIVES
from ldlm.pipeline import LDLMPipeline
from ldlm.training.grid_search import Tuner, TuningSettings, matches_ddim50, tune_grid

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from scripts.harness.models import preset_or_checkpoint  # noqa: E402

DDIM_STEPS = (10, 20, 50, 100)


def measure(
    name: str, settings: TuningSettings, seed: int, references: dict | None = None, device: str = "cpu"
) -> tuple[dict[str, Any], dict]:
    """``references``: those of an earlier sampler on the same model, reused (they do not depend on the sampler).
    ``device``: where the model runs and the noise is drawn (references and candidates alike)."""
    pipe = LDLMPipeline(*preset_or_checkpoint(name, seed), device=device)
    tuner = Tuner(pipe, settings, {} if references is None else references)
    started = time.perf_counter()
    tuner.samples(settings.tune_seed, settings.tune_n, settings.tune_length)  # the references, timed apart
    tuner.samples(settings.validation_seed, settings.tune_n, settings.tune_length)
    for length in settings.held_out_lengths:
        tuner.samples(settings.held_out_seed, settings.held_out_n, length)
    reference_s = time.perf_counter() - started
    grids = []
    for steps in settings.steps:
        started = time.perf_counter()
        grid = tune_grid(tuner, steps, progress=True)
        grids.append({"steps": steps, "times": grid.times, "tuning_s": round(time.perf_counter() - started, 1), **grid.measured})
        grids[-1]["matches_ddim50"] = matches_ddim50(grid)
        print(
            f"{name} {settings.sampler}@{steps} ({grid.measured['validation']['kept']} kept): held out {grid.measured['held_out']} "
            f"vs DDIM@50 {grid.measured['ddim50_held_out']}",
            flush=True,
        )
    ddim = {str(s): tuner.held_out("ddim", s, None) for s in DDIM_STEPS}
    model = {"preset": name, "sampler": settings.sampler, "references_s": round(reference_s, 1), "grids": grids, "ddim_held_out": ddim}
    return model, tuner.references


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        lengths = list(model["ddim_held_out"]["10"])
        for length in lengths:
            ax.plot(
                DDIM_STEPS,
                [model["ddim_held_out"][str(s)][length]["error"] for s in DDIM_STEPS],
                "o-",
                color="grey",
                alpha=0.6,
                label=f"DDIM L{length}",
            )
            steps = [g["steps"] for g in model["grids"]]
            ax.plot(steps, [g["default_grid_held_out"][length]["error"] for g in model["grids"]], "s--", label=f"default grid L{length}")
            ax.plot(steps, [g["held_out"][length]["error"] for g in model["grids"]], "^-", label=f"tuned L{length}")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="denoiser calls",
            ylabel="held-out relative latent error",
            title=f"{model['preset']} ({model['sampler']})",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--presets", default="tiny", help="comma-separated presets (random init, random norms) or checkpoint directories (default: tiny)"
    )
    parser.add_argument("--samplers", default="dpm3m-psc", help="comma-separated samplers to tune, side by side (default: dpm3m-psc)")
    parser.add_argument("--steps", default="6,8,10,12", help="step counts (default: 6,8,10,12)")
    parser.add_argument("--evaluations", type=int, default=600, help="sampling runs per step count (default: 600)")
    parser.add_argument("--reference-steps", type=int, default=1000, help="DDIM steps of the reference (default: 1000)")
    parser.add_argument("--tune", default="64x64", help="tuning samples NxLENGTH, as ldlm tune-schedule's (default: 64x64)")
    parser.add_argument("--held-out", default="32x32,64,128", help="held-out samples Nxlengths (default: 32x32,64,128)")
    parser.add_argument(
        "--objective",
        choices=TUNING_OBJECTIVES,
        default=DEFAULT_TUNING_OBJECTIVE,
        help="what the search minimizes (ldlm/training/grid_search.py; default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="init seed of the random checkpoints (default: 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda[:N], fp32 with TF32 off; the noise is drawn there, so grids and figures differ from the CPU's by the draw (default: cpu)",
    )
    parser.add_argument("--out", default="runs/schedules.json", help="JSON path; the PNG goes beside it")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32: the reference and the candidates alike
    device = str(resolve_device(args.device))
    tune_n, tune_length = (int(v) for v in args.tune.split("x"))
    held_n, held_lengths = args.held_out.split("x")
    models = []
    for name in args.presets.split(","):
        references = None
        for sampler in args.samplers.split(","):
            settings = TuningSettings(
                sampler, tuple(int(s) for s in args.steps.split(",")), args.reference_steps, 101, tune_n, tune_length,
                202, int(held_n), tuple(int(n) for n in held_lengths.split(",")), args.evaluations, args.objective,
            )  # fmt: skip
            model, references = measure(name, settings, args.seed, references, device)
            models.append(model)
    report = {
        "settings": vars(args),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
            "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
        },
        "models": models,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
