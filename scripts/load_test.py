#!/usr/bin/env python
"""Load test of `ldlm serve` on 127.0.0.1: N concurrent clients for M seconds, then the server's
overhead at batch 1 (end-to-end HTTP latency minus the raw runner's, measured side by side).

Traffic goes to loopback only. Without --url the script starts its own server on a free port
(from --source, or from a fresh tiny random-init checkpoint exported to ONNX) and stops it after.
Writes JSON: throughput, p50/p99 latency, errors and lost requests (sent but never answered).

    python scripts/load_test.py --clients 16 --seconds 60 --out runs/load_test.json

With --ray-replicas (needs `pip install -e .[ray]`) the script starts a local Ray cluster instead,
serves the Ray Serve application (ldlm.serve.deploy.ray_app) with each replica count in turn, alternating
them for --repeats rounds so that drifting load on the machine hits every count alike, and reports
the median throughput per count and the speed-up of the largest count over the smallest:

    python scripts/load_test.py --ray-replicas 1,2 --threads 1 --mix generate --clients 8 \
        --seconds 20 --repeats 3 --overhead-requests 0 --out runs/ray_scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from ldlm.serve.api.kserve_tensors import DATATYPES  # noqa: E402
from scripts.harness.loopback import LOOPBACK, free_port, start_server, stop_server, tiny_export  # noqa: E402
from scripts.harness.traffic import encoder_body, latent_width, run_clients, write_report  # noqa: E402


def binary_infer(http: httpx.Client, model: str, feed: dict[str, np.ndarray], output: str) -> np.ndarray:
    """One KServe v2 infer with binary tensors both ways (the binary-data extension Triton's clients use):
    a JSON head, then each input's bytes; the answer's head, then ``output``'s bytes."""
    inputs = [
        {"name": name, "shape": list(value.shape), "datatype": "INT64", "parameters": {"binary_data_size": value.nbytes}}
        for name, value in feed.items()
    ]
    head = json.dumps({"inputs": inputs, "outputs": [{"name": output, "parameters": {"binary_data": True}}]}).encode()
    answer = http.post(
        f"/v2/models/{model}/infer",
        content=head + b"".join(value.tobytes() for value in feed.values()),
        headers={"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"},
    )
    answer.raise_for_status()
    size = int(answer.headers["Inference-Header-Content-Length"])
    (meta,) = json.loads(answer.content[:size])["outputs"]
    return np.frombuffer(answer.content[size:], dtype=DATATYPES[meta["datatype"]]).reshape(meta["shape"])


def measure_overhead(url: str, source: str, requests: int) -> dict:
    """Batch 1 encoder, 16 tokens, over HTTP with binary tensors (as Triton's clients send them) and
    through the raw runner in this process, alternating call by call."""
    from ldlm.serve.runtime.backends import open_graphs  # per measurement: the load alone needs no runner

    graphs, _, _ = open_graphs("ort", source)
    body = encoder_body(16, 0)
    feed = {i["name"]: np.asarray(i["data"], dtype=np.int64).reshape(i["shape"]) for i in body["inputs"]}
    http = httpx.Client(base_url=url, timeout=30.0)
    http_ms, raw_ms = [], []
    for _ in range(10):  # warm-up both
        binary_infer(http, "encoder", feed, "latents")
        graphs["encoder"].run(feed)
    for _ in range(requests):
        start = time.perf_counter()
        binary_infer(http, "encoder", feed, "latents")
        http_ms.append(1000 * (time.perf_counter() - start))
        start = time.perf_counter()
        graphs["encoder"].run(feed)
        raw_ms.append(1000 * (time.perf_counter() - start))
    http.close()
    http_p50, raw_p50 = statistics.median(http_ms), statistics.median(raw_ms)
    return {
        "requests": requests,
        "client": "httpx (binary tensors)",
        "http_p50_ms": round(http_p50, 3),
        "runner_p50_ms": round(raw_p50, 3),
        "overhead_p50_ms": round(http_p50 - raw_p50, 3),
        "graph": "encoder",
        "batch": 1,
        "length": 16,
    }


def cpu_seconds_by_process() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process ("load generator") and every process
    below it, grouped by name (Ray sets "ray::ServeReplica:...", "ray::ProxyActor", ...), so a run
    shows where the CPU went: a speed-up needs the replicas, not the proxy, to be the bottleneck."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError):
            continue
        table[int(entry.name)] = (int(fields[1]), argv0, (int(fields[11]) + int(fields[12])) / tick)
    me = os.getpid()
    below, todo = set(), [me]
    while todo:
        parent = todo.pop()
        for pid, (ppid, _, _) in table.items():
            if ppid == parent and pid not in below:
                below.add(pid)
                todo.append(pid)
    groups: dict[str, float] = {"load generator": table[me][2] if me in table else 0.0}
    for pid in below:
        _, argv0, cpu = table[pid]
        name = argv0.split()[0] if argv0.strip() else "?"
        name = "ray::" + name[5:].split(":")[0] if name.startswith("ray::") else Path(name).name
        groups[name] = groups.get(name, 0.0) + cpu
    return groups


def ray_scaling(source: str, counts: list[int], args: argparse.Namespace) -> dict:
    """Throughput of the Ray Serve app per replica count, on a local Ray cluster started here."""
    import ray
    from ray import serve

    from ldlm.serve.api.service import ServerSettings
    from ldlm.serve.deploy.ray_app import APP_NAME, DEPLOYMENT_NAME, RayOptions, build_app

    ray.init(include_dashboard=False, log_to_driver=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ServerSettings(threads=args.threads)
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    load_before = os.getloadavg()
    try:
        for round_ in range(args.repeats):
            for n in counts:
                serve.delete(APP_NAME)  # a clean start: every count gets fresh replicas and all the CPUs it reserves
                serve.run(build_app(source, settings, RayOptions(replicas=n, num_cpus=args.replica_cpus)), name=APP_NAME, route_prefix="/")
                deadline = time.time() + 180
                while serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states != {"RUNNING": n}:
                    if time.time() > deadline:
                        raise RuntimeError(f"{n} replicas did not become RUNNING in 180 s")
                    time.sleep(0.5)
                d = latent_width(url, 30)
                run_clients(url, args.clients, min(5.0, args.seconds), d, args.mix, args.gen_length, args.gen_steps)  # warm-up
                cpu_before = cpu_seconds_by_process()
                result = run_clients(url, args.clients, args.seconds, d, args.mix, args.gen_length, args.gen_steps)
                cpu_after = cpu_seconds_by_process()
                spent = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
                per_request = {
                    k: round(1000 * v / max(result["answered"], 1), 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v > 0.05
                }
                runs[n].append({"round": round_, "loadavg_1m": round(os.getloadavg()[0], 2), **result, "cpu_ms_per_request": per_request})
                print(f"round {round_}: {n} replica(s): {result['throughput_rps']} req/s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    medians = {n: statistics.median(r["throughput_rps"] for r in runs[n]) for n in counts}
    cpu = {
        n: {
            "replicas": statistics.median(r["cpu_ms_per_request"].get("ray::ServeReplica", 0.0) for r in runs[n]),
            "total": statistics.median(round(sum(r["cpu_ms_per_request"].values()), 3) for r in runs[n]),
        }
        for n in counts
    }
    cores = os.cpu_count() or 1
    # What the CPU cost per request allows on this machine if nothing else ran: n replicas of one
    # intra-op thread use at most about n cores, and all processes together at most `cores`.
    bound = {n: min(n * 1000 / c["replicas"], cores * 1000 / c["total"]) if c["replicas"] else 0.0 for n, c in cpu.items()}
    return {
        "mode": "ray_scaling",
        "url": url,
        "threads_per_replica": args.threads,
        "cpus_per_replica": args.replica_cpus,
        "machine_cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "median_throughput_rps": {str(n): round(m, 2) for n, m in medians.items()},
        "speedup": round(medians[max(counts)] / medians[min(counts)], 3) if medians[min(counts)] else None,
        # CPU per answered request, median over rounds: the replicas against everything (proxy,
        # controller, raylet, this load generator). Less affected by other load than throughput.
        "cpu_ms_per_request": {str(n): c for n, c in cpu.items()},
        "cpu_bound_estimate": {
            "throughput_rps": {str(n): round(b, 2) for n, b in bound.items()},
            "speedup": round(bound[max(counts)] / bound[min(counts)], 3) if bound[min(counts)] else None,
            "assumes": f"only this test on the {cores} cores; a replica with 1 intra-op thread uses about one core",
        },
        "runs": {str(n): r for n, r in runs.items()},
        "load": {
            "errors": sum(r["errors"] for rs in runs.values() for r in rs),
            "lost": sum(r["lost"] for rs in runs.values() for r in rs),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server on loopback (default: start one)")
    parser.add_argument("--source", help="`ldlm export` directory to serve (default: a fresh tiny export)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--overhead-requests", type=int, default=300, help="0 skips the overhead measurement")
    parser.add_argument(
        "--mix",
        choices=["mixed", "generate"],
        default="mixed",
        help="mixed: 70%% encoder, 20%% decoder, 10%% generate; generate: only /v1/generate (default: mixed)",
    )
    parser.add_argument("--gen-length", type=int, default=16, help="tokens per /v1/generate request (default: 16)")
    parser.add_argument("--gen-steps", type=int, default=10, help="steps per /v1/generate request (default: 10)")
    parser.add_argument("--ray-replicas", help="compare Ray Serve replica counts on a local Ray cluster, e.g. 1,2")
    parser.add_argument("--threads", type=int, default=1, help="with --ray-replicas: intra-op threads per replica (default: 1)")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray-replicas: CPUs reserved per replica (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="with --ray-replicas: rounds over the counts (default: 3)")
    parser.add_argument("--out", default="runs/load_test.json")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256 or not 0 < args.seconds <= 600:
        parser.error("--clients must be in 1..256 and --seconds in (0, 600]")
    if not 1 <= args.gen_length <= 4096 or not 1 <= args.gen_steps <= 1000 or not 1 <= args.repeats <= 100 or not 1 <= args.threads <= 256:
        parser.error("--gen-length must be in 1..4096, --gen-steps in 1..1000, --repeats in 1..100 and --threads in 1..256")
    counts = []
    if args.ray_replicas:
        try:
            counts = sorted({int(n) for n in args.ray_replicas.split(",")})
        except ValueError:
            parser.error(f"--ray-replicas {args.ray_replicas!r} is not a comma-separated list of replica counts, e.g. 1,2")
        if not counts or counts[0] < 1 or counts[-1] > 64 or args.url:
            parser.error("--ray-replicas takes counts in 1..64 and starts its own cluster (no --url)")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error(f"--url {args.url} is not on loopback; load tests send traffic to 127.0.0.1 only")

    with tempfile.TemporaryDirectory(prefix="ldlm-load-") as work:
        source = args.source
        if source is None and args.url is None or (args.overhead_requests and source is None):
            source = str(tiny_export(Path(work)))
        if counts:
            report = ray_scaling(source, counts, args)
            write_report(report, args.out)
            if report["load"]["errors"] or report["load"]["lost"]:
                sys.exit(1)
            return
        process = None
        url = args.url
        if url is None:
            port = free_port()
            process = start_server(source, port)
            url = f"http://127.0.0.1:{port}"
        try:
            d = latent_width(url)
            report = {"url": url, "load": run_clients(url, args.clients, args.seconds, d, args.mix, args.gen_length, args.gen_steps)}
            if args.overhead_requests:
                report["overhead"] = measure_overhead(url, source, args.overhead_requests)
        finally:
            if process is not None:
                report_exit = stop_server(process)
        if process is not None:
            report["server_exit_code"] = report_exit
    write_report(report, args.out)
    if report["load"]["errors"] or report["load"]["lost"]:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
