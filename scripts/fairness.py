#!/usr/bin/env python
"""Issue 22's fairness measurement: how long short generations take alone and beside a stream of
long ones, and what the short ones cost the long ones' throughput. One real `ldlm serve` on
127.0.0.1 per server checkout measured (give --python/--cwd of another checkout, e.g. main, for
the numbers before a change), three phases each:

1. alone: --short-requests requests of n=1 x --short-steps steps, one after another, on an idle server;
2. long only: --long-clients clients each sending n=--long-n x --long-steps requests back to back,
   for --seconds: the long requests' throughput (samples x steps per second) without short ones;
3. beside: the same long stream, and the short requests again, one after another.

Latencies are client wall times (p50, p99). Long throughput is read from the server's own count of
samples stepped (/metrics ldlm_inference_count{model="generate"}), less the short requests' known
work, over the phase's wall time. Targets (issue 22): p99 beside <= 3 x p99 alone; long throughput
beside within 10% of long only.

    python scripts/fairness.py --out docs/measurements/fairness-2026-12-01.json
    python scripts/fairness.py --baseline-python /work/main/.venv/bin/python --baseline-cwd /work/main --out fairness.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_check import make_export  # noqa: E402
from load_test import write_report  # noqa: E402
from loopback import free_port, serve_command, stop_server, wait_ready  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]  # nearest rank


def samples_stepped(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(r'^ldlm_inference_count_total\{model="generate"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def short_latencies(url: str, count: int, body: dict[str, Any]) -> dict[str, Any]:
    seconds, errors = [], []
    with httpx.Client(timeout=120) as http:
        for i in range(count):
            started = time.perf_counter()
            response = http.post(f"{url}/v1/generate", json={**body, "seed": i})
            if response.status_code == 200:
                seconds.append(time.perf_counter() - started)
            else:
                errors.append(f"{response.status_code}: {response.text[:200]}")
    return {"requests": count, "answered": len(seconds), "errors": errors[:5], "p50_ms": round(1000 * statistics.median(seconds), 2),
            "p99_ms": round(1000 * percentile(seconds, 99), 2), "max_ms": round(1000 * max(seconds), 2)}


class LongStream:
    """``clients`` threads, each sending long requests back to back until closed; closing disconnects
    them, so a server that cancels abandoned work frees the batch at once (one that does not runs on)."""

    def __init__(self, url: str, clients: int, body: dict[str, Any]) -> None:
        self.url, self.body = url, body
        self.stop = threading.Event()
        self.done: list[float] = []
        self.errors: list[str] = []
        self.clients = [httpx.Client(timeout=600) for _ in range(clients)]
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                response = self.clients[index].post(f"{self.url}/v1/generate", json={**self.body, "seed": 1000 * index + i})
            except (httpx.HTTPError, RuntimeError):  # closed by close(): the stream ends
                if self.stop.is_set():
                    return
                raise
            i += 1
            if response.status_code == 200:
                self.done.append(time.perf_counter())
            else:
                self.errors.append(f"{response.status_code}: {response.text[:200]}")

    def close(self) -> None:
        self.stop.set()
        for client in self.clients:
            client.close()
        for thread in self.threads:
            thread.join(60)


def wait_until_busy(url: str, samples: int, timeout_s: float = 120) -> None:
    """Until the long stream has stepped ``samples`` samples (the batch is full and running)."""
    start, deadline = samples_stepped(url), time.time() + timeout_s
    while samples_stepped(url) - start < samples:
        if time.time() > deadline:
            raise RuntimeError("the long stream did not start")
        time.sleep(0.2)


class Server:
    """A fresh ``ldlm serve`` of ``source`` from the checkout ``cwd`` with ``python``: each phase gets its own,
    so nothing one phase left running (a server that does not cancel abandoned work) reaches the next."""

    def __init__(self, python: str, cwd: str, source: Path, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        flags = ["--threads", str(args.threads), "--max-batch", str(args.max_batch), "--timeout-s", "600"]
        self.process = subprocess.Popen(serve_command(source, self.port, flags, python), cwd=cwd, stdout=self.log,
                                        stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_ready(self.process, self.url)

    def stop(self) -> int | str:
        # 30 s to drain: a server that runs abandoned long requests on would otherwise hold the next phase
        code = stop_server(self.process, 30)
        if code != 0:
            self.log.seek(0)
            print(self.log.read().decode(errors="replace")[-1500:], file=sys.stderr)
        return code


def measure(python: str, cwd: str, source: Path, args: argparse.Namespace) -> dict[str, Any]:
    short = {"n": 1, "length": args.length, "steps": args.short_steps, "sampler": "ddim"}
    long = {"n": args.long_n, "length": args.length, "steps": args.long_steps, "sampler": "ddim"}
    result: dict[str, Any] = {"server_python": python, "server_cwd": cwd, "server_exit": {}}
    for phase in ("alone", "long_only", "beside"):
        server = Server(python, cwd, source, args)
        try:
            short_latencies(server.url, 5, short)  # warm-up (and the cost model's first measurements)
            if phase == "alone":
                result["alone"] = short_latencies(server.url, args.short_requests, short)
                continue
            stream = LongStream(server.url, args.long_clients, long)
            try:
                wait_until_busy(server.url, args.max_batch * 20)
                before, started = samples_stepped(server.url), time.perf_counter()
                shorts = short_latencies(server.url, args.short_requests, short) if phase == "beside" else None
                left = args.seconds - (time.perf_counter() - started)
                if left > 0:
                    time.sleep(left)
                elapsed = time.perf_counter() - started
                stepped = samples_stepped(server.url) - before - (args.short_requests * args.short_steps if shorts else 0)
                result[phase] = {"seconds": round(elapsed, 2), "long_sample_steps_per_s": round(stepped / elapsed, 1),
                                 "long_requests_finished": sum(started <= t for t in stream.done)}
                if shorts:
                    result[phase]["short"] = shorts
            finally:
                stream.close()
            result[phase]["long_errors"] = stream.errors[:5]
        finally:
            result["server_exit"][phase] = server.stop()
    beside = result["beside"]["short"]
    result["targets"] = {
        "short_p99_beside_over_alone": round(beside["p99_ms"] / result["alone"]["p99_ms"], 2),
        "short_p99_target": "<= 3",
        "long_throughput_beside_over_long_only": round(result["beside"]["long_sample_steps_per_s"]
                                                       / result["long_only"]["long_sample_steps_per_s"], 3),
        "long_throughput_target": ">= 0.9 (and beside: within 10% of the baseline's beside)",
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="an `ldlm export` directory (default: export a tiny checkpoint)")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the server (default: this one)")
    parser.add_argument("--cwd", default=str(Path(__file__).resolve().parents[1]), help="checkout the server runs from")
    parser.add_argument("--baseline-python", help="also measure this interpreter's server (e.g. main's, for 'before')")
    parser.add_argument("--baseline-cwd", help="the checkout --baseline-python runs from")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64, help="tokens per sample, short and long alike (default: 64)")
    parser.add_argument("--short-steps", type=int, default=8)
    parser.add_argument("--short-requests", type=int, default=100)
    parser.add_argument("--long-n", type=int, default=16)
    parser.add_argument("--long-steps", type=int, default=1000)
    parser.add_argument("--long-clients", type=int, default=2, help="long requests in flight at once (default: 2)")
    parser.add_argument("--seconds", type=float, default=30.0, help="each long phase lasts at least this (default: 30)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="ldlm-fairness-")
    try:
        source = args.source or make_export(Path(scratch.name))
        report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k not in ("out",)}, "cpu_count": os.cpu_count()}
        report["settings"] = json.loads(json.dumps(report["settings"], default=str))
        report["after"] = measure(args.python, args.cwd, source, args)
        write_report(report, str(args.out))  # kept if the baseline's run is interrupted
        if args.baseline_python:
            report["before"] = measure(args.baseline_python, args.baseline_cwd or args.cwd, source, args)
            report["after_over_before"] = {
                "short_p99_beside": round(report["after"]["beside"]["short"]["p99_ms"] / report["before"]["beside"]["short"]["p99_ms"], 3),
                "long_sample_steps_per_s_beside": round(report["after"]["beside"]["long_sample_steps_per_s"]
                                                        / report["before"]["beside"]["long_sample_steps_per_s"], 3),
            }
    finally:
        scratch.cleanup()
    write_report(report, str(args.out))


if __name__ == "__main__":
    main()
