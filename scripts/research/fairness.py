#!/usr/bin/env python
"""The fairness measurement: how long short generations take alone and beside a stream of
long ones, and what the short ones cost the long ones' throughput. Real `ldlm serve` processes on
127.0.0.1; with --baseline-python/--baseline-cwd the code before a change is measured too,
interleaved round by round (the machine may be shared: neither server gets all the quiet minutes).
Per round and server, three phases, each on a fresh server (what one phase leaves running never
reaches the next):

1. alone: --short-requests requests of n=1 x --short-steps steps, one after another, on an idle server;
2. long_only: --long-clients clients each sending n=--long-n x --long-steps requests back to back,
   for --seconds: the long requests' throughput (samples x steps per second) without short ones;
3. beside: the same long stream, and the short requests again, one after another.

Short latencies are client wall times, pooled over the rounds (p50, p99). Long throughput is read
from the server's own count of samples stepped (/metrics ldlm_inference_count{model="generate"}),
less the short requests' known work, over the phase's wall time and over the server process's CPU
time (the latter holds still when other jobs share the machine); medians over the rounds.
Targets: short p99 beside <= 3 x alone; long throughput beside within 10% of the code
before the change (beside).

    python scripts/research/fairness.py --baseline-python BASE/.venv/bin/python --baseline-cwd BASE \
        --out docs/measurements/fairness-2026-12-01.json
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from scripts.harness.loopback import free_port, serve_command, stop_server, tiny_export, wait_ready  # noqa: E402
from scripts.harness.traffic import write_report  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]  # nearest rank


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) the process has used: a throughput per CPU second holds
    still when other jobs share the machine, which wall-time throughput does not."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15 of stat)


def samples_stepped(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(r'^ldlm_inference_count_total\{model="generate"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def run_shorts(url: str, count: int, body: dict[str, Any], budget_s: float) -> tuple[list[float], list[str], int]:
    """Up to ``count`` requests one after another, none started after ``budget_s``, each given at most
    the time left: their wall times (s; a request still unanswered when time ran out counts as the time
    it waited, a lower bound), the errors, and how many were cut off so."""
    seconds, errors, cut = [], [], 0
    deadline = time.perf_counter() + budget_s
    with httpx.Client() as http:
        for i in range(count):
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            started = time.perf_counter()
            try:
                response = http.post(f"{url}/v1/generate", json={**body, "seed": i}, timeout=left)
            except httpx.TimeoutException:
                seconds.append(time.perf_counter() - started)
                cut += 1
                break
            if response.status_code == 200:
                seconds.append(time.perf_counter() - started)
            else:
                errors.append(f"{response.status_code}: {response.text[:200]}")
    return seconds, errors, cut


def latency_summary(seconds: list[float], errors: list[str], cut: int) -> dict[str, Any]:
    return {
        "timed": len(seconds),
        "cut_off_unanswered": cut,
        "errors": len(errors),
        "first_errors": errors[:3],
        "p50_ms": round(1000 * statistics.median(seconds), 2),
        "p99_ms": round(1000 * percentile(seconds, 99), 2),
        "max_ms": round(1000 * max(seconds), 2),
    }


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
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (open for the server's life, closed in stop)
        flags = ["--threads", str(args.threads), "--max-batch", str(args.max_batch), "--timeout-s", "600"]
        self.process = subprocess.Popen(
            serve_command(source, self.port, flags, python),
            cwd=cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        wait_ready(self.process, self.url)

    def stop(self) -> int | str:
        # 30 s to drain: a server that runs abandoned long requests on would otherwise hold the next phase
        code = stop_server(self.process, 30)
        if code != 0:
            self.log.seek(0)
            print(self.log.read().decode(errors="replace")[-1500:], file=sys.stderr)
        self.log.close()
        return code


def run_phase(phase: str, python: str, cwd: str, source: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One phase on a fresh server: short latencies (alone, beside) and the long stream's throughput (long_only, beside)."""
    short = {"n": 1, "length": args.length, "steps": args.short_steps, "sampler": "ddim"}
    long = {"n": args.long_n, "length": args.length, "steps": args.long_steps, "sampler": "ddim"}
    server = Server(python, cwd, source, args)
    out: dict[str, Any] = {}
    try:
        run_shorts(server.url, 5, short, 60)  # warm-up (and the cost model's first measurements)
        if phase == "alone":
            out["short_s"], out["errors"], out["cut"] = run_shorts(server.url, args.short_requests, short, 2 * args.seconds)
            return out
        stream = LongStream(server.url, args.long_clients, long)
        try:
            wait_until_busy(server.url, args.max_batch * 20)
            before, started, cpu = samples_stepped(server.url), time.perf_counter(), cpu_seconds(server.process.pid)
            if phase == "beside":  # a server without fair scheduling makes a short request wait for a long one: capped at 2 x --seconds
                out["short_s"], out["errors"], out["cut"] = run_shorts(server.url, args.short_requests, short, 2 * args.seconds)
            left = args.seconds - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)
            elapsed = time.perf_counter() - started
            short_work = (len(out.get("short_s", ())) - out.get("cut", 0)) * args.short_steps
            long_work = samples_stepped(server.url) - before - short_work
            out["long_sample_steps_per_s"] = long_work / elapsed
            out["long_sample_steps_per_cpu_s"] = long_work / (cpu_seconds(server.process.pid) - cpu)
        finally:
            stream.close()
        out["long_errors"] = stream.errors[:3]
    finally:
        out["server_exit"] = server.stop()
    return out


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Short latencies pooled over the rounds; long throughput per round and its median."""
    result: dict[str, Any] = {}
    for phase in ("alone", "beside"):
        seconds = [t for r in rounds for t in r[phase]["short_s"]]
        errors = [e for r in rounds for e in r[phase]["errors"]]
        result[f"short_{phase}"] = latency_summary(seconds, errors, sum(r[phase]["cut"] for r in rounds))
    for phase in ("long_only", "beside"):
        for unit in ("s", "cpu_s"):
            rates = [round(r[phase][f"long_sample_steps_per_{unit}"], 1) for r in rounds]
            result[f"long_{phase}_sample_steps_per_{unit}"] = {"rounds": rates, "median": statistics.median(rates)}
    result["long_errors"] = [e for r in rounds for phase in ("long_only", "beside") for e in r[phase]["long_errors"]][:3]
    result["server_exits"] = sorted({str(r[phase]["server_exit"]) for r in rounds for phase in r})
    result["targets"] = {
        "short_p99_beside_over_alone": round(result["short_beside"]["p99_ms"] / result["short_alone"]["p99_ms"], 2),
        "short_p99_target": "<= 3",
        "long_beside_over_long_only": round(
            result["long_beside_sample_steps_per_s"]["median"] / result["long_long_only_sample_steps_per_s"]["median"], 3
        ),
        "long_per_cpu_s_beside_over_long_only": round(
            result["long_beside_sample_steps_per_cpu_s"]["median"] / result["long_long_only_sample_steps_per_cpu_s"]["median"], 3
        ),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="an `ldlm export` directory (default: export a tiny checkpoint)")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the server (default: this one)")
    parser.add_argument("--cwd", default=str(Path(__file__).resolve().parents[2]), help="checkout the server runs from")
    parser.add_argument("--baseline-python", help="also measure this interpreter's server (the code before a change), interleaved")
    parser.add_argument("--baseline-cwd", help="the checkout --baseline-python runs from")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three phases per server (order alternating; default: 3)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64, help="tokens per sample, short and long alike (default: 64)")
    parser.add_argument("--short-steps", type=int, default=8)
    parser.add_argument("--short-requests", type=int, default=50, help="short requests per phase and round (default: 50)")
    parser.add_argument("--long-n", type=int, default=16)
    parser.add_argument("--long-steps", type=int, default=1000)
    parser.add_argument("--long-clients", type=int, default=2, help="long requests in flight at once (default: 2)")
    parser.add_argument("--seconds", type=float, default=20.0, help="each long phase lasts at least this (default: 20)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    servers = {"after": (args.python, args.cwd)}
    if args.baseline_python:
        servers["before"] = (args.baseline_python, args.baseline_cwd or args.cwd)
    scratch = tempfile.TemporaryDirectory(prefix="ldlm-fairness-")
    report: dict[str, Any] = {
        "settings": json.loads(json.dumps({k: v for k, v in vars(args).items() if k != "out"}, default=str)),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
    }
    try:
        source = args.source or tiny_export(Path(scratch.name))
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]  # neither server always runs first
            for name in order:
                python, cwd = servers[name]
                rounds[name].append({phase: run_phase(phase, python, cwd, source, args) for phase in ("alone", "long_only", "beside")})
                print(f"round {r + 1}/{args.rounds}: {name} measured", file=sys.stderr, flush=True)
        for name, (python, cwd) in servers.items():
            report[name] = {"server_python": python, "server_cwd": cwd, **summarize(rounds[name])}
        if "before" in report:
            report["after_over_before"] = {
                "short_p99_beside": round(report["after"]["short_beside"]["p99_ms"] / report["before"]["short_beside"]["p99_ms"], 3),
                "long_beside_sample_steps_per_s": round(
                    report["after"]["long_beside_sample_steps_per_s"]["median"]
                    / report["before"]["long_beside_sample_steps_per_s"]["median"],
                    3,
                ),
                "long_beside_sample_steps_per_cpu_s": round(
                    report["after"]["long_beside_sample_steps_per_cpu_s"]["median"]
                    / report["before"]["long_beside_sample_steps_per_cpu_s"]["median"],
                    3,
                ),
            }
        report["load_average_at_end"] = os.getloadavg()
    finally:
        scratch.cleanup()
    write_report(report, str(args.out))


if __name__ == "__main__":
    main()
