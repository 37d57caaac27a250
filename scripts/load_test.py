#!/usr/bin/env python
"""Load test of `ldlm serve` on 127.0.0.1: N concurrent clients for M seconds, then the server's
overhead at batch 1 (end-to-end HTTP latency minus the raw runner's, measured side by side).

Traffic goes to loopback only. Without --url the script starts its own server on a free port
(from --source, or from a fresh tiny random-init checkpoint exported to ONNX) and stops it after.
Writes JSON: throughput, p50/p99 latency, errors and lost requests (sent but never answered).

    python scripts/load_test.py --clients 16 --seconds 60 --out runs/load_test.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def encoder_body(length: int, seed: int) -> dict:
    ids = np.random.default_rng(seed).integers(0, 50257, length).tolist()
    return {"inputs": [{"name": "input_ids", "shape": [1, length], "datatype": "INT64", "data": ids},
                       {"name": "attention_mask", "shape": [1, length], "datatype": "INT64", "data": [1] * length}]}


def decoder_body(length: int, d: int, seed: int) -> dict:
    x = np.random.default_rng(seed).standard_normal(length * d).round(4).tolist()
    return {"inputs": [{"name": "latents", "shape": [1, length, d], "datatype": "FP32", "data": x},
                       {"name": "attention_mask", "shape": [1, length], "datatype": "INT64", "data": [1] * length}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(source: str, port: int, flags: list[str] | None = None) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "ldlm.cli", "serve", source, "--port", str(port), "--log-level", "warning", *(flags or [])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ldlm serve exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("ldlm serve did not become ready in 120 s")


def run_clients(url: str, clients: int, seconds: float, d: int) -> dict:
    stop_at = time.perf_counter() + seconds
    lock = threading.Lock()
    stats = {"sent": 0, "answered": 0, "errors": 0, "lost": 0, "by_status": {}}
    latencies: list[float] = []

    def client(index: int) -> None:
        rng = np.random.default_rng(index)
        with httpx.Client(base_url=url, timeout=30) as http:
            i = 0
            while time.perf_counter() < stop_at:
                kind = rng.random()
                if kind < 0.7:
                    request = ("/v2/models/encoder/infer", encoder_body(int(rng.integers(8, 33)), index * 100000 + i))
                elif kind < 0.9:
                    request = ("/v2/models/decoder/infer", decoder_body(int(rng.integers(8, 33)), d, i))
                else:
                    request = ("/v1/generate", {"n": 1, "length": 16, "steps": 10, "seed": i, "sampler": "ddim"})
                i += 1
                with lock:
                    stats["sent"] += 1
                start = time.perf_counter()
                try:
                    response = http.post(request[0], json=request[1])
                except httpx.HTTPError:
                    with lock:
                        stats["lost"] += 1
                    continue
                elapsed = time.perf_counter() - start
                with lock:
                    stats["answered"] += 1
                    stats["by_status"][str(response.status_code)] = stats["by_status"].get(str(response.status_code), 0) + 1
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
        "clients": clients,
        "seconds": round(wall, 2),
        "throughput_rps": round(stats["answered"] / wall, 2),
        "latency_p50_ms": round(1000 * float(np.percentile(latencies, 50)), 3) if latencies else None,
        "latency_p99_ms": round(1000 * float(np.percentile(latencies, 99)), 3) if latencies else None,
    }


def measure_overhead(url: str, source: str, requests: int) -> dict:
    """Batch 1 encoder, 16 tokens, through tritonclient (binary tensors, as Triton clients send
    them) and through the raw runner in this process, alternating call by call."""
    import tritonclient.http as triton

    from ldlm.serve.backends import open_graphs

    graphs, _, _ = open_graphs("ort", source)
    body = encoder_body(16, 0)
    feed = {i["name"]: np.asarray(i["data"], dtype=np.int64).reshape(i["shape"]) for i in body["inputs"]}
    inputs = []
    for name, value in feed.items():
        tensor = triton.InferInput(name, list(value.shape), "INT64")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client = triton.InferenceServerClient(urlparse(url).netloc)
    http_ms, raw_ms = [], []
    for _ in range(10):  # warm-up both
        client.infer("encoder", inputs)
        graphs["encoder"].run(feed)
    for _ in range(requests):
        start = time.perf_counter()
        client.infer("encoder", inputs).as_numpy("latents")
        http_ms.append(1000 * (time.perf_counter() - start))
        start = time.perf_counter()
        graphs["encoder"].run(feed)
        raw_ms.append(1000 * (time.perf_counter() - start))
    client.close()
    http_p50, raw_p50 = statistics.median(http_ms), statistics.median(raw_ms)
    return {"requests": requests, "client": "tritonclient (binary tensors)", "http_p50_ms": round(http_p50, 3),
            "runner_p50_ms": round(raw_p50, 3), "overhead_p50_ms": round(http_p50 - raw_p50, 3),
            "graph": "encoder", "batch": 1, "length": 16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server on loopback (default: start one)")
    parser.add_argument("--source", help="`ldlm export` directory to serve (default: a fresh tiny export)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--overhead-requests", type=int, default=300, help="0 skips the overhead measurement")
    parser.add_argument("--out", default="runs/load_test.json")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256 or not 0 < args.seconds <= 600:
        parser.error("--clients must be in 1..256 and --seconds in (0, 600]")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error(f"--url {args.url} is not on loopback; load tests send traffic to 127.0.0.1 only")

    with tempfile.TemporaryDirectory(prefix="ldlm-load-") as work:
        source = args.source
        if source is None and args.url is None or (args.overhead_requests and source is None):
            from ldlm.checkpoint import init_model, save_checkpoint
            from ldlm.config import preset
            from ldlm.export.onnx_export import export_graphs
            from ldlm.tokenizer import TextTokenizer

            checkpoint = save_checkpoint(init_model(preset("tiny"), 0), TextTokenizer.gpt2(), Path(work) / "tiny")
            source = str(export_graphs(checkpoint, Path(work) / "onnx").out)
        process = None
        url = args.url
        if url is None:
            port = free_port()
            process = start_server(source, port)
            url = f"http://127.0.0.1:{port}"
        try:
            d = httpx.get(f"{url}/v2/models/decoder", timeout=10).json()["inputs"][0]["shape"][-1]
            report = {"url": url, "load": run_clients(url, args.clients, args.seconds, d)}
            if args.overhead_requests:
                report["overhead"] = measure_overhead(url, source, args.overhead_requests)
        finally:
            if process is not None:
                process.send_signal(signal.SIGTERM)
                report_exit = process.wait(60)
        if process is not None:
            report["server_exit_code"] = report_exit
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if report["load"]["errors"] or report["load"]["lost"]:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
