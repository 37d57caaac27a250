"""``ldlm serve`` with its gRPC endpoint: on --port + 1 unless told otherwise (Triton's 8001 beside 8000), off
with --no-grpc, a --grpc-port another server holds refused before anything loads (the default one, taken,
leaves HTTP alone, said on stderr), and the real command serving tritonclient.grpc beside HTTP until SIGTERM,
after which it exits 0 with both closed; its calls in flight capped by --max-connections."""

from __future__ import annotations

import queue
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ldlm.cli import main
from ldlm.serve.api import grpc_server, server
from ldlm.serve.api.service import LDLMService, ServerSettings
from scripts.harness.loopback import start_server, stop_server
from tests.servers import RunningServer, free_port


def grpc_port_served(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int | None:
    """The gRPC port ``ldlm serve ARGV`` would serve beside HTTP (the server replaced by a recorder)."""
    seen: list[int | None] = []
    monkeypatch.delenv("LDLM_API_KEY", raising=False)
    monkeypatch.setattr(server, "serve", lambda source, settings, log_level: seen.append(settings.grpc_port))
    assert main(["serve", "export-dir", *argv]) == 0
    return seen[0]


def test_the_grpc_port_is_the_http_port_plus_one_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    free = free_port()
    assert grpc_port_served(["--port", str(free - 1)], monkeypatch) == free
    assert grpc_port_served(["--port", "0"], monkeypatch) == 0  # the OS picks both
    assert grpc_port_served(["--port", str(free - 1), "--grpc-port", "0"], monkeypatch) == 0
    assert grpc_port_served(["--port", str(free - 1), "--no-grpc"], monkeypatch) is None
    assert grpc_server.default_grpc_port(8000) == 8001 and grpc_server.default_grpc_port(65535) == 0


def test_a_held_grpc_port_is_refused_before_anything_loads(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("LDLM_API_KEY", raising=False)
    monkeypatch.setattr(server, "serve", lambda source, settings, log_level: pytest.fail("the server started"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", "export-dir", "--grpc-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert (
        f"gRPC port {port} on 127.0.0.1 is already in use (another `ldlm serve`, or a Triton?); choose another with "
        f"--grpc-port, e.g. --grpc-port {port + 1}, or serve HTTP alone with --no-grpc"
    ) in err, err


def test_a_held_default_grpc_port_leaves_http_alone_and_says_so(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert grpc_port_served(["--port", str(port - 1)], monkeypatch) is None
    err = capsys.readouterr().err
    assert f"ldlm serve: warning: gRPC port {port} on 127.0.0.1 is already in use" in err
    assert err.rstrip().endswith("going on without a gRPC endpoint"), err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grpc-port", "9001", "--no-grpc"], "--grpc-port 9001 and --no-grpc contradict each other; leave one of them out"),
        (["--ray", "--grpc-port", "9001"], "--grpc-port 9001 applies without --ray only: Ray's proxy serves HTTP; leave it out"),
    ],
)
def test_grpc_options_that_cannot_hold(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("LDLM_API_KEY", raising=False)
    monkeypatch.setattr(server, "serve", lambda source, settings, log_level: pytest.fail("the server started"))
    assert main(["serve", "export-dir", *argv]) == 2
    assert message in capsys.readouterr().err


def test_ldlm_serve_answers_tritonclient_grpc_beside_http(export_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = start_server(export_dir, port, ["--threads", "1", "--log-level", "info"], log=out, log_path=log)
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
        assert client.is_server_ready() and client.is_model_ready("encoder")
        ids = grpcclient.InferInput("input_ids", [1, 4], "INT32")
        ids.set_data_from_numpy(np.array([[1, 2, 3, 4]], dtype=np.int32))
        mask = grpcclient.InferInput("attention_mask", [1, 4], "INT64")
        mask.set_data_from_numpy(np.ones((1, 4), dtype=np.int64))
        assert client.infer("encoder", [ids, mask]).as_numpy("latents").shape == (1, 4, 64)
    finally:
        code = stop_server(process)
    output = log.read_text()
    assert code == 0, output
    assert f"grpc: 127.0.0.1:{port + 1} (KServe v2" in output
    assert '"method": "gRPC", "path": "/inference.GRPCInferenceService/ModelInfer", "status": 200' in output  # the request log
    with pytest.raises(InferenceServerException):
        grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}").is_server_live(client_timeout=2)


def test_calls_in_flight_are_capped_by_max_connections(export_dir: Path) -> None:
    """--max-connections caps gRPC's calls in flight as it caps HTTP's connections: with one allowed, a call
    beside an open generation stream is refused RESOURCE_EXHAUSTED, and answered once the stream closes."""
    pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
    settings = ServerSettings(port=free_port(), grpc_port=free_port(), max_connections=1, max_steps=2000, request_timeout_s=300)
    running = RunningServer(LDLMService(str(export_dir), settings))
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{settings.grpc_port}")
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        inputs = []
        for name, value in (("N", 1), ("LENGTH", 64), ("STEPS", 2000)):
            tensor = grpcclient.InferInput(name, [1], "INT64")
            tensor.set_data_from_numpy(np.array([value], dtype=np.int64))
            inputs.append(tensor)
        client.async_stream_infer("ldlm_generate", inputs, parameters={"preview_every": 1})
        result, error = answers.get(timeout=60)
        assert error is None, error  # the stream's call is in flight: its first preview came
        other = grpcclient.InferenceServerClient(f"127.0.0.1:{settings.grpc_port}")
        with pytest.raises(InferenceServerException) as refused:
            other.is_server_live()
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
        client.stop_stream(cancel_requests=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the stream's handler ends as its cancellation reaches the server
            try:
                assert other.is_server_live()
                break
            except InferenceServerException:
                time.sleep(0.1)
        assert other.is_server_live()
    finally:
        running.stop()
