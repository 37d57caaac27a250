#!/usr/bin/env python
"""The fixed costs of a request, measured side by side in one run (medians), in four parts:

- graphs: the decoder's and the denoiser's p50 at batch 1 and 8 x 128 tokens on the checkpoint (ONNX
  Runtime on the CPU; with --device cuda the torch backend --backend, default eager), and the decoder's
  cost in denoiser steps;
- head: ONNX Runtime's profile of the exported decoder at 8 x 128 (SessionOptions.enable_profiling):
  milliseconds per op type and the vocabulary head's share (the nodes after the token decoder's final
  LayerNorm), for the decoder as exported and, beside it, for the head as it was before it was chunked
  (nn.Linear, then one ArgMax over the whole logits), exported from the same checkpoint (CPU only);
- stream: one request of --stream-steps steps at --stream-length tokens, plain and streamed with a preview
  every --every steps, alternating, on an otherwise idle `ldlm serve` of the checkpoint's export on
  127.0.0.1 (default settings): per-mode medians, their ratio, and the previews each stream got;
- kserve: the overhead of KServe v2 over the in-process runner, on a random-init tiny export's encoder
  at batch 1 x 16 tokens, with JSON and binary tensors (`ldlm serve` of that export on 127.0.0.1).

The machine may be shared: modes alternate run by run, the JSON records the load average, and every
figure is a median over --repeats runs.

    .venv/bin/python scripts/research/fixed_costs.py --out runs/fixed_costs.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from torch import nn

from ldlm.export.onnx_export import export_graphs
from ldlm.files import write_atomically
from ldlm.model.config import LDLMConfig
from ldlm.model.token_decoder import VocabularyHead
from ldlm.serve.checks.bench_latency import graph_feed, timed_call
from ldlm.serve.runtime.backends import open_graphs

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from scripts.harness.loopback import free_port, start_server, stop_server, tiny_export  # noqa: E402

REFERENCE = "models/ldlm-austen-tiny"
LENGTH = 128


def median_ms(call: Callable[[], Any], repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 2)


def graph_costs(source: str, backend: str, device: str, repeats: int) -> dict[str, Any]:
    """p50 of the decoder and the denoiser at batch 1 and 8 x LENGTH, alternating graph by graph."""
    graphs, config, _ = open_graphs(backend, source, device=device)
    result: dict[str, Any] = {"backend": backend, "device": device, "provider": graphs["decoder"].provider}
    for batch in (1, 8):
        calls = {name: timed_call(graphs[name], graph_feed(config, name, batch, LENGTH)) for name in ("denoiser", "decoder")}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(repeats):
            for name, call in calls.items():
                times[name].append(median_ms(call, 1))
        p50 = {name: round(statistics.median(values), 2) for name, values in times.items()}
        result[f"b{batch}"] = {
            **{f"{name}_p50_ms": ms for name, ms in p50.items()},
            "decoder_in_steps": round(p50["decoder"] / p50["denoiser"], 2),
        }
    for graph in graphs.values():
        graph.close()
    return result


@contextlib.contextmanager
def whole_logits_head() -> Iterator[None]:
    """The head as it was before it was chunked: nn.Linear, then one ArgMax over the whole logits."""
    chunked = VocabularyHead.forward

    def forward(self: VocabularyHead, x: Any, ids_only: bool = False) -> Any:
        logits = nn.Linear.forward(self, x)
        return logits.argmax(-1) if ids_only else logits

    VocabularyHead.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        VocabularyHead.forward = chunked  # type: ignore[method-assign]


def profile_decoder(path: Path, batch: int, repeats: int) -> dict[str, Any]:
    """ONNX Runtime's own profile of one decoder: ms per call by op type, and the head's share of the nodes' time."""
    import onnx
    import onnxruntime as ort

    graph = onnx.load(str(path), load_external_data=False).graph
    last_norm = max(i for i, n in enumerate(graph.node) if n.op_type == "LayerNormalization")
    head = {n.name for n in graph.node[last_norm + 1 :]}
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(path.parent / "profile")
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the server runs it
    options.enable_cpu_mem_arena = False
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = graph_feed(LDLMConfig.load(path.parent / "config.json"), "decoder", batch, LENGTH)
    wall = median_ms(lambda: session.run(None, feed), repeats)
    events = json.loads(Path(session.end_profiling()).read_text())
    calls = repeats + 1
    by_op: collections.Counter[str] = collections.Counter()
    in_head = total = 0.0
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            by_op[event["args"]["op_name"]] += event["dur"] / 1000 / calls
            total += event["dur"]
            in_head += event["dur"] if event["name"].removesuffix("_kernel_time") in head else 0
    return {
        "batch": batch,
        "p50_ms": wall,
        "op_ms": {op: round(ms, 2) for op, ms in by_op.most_common(8)},
        "nodes_ms": round(total / 1000 / calls, 2),
        "head_ms": round(in_head / 1000 / calls, 2),
        "head_share": round(in_head / total, 3),
        "head_nodes": len(head),
    }


def head_profiles(checkpoint: str, work: Path, repeats: int) -> dict[str, Any]:
    export_graphs(checkpoint, work / "chunked", graphs=("decoder",))
    with whole_logits_head():
        export_graphs(checkpoint, work / "whole", graphs=("decoder",))
    return {
        name: [profile_decoder(work / name / "decoder.onnx", batch, repeats) for batch in (1, 8)]
        for name in ("whole", "chunked")  # the head before (whole logits) and as exported now
    }


def read_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    events, kind, data = [], "message", ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif line == "" and data:
            events.append((kind, json.loads(data)))
            kind, data = "message", ""
    return events


