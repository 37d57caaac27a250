#!/usr/bin/env python
"""KServe v2 round trips at batch 1, one request at a time, side by side in one run: the in-process runner,
`ldlm serve` over gRPC and over HTTP (binary tensors), and a real tritonserver serving the same ONNX graphs.

Graphs: the encoder and the denoiser of the checkpoint's export (default: the reference), batch 1 x --tokens.
Calls go back to back, as perf_analyzer sends them at concurrency 1, in blocks of 10 calls of one kind; each
round runs one block of every kind below, for each graph, in an order shuffled anew (a seeded shuffle), so a
drifting load on the machine hits them all alike. A block's first call, which finds its server idle after the
other kinds' calls, is reported apart ("after idle"): on this machine a process woken from idle answers later,
and the more threads a request passes through, the more so. The report has p50 and p99 of each and, for the
servers, the overhead over the in-process runner (p50 minus the runner's p50):

  graph          the ONNX Runtime session alone, in this process
  runner         the same graph through its DynamicBatcher, as `ldlm serve` runs it (the in-process runner)
  grpc           tritonclient.grpc's infer (what a Triton user calls)
  http           tritonclient.http's infer, binary inputs and outputs
  grpc_bare      a grpc stub sending one ModelInferRequest built once (as perf_analyzer drives a server):
                 the server and the wire, without tritonclient's own work
  live           ServerLive over each transport: the round trip of a call that does nothing, the floor

The floor of a Python front end is measured too, as "grpcio floor": a bare grpcio server (grpcio_floor.py) whose
ModelInfer runs the same graph on its event loop, with no batcher, no checks, no statistics; its grpc_bare and
live calls tell what grpcio alone adds on this machine, and so what no Python gRPC server can go below.
The same kinds are sent to tritonserver (nvidia-pytriton's 2.51, the one the tests run), serving
``ldlm triton-repo --graph-backend python`` of the same export: this machine's Triton has only its Python
backend, so each graph runs ONNX Runtime in a Python-backend stub, a process of its own that Triton talks to
through shared memory. Its overhead is measured over the same in-process graph call. Both servers run on
127.0.0.1 in processes of their own, with their default settings; the client is this process.

    .venv/bin/python scripts/research/kserve_round_trip.py --repeats 1000 --out runs/kserve_round_trip.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.grpc import service_pb2, service_pb2_grpc

from ldlm.export.onnx_export import export_graphs
from ldlm.files import write_atomically
from ldlm.model.config import LDLMConfig
from ldlm.serve.checks.bench_latency import graph_feed
from ldlm.serve.deploy.triton_env import DEFAULT_CACHE, TritonUnavailable, prepare_env
from ldlm.serve.deploy.triton_repo import write_triton_repo
from ldlm.serve.deploy.triton_server import start_server as start_triton
from ldlm.serve.runtime.backends import open_graphs
from ldlm.serve.runtime.batcher import DynamicBatcher

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from scripts.harness.loopback import free_port, start_server, stop_server  # noqa: E402

REFERENCE = "models/ldlm-austen-tiny"
GRAPHS = ("encoder", "denoiser")
TARGET_GRPC_OVERHEAD_MS = 0.6  # over the in-process runner, p50, batch 1
BLOCK = 10  # back-to-back calls of one kind in a row
Call = Callable[[], Any]


def server_feed(feed: dict[str, np.ndarray], triton: bool) -> dict[str, np.ndarray]:
    """A graph's feed as each server's model takes it: Triton's config gives a per-sample scalar (t, shape
    [batch]) dims [1], so its clients send [batch, 1]; `ldlm serve` takes the graph's own shape."""
    return {name: a.reshape(-1, 1) if triton and a.ndim == 1 else a for name, a in feed.items()}


def grpc_inputs(feed: dict[str, np.ndarray]) -> list[Any]:
    inputs = []
    for name, array in feed.items():
        tensor = triton_grpc.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "FP32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def http_inputs(feed: dict[str, np.ndarray]) -> list[Any]:
    inputs = []
    for name, array in feed.items():
        tensor = triton_http.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "FP32")
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    return inputs


def bare_request(graph: str, feed: dict[str, np.ndarray]) -> Any:
    """One ModelInferRequest, built once: raw inputs, every output."""
    request = service_pb2.ModelInferRequest(model_name=graph)
    for name, array in feed.items():
        request.inputs.add(name=name, datatype="INT64" if array.dtype == np.int64 else "FP32", shape=array.shape)
        request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    return request


