#!/usr/bin/env python
"""The fixed costs of a request, measured side by side in one run (medians), in four parts:

- graphs: the decoder's and the denoiser's p50 at batch 1 and 8 x 128 tokens on the checkpoint (ONNX
  Runtime on the CPU; with --device cuda the torch backend --backend, default eager), and the decoder's
  cost in denoiser steps;
- head: ONNX Runtime's profile of the exported decoder at 1 and 8 x 128 (SessionOptions.enable_profiling):
  milliseconds per op type and the vocabulary head's share (the nodes after the token decoder's final
  LayerNorm), for the decoder as exported and, beside it, for a head that makes the whole logits (nn.Linear,
  then one ArgMax over them), exported from the same checkpoint (CPU only);
- stream: one request of --stream-steps steps at --stream-length tokens, plain and streamed with a preview
  every --every steps, alternating, on an otherwise idle `ldlm serve` of the checkpoint's export on
  127.0.0.1 (default settings, and with --stream-variant FLAGS one more started with them): per-mode
  medians, their ratio, and the previews each stream got;
- kserve: the overhead of KServe v2 over the in-process runner, on a random-init tiny export's encoder
  at batch 1 x 16 tokens, with JSON and binary tensors (`ldlm serve` of that export on 127.0.0.1), from
  two clients: httpx (what a Python caller uses; about 1 ms of the figure is its own work) and a bare
  keep-alive HTTP/1.1 socket (the server's overhead and the wire's).

With --against REV, every part also measures REV's code (a git worktree), alternating with this code's:
REV's export of the checkpoint (graphs, head, stream) and `ldlm serve` from REV (stream, kserve). Before
and after, side by side in one run.

--parts picks which of the four run (default: all).

The machine may be shared: modes alternate run by run, the JSON records the load average, and every
figure is a median over --repeats runs.

    .venv/bin/python scripts/research/fixed_costs.py --out runs/fixed_costs.json
    .venv/bin/python scripts/research/fixed_costs.py --against HEAD~1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import shlex
import socket
import statistics
import subprocess
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

from scripts.harness.loopback import free_port, start_server, stop_server, tiny_export, wait_ready  # noqa: E402
from scripts.harness.traffic import sse_events  # noqa: E402

REFERENCE = "models/ldlm-austen-tiny"
LENGTH = 128
PARTS = ("graphs", "head", "stream", "kserve")


def median_ms(call: Callable[[], Any], repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 2)


def graph_costs(sources: dict[str, str], backend: str, device: str, repeats: int) -> dict[str, Any]:
    """p50 of the decoder and the denoiser at batch 1 and 8 x LENGTH for each of ``sources`` (label -> export or
    checkpoint), alternating graph by graph and source by source."""
    opened = {label: open_graphs(backend, source, device=device) for label, source in sources.items()}
    result: dict[str, Any] = {"backend": backend, "device": device}
    for batch in (1, 8):
        calls = {
            (label, name): timed_call(graphs[name], graph_feed(config, name, batch, LENGTH))
            for label, (graphs, config, _) in opened.items()
            for name in ("denoiser", "decoder")
        }
        times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
        for _ in range(repeats):
            for key, call in calls.items():
                times[key].append(median_ms(call, 1))
        for label in sources:
            p50 = {name: round(statistics.median(times[(label, name)]), 2) for name in ("denoiser", "decoder")}
            result.setdefault(label, {})[f"b{batch}"] = {
                **{f"{name}_p50_ms": ms for name, ms in p50.items()},
                "decoder_in_steps": round(p50["decoder"] / p50["denoiser"], 2),
            }
    for graphs, _, _ in opened.values():
        result["provider"] = graphs["decoder"].provider
        for graph in graphs.values():
            graph.close()
    return result


@contextlib.contextmanager
def whole_logits_head() -> Iterator[None]:
    """A head that makes the whole logits: nn.Linear, then one ArgMax over them."""
    two_pass = VocabularyHead.forward

    def forward(self: VocabularyHead, x: Any, ids_only: bool = False) -> Any:
        logits = nn.Linear.forward(self, x)
        return logits.argmax(-1) if ids_only else logits

    VocabularyHead.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        VocabularyHead.forward = two_pass  # type: ignore[method-assign]


class ProfiledDecoder:
    """One decoder under ONNX Runtime's own profiler, as the server runs it (workers asleep between calls, no arena)."""

    def __init__(self, path: Path, batch: int) -> None:
        import onnx
        import onnxruntime as ort

        graph = onnx.load(str(path), load_external_data=False).graph
        last_norm = max(i for i, n in enumerate(graph.node) if n.op_type == "LayerNormalization")
        self.head = {n.name for n in graph.node[last_norm + 1 :]}
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(path.parent / f"profile-b{batch}")
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_cpu_mem_arena = False
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.feed = graph_feed(LDLMConfig.load(path.parent / "config.json"), "decoder", batch, LENGTH)
        self.batch, self.times = batch, list[float]()

    def run(self) -> None:
        started = time.perf_counter()
        self.session.run(None, self.feed)
        self.times.append(time.perf_counter() - started)

    def summary(self) -> dict[str, Any]:
        """ms per call by op type, and the head's share of the nodes' time."""
        events = json.loads(Path(self.session.end_profiling()).read_text())
        calls = len(self.times)
        by_op: collections.Counter[str] = collections.Counter()
        in_head = total = 0.0
        for event in events:
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                by_op[event["args"]["op_name"]] += event["dur"] / 1000 / calls
                total += event["dur"]
                in_head += event["dur"] if event["name"].removesuffix("_kernel_time") in self.head else 0
        return {
            "batch": self.batch,
            "p50_ms": round(1000 * statistics.median(self.times[1:]), 2),  # the first call warms up
            "op_ms": {op: round(ms, 2) for op, ms in by_op.most_common(8)},
            "nodes_ms": round(total / 1000 / calls, 2),
            "head_ms": round(in_head / 1000 / calls, 2),
            "head_share": round(in_head / total, 3),
            "head_nodes": len(self.head),
        }


