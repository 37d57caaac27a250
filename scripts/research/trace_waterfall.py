#!/usr/bin/env python
"""One traced streaming request, drawn from its real spans: `ldlm serve` on the reference checkpoint exports its
traces to an OTLP receiver in this process (scripts/harness/otlp_receiver.py); one /v1/generate with ``stream: true``,
previews and a caller's traceparent is sent, and the spans the receiver got are printed as a text waterfall
(after one warm-up request; each span's offset and duration from the request's start, a bar on a common time axis, its attributes; the
previews as the request span's events). docs/serving.md's picture of a traced request is this script's output.

Needs the OpenTelemetry SDK and the receiver's protocol definitions: `pip install -e .[otel,test]`.

    python scripts/research/trace_waterfall.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from scripts.harness.loopback import free_port, start_server, stop_server  # noqa: E402
from scripts.harness.otlp_receiver import OtlpReceiver, ReceivedSpan  # noqa: E402
from scripts.harness.traffic import sse_events  # noqa: E402

REFERENCE = ROOT / "models" / "ldlm-austen-tiny"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
WIDTH = 48  # characters of the time axis


def waterfall(root: ReceivedSpan, children: list[ReceivedSpan]) -> str:
    """The request's span and its children as lines of offset, duration, bar and attributes, then its events."""
    total = max(root.end_ns - root.start_ns, 1)

    def line(span: ReceivedSpan, indent: str, shown: dict) -> str:
        start, end = span.start_ns - root.start_ns, span.end_ns - root.start_ns
        left, right = round(WIDTH * start / total), max(round(WIDTH * end / total), round(WIDTH * start / total) + 1)
        bar = " " * left + "#" * (right - left) + " " * (WIDTH - right)
        words = " ".join(f"{key}={value}" for key, value in shown.items())
        return f"{indent}{span.name:<{24 - len(indent)}} {start / 1e6:8.1f} ms {(end - start) / 1e6:8.1f} ms |{bar}| {words}".rstrip()

    keep = ("ldlm.request_id", "gen_ai.request.model", "gen_ai.request.choice.count", "gen_ai.request.max_tokens", "ldlm.status")
    lines = [f"trace {root.trace_id}, parent span {root.parent_id} (the caller's traceparent)"]
    lines.append(line(root, "", {key: root.attributes[key] for key in keep}))
    lines += [line(child, "  ", child.attributes) for child in children]
    for name, at, attributes in root.events:
        offset = (at - root.start_ns) / 1e6
        mark = min(WIDTH - 1, round(WIDTH * (at - root.start_ns) / total))
        bar = " " * mark + "*" + " " * (WIDTH - mark - 1)
        lines.append(f"  {'event ' + name:<22} {offset:8.1f} ms {'':>11} |{bar}| step={attributes['ldlm.step']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=str(REFERENCE), help="what to serve (default: the reference checkpoint)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps (default: 20)")
    parser.add_argument("--every", type=int, default=5, help="a preview every this many steps (default: 5)")
    args = parser.parse_args()
    with OtlpReceiver() as receiver:
        port = free_port()
        env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "50"}
        flags = ["--no-grpc", "--backend", "eager", "--otlp-traces-endpoint", receiver.endpoint]
        server = start_server(args.source, port, flags, env=env)
        try:
            body = {"n": 4, "length": 32, "steps": args.steps, "stream": True, "preview_every": args.every}
            httpx.post(
                f"http://127.0.0.1:{port}/v1/generate", json={**body, "stream": False}, timeout=120
            )  # warm-up: a first call's set-up
            headers = {"traceparent": TRACEPARENT, "x-request-id": "waterfall"}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/generate", json=body, headers=headers, timeout=120) as response:
                sse_events(response.iter_lines())
            root, children = receiver.request("waterfall", 5)
        finally:
            stop_server(server)
    print(f"POST /v1/generate {body} on {Path(args.source).name}, {os.cpu_count()} CPUs")
    print(waterfall(root, children))


if __name__ == "__main__":
    main()
