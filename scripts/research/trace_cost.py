#!/usr/bin/env python
"""What OpenTelemetry tracing costs `ldlm serve`: the same generation load against the service started twice in
one run, tracing off and tracing on (exporting every request's spans over OTLP/gRPC to a real receiver in this
process, scripts/harness/otlp_receiver.py, which counts the spans it gets and keeps none: a collector's own work is
not the service's), in interleaved rounds so that other load on the machine falls on both.

A round sends `--concurrency` /v1/generate requests at once (`--n` samples of `--length` tokens, `--steps` steps each;
by default 64 single-sample requests, which fill one batch of `--max-batch 64`) to one server, waits for every answer,
then does the same against the other; the order alternates round by round. Per mode: the median of the rounds'
wall seconds and of every request's latency (p50, p99), and the ratio on / off of each, side by side; and the spans
the receiver got (every traced request sends six: its own and five stages), which checks that tracing was on.

Needs the OpenTelemetry SDK and the receiver's protocol definitions: `pip install -e .[otel,test]`.

    python scripts/research/trace_cost.py --rounds 10 --out runs/trace_cost.json
    python scripts/research/trace_cost.py --rounds 1 --concurrency 4 --steps 4 --out /tmp/trace_cost.json   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from scripts.harness.loopback import free_port, start_server, stop_server  # noqa: E402
from scripts.harness.otlp_receiver import OtlpReceiver  # noqa: E402
from scripts.harness.traffic import write_report  # noqa: E402

REFERENCE = ROOT / "models" / "ldlm-austen-tiny"
MODES = ("off", "on")


async def one_round(url: str, concurrency: int, body: dict) -> tuple[float, list[float]]:
    """Wall seconds of ``concurrency`` requests of ``body`` sent at once, and each one's latency."""

    async def one(http: httpx.AsyncClient) -> float:
        started = time.perf_counter()
        response = await http.post("/v1/generate", json=body)
        response.raise_for_status()
        return time.perf_counter() - started

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        started = time.perf_counter()
        latencies = await asyncio.gather(*(one(http) for _ in range(concurrency)))
        return time.perf_counter() - started, list(latencies)


def summary(walls: list[float], latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "round_s_median": statistics.median(walls),
        "latency_s_p50": statistics.median(ordered),
        "latency_s_p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
    }


def measure(args: argparse.Namespace, receiver: OtlpReceiver) -> dict:
    """Both servers up at once, the rounds interleaved; the report."""
    flags = ["--no-grpc", "--max-batch", str(args.max_batch), "--max-queue", "4096", "--backend", args.backend]
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "5000")}  # the SDK's default
    ports = {mode: free_port() for mode in MODES}
    traced = ["--otlp-traces-endpoint", receiver.endpoint]
    servers = {mode: start_server(args.source, ports[mode], flags + (traced if mode == "on" else []), env=env) for mode in MODES}
    body = {"n": args.n, "length": args.length, "steps": args.steps}
    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for mode in MODES:  # warm-up, not counted
            asyncio.run(one_round(f"http://127.0.0.1:{ports[mode]}", args.concurrency, body))
        for i in range(args.rounds):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                wall, each = asyncio.run(one_round(f"http://127.0.0.1:{ports[mode]}", args.concurrency, body))
                walls[mode].append(wall)
                latencies[mode] += each
                print(f"round {i + 1}/{args.rounds} {mode}: {wall:.3f} s", file=sys.stderr, flush=True)
    finally:
        exits = {mode: stop_server(server) for mode, server in servers.items()}  # the traced one sends what it holds
    result = {mode: summary(walls[mode], latencies[mode]) for mode in MODES}
    ratio = {key: result["on"][key] / result["off"][key] for key in result["off"]}
    requests = (args.rounds + 1) * args.concurrency
    return {
        "source": str(args.source),
        "settings": {key: getattr(args, key) for key in ("backend", "max_batch", "concurrency", "n", "length", "steps", "rounds")},
        "off": result["off"],
        "on": result["on"],
        "ratio_on_off": ratio,
        "spans_received": receiver.count,
        "spans_expected": requests * 6,
        "server_exits": exits,
        "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=str(REFERENCE), help="what both servers serve (default: the reference checkpoint)")
    parser.add_argument("--backend", default="eager", help="ldlm serve --backend (default: eager: no export to wait for)")
    parser.add_argument("--max-batch", type=int, default=64, help="samples per step (default: 64)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests sent at once per round (default: 64)")
    parser.add_argument("--n", type=int, default=1, help="samples per request (default: 1)")
    parser.add_argument("--length", type=int, default=32, help="tokens per sample (default: 32)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps (default: 20)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per mode, after one warm-up each (default: 10)")
    parser.add_argument("--out", required=True, help="where the JSON report goes")
    args = parser.parse_args()
    with OtlpReceiver(keep=False) as receiver:  # counts what it gets: the cost measured is the service's
        report = measure(args, receiver)
        time.sleep(1)  # the last export, sent as the traced server stopped, is in
        report["spans_received"] = receiver.count
    write_report(report, args.out)


if __name__ == "__main__":
    main()
