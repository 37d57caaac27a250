"""Client traffic for the measuring scripts (load_test, triton_compare, attack_check, fairness,
preview_cost, gpu_service, fixed_costs) and the tests: KServe v2 and /v1 request bodies, Server-Sent Events
read back, N concurrent clients for M seconds, and the JSON report they write. Traffic goes to loopback only (the scripts check their --url)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ldlm.files import write_atomically


def sse_events(lines: Iterable[str]) -> list[tuple[str, Any]]:
    """Server-Sent Events as (event name, decoded data); the name is "message" when absent."""
    events: list[tuple[str, Any]] = []
    name, data = "message", list[str]()
    for line in [*lines, ""]:
        if line == "":
            if data:
                payload = "\n".join(data)
                try:
                    events.append((name, json.loads(payload)))
                except ValueError:
                    events.append((name, payload))
            name, data = "message", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    return events


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


RequestFor = Callable[[int, int], tuple[str, dict | bytes]]


def next_request(
    rng: np.random.Generator, index: int, i: int, mix: str, d: int, gen_length: int, gen_steps: int, request_for: RequestFor | None
) -> tuple[str, dict | bytes]:
    """Request ``i`` of client ``index``: ``request_for``'s, else one drawn from ``mix``."""
    kind = 1.0 if mix == "generate" else rng.random()
    if request_for is not None:
        return request_for(index, i)
    if kind < 0.7:
        return ("/v2/models/encoder/infer", encoder_body(int(rng.integers(8, 33)), index * 100000 + i))
    if kind < 0.9:
        return ("/v2/models/decoder/infer", decoder_body(int(rng.integers(8, 33)), d, i))
    return ("/v1/generate", generate_body(i, gen_length, gen_steps))


def post(http: httpx.Client, request: tuple[str, dict | bytes]) -> httpx.Response:
    path, body = request
    # bytes: JSON encoded once ahead (large tensors: encoding them per request would load the client, not the server)
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(path, json=body)


class Tally:
    """What every client saw, counted under one lock: requests sent, answered, refused (not 200) and
    lost (no answer), answers by status, and the latency of each answer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = {"sent": 0, "answered": 0, "errors": 0, "lost": 0}
        self.by_status: dict[str, int] = {}
        self.latencies: list[float] = []

    def count(self, key: str) -> None:
        with self.lock:
            self.stats[key] += 1

    def answered(self, status_code: int, elapsed: float) -> None:
        with self.lock:
            self.stats["answered"] += 1
            self.by_status[str(status_code)] = self.by_status.get(str(status_code), 0) + 1
            if status_code != 200:
                self.stats["errors"] += 1
            self.latencies.append(elapsed)

    def report(self, mix: str, clients: int, wall: float) -> dict:
        latencies = self.latencies
        return {
            **self.stats,
            "by_status": self.by_status,
            "mix": mix,
            "clients": clients,
            "seconds": round(wall, 2),
            "throughput_rps": round(self.stats["answered"] / wall, 2),
            "latency_p50_ms": round(1000 * float(np.percentile(latencies, 50)), 3) if latencies else None,
            "latency_p99_ms": round(1000 * float(np.percentile(latencies, 99)), 3) if latencies else None,
        }


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
    (scripts/research/triton_compare.py)."""
    stop_at = time.perf_counter() + seconds
    tally = Tally()

    def client(index: int) -> None:
        rng = np.random.default_rng(index)
        with httpx.Client(base_url=url, timeout=30) as http:
            i = 0
            while time.perf_counter() < stop_at:
                request = next_request(rng, index, i, mix, d, gen_length, gen_steps, request_for)
                i += 1
                tally.count("sent")
                start = time.perf_counter()
                try:
                    response = post(http, request)
                except httpx.HTTPError:
                    tally.count("lost")
                    continue
                tally.answered(response.status_code, time.perf_counter() - start)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally.report(mix, clients, time.perf_counter() - started)


def write_report(report: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, json.dumps(report, indent=2) + "\n")  # no half-written report if interrupted
    print(json.dumps(report, indent=2))


def first_preview_seconds(url: str, body: dict, repeats: int) -> dict:
    """Batch 1, idle server: seconds from sending the request to the end of its first ``event: preview``
    (that event's data line). A stream with no preview before its result (the server skips previews
    over its --preview-budget) is not timed: it is counted in ``runs_without_preview``."""
    times = []
    with httpx.Client(base_url=url, timeout=300) as http:
        for i in range(repeats):
            started = time.perf_counter()
            with http.stream("POST", "/v1/generate", json={**body, "seed": i}) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"/v1/generate answered {response.status_code}: {response.read()[:300]!r}")
                event = None
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: ") and event == "preview":
                        times.append(time.perf_counter() - started)
                        break
                    elif not line:
                        event = None  # a blank line ends the event
    return {
        "median_ms": round(1000 * statistics.median(times), 2) if times else None,
        "min_ms": round(1000 * min(times), 2) if times else None,
        "runs": repeats,
        "runs_without_preview": repeats - len(times),
    }