def lone_stream(url: str, steps: int, length: int, every: int, repeats: int) -> dict[str, Any]:
    """One request at a time, plain and streamed alternating: medians, ratio, previews per stream."""
    body = {"n": 1, "length": length, "steps": steps, "seed": 3}
    times: dict[str, list[float]] = {"plain": [], "streamed": []}
    previews = []
    with httpx.Client(base_url=url, timeout=600) as http:
        http.post("/v1/generate", json=body).raise_for_status()  # warm-up
        for _ in range(repeats):
            started = time.perf_counter()
            http.post("/v1/generate", json=body).raise_for_status()
            times["plain"].append(time.perf_counter() - started)
            started = time.perf_counter()
            with http.stream("POST", "/v1/generate", json={**body, "stream": True, "preview_every": every}) as response:
                response.raise_for_status()
                events = read_events(response)
            times["streamed"].append(time.perf_counter() - started)
            previews.append([e["samples"][0]["step"] for kind, e in events if kind == "preview"])
    medians = {mode: round(statistics.median(values), 4) for mode, values in times.items()}
    asked = list(range(every, steps, every))
    return {
        "body": {**body, "preview_every": every},
        "plain_s": medians["plain"],
        "streamed_s": medians["streamed"],
        "ratio": round(medians["streamed"] / medians["plain"], 3),
        "previews_asked": asked,
        "streams_with_every_preview": sum(p == asked for p in previews),
        "streams": len(previews),
        "previews": previews,
    }


def encoder_bodies(seq: int) -> dict[str, tuple[bytes, dict[str, str]]]:
    ids = np.ones((1, seq), dtype=np.int64)
    names = ("input_ids", "attention_mask")
    plain = {"inputs": [{"name": n, "shape": [1, seq], "datatype": "INT64", "data": ids.ravel().tolist()} for n in names]}
    inputs = [{"name": n, "shape": [1, seq], "datatype": "INT64", "parameters": {"binary_data_size": ids.nbytes}} for n in names]
    head = json.dumps({"inputs": inputs, "outputs": [{"name": "latents", "parameters": {"binary_data": True}}]}).encode()
    return {
        "json": (json.dumps(plain).encode(), {"Content-Type": "application/json"}),
        "binary": (
            head + ids.tobytes() * 2,
            {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"},
        ),
    }


def kserve_overhead(source: Path, url: str, repeats: int, seq: int = 16) -> dict[str, Any]:
    """KServe v2 over HTTP against the same graph run in this process (ONNX Runtime), alternating."""
    graphs, config, _ = open_graphs("ort", source)
    runner = timed_call(graphs["encoder"], graph_feed(config, "encoder", 1, seq))
    bodies = encoder_bodies(seq)
    times: dict[str, list[float]] = {"runner": [], "json": [], "binary": []}
    with httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(repeats):
            times["runner"].append(median_ms(runner, 1))
            for kind, (content, headers) in bodies.items():
                started = time.perf_counter()
                http.post("/v2/models/encoder/infer", content=content, headers=headers).raise_for_status()
                times[kind].append(1000 * (time.perf_counter() - started))
    p50 = {kind: round(statistics.median(values), 3) for kind, values in times.items()}
    return {
        "graph": f"encoder, batch 1 x {seq} tokens",
        **{f"{kind}_p50_ms": ms for kind, ms in p50.items()},
        "json_overhead_ms": round(p50["json"] - p50["runner"], 3),
        "binary_overhead_ms": round(p50["binary"] - p50["runner"], 3),
    }


@contextlib.contextmanager
def served(source: Path, flags: list[str]) -> Iterator[str]:
    port = free_port()
    process = start_server(source, port, flags, timeout_s=600)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(process)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=REFERENCE, help=f"the checkpoint measured (default: {REFERENCE})")
    p.add_argument(
        "--device", default="cpu", help="cpu: ONNX Runtime on its export; cuda (or cuda:N): the torch --backend on the checkpoint"
    )
    p.add_argument("--backend", default="eager", help="the torch backend with --device cuda: eager or compiled (default: eager)")
    p.add_argument("--repeats", type=int, default=15, help="runs per figure, alternating modes (default: 15)")
    p.add_argument("--stream-steps", type=int, default=40, help="the lone stream's steps (default: 40)")
    p.add_argument("--stream-length", type=int, default=LENGTH, help=f"the lone stream's tokens (default: {LENGTH})")
    p.add_argument("--every", type=int, default=5, help="steps between the lone stream's previews (default: 5)")
    p.add_argument("--out", type=Path, help="write the JSON here (default: print it)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.every < 1 or args.stream_steps < 2:
        p.error(f"--repeats {args.repeats}, --every {args.every}, --stream-steps {args.stream_steps}: allowed: >= 1, >= 1, >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = args.device != "cpu"
    report: dict[str, Any] = {
        "checkpoint": args.checkpoint,
        "device": args.device,
        "repeats": args.repeats,
        "load_average": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory(prefix="ldlm-fixed-costs-") as scratch:
        work = Path(scratch)
        export = export_graphs(args.checkpoint, work / "export").out
        source, backend = (args.checkpoint, args.backend) if gpu else (str(export), "ort")
        report["graphs"] = graph_costs(source, backend, args.device, args.repeats)
        if not gpu:
            report["head"] = head_profiles(args.checkpoint, work, args.repeats)
        flags = ["--backend", args.backend, "--device", args.device] if gpu else []
        with served(Path(source), flags) as url:
            report["stream"] = lone_stream(url, args.stream_steps, args.stream_length, args.every, args.repeats)
        tiny = tiny_export(work / "tiny", progress=False)
        with served(tiny, []) as url:
            report["kserve"] = kserve_overhead(tiny, url, 10 * args.repeats)
    report["load_average_end"] = list(os.getloadavg())
    text = json.dumps(report, indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
