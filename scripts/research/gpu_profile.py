#!/usr/bin/env python
"""Where a served generation's GPU time goes, for the targets that scripts/research/gpu_check.py reports
missed: the denoiser's own time against the sampler's per step, the kernels of one denoiser call,
and what torch.compile (Inductor) changes. Writes OUT/gpu_profile.json, rewritten after every
stage (gpu_check.py's Run), so a run cut short keeps what it measured.

    python scripts/research/gpu_profile.py --out $OUT                # base config, on CUDA
    python scripts/research/gpu_profile.py --tiny --out runs/prof    # tiny config, whatever device: a dry run

Stages, in order (each skipped with the reason when --budget-s would be exceeded):
- step_split: at batch 1 and the longest length, the denoiser alone (the served compiled bf16
  backend: a CUDA graph replay, timed with CUDA events) against one step of each sampler (the
  whole lockstep loop of `LDLMPipeline.sample_latents` divided by its steps). The difference is
  the sampler's own work per step: inputs copied into the graph's buffers, the update, noise.
- kernels: torch.profiler over one eager bf16 denoiser call at batch 1 x longest length and at the
  throughput shape: the number of kernels, their summed GPU time, the top kernels by time.
- inductor: the inductor backend (InductorBackend: torch.compile of the bf16 denoiser in the buckets'
  CUDA graphs; mode "max-autotune-no-cudagraphs" is not used, its autotuning does not fit the time)
  against the compiled backend's replay at the same shapes, with the largest absolute difference
  between their outputs on the same random inputs.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ldlm.model.checkpoint import init_model
from ldlm.model.config import SAMPLERS, preset
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.runtime.backends import BackendGraphs
from ldlm.serve.runtime.torch_backends import CompiledBackend, InductorBackend, length_buckets, prepare_model

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import Run  # noqa: E402

STAGES = ("step_split", "kernels", "inductor")
SIZES = {
    "base": {"long_len": 1024, "steps": 20, "runs": 20, "tps_batch": 256, "tps_len": 128, "top": 12},
    "tiny": {"long_len": 128, "steps": 5, "runs": 3, "tps_batch": 8, "tps_len": 32, "top": 5},
}


def device_ms(fn: Callable[[], Any], runs: int, device: torch.device) -> float:
    """Median wall time of ``fn`` in ms: CUDA events on a GPU, the host clock elsewhere."""
    fn()  # warm-up (and capture)
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - begin))
    return round(statistics.median(times), 4)


def random_inputs(backend: CompiledBackend, batch: int, length: int) -> dict[str, torch.Tensor]:
    """The denoiser's inputs, random where they are activations (zeros would flatter the matmuls)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    inputs = backend.example_inputs(batch, length)
    for name, value in inputs.items():
        if value.is_floating_point():
            rand = torch.rand if name == "t" else torch.randn
            inputs[name] = rand(value.shape, generator=generator).to(value.device, value.dtype)
    return inputs


