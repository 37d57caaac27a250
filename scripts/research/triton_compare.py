#!/usr/bin/env python
"""`ldlm serve` against a real Triton Inference Server, side by side: the same requests, the same
ONNX graphs, one run, both on 127.0.0.1.

Triton is nvidia-pytriton's tritonserver (ldlm.serve.deploy.triton_local) with the repository of
``ldlm triton-repo --graph-backend python --cpu`` (graphs as Python-backend models running ONNX
Runtime; its max_batch_size set to ldlm serve's max_batch, 16). The load is load_test's client loop
(run_clients: N client threads, KServe v2 JSON over httpx, requests/s and p50/p99; denoiser bodies
encoded once ahead), three workloads:

  denoiser-b1   POST /v2/models/denoiser/infer, batch 1 x L tokens          (both servers)
  denoiser-b8   the same at batch 8
  generate      ldlm serve: POST /v1/generate; Triton: POST /v2/models/ldlm_generate/infer
                (n=1, the same length, steps, seed and sampler ddim)

Each workload runs on both servers twice, in the order A B B A, so drifting load on the machine
hits both alike; the report has each run and their mean. Before the load, one request of each kind
goes to both, and the answers are compared (denoiser max abs difference, generated texts). Each run
also records, per model, samples per execution and compute time from the servers' own counters
(Triton's statistics extension, ldlm serve's /metrics): where the difference comes from.

    flock /tmp/ldlm-cpu.lock python scripts/research/triton_compare.py --out docs/measurements/triton-vs-ldlm-serve-2026-12-01.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from ldlm.serve.deploy.triton_env import DEFAULT_CACHE, prepare_env  # noqa: E402
from ldlm.serve.deploy.triton_server import start_server as start_triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from scripts.harness.loopback import free_port, start_server, stop_server, tiny_export  # noqa: E402
from scripts.harness.traffic import generate_body, run_clients, write_report  # noqa: E402

MAX_BATCH = 16  # ldlm serve's default max_batch; Triton's max_batch_size is set to the same


def kserve_body(inputs: dict[str, np.ndarray]) -> dict:
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}
    return {
        "inputs": [
            {"name": n, "shape": list(v.shape), "datatype": datatypes[v.dtype], "data": v.reshape(-1).tolist()} for n, v in inputs.items()
        ]
    }


def denoiser_bodies(batch: int, length: int, d: int, count: int, triton: bool) -> list[dict]:
    """``count`` different requests; the same for both servers but for t's shape: [B] for ldlm serve
    (the graph's), [B, 1] for Triton (dims [1] reshaped to [] by the config). The load sends them
    JSON-encoded once ahead: a batch-8 body is ~0.7 MB, 40 ms of json.dumps in the client."""
    bodies = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        t = rng.uniform(0.05, 1.0, batch).astype(np.float32)
        bodies.append(
            kserve_body(
                {
                    "x_t": rng.standard_normal((batch, length, d)).astype(np.float32).round(4),
                    "t": t.reshape(batch, 1) if triton else t,
                    "x0_prev": rng.standard_normal((batch, length, d)).astype(np.float32).round(4),
                    "attention_mask": np.ones((batch, length), dtype=np.int64),
                }
            )
        )
    return bodies


def triton_generate_body(seed: int, length: int, steps: int) -> dict:
    """traffic.generate_body's request as ldlm_generate's KServe inputs."""
    ours = generate_body(seed, length, steps)
    scalars = [
        {"name": name, "shape": [1], "datatype": "INT64", "data": [ours[key]]}
        for name, key in (("N", "n"), ("LENGTH", "length"), ("STEPS", "steps"), ("SEED", "seed"))
    ]
    return {"inputs": [*scalars, {"name": "SAMPLER", "shape": [1], "datatype": "BYTES", "data": [ours["sampler"]]}]}


def workloads(args: argparse.Namespace, d: int) -> dict[str, dict[str, object]]:
    """name -> server -> request_for(client, i) as run_clients takes it."""
    pools = {
        (b, t): [json.dumps(body).encode() for body in denoiser_bodies(b, args.length, d, 16, t)] for b in (1, 8) for t in (False, True)
    }
    return {
        f"denoiser-b{b}": {
            "ldlm serve": lambda c, i, b=b: ("/v2/models/denoiser/infer", pools[(b, False)][(c + i) % 16]),
            "triton": lambda c, i, b=b: ("/v2/models/denoiser/infer", pools[(b, True)][(c + i) % 16]),
        }
        for b in (1, 8)
    } | {
        "generate": {
            "ldlm serve": lambda c, i: ("/v1/generate", generate_body(c * 100000 + i, args.gen_length, args.gen_steps)),
            "triton": lambda c, i: (
                "/v2/models/ldlm_generate/infer",
                triton_generate_body(c * 100000 + i, args.gen_length, args.gen_steps),
            ),
        }
    }


def agreement(urls: dict[str, str], d: int, args: argparse.Namespace) -> dict:
    """One request of each kind to both servers: are the answers the same?"""
    with httpx.Client(timeout=60) as http:
        ours = http.post(f"{urls['ldlm serve']}/v2/models/denoiser/infer", json=denoiser_bodies(8, args.length, d, 1, False)[0]).json()
        theirs = http.post(f"{urls['triton']}/v2/models/denoiser/infer", json=denoiser_bodies(8, args.length, d, 1, True)[0]).json()
        x_ours, x_theirs = (np.asarray(r["outputs"][0]["data"], dtype=np.float32) for r in (ours, theirs))
        texts_ours = http.post(f"{urls['ldlm serve']}/v1/generate", json=generate_body(7, args.gen_length, args.gen_steps)).json()["texts"]
        answer = http.post(
            f"{urls['triton']}/v2/models/ldlm_generate/infer", json=triton_generate_body(7, args.gen_length, args.gen_steps)
        ).json()
        texts_theirs = next(o["data"] for o in answer["outputs"] if o["name"] == "TEXTS")
    return {"denoiser_b8_max_abs_diff": float(np.abs(x_ours - x_theirs).max()), "generate_same_texts": texts_ours == texts_theirs}


def counters(server: str, url: str) -> dict[str, dict[str, float]]:
    """Per model: samples inferred, executions (batches run) and compute seconds, from Triton's
    statistics extension or ldlm serve's /metrics (the same three counters, named after Triton's).
    ldlm serve's generation scheduler counts its denoiser steps under "generate"."""
    if server == "triton":
        stats = httpx.get(f"{url}/v2/models/stats", timeout=10).json()["model_stats"]
        return {
            m["name"]: {
                "inferences": float(m["inference_count"]),
                "executions": float(m["execution_count"]),
                "compute_s": float(m["inference_stats"]["compute_infer"]["ns"]) / 1e9,
            }
            for m in stats
        }
    found: dict[str, dict[str, float]] = {}
    names = {
        "ldlm_inference_count_total": "inferences",
        "ldlm_execution_count_total": "executions",
        "ldlm_compute_duration_seconds_sum": "compute_s",
    }
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        metric, _, rest = line.partition("{")
        if metric in names and 'model="' in rest:
            model = rest.split('model="', 1)[1].split('"', 1)[0]
            found.setdefault(model, {})[names[metric]] = float(line.rsplit(" ", 1)[1])
    return found