def head_profiles(checkpoint: str, work: Path, repeats: int, against: tuple[str, Path] | None) -> dict[str, Any]:
    """The decoder's profile as exported now, beside the whole-logits head's and, with ``against`` (label,
    export), that export's decoder; their calls alternate."""
    export_graphs(checkpoint, work / "now", graphs=("decoder",))
    with whole_logits_head():
        export_graphs(checkpoint, work / "whole", graphs=("decoder",))
    decoders = {"now": work / "now", "whole": work / "whole", **dict([against] if against else [])}
    profiled = {(name, batch): ProfiledDecoder(folder / "decoder.onnx", batch) for name, folder in decoders.items() for batch in (1, 8)}
    for _ in range(repeats + 1):
        for decoder in profiled.values():
            decoder.run()
    return {name: [profiled[(name, batch)].summary() for batch in (1, 8)] for name in decoders}


def lone_stream(urls: dict[str, str], steps: int, length: int, every: int, repeats: int) -> dict[str, Any]:
    """One request at a time, plain and streamed, alternating mode by mode and server by server (``urls``: label ->
    server): per server the medians, their ratio and the previews each stream got."""
    body = {"n": 1, "length": length, "steps": steps, "seed": 3}
    modes = {"plain": body, "streamed": {**body, "stream": True, "preview_every": every}}
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    previews: dict[str, list[list[int]]] = collections.defaultdict(list)
    clients = {label: httpx.Client(base_url=url, timeout=600) for label, url in urls.items()}
    try:
        for http in clients.values():
            http.post("/v1/generate", json=body).raise_for_status()  # warm-up
        for _ in range(repeats):
            for (label, http), (mode, request) in itertools.product(clients.items(), modes.items()):
                started = time.perf_counter()
                with http.stream("POST", "/v1/generate", json=request) as response:
                    response.raise_for_status()
                    events = sse_events(response.iter_lines()) if mode == "streamed" else response.read()
                times[(label, mode)].append(time.perf_counter() - started)
                if mode == "streamed":
                    previews[label].append([e["samples"][0]["step"] for kind, e in events if kind == "preview"])
    finally:
        for http in clients.values():
            http.close()
    asked = list(range(every, steps, every))
    result: dict[str, Any] = {"body": {**body, "preview_every": every}, "previews_asked": asked}
    for label in urls:
        plain, streamed = (round(statistics.median(times[(label, mode)]), 4) for mode in modes)
        result[label] = {
            "plain_s": plain,
            "streamed_s": streamed,
            "ratio": round(streamed / plain, 3),
            "streams_with_every_preview": sum(p == asked for p in previews[label]),
            "streams": len(previews[label]),
            "previews": previews[label],
        }
    return result


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


