#!/usr/bin/env python
"""What denoising previews cost, measured side by side on one server, in four parts:

- lone: one request at a time on an otherwise idle server, plain and streamed with previews every
  `--every` steps alternating (`--lone-length` tokens, `--lone-steps` steps, the server's default
  sampler): per-mode median seconds and their ratio, streamed / plain, against the bound that the
  server's `--preview-lone-budget` sets (1 / (1 - share); none at a share of 1), and the previews each
  stream got against the steps k, 2k, ... below its last (all of them at a share of 1);
- concurrent: `--streams` streams of that body sent at once, `--concurrent-rounds` times: the
  previews each got while all were in flight (before the first result) against what the preview
  budget promises for that time (streaming.py: about T x budget / busy, busy being one decoder call,
  which takes the newest preview of every stream), and in all;
- throughput: `--clients` clients, each sending `--requests` requests one after another, plain and
  streamed rounds alternating: denoising work (samples x steps) per second and the cost,
  1 - previews / plain (`--rounds 0` skips it);
- the time to the first preview event of a lone stream of the lone body, every 1 and `--every` steps.

The machine may be shared: alternating modes and medians keep other load off one mode only. Without
--url the script serves --source (default: a fresh tiny random-init export) on a free loopback port.

    python scripts/research/preview_cost.py --rounds 5 --out runs/preview_cost.json
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx

from ldlm.limits import PREVIEW_BUDGET, PREVIEW_LONE_BUDGET

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from scripts.harness.loopback import LOOPBACK, free_port, start_server, stop_server, tiny_export  # noqa: E402
from scripts.harness.traffic import first_preview_seconds, write_report  # noqa: E402


def run_threads(target: Callable[[int], None], count: int) -> None:
    """``target(0)`` .. ``target(count - 1)``, each on its own thread, all at once; back when all are done."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


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

    started = time.perf_counter()
    run_threads(client, clients)
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:5]}")
    return clients * requests * body["n"] * body["steps"] / elapsed, sum(previews)


