"""Tracing that costs nothing when off and nothing to a request when its collector is down: off (the default), the
service holds no SDK (a fresh process serving requests imports none) and no request is marked; on, with the
collector's port closed, every request is answered in full. And ``ldlm serve``'s refusals: a bad endpoint (the
option's or a variable's), and tracing asked for without the SDK, which names the extra to install."""

from __future__ import annotations

import builtins
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient's gRPC client")

from ldlm.cli import main  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.tracing import CURRENT  # noqa: E402
from scripts.harness.traffic import sse_events  # noqa: E402
from tests import REPO  # noqa: E402
from tests.servers import RunningServer, free_port, infer_body  # noqa: E402

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def exercise(server: RunningServer, grpc_port: int) -> None:
    """A request down every traced path, each answered in full."""
    headers = {"traceparent": TRACEPARENT}
    stream = {"n": 2, "length": 8, "steps": 4, "stream": True, "preview_every": 2}
    with httpx.stream("POST", f"{server.url}/v1/generate", json=stream, headers=headers, timeout=60) as response:
        assert [name for name, _ in sse_events(response.iter_lines())] == ["preview", "result"]
    plain = httpx.post(f"{server.url}/v1/generate", json={"n": 1, "length": 8, "steps": 4}, headers=headers, timeout=60)
    assert plain.status_code == 200 and len(plain.json()["texts"]) == 1
    completion = {"model": "ldlm", "prompt": "It is", "max_tokens": 4, "steps": 3}
    assert httpx.post(f"{server.url}/v1/completions", json=completion, headers=headers, timeout=60).json()["choices"]
    graph = httpx.post(f"{server.url}/v2/models/encoder/infer", json=infer_body(), headers=headers, timeout=60)
    assert graph.status_code == 200 and graph.json()["outputs"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    n = grpcclient.InferInput("N", [1], "INT64")
    n.set_data_from_numpy(np.array([1], dtype=np.int64))
    length = grpcclient.InferInput("LENGTH", [1], "INT64")
    length.set_data_from_numpy(np.array([6], dtype=np.int64))
    assert client.infer("ldlm_generate", [n, length], headers=headers).as_numpy("TOKEN_IDS").shape == (1, 6)
    client.close()


def serving(checkpoint: Path, endpoint: str | None) -> tuple[RunningServer, int]:
    grpc_port = free_port()
    settings = ServerSettings(port=free_port(), grpc_port=grpc_port, backend="eager", otlp_traces_endpoint=endpoint)
    return RunningServer(LDLMService(str(checkpoint), settings)), grpc_port


@pytest.fixture(scope="module")
def untraced(tiny_checkpoint: Path) -> Iterator[tuple[RunningServer, int]]:
    running = serving(tiny_checkpoint, None)
    yield running
    running[0].stop()


def test_off_no_request_is_marked(untraced: tuple[RunningServer, int]) -> None:
    server, grpc_port = untraced
    scheduler = server.service.scheduler
    seen: list[Any] = []
    submit = scheduler.submit

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[6] if len(args) > 6 else kwargs.get("trace"))
        return submit(*args, **kwargs)

    scheduler.submit = watched  # type: ignore[method-assign]
    try:
        exercise(server, grpc_port)
    finally:
        del scheduler.submit
    assert server.service.tracing is None
    assert len(seen) == 4 and seen == [None] * 4  # every generation handed over unmarked
    assert scheduler._traced == {}
    assert CURRENT.get() is None


def test_off_a_serving_process_imports_no_sdk(tiny_checkpoint: Path) -> None:
    """A fresh process serves every traced path with tracing off: no module of the SDK or the exporter is ever loaded
    (this module imports none: the test that needs the SDK asks for it itself)."""
    script = f"""
import sys
from tests.serve.runtime.test_tracing_off import exercise, serving
server, grpc_port = serving({str(tiny_checkpoint)!r}, None)
exercise(server, grpc_port)
server.stop()
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_collector_that_is_down_costs_no_request(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the OpenTelemetry SDK (pip install -e .[otel] or .[test])")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # the exporter tries at once, and fails, while requests run
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")  # its retries give up within a second (a quick shutdown)
    closed = free_port()  # nothing listens there
    server, grpc_port = serving(tiny_checkpoint, f"http://127.0.0.1:{closed}")
    try:
        assert server.service.tracing is not None
        for _ in range(2):
            exercise(server, grpc_port)
    finally:
        started = time.monotonic()
        server.stop()
    assert time.monotonic() - started < 15


def test_a_bad_endpoint_is_refused_naming_it(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "unused", "--otlp-traces-endpoint", "localhost:4317"])
    assert exited.value.code == 2
    assert "argument --otlp-traces-endpoint: --otlp-traces-endpoint='localhost:4317' is not a collector's URL" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317")
    assert main(["serve", str(REPO / "models" / "ldlm-austen-tiny"), "--port", "0", "--no-grpc", "--backend", "eager"]) == 2
    assert "ldlm serve: error: OTEL_EXPORTER_OTLP_ENDPOINT='collector:4317' is not a collector's URL" in capsys.readouterr().err


def test_without_the_sdk_serve_fails_at_start_naming_the_extra(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_sdk(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    argv = ["serve", str(REPO / "models" / "ldlm-austen-tiny"), "--port", "0", "--no-grpc", "--backend", "eager"]
    started = time.monotonic()
    assert main([*argv, "--otlp-traces-endpoint", "http://127.0.0.1:4317"]) == 2
    err = capsys.readouterr().err
    assert (
        "ldlm serve: error: tracing to http://127.0.0.1:4317 needs the OpenTelemetry SDK and its OTLP exporter: pip install 'ldlm[otel]'"
        in err
    )
    assert "loading the graphs" not in err and time.monotonic() - started < 10  # before anything loads