class RawClient:
    """A bare keep-alive HTTP/1.1 POST on one socket: what is left of a client once its own work is removed."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the request leaves at once, as httpx's does

    def post(self, path: str, content: bytes, headers: dict[str, str]) -> None:
        head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Content-Length": str(len(content))}.items())
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: loopback\r\n{head}\r\n".encode() + content)
        data = b""
        while b"\r\n\r\n" not in data:
            data += self.receive()
        status, _, rest = data.partition(b"\r\n\r\n")
        lines = status.decode("latin-1").split("\r\n")
        length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:"))
        while len(rest) < length:
            rest += self.receive()
        if not lines[0].startswith("HTTP/1.1 200"):
            raise RuntimeError(f"POST {path}: {lines[0]}: {rest[:300]!r}")

    def receive(self) -> bytes:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise RuntimeError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


class HttpxClient:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)

    def post(self, path: str, content: bytes, headers: dict[str, str]) -> None:
        self.http.post(path, content=content, headers=headers).raise_for_status()

    def close(self) -> None:
        self.http.close()


def kserve_overhead(source: Path, urls: dict[str, str], repeats: int, seq: int = 16) -> dict[str, Any]:
    """KServe v2 over HTTP, per server in ``urls`` and per client, against the same graph run in this
    process (ONNX Runtime): every request of a repeat goes once to each, alternating."""
    graphs, config, _ = open_graphs("ort", source)
    runner = timed_call(graphs["encoder"], graph_feed(config, "encoder", 1, seq))
    bodies = encoder_bodies(seq)
    clients = {(server, name): kind(url) for server, url in urls.items() for name, kind in (("httpx", HttpxClient), ("raw", RawClient))}
    times: dict[tuple[str, ...], list[float]] = collections.defaultdict(list)
    try:
        for _ in range(repeats):
            times[("runner",)].append(median_ms(runner, 1))
            for key, client in clients.items():
                for body, (content, headers) in bodies.items():
                    started = time.perf_counter()
                    client.post("/v2/models/encoder/infer", content, headers)
                    times[(*key, body)].append(1000 * (time.perf_counter() - started))
    finally:
        for client in clients.values():
            client.close()
    p50 = {key: round(statistics.median(values), 3) for key, values in times.items()}
    runner_ms = p50.pop(("runner",))
    result: dict[str, Any] = {"graph": f"encoder, batch 1 x {seq} tokens", "runner_p50_ms": runner_ms, "servers": dict(urls)}
    for (server, client, body), ms in p50.items():
        entry = result.setdefault(server, {}).setdefault(client, {})
        entry[f"{body}_p50_ms"] = ms
        entry[f"{body}_overhead_ms"] = round(ms - runner_ms, 3)
    return result


@contextlib.contextmanager
def revision_tree(revision: str, work: Path) -> Iterator[Path]:
    """A git worktree of this repository at ``revision``, removed afterwards."""
    tree = work / "revision"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), revision], check=True, capture_output=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False, capture_output=True)


def revision_cli(tree: Path, *args: str) -> list[str]:
    """The command line of ``ldlm ARGS`` run with the code in ``tree``."""
    return [sys.executable, "-P", "-c", REVISION_BOOT, str(tree), *args]


def revision_script(tree: Path, script: Path, *args: str) -> list[str]:
    """The command line of ``python SCRIPT ARGS`` run with the code in ``tree``."""
    return [sys.executable, "-P", "-c", SCRIPT_BOOT, str(tree), str(script), *args]


@contextlib.contextmanager
def served_revision(tree: Path, source: Path) -> Iterator[str]:
    """``ldlm serve`` of ``source`` with the code in ``tree``."""
    port = free_port()
    command = revision_cli(tree, "serve", str(source), "--port", str(port), "--log-level", "warning")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", timeout_s=600)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(process)


# The package from a worktree (the first argument): its three source folders under the names the installed package
# maps them to (pyproject's package-dir), found before the editable install's finder.
PACKAGE_FROM_TREE = """
import sys
from importlib.util import spec_from_file_location
root = sys.argv.pop(1)
homes = {"ldlm": root + "/ldlm", "ldlm.export": root + "/export", "ldlm.serve": root + "/serve"}
class Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        home = homes.get(name)
        return spec_from_file_location(name, home + "/__init__.py", submodule_search_locations=[home]) if home else None
