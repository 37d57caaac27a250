#!/usr/bin/env python
"""What denoising previews cost: generation throughput with and without `stream: true` previews,
measured side by side on one server, and the time to the first preview event at batch 1.

Each round runs both modes back to back (their order alternates), with the same concurrent load:
`--clients` clients, each sending `--requests` /v1/generate requests one after another. Throughput
is denoising work done (samples x steps) per second of wall time; the report gives per-mode
medians over the rounds and the cost, 1 - previews / plain. The machine may be shared: side by side
rounds and medians keep other load from landing on one mode only.

Without --url the script serves a fresh tiny random-init checkpoint on a free 127.0.0.1 port.

    python scripts/preview_cost.py --rounds 5 --out runs/preview_cost.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from ldlm.serve.checks.loopback import LOOPBACK, free_port, start_server, stop_server, tiny_export
from ldlm.serve.checks.traffic import write_report


def run_load(url: str, clients: int, requests: int, body: dict) -> tuple[float, int]:
    """samples x steps per second for clients x requests requests of ``body``; preview events received."""
    errors: list[str] = []
    previews = [0] * clients

    def client(index: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            for i in range(requests):
                payload = {**body, "seed": index * 1000 + i}
                if body.get("stream"):
                    with http.stream("POST", "/v1/generate", json=payload) as response:
                        kinds = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
                    ok = response.status_code == 200 and kinds[-1:] == ["result"]
                    previews[index] += kinds.count("preview")
                else:
                    response = http.post("/v1/generate", json=payload)
                    ok = response.status_code == 200
                if not ok:
                    errors.append(f"{response.status_code}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:5]}")
    return clients * requests * body["n"] * body["steps"] / elapsed, sum(previews)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server on loopback (default: start one on a tiny model)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client per round (default 4)")
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=5, help="steps between previews (default 5)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.05, help="the server's --preview-budget (default 0.05)")
    parser.add_argument("--out", default="runs/preview_cost.json")
    args = parser.parse_args()
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error(f"--url {args.url} is not on loopback; this script sends traffic to 127.0.0.1 only")
    for name in ("clients", "requests", "length", "steps", "every", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")

    with tempfile.TemporaryDirectory(prefix="ldlm-preview-") as work:
        process, url = None, args.url
        if url is None:
            source = str(tiny_export(Path(work)))
            port = free_port()
            process = start_server(source, port, ["--preview-budget", str(args.budget)])
            url = f"http://127.0.0.1:{port}"
        try:
            plain = {"n": 1, "length": args.length, "steps": args.steps, "sampler": "sde"}
            streamed = {**plain, "stream": True, "preview_every": args.every}
            run_load(url, args.clients, 1, plain)  # warm up both paths
            run_load(url, args.clients, 1, streamed)
            rates: dict[str, list[float]] = {"plain": [], "previews": []}
            received = 0
            for r in range(args.rounds):
                order = ("plain", "previews") if r % 2 == 0 else ("previews", "plain")
                for mode in order:
                    rate, events = run_load(url, args.clients, args.requests, plain if mode == "plain" else streamed)
                    rates[mode].append(rate)
                    received += events
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {v[-1]:.0f}" for m, v in rates.items()), flush=True)
            medians = {m: statistics.median(v) for m, v in rates.items()}
            report = {
                "url": url,
                "clients": args.clients,
                "requests_per_client": args.requests,
                "length": args.length,
                "steps": args.steps,
                "preview_every": args.every,
                "rounds": args.rounds,
                "preview_budget": args.budget,
                "sample_steps_per_s": {m: [round(x, 1) for x in v] for m, v in rates.items()},
                "median_sample_steps_per_s": {m: round(v, 1) for m, v in medians.items()},
                "throughput_cost": round(1 - medians["previews"] / medians["plain"], 4),
                # previews are skipped, never queued, when decoding them would exceed the budget
                "preview_events_per_request": round(received / (args.rounds * args.clients * args.requests), 2),
                "preview_events_per_request_nominal": (args.steps - 1) // args.every,
                "first_preview_batch1": {
                    f"preview_every_{k}": first_preview_seconds(url, {**streamed, "preview_every": k}, 10) for k in sorted({1, args.every})
                },
            }
        finally:
            if process is not None:
                stop_server(process)
    write_report(report, args.out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
