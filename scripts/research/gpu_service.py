"""The service stages of scripts/research/gpu_check.py: ``ldlm serve`` on loopback (overhead over the raw
runner, a short bounded load; the cost of streamed previews) and ``ldlm probe-eps`` where NVIDIA
TensorRT is importable."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ldlm.model.checkpoint import init_model, save_checkpoint
from ldlm.model.config import preset
from ldlm.model.tokenizer import TextTokenizer
from ldlm.serve.runtime.graph_backend import GraphBackend

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script
from scripts.harness import traffic  # noqa: E402
from scripts.harness.loopback import free_port, serve_command, start_server, stop_server  # noqa: E402


def kserve_encoder_body(length: int, seed: int) -> bytes:
    """The load test's encoder request (batch 1), asking for the latents as binary data."""
    return json.dumps(
        {**traffic.encoder_body(length, seed), "outputs": [{"name": "latents", "parameters": {"binary_data": True}}]}
    ).encode()


def http_stage(checkpoint: Path, raw_encoder: GraphBackend, device: torch.device, sizes: dict[str, Any], out: Path) -> dict[str, Any]:
    """``ldlm serve`` (compiled, in its default precision on the device) in its own process on 127.0.0.1: the overhead of
    the service over the raw runner at batch 1 (encoder, 16 tokens, binary output), then a short
    bounded load of mixed requests from concurrent clients."""
    import httpx

    port = free_port()
    flags = ["--backend", "compiled", "--device", str(device), "--max-batch", "16"]
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {"command": " ".join(serve_command(checkpoint, port, flags)[1:])}
    log_path = out / "server.log"
    with log_path.open("w") as log:
        started = time.perf_counter()
        server = start_server(checkpoint, port, flags, log=log, log_path=log_path, timeout_s=sizes["server_ready_s"])
        result["ready_after_s"] = round(time.perf_counter() - started, 1)
        try:
            body = kserve_encoder_body(16, 0)
            feed = {i["name"]: np.asarray(i["data"], dtype=np.int64).reshape(i["shape"]) for i in json.loads(body)["inputs"]}
            http_ms, raw_ms = [], []
            with httpx.Client(base_url=url, timeout=30) as client:
                for _ in range(20):  # warm-up both (the server captures its batch-1 bucket here)
                    response = client.post("/v2/models/encoder/infer", content=body)
                    if response.status_code != 200:
                        raise RuntimeError(f"encoder infer answered {response.status_code}: {response.text[:300]}")
                    raw_encoder.run(feed)
                for _ in range(sizes["overhead_requests"]):
                    start = time.perf_counter()
                    response = client.post("/v2/models/encoder/infer", content=body)
                    http_ms.append(1000 * (time.perf_counter() - start))
                    if response.status_code != 200:
                        raise RuntimeError(f"encoder infer answered {response.status_code}: {response.text[:300]}")
                    start = time.perf_counter()
                    raw_encoder.run(feed)  # NumPy in and out, as the server's batcher runs it
                    raw_ms.append(1000 * (time.perf_counter() - start))
            result["overhead"] = {
                "graph": "encoder",
                "batch": 1,
                "length": 16,
                "requests": len(http_ms),
                "client": "httpx, JSON inputs, binary output",
                "http_p50_ms": round(statistics.median(http_ms), 3),
                "http_p99_ms": round(float(np.percentile(http_ms, 99)), 3),
                "runner_p50_ms": round(statistics.median(raw_ms), 3),
                "overhead_p50_ms": round(statistics.median(http_ms) - statistics.median(raw_ms), 3),
            }
            result["load"] = traffic.run_clients(url, sizes["http_clients"], sizes["http_seconds"], traffic.latent_width(url))
        finally:
            result["server_exit_code"] = stop_server(server)
    return result