sys.meta_path.insert(0, Finder)
"""
REVISION_BOOT = PACKAGE_FROM_TREE + "from ldlm.cli import main\nraise SystemExit(main(sys.argv[1:]))\n"
SCRIPT_BOOT = PACKAGE_FROM_TREE + "import runpy\nsys.argv.pop(0)\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"


@contextlib.contextmanager
def served(source: Path, flags: list[str]) -> Iterator[str]:
    port = free_port()
    process = start_server(source, port, flags, timeout_s=600)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(process)


def kserve_part(work: Path, against: tuple[str, Path] | None, repeats: int) -> dict[str, Any]:
    tiny = tiny_export(work / "tiny", progress=False)
    with contextlib.ExitStack() as stack:
        urls = {"this": stack.enter_context(served(tiny, []))}
        if against is not None:
            urls[against[0]] = stack.enter_context(served_revision(against[1], tiny))
        return {**kserve_overhead(tiny, urls, repeats), "against": against and against[0]}


def stream_part(sources: dict[str, Path], flags: list[str], tree: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    """The lone stream on a server of each source (this code's, and ``tree``'s for any other label) and, with
    --stream-variant, on one more of this code's started with those flags."""

    def server(label: str, source: Path) -> contextlib.AbstractContextManager[str]:
        if label == "this":
            return served(source, flags)
        assert tree is not None, f"{label}: a source of another revision comes with its worktree"
        return served_revision(tree, source)

    with contextlib.ExitStack() as stack:
        urls = {label: stack.enter_context(server(label, source)) for label, source in sources.items()}
        if args.stream_variant:
            variant = flags + shlex.split(args.stream_variant)
            urls[f"this {args.stream_variant}"] = stack.enter_context(served(sources["this"], variant))
        return lone_stream(urls, args.stream_steps, args.stream_length, args.every, args.repeats)


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
    p.add_argument(
        "--stream-variant",
        metavar="FLAGS",
        help='stream: also on a server of this code started with these `ldlm serve` flags, side by side (e.g. "--threads 1")',
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"which parts run, comma-separated (default: {','.join(PARTS)})")
    p.add_argument(
        "--against",
        metavar="REV",
        help="also measure this git revision's code, side by side: its export (graphs, head, stream) and its server "
        "(stream, kserve); with --device cuda, kserve only (e.g. HEAD~1)",
    )
    p.add_argument("--out", type=Path, help="write the JSON here (default: print it)")
    args = p.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not args.parts or set(args.parts) - set(PARTS):
        p.error(f"--parts {','.join(args.parts)!r}: allowed: one or more of {', '.join(PARTS)}")
    if args.repeats < 1 or args.every < 1 or args.stream_steps < 2:
        p.error(f"--repeats {args.repeats}, --every {args.every}, --stream-steps {args.stream_steps}: allowed: >= 1, >= 1, >= 2")
    return args


def measure(args: argparse.Namespace, work: Path, tree: Path | None) -> dict[str, Any]:
    """Every part of ``args.parts``, for this code and, with ``tree`` (``args.against``'s worktree), for that."""
    gpu, report = args.device != "cpu", {}
    sources: dict[str, Path] = {}
    if {"graphs", "head", "stream"} & set(args.parts):
        sources["this"] = Path(args.checkpoint) if gpu else export_graphs(args.checkpoint, work / "export").out
        if tree is not None and not gpu:
            subprocess.run(revision_cli(tree, "export", args.checkpoint, str(work / "against-export"), "--quiet"), check=True)
            sources[args.against] = work / "against-export"
    if "graphs" in args.parts:
        backend = args.backend if gpu else "ort"
        report["graphs"] = graph_costs({label: str(source) for label, source in sources.items()}, backend, args.device, args.repeats)
    if "head" in args.parts and not gpu:
        against = (args.against, sources[args.against]) if tree is not None else None
        report["head"] = head_profiles(args.checkpoint, work, args.repeats, against)
    if "stream" in args.parts:
        flags = ["--backend", args.backend, "--device", args.device] if gpu else []
        report["stream"] = stream_part(sources, flags, tree, args)
    if "kserve" in args.parts:
        report["kserve"] = kserve_part(work, (args.against, tree) if tree is not None else None, 10 * args.repeats)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {
        "checkpoint": args.checkpoint,
        "device": args.device,
        "repeats": args.repeats,
        "parts": args.parts,
        "load_average": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory(prefix="ldlm-fixed-costs-") as scratch, contextlib.ExitStack() as stack:
        work = Path(scratch)
        tree = stack.enter_context(revision_tree(args.against, work)) if args.against else None
        report.update(measure(args, work, tree))
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
