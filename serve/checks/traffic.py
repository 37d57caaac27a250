"""Client traffic for the measuring scripts (load_test, triton_compare, attack_check, fairness,
preview_cost, gpu_service): KServe v2 and /v1 request bodies, N concurrent clients for M seconds, and
the JSON report they write. Traffic goes to loopback only (the scripts check their --url)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from ldlm.files import write_atomically


def encoder_body(length: int, seed: int) -> dict:
    ids = np.random.default_rng(seed).integers(0, 50257, length).tolist()
    return {
        "inputs": [
            {"name": "input_ids", "shape": [1, length], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, length], "datatype": "INT64", "data": [1] * length},
        ]
    }


def decoder_body(length: int, d: int, seed: int) -> dict:
    x = np.random.default_rng(seed).standard_normal(length * d).round(4).tolist()
    return {
        "inputs": [
            {"name": "latents", "shape": [1, length, d], "datatype": "FP32", "data": x},
            {"name": "attention_mask", "shape": [1, length], "datatype": "INT64", "data": [1] * length},
        ]
    }


def latent_width(url: str, timeout_s: float = 10.0) -> int:
    """The served model's d_model: the last axis of the decoder's latents input, from its KServe metadata."""
    return int(httpx.get(f"{url}/v2/models/decoder", timeout=timeout_s).json()["inputs"][0]["shape"][-1])


def generate_body(seed: int, length: int, steps: int) -> dict:
    return {"n": 1, "length": length, "steps": steps, "seed": seed, "sampler": "ddim"}


def run_clients(
    url: str,
    clients: int,
    seconds: float,
    d: int,
    mix: str = "mixed",
    gen_length: int = 16,
    gen_steps: int = 10,
    request_for: Callable[[int, int], tuple[str, dict | bytes]] | None = None,
) -> dict:
    """``mix``: "mixed" (70% encoder, 20% decoder, 10% /v1/generate) or "generate" (only
    /v1/generate, where the replicas' compute dominates over HTTP handling). ``request_for(client,
    i)``, when given, makes each request (path, JSON body as a dict or encoded bytes) instead
    (scripts/triton_compare.py)."""
    stop_at = time.perf_counter() + seconds
    lock = threading.Lock()
    stats = {"sent": 0, "answered": 0, "errors": 0, "lost": 0}
    by_status: dict[str, int] = {}
    latencies: list[float] = []

    def client(index: int) -> None:
        rng = np.random.default_rng(index)
        with httpx.Client(base_url=url, timeout=30) as http:
            i = 0
            while time.perf_counter() < stop_at:
                kind = 1.0 if mix == "generate" else rng.random()
                if request_for is not None:
                    request = request_for(index, i)
                elif kind < 0.7:
                    request = ("/v2/models/encoder/infer", encoder_body(int(rng.integers(8, 33)), index * 100000 + i))
                elif kind < 0.9:
                    request = ("/v2/models/decoder/infer", decoder_body(int(rng.integers(8, 33)), d, i))
                else:
                    request = ("/v1/generate", generate_body(i, gen_length, gen_steps))
                i += 1
                with lock:
                    stats["sent"] += 1
                start = time.perf_counter()
                try:
                    body = request[1]
                    # bytes: JSON encoded once ahead (large tensors: encoding them per request would load the client, not the server)
                    response = (
                        http.post(request[0], content=body, headers={"Content-Type": "application/json"})
                        if isinstance(body, bytes)
                        else http.post(request[0], json=body)
                    )
                except httpx.HTTPError:
                    with lock:
                        stats["lost"] += 1
                    continue
                elapsed = time.perf_counter() - start
                with lock:
                    stats["answered"] += 1
                    by_status[str(response.status_code)] = by_status.get(str(response.status_code), 0) + 1
                    if response.status_code != 200:
                        stats["errors"] += 1
                    latencies.append(elapsed)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {
        **stats,
        "by_status": by_status,
        "mix": mix,
        "clients": clients,
        "seconds": round(wall, 2),
        "throughput_rps": round(stats["answered"] / wall, 2),
        "latency_p50_ms": round(1000 * float(np.percentile(latencies, 50)), 3) if latencies else None,
        "latency_p99_ms": round(1000 * float(np.percentile(latencies, 99)), 3) if latencies else None,
    }


def write_report(report: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, json.dumps(report, indent=2) + "\n")  # no half-written report if interrupted
    print(json.dumps(report, indent=2))