def server_calls(http_url: str, grpc_url: str, feeds: dict[str, dict[str, np.ndarray]], triton: bool, stack: ExitStack) -> dict[str, Call]:
    """Each kind of call to one server: "<graph> <kind>" for every graph, and "live <transport>"."""
    grpc_client = stack.enter_context(triton_grpc.InferenceServerClient(grpc_url))
    http_client = triton_http.InferenceServerClient(http_url)
    stack.callback(http_client.close)
    channel = stack.enter_context(grpc.insecure_channel(grpc_url))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    calls: dict[str, Call] = {
        "live grpc": lambda: stub.ServerLive(service_pb2.ServerLiveRequest()),
        "live http": http_client.is_server_live,
    }
    for graph, feed in feeds.items():
        given = server_feed(feed, triton)
        outputs = [triton_http.InferRequestedOutput(name, binary_data=True) for name in output_names(grpc_client, graph)]
        g_in, h_in, bare = grpc_inputs(given), http_inputs(given), bare_request(graph, given)
        calls[f"{graph} grpc"] = lambda graph=graph, g_in=g_in: grpc_client.infer(graph, g_in)
        calls[f"{graph} http"] = lambda graph=graph, h_in=h_in, outputs=outputs: http_client.infer(graph, h_in, outputs=outputs)
        calls[f"{graph} grpc_bare"] = lambda bare=bare: stub.ModelInfer(bare)
    return calls


def floor_calls(grpc_url: str, feeds: dict[str, dict[str, np.ndarray]], stack: ExitStack) -> dict[str, Call]:
    """The bare grpcio server's kinds: "<graph> grpc_bare" and "live grpc"."""
    channel = stack.enter_context(grpc.insecure_channel(grpc_url))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    calls: dict[str, Call] = {"live grpc": lambda: stub.ServerLive(service_pb2.ServerLiveRequest())}
    for graph, feed in feeds.items():
        request = bare_request(graph, feed)
        calls[f"{graph} grpc_bare"] = lambda request=request: stub.ModelInfer(request)
    return calls