def timed_events(http: httpx.Client, body: dict, since: float) -> list[tuple[str, float]]:
    """(event, seconds after ``since``) of one /v1/generate request read to its end; a plain answer is one "result"."""
    with http.stream("POST", "/v1/generate", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/v1/generate answered {response.status_code}: {response.read()[:300]!r}")
        if not body.get("stream"):
            response.read()
            return [("result", time.perf_counter() - since)]
        events = [(line[7:], time.perf_counter() - since) for line in response.iter_lines() if line.startswith("event: ")]
    if [kind for kind, _ in events[-1:]] != ["result"]:
        raise RuntimeError(f"a stream ended without its result: {[kind for kind, _ in events]}")
    return events


def preview_metrics(http: httpx.Client) -> dict[str, float]:
    """The server's preview counters: sent, skipped, decode seconds."""
    names = {"sent": "ldlm_previews_sent_total", "skipped": "ldlm_previews_skipped_total", "seconds": "ldlm_preview_decode_seconds_total"}
    text = http.get("/metrics").text
    return {key: float(m.group(1)) if (m := re.search(rf"^{name} (\S+)$", text, re.M)) else 0.0 for key, name in names.items()}


def lone_cost(url: str, plain: dict, streamed: dict, repeats: int, nominal: int, lone_budget: float) -> dict:
    """One request at a time, plain and streamed alternating (the same seeds): median seconds per mode,
    their ratio, the previews of each stream, and one preview's decode seconds (for ``concurrent_previews``)."""
    seconds: dict[str, list[float]] = {"plain": [], "streamed": []}
    previews = []
    with httpx.Client(base_url=url, timeout=300) as http:
        timed_events(http, plain, time.perf_counter())  # warm up both paths
        timed_events(http, streamed, time.perf_counter())
        before = preview_metrics(http)
        for i in range(repeats):
            for mode in ("plain", "streamed") if i % 2 == 0 else ("streamed", "plain"):
                started = time.perf_counter()
                events = timed_events(http, {**(plain if mode == "plain" else streamed), "seed": i}, started)
                seconds[mode].append(events[-1][1])
                if mode == "streamed":
                    previews.append(sum(kind == "preview" for kind, _ in events))
        after = preview_metrics(http)
    medians = {mode: statistics.median(v) for mode, v in seconds.items()}
    sent = after["sent"] - before["sent"]
    ratio = medians["streamed"] / medians["plain"]
    bound = None if lone_budget >= 1 else 1 / (1 - lone_budget)
    return {
        "seconds": {mode: [round(x, 4) for x in v] for mode, v in seconds.items()},
        "median_seconds": {mode: round(v, 4) for mode, v in medians.items()},
        "ratio_streamed_to_plain": round(ratio, 3),
        "lone_budget": lone_budget,
        "ratio_bound": None if bound is None else round(bound, 3),
        "within_bound": None if bound is None else ratio <= bound,
        "previews_per_stream": previews,
        "previews_asked": nominal,
        "every_preview_sent": all(p == nominal for p in previews),
        "skipped": after["skipped"] - before["skipped"],
        "decode_seconds_per_preview": round((after["seconds"] - before["seconds"]) / sent, 5) if sent else None,
    }


def concurrent_round(url: str, streamed: dict, streams: int, seed: int) -> list[list[tuple[str, float]]]:
    """``streams`` streams sent at once; each one's events, timed from a common start."""
    events: list[list[tuple[str, float]]] = [[] for _ in range(streams)]
    barrier = threading.Barrier(streams)
    started = [0.0]

    def client(index: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            http.get("/v2/health/live")  # connected before the barrier: the streams start together
            if barrier.wait() == 0:
                started[0] = time.perf_counter()
            barrier.wait()
            events[index] = timed_events(http, {**streamed, "seed": seed * 100 + index}, started[0])

    run_threads(client, streams)
    if not all(events):
        raise RuntimeError("a concurrent stream failed (see its traceback above)")
    return events


def concurrent_previews(url: str, streamed: dict, streams: int, rounds: int, budget: float, preview_s: float | None, nominal: int) -> dict:
    """Previews of ``streams`` concurrent streams while all are in flight (T s, to the first result) against
    the budget's promise: a call (the newest preview of each) lasts about streams x ``preview_s``; the
    budget allows one per call / budget seconds, the first (no rest before it) may add one."""
    per_round = []
    for r in range(rounds):
        events = concurrent_round(url, streamed, streams, r)
        overlap_s = min(e[-1][1] for e in events)
        during = [sum(kind == "preview" and at < overlap_s for kind, at in e) for e in events]
        promised = int(overlap_s * budget / (streams * preview_s)) if preview_s else 0
        per_round.append(
            {
                "overlap_seconds": round(overlap_s, 3),
                "previews_while_all_in_flight": during,
                "previews_in_all": [sum(kind == "preview" for kind, _ in e) for e in events],
                "promised_while_all_in_flight": [min(promised, nominal), min(promised + 1, nominal)],
                "got_the_promised": all(d >= min(promised, nominal) for d in during),
            }
        )
        print(f"concurrent round {r + 1}/{rounds}: {per_round[-1]}", flush=True)
    return {"streams": streams, "rounds": per_round, "all_got_the_promised": all(r["got_the_promised"] for r in per_round)}


def throughput_cost(url: str, args: argparse.Namespace) -> dict:
    """The throughput rounds: plain and streamed loads alternating, medians and the cost."""
    plain = {"n": 1, "length": args.length, "steps": args.steps, "sampler": "sde"}
    streamed = {**plain, "stream": True, "preview_every": args.every}
    run_load(url, args.clients, 1, plain)  # warm up both paths
    run_load(url, args.clients, 1, streamed)
    rates: dict[str, list[float]] = {"plain": [], "previews": []}
    received = 0
    for r in range(args.rounds):
        for mode in ("plain", "previews") if r % 2 == 0 else ("previews", "plain"):
            rate, events = run_load(url, args.clients, args.requests, plain if mode == "plain" else streamed)
            rates[mode].append(rate)
            received += events
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {v[-1]:.0f}" for m, v in rates.items()), flush=True)
    medians = {m: statistics.median(v) for m, v in rates.items()}
    return {
        **{name: getattr(args, name) for name in ("clients", "requests", "length", "steps", "rounds")},
        "sample_steps_per_s": {m: [round(x, 1) for x in v] for m, v in rates.items()},
        "median_sample_steps_per_s": {m: round(v, 1) for m, v in medians.items()},
        "throughput_cost": round(1 - medians["previews"] / medians["plain"], 4),
        # previews are skipped, never queued, when decoding them would exceed the budget
        "preview_events_per_request": round(received / (args.rounds * args.clients * args.requests), 2),
        "preview_events_per_request_nominal": (args.steps - 1) // args.every,
    }


def measure(url: str, args: argparse.Namespace) -> dict:
    """Every part of the report against the server at ``url``."""
    schema = httpx.get(f"{url}/openapi.json", timeout=30).json()["components"]["schemas"]["GenerateBody"]
    lone_steps = args.lone_steps or schema["properties"]["steps"]["default"]  # the server's default
    plain = {"n": 1, "length": args.lone_length, "steps": lone_steps}
    streamed = {**plain, "stream": True, "preview_every": args.every}
    nominal = (lone_steps - 1) // args.every
    lone = lone_cost(url, plain, streamed, args.lone_repeats, nominal, args.lone_budget)
    print(f"lone: {lone['median_seconds']}, ratio {lone['ratio_streamed_to_plain']}, previews {lone['previews_per_stream']}", flush=True)
    steps = args.concurrent_steps or lone_steps
    body, preview_s = {**streamed, "steps": steps}, lone["decode_seconds_per_preview"]
    concurrent = concurrent_previews(url, body, args.streams, args.concurrent_rounds, args.budget, preview_s, (steps - 1) // args.every)
    report = {"url": url, "preview_every": args.every, "preview_budget": args.budget, "preview_lone_budget": args.lone_budget}
    report.update({"lone_body": plain, "lone": lone})
    report["concurrent"] = {"steps": steps, **concurrent}
    if args.rounds:
        report["throughput"] = throughput_cost(url, args)
    report["first_preview_batch1"] = {
        f"preview_every_{k}": first_preview_seconds(url, {**streamed, "preview_every": k}, 10) for k in sorted({1, args.every})
    }
    return report


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server on loopback (default: start one)")
    parser.add_argument("--source", help="what to serve without --url: an export or checkpoint (default: a fresh tiny export)")
    parser.add_argument("--every", type=int, default=5, help="steps between previews (default 5)")
    parser.add_argument("--budget", type=float, default=PREVIEW_BUDGET, help=f"the server's --preview-budget (default {PREVIEW_BUDGET:g})")
    parser.add_argument(
        "--lone-budget",
        type=float,
        default=PREVIEW_LONE_BUDGET,
        help="the server's --preview-lone-budget (default 1/3; 1: every preview, in order)",
    )
    parser.add_argument("--lone-length", type=int, default=64, help="tokens of the lone and concurrent requests (default 64)")
    parser.add_argument("--lone-steps", type=int, default=0, help="their steps (default 0: the server's default)")
    parser.add_argument("--lone-repeats", type=int, default=10, help="lone requests per mode (default 10)")
    parser.add_argument("--streams", type=int, default=3, help="concurrent streams (default 3)")
    parser.add_argument("--concurrent-steps", type=int, default=0, help="their steps (default 0: as the lone ones)")
    parser.add_argument("--concurrent-rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8, help="throughput: concurrent clients (default 8)")
    parser.add_argument("--requests", type=int, default=4, help="throughput: requests per client per round (default 4)")
    parser.add_argument("--length", type=int, default=32, help="throughput: tokens per request (default 32)")
    parser.add_argument("--steps", type=int, default=50, help="throughput: steps per request (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds (default 5; 0 skips them)")
    parser.add_argument("--threads", type=int, default=0, help="the server's --threads without --url (default 0: its own default)")
    parser.add_argument("--out", default="runs/preview_cost.json")
    args = parser.parse_args()
    for name in ("budget", "lone_budget"):
        if not 0 < getattr(args, name) <= 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is out of range; allowed: (0, 1]")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error(f"--url {args.url} is not on loopback; this script sends traffic to 127.0.0.1 only")
    at_least_one = ("every", "lone_length", "lone_repeats", "streams", "concurrent_rounds", "clients", "requests", "length", "steps")
    for name, low in {**dict.fromkeys(at_least_one, 1), "lone_steps": 0, "concurrent_steps": 0, "rounds": 0, "threads": 0}.items():
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}")
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="ldlm-preview-") as work:
        process, url = None, args.url
        if url is None:
            source = args.source or str(tiny_export(Path(work)))
            port = free_port()
            threads = ["--threads", str(args.threads)] if args.threads else []
            budgets = ["--preview-budget", str(args.budget), "--preview-lone-budget", str(args.lone_budget)]
            process = start_server(source, port, [*budgets, *threads])
            url = f"http://127.0.0.1:{port}"
        try:
            report = measure(url, args)
        finally:
            if process is not None:
                stop_server(process)
    write_report(report, args.out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