def batching(before: dict, after: dict, seconds: float) -> dict[str, dict[str, float]]:
    """What each model did during one run: samples per execution and the share of the run it computed."""
    report = {}
    for model, end in after.items():
        start = before.get(model, {})
        delta = {k: v - start.get(k, 0.0) for k, v in end.items()}
        if delta.get("executions"):
            report[model] = {
                "executions": int(delta["executions"]),
                "samples_per_execution": round(delta["inferences"] / delta["executions"], 2),
                "compute_ms_per_execution": round(1000 * delta["compute_s"] / delta["executions"], 2),
                "compute_busy_share": round(delta["compute_s"] / seconds, 3),
            }
    return report


def host() -> dict:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", help="`ldlm export` directory (default: a fresh tiny random-init export)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients per run (default: 8)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per run (default: 10), after a 2 s warm-up")
    parser.add_argument("--length", type=int, default=32, help="denoiser tokens per sample (default: 32)")
    parser.add_argument("--gen-length", type=int, default=16, help="tokens per generation request (default: 16)")
    parser.add_argument("--gen-steps", type=int, default=10, help="steps per generation request (default: 10)")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help=f"the local Triton's environment (default: {DEFAULT_CACHE})")
    parser.add_argument("--out", default="runs/triton_compare.json")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256 or not 0 < args.seconds <= 600:
        parser.error(f"--clients {args.clients} / --seconds {args.seconds} out of range; allowed: 1..256 and (0, 600]")
    if not 1 <= args.length <= 4096 or not 1 <= args.gen_length <= 4096 or not 1 <= args.gen_steps <= 1000:
        parser.error("--length and --gen-length must be in 1..4096, --gen-steps in 1..1000")

    from ldlm.serve.deploy.triton_repo import write_triton_repo

    env = prepare_env(args.cache)
    report: dict = {"host": host(), "settings": {**vars(args), "max_batch": MAX_BATCH, "order": "A B B A per workload"}}
    with tempfile.TemporaryDirectory(prefix="ldlm-triton-compare-") as work:
        source = args.source
        if source is None:
            source = str(tiny_export(Path(work), progress=False))
        repo = write_triton_repo(source, Path(work) / "repo", max_batch=MAX_BATCH, gpu=False, graph_backend="python")
        port = free_port()
        ours = start_server(source, port)
        triton = None
        try:
            triton = start_triton(repo, env, Path(work) / "triton.log")
            urls = {"ldlm serve": f"http://127.0.0.1:{port}", "triton": f"http://{triton.http_url}"}
            d = int(httpx.get(f"{urls['ldlm serve']}/v2/models/decoder", timeout=10).json()["inputs"][0]["shape"][-1])
            report["agreement"] = agreement(urls, d, args)
            results: dict[str, dict[str, list[dict]]] = {}
            for name, per_server in workloads(args, d).items():
                results[name] = {server: [] for server in per_server}
                for server in ("ldlm serve", "triton", "triton", "ldlm serve"):
                    request_for = per_server[server]
                    run_clients(urls[server], args.clients, 2.0, d, request_for=request_for)  # warm-up
                    before = counters(server, urls[server])
                    result = run_clients(urls[server], args.clients, args.seconds, d, request_for=request_for)
                    result["batching"] = batching(before, counters(server, urls[server]), result["seconds"])
                    results[name][server].append(result)
                    print(
                        f"{name:12s} {server:10s} {result['throughput_rps']:8.2f} req/s  p50 {result['latency_p50_ms']} ms  "
                        f"p99 {result['latency_p99_ms']} ms  errors {result['errors']}",
                        flush=True,
                    )
        finally:
            report["ldlm_serve_exit_code"] = stop_server(ours)
            if triton is not None:
                report["triton_exit_code"] = triton.stop()
    report["host"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    report["results"] = {
        name: {
            server: {
                "requests_per_s": round(statistics.mean(r["throughput_rps"] for r in runs), 2),
                "p50_ms": round(statistics.mean(r["latency_p50_ms"] for r in runs), 2),
                "p99_ms": round(statistics.mean(r["latency_p99_ms"] for r in runs), 2),
                "runs": runs,
            }
            for server, runs in per_server.items()
        }
        for name, per_server in results.items()
    }
    report["ldlm_serve_over_triton_rps"] = {
        name: round(r["ldlm serve"]["requests_per_s"] / r["triton"]["requests_per_s"], 2)
        for name, r in report["results"].items()
        if r["triton"]["requests_per_s"]
    }
    report["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_report(report, args.out)
    errors = sum(r["errors"] + r["lost"] for per in results.values() for runs in per.values() for r in runs)
    if errors:
        sys.exit(f"{errors} requests failed or were lost")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