@contextmanager
def floor_server(export: Path, timeout_s: float = 60.0) -> Iterator[str]:
    """grpcio_floor.py serving ``export``, answering: its gRPC address."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("grpcio_floor.py")), str(export), str(port)])
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        yield address
    finally:
        process.kill()
        process.wait()


def output_names(client: Any, graph: str) -> list[str]:
    return [output.name for output in client.get_model_metadata(graph).outputs]


def in_process_calls(export: Path, feeds: dict[str, dict[str, np.ndarray]], stack: ExitStack) -> dict[str, Call]:
    """The graph alone, and through its DynamicBatcher, as `ldlm serve` runs it (default batch and delay)."""
    graphs, _, _ = open_graphs("ort", str(export))
    calls: dict[str, Call] = {}
    for graph, feed in feeds.items():
        batcher = DynamicBatcher(graphs[graph])
        stack.callback(batcher.close)
        calls[f"{graph} graph"] = lambda backend=graphs[graph], feed=feed: backend.run(feed)
        calls[f"{graph} runner"] = lambda batcher=batcher, feed=feed: batcher.submit(feed).result()
    return calls


def interleaved(calls: dict[str, Call], repeats: int, block: int = BLOCK, warmup: int = 2) -> dict[str, list[float]]:
    """Milliseconds of each call, ``repeats`` times, in blocks of ``block`` back-to-back calls of one kind (as
    perf_analyzer sends at concurrency 1), the kinds' blocks in an order shuffled anew each round (after
    ``warmup`` rounds). A block's first call, which follows another kind's and finds its server idle, is kept
    apart under "<kind> after idle"."""
    times: dict[str, list[float]] = defaultdict(list)
    order, shuffle = list(calls.items()), random.Random(0).shuffle
    for round_ in range(warmup + -(-repeats // (block - 1))):
        shuffle(order)
        for name, call in order:
            for i in range(block):
                started = time.perf_counter()
                call()
                if round_ >= warmup:
                    times[name if i else f"{name} after idle"].append(1000 * (time.perf_counter() - started))
    return times


def percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3)


def summary(times: dict[str, list[float]]) -> dict[str, Any]:
    """Per graph: each in-process kind and each server's kinds as p50/p99, and a server call's overhead over
    the in-process runner (Triton's: over the graph alone, the work its stub does), a first call after idle over
    the runner's first call after idle."""
    out: dict[str, Any] = {}
    for key, values in times.items():
        server, name = key.split(": ", 1) if ": " in key else ("in process", key)
        subject, kind = name.split(" ", 1)
        out.setdefault(subject, {}).setdefault(server, {})[kind] = {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}
    for graph in GRAPHS:
        local = out[graph]["in process"]
        for server, base in (("ldlm serve", "runner"), ("tritonserver", "graph"), ("grpcio floor", "graph")):
            for kind, entry in out[graph].get(server, {}).items():
                idle = " after idle" if kind.endswith(" after idle") else ""  # compared with the runner's own, idle too
                entry["overhead_p50_ms"] = round(entry["p50_ms"] - local[base + idle]["p50_ms"], 3)
    return out


def agreement(servers: dict[str, dict[str, Call]], feeds: dict[str, dict[str, np.ndarray]]) -> dict[str, float]:
    """Per graph, the largest difference between the two servers' first output (they serve the same ONNX)."""
    result = {}
    for graph in feeds:
        answers = [servers[name][f"{graph} grpc"]() for name in servers]
        arrays = [answer.as_numpy(answer.get_response().outputs[0].name).astype(np.float64) for answer in answers]
        result[graph] = float(np.abs(arrays[0].reshape(arrays[-1].shape) - arrays[-1]).max()) if len(arrays) > 1 else 0.0
    return result


@contextmanager
def servers(export: Path, work: Path, cache: str, triton: bool) -> Iterator[dict[str, tuple[str, str, bool]]]:
    """`ldlm serve` of the export (and tritonserver of its repository), started: name -> (HTTP, gRPC, is Triton)."""
    port, grpc_port = free_port(), free_port()
    ours = start_server(export, port, ["--grpc-port", str(grpc_port)])
    started: dict[str, tuple[str, str, bool]] = {"ldlm serve": (f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", False)}
    theirs = None
    try:
        if triton:
            repo = write_triton_repo(export, work / "repo", gpu=False, graph_backend="python")
            theirs = start_triton(repo, prepare_env(cache), work / "triton.log")
            started["tritonserver"] = (theirs.http_url, theirs.grpc_url, True)
        yield started
    finally:
        stop_server(ours)
        if theirs is not None:
            theirs.stop()


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    export = export_graphs(args.checkpoint, work / "onnx", progress=False).out
    config = LDLMConfig.load(export / "config.json")
    feeds = {graph: graph_feed(config, graph, 1, args.tokens) for graph in GRAPHS}
    triton, why_not = True, None
    try:
        prepare_env(args.cache)
    except TritonUnavailable as error:
        triton, why_not = False, str(error)
    report: dict[str, Any] = {"tritonserver_unavailable": why_not} if why_not else {}
    with servers(export, work, args.cache, triton and not args.no_triton) as running, floor_server(export) as floor, ExitStack() as stack:
        per_server = {name: server_calls(http, grpc_url, feeds, is_triton, stack) for name, (http, grpc_url, is_triton) in running.items()}
        report["max_abs_difference_between_servers"] = agreement(per_server, feeds)
        calls = in_process_calls(export, feeds, stack)
        per_server["grpcio floor"] = floor_calls(floor, feeds, stack)
        calls.update({f"{server}: {kind}": call for server, kinds in per_server.items() for kind, call in kinds.items()})
        report["results"] = summary(interleaved(calls, args.repeats))
    return report


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """The target: gRPC's overhead over the in-process runner at most 0.6 ms p50, per graph; beside it, what the
    bare grpcio server adds over the graph (the floor of a Python front end) and tritonserver's overhead."""

    def overheads(server: str, kind: str) -> dict[str, float] | None:
        present = all(server in results[graph] for graph in GRAPHS)
        return {graph: results[graph][server][kind]["overhead_p50_ms"] for graph in GRAPHS} if present else None

    rows = overheads("ldlm serve", "grpc")
    assert rows is not None
    return {
        "grpc_overhead_p50_ms_max": TARGET_GRPC_OVERHEAD_MS,
        "measured": rows,
        "met": all(v <= TARGET_GRPC_OVERHEAD_MS for v in rows.values()),
        "grpcio_floor_overhead_p50_ms": overheads("grpcio floor", "grpc_bare"),
        "tritonserver_grpc_overhead_p50_ms": overheads("tritonserver", "grpc"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=REFERENCE, help=f"the checkpoint to export and serve (default: {REFERENCE})")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sample, batch 1 (default: 16)")
    parser.add_argument("--repeats", type=int, default=300, help="calls of each kind, after 20 rounds of warm-up (default: 300)")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help=f"the local Triton's environment (default: {DEFAULT_CACHE})")
    parser.add_argument("--no-triton", action="store_true", help="leave tritonserver out")
    parser.add_argument("--out", required=True, help="the JSON report to write")
    args = parser.parse_args(argv)
    if not 1 <= args.tokens <= 1024 or not 10 <= args.repeats <= 100_000:
        parser.error(f"--tokens {args.tokens} / --repeats {args.repeats} out of range; allowed: 1..1024 and 10..100000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ldlm-round-trip-") as work:
        report = measure(args, Path(work))
    report = {
        "checkpoint": args.checkpoint,
        "batch": 1,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "load_average_start": [round(x, 2) for x in started],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "tritonserver": "nvidia-pytriton 0.7.0 (tritonserver 2.51), Python backend: each graph runs ONNX Runtime in a stub process",
        **report,
        "target": verdict(report["results"]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_atomically(args.out, json.dumps(report, indent=1) + "\n")
    for graph, entry in report["results"].items():
        for server, kinds in entry.items():
            print(graph, server, {kind: (v["p50_ms"], v.get("overhead_p50_ms")) for kind, v in kinds.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