def previews_stage(checkpoint: Path, device: torch.device, sizes: dict[str, Any], out: Path) -> dict[str, Any]:
    """On the GPU: what streamed previews every 5 steps cost. ``ldlm serve`` (compiled, its default precision)
    runs with ``--preview-budget 1 --preview-lone-budget 1``, so no preview is skipped to save time; the same concurrent
    load of /v1/generate requests runs with and without ``stream: true``, side by side in
    alternating order; then the time to the first preview event at batch 1."""
    import preview_cost

    port = free_port()
    log_path = out / "server-previews.log"
    flags = [
        "--backend",
        "compiled",
        "--device",
        str(device),
        "--max-batch",
        "16",
        "--preview-budget",
        "1",
        "--preview-lone-budget",
        "1",
    ]
    url = f"http://127.0.0.1:{port}"
    every, clients, requests = 5, sizes["preview_clients"], sizes["preview_requests"]
    plain = {"n": 1, "length": sizes["preview_len"], "steps": sizes["preview_steps"], "sampler": "sde"}
    streamed = {**plain, "stream": True, "preview_every": every}
    result: dict[str, Any] = {
        "preview_every": every,
        "clients": clients,
        "requests_per_client": requests,
        **plain,
        "server": " ".join(serve_command(checkpoint, port, flags)[1:]),
    }
    with log_path.open("w") as log:
        server = start_server(checkpoint, port, flags, log=log, log_path=log_path, timeout_s=sizes["server_ready_s"])
        try:
            preview_cost.run_load(url, clients, 1, plain)  # warm up both paths (captures the buckets)
            preview_cost.run_load(url, clients, 1, streamed)
            rates: dict[str, list[float]] = {"plain": [], "previews": []}
            received = 0
            for r in range(sizes["preview_rounds"]):
                for mode in ("plain", "previews") if r % 2 == 0 else ("previews", "plain"):
                    rate, events = preview_cost.run_load(url, clients, requests, plain if mode == "plain" else streamed)
                    rates[mode].append(round(rate, 1))
                    received += events
            medians = {m: statistics.median(v) for m, v in rates.items()}
            result.update(
                sample_steps_per_s=rates,
                throughput_cost=round(1 - medians["previews"] / medians["plain"], 4),
                preview_events_per_request=round(received / (sizes["preview_rounds"] * clients * requests), 2),
                preview_events_per_request_nominal=(plain["steps"] - 1) // every,
                first_preview_batch1=preview_cost.first_preview_seconds(url, streamed, 5),
            )
        finally:
            result["server_exit_code"] = stop_server(server)
    return result


def probe_eps_stage(work: Path) -> dict[str, Any]:
    """``ldlm probe-eps`` on tiny engines, only where NVIDIA TensorRT is importable and the command exists."""
    if importlib.util.find_spec("tensorrt") is None:
        return {"skipped": "NVIDIA TensorRT is not importable here"}
    help_text = subprocess.run([sys.executable, "-P", "-m", "ldlm.cli", "--help"], capture_output=True, text=True).stdout
    if "probe-eps" not in help_text:
        return {"skipped": "this ldlm has no probe-eps command"}
    # Every norm with its own scale and bias, as trained: a scale or bias mixed up between nodes shows.
    ckpt = save_checkpoint(init_model(preset("tiny"), 0, norm_init="random"), TextTokenizer.gpt2(), work / "tiny-ckpt")
    steps = [
        ["export", str(ckpt), str(work / "tiny-onnx"), "--quiet"],
        ["build-engine", str(work / "tiny-onnx"), str(work / "tiny-engines"), "--flavor", "tensorrt", "--quiet"],
        ["probe-eps", str(ckpt), "--engine-dir", str(work / "tiny-engines")],
    ]
    result: dict[str, Any] = {}
    for argv in steps:
        done = subprocess.run([sys.executable, "-P", "-m", "ldlm.cli", *argv], capture_output=True, text=True, timeout=240)
        result[argv[0]] = {"exit_code": done.returncode, "output": (done.stdout + done.stderr)[-2000:]}
        if done.returncode != 0:
            break
    return result