def step_split(denoiser: CompiledBackend, pipe: LDLMPipeline, sizes: dict[str, int], device: torch.device) -> dict[str, Any]:
    length, steps = sizes["long_len"], sizes["steps"]
    feed = random_inputs(denoiser, 1, length)
    alone = device_ms(lambda: denoiser.run_tensors(feed), sizes["runs"], device)
    result: dict[str, Any] = {"batch": 1, "length": length, "steps": steps, "denoiser_call_ms": alone, "per_step_ms": {}}
    with torch.inference_mode():
        for sampler in SAMPLERS:
            total = device_ms(lambda s=sampler: pipe.sample_latents(1, length, steps, 0, s), max(2, sizes["runs"] // 5), device)
            per_step = total / steps
            result["per_step_ms"][sampler] = {"step_ms": round(per_step, 4), "sampler_overhead_ms": round(per_step - alone, 4)}
    return result


def kernels(model_bf16: Any, sizes: dict[str, int], device: torch.device) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from ldlm.serve.runtime.torch_backends import EagerBackend

    eager = EagerBackend(model_bf16, "denoiser")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    result: dict[str, Any] = {"backend": eager.provider}
    for batch, length in ((1, sizes["long_len"]), (sizes["tps_batch"], sizes["tps_len"])):
        feed = random_inputs(CompiledBackend(model_bf16, "denoiser", cuda_graphs=False), batch, length)
        eager.run_tensors(feed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            eager.run_tensors(feed)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        rows = []
        for event in prof.key_averages():
            gpu_us = getattr(event, "device_time_total", 0.0) if device.type == "cuda" else event.self_cpu_time_total
            if device.type == "cuda" and getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            rows.append((gpu_us, event.count, event.key))
        if device.type != "cuda":  # on CPU: the aten ops, not kernels
            rows = [r for r in rows if r[2].startswith("aten::")]
        rows.sort(reverse=True)
        result[f"b{batch}/L{length}"] = {
            "kernels": sum(r[1] for r in rows),
            "summed_ms": round(sum(r[0] for r in rows) / 1000, 4),
            "top": [{"ms": round(us / 1000, 4), "count": count, "name": name[:120]} for us, count, name in rows[: sizes["top"]]],
        }
    return result


def inductor(denoiser: CompiledBackend, model_bf16: Any, sizes: dict[str, int], device: torch.device) -> dict[str, Any]:
    compiled_backend = InductorBackend(model_bf16, "denoiser", batch_buckets=(1, sizes["tps_batch"]))
    result: dict[str, Any] = {"backend": compiled_backend.provider}
    for batch, length in (
        (1, sizes["long_len"]),
        (1, 128 if sizes["long_len"] > 128 else sizes["long_len"] // 2),
        (sizes["tps_batch"], sizes["tps_len"]),
    ):
        feed = random_inputs(denoiser, batch, length)
        start = time.perf_counter()
        with torch.inference_mode():
            mine = compiled_backend.run_tensors(feed)  # compiles and captures
        compile_s = time.perf_counter() - start
        with torch.inference_mode():
            served = denoiser.run_tensors(feed)
            diff = max(float((mine[n] - served[n]).abs().max()) for n in served)
        result[f"b{batch}/L{length}"] = {
            "served_ms": device_ms(lambda feed=feed: denoiser.run_tensors(feed), sizes["runs"], device),
            "inductor_ms": device_ms(lambda feed=feed: compiled_backend.run_tensors(feed), sizes["runs"], device),
            "compile_and_capture_s": round(compile_s, 1),
            "max_abs_difference": diff,
        }
        cell = result[f"b{batch}/L{length}"]
        cell["speedup"] = round(cell["served_ms"] / cell["inductor_ms"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_profile", help="output directory (default: runs/gpu_profile)")
    parser.add_argument("--tiny", action="store_true", help="tiny config and small sizes: a dry run on any device")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stages that would not fit are skipped (default: 240)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset (default: all of {', '.join(STAGES)})")
    args = parser.parse_args()
    selected = set(args.stages.split(","))
    if not selected <= set(STAGES):
        parser.error(f"--stages {args.stages!r} names unknown stages; allowed: {', '.join(STAGES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config_name = "tiny" if args.tiny else "base"
    sizes = SIZES[config_name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.budget_s, selected, name="gpu_profile", markdown=None)
    run.report.update(
        date=datetime.date.today().isoformat(),
        config=config_name,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        python=sys.version.split()[0],
        sizes=sizes,
    )
    model = prepare_model(init_model(preset(config_name), 0), device, "bf16")
    denoiser = CompiledBackend(model, "denoiser", batch_buckets=(1, sizes["tps_batch"]))
    graphs = BackendGraphs({g: CompiledBackend(model, g) for g in ("encoder", "decoder")} | {"denoiser": denoiser})
    pipe = LDLMPipeline(graphs, TextTokenizer.gpt2(), device, config=model.config, buckets=length_buckets(model.config.max_seq_len))
    run.stage("step_split", lambda: step_split(denoiser, pipe, sizes, device), 30)
    run.stage("kernels", lambda: kernels(model, sizes, device), 20)
    run.stage("inductor", lambda: inductor(denoiser, model, sizes, device), 120)
    print(f"wrote {out / 'gpu_profile.json'} in {run.report['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    main()
