"""The attacks a server must survive, each sent to a real server on 127.0.0.1: per-request memory caps, JSON off
the event loop, slow and idle clients, malformed bodies (a battery and a Hypothesis fuzz), auth,
a busy port, and the one error shape and typed OpenAPI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
hypothesis = pytest.importorskip("hypothesis", reason="the fuzz test (pip install -e .[test])")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ldlm.model.ldlm import LDLM  # noqa: E402
from ldlm.serve.api import offload as server_module  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port, infer_body, wait_ready  # noqa: E402

LIMITS = dict(
    max_batch=4,
    max_delay_ms=0.0,
    request_timeout_s=60,
    max_body_bytes=1 << 20,
    max_n=8,
    max_steps=100,
    max_texts=8,
    max_request_samples=16,
    max_request_tokens=512,
    header_timeout_s=1.0,
    body_timeout_s=1.0,
    keep_alive_s=5.0,
    max_connections=24,
)


@pytest.fixture(scope="module")
def hardened(export_dir: Path):
    running = RunningServer(LDLMService(str(export_dir), ServerSettings(port=free_port(), **LIMITS)))
    yield running
    running.stop()


def post(server: RunningServer, path: str, **kwargs) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        return http.post(path, **kwargs)


def binary_ids(batch: int, seq: int) -> tuple[bytes, dict[str, str]]:
    ids = np.ones((batch, seq), dtype=np.int64)
    header = {
        "inputs": [
            {"name": n, "shape": [batch, seq], "datatype": "INT64", "parameters": {"binary_data_size": ids.nbytes}}
            for n in ("input_ids", "attention_mask")
        ]
    }
    head = json.dumps(header).encode()
    return head + ids.tobytes() * 2, {"Inference-Header-Content-Length": str(len(head))}


def ids_input(data, shape=(1, 3), datatype="INT64", **extra):
    return {
        "inputs": [
            {"name": "input_ids", "shape": list(shape), "datatype": datatype, "data": data, **extra},
            {"name": "attention_mask", "shape": list(shape), "datatype": "INT64", "data": [1] * int(np.prod(shape))},
        ]
    }


def assert_alive(server: RunningServer) -> None:
    ok = post(server, "/v2/models/encoder/infer", json=infer_body())
    assert ok.status_code == 200 and ok.json()["outputs"][0]["shape"] == [1, 3, 64]


# --- 1. memory bounded per request -------------------------------------------------------------


def test_huge_batch_is_refused_naming_the_limit(hardened: RunningServer) -> None:
    body, headers = binary_ids(20000, 1)  # the issue's [520000, 1], scaled to this server's 1 MiB body cap
    response = post(hardened, "/v2/models/encoder/infer", content=body, headers=headers)
    assert response.status_code == 413, response.text
    assert "20000 samples; allowed: 1..16 per request (--max-request-samples)" in response.json()["error"]
    body, headers = binary_ids(8, 100)  # 800 tokens > 512
    response = post(hardened, "/v2/models/encoder/infer", content=body, headers=headers)
    assert response.status_code == 413 and "800 tokens (batch x seq); allowed: up to 512" in response.json()["error"]
    assert_alive(hardened)


def test_large_request_runs_in_max_batch_chunks_with_single_run_answers(hardened: RunningServer, tiny_model: LDLM, monkeypatch) -> None:
    backend = hardened.service.graphs["encoder"]
    seen: list[int] = []
    original = backend._run

    def recording(inputs):
        seen.append(int(inputs["input_ids"].shape[0]))
        return original(inputs)

    monkeypatch.setattr(backend, "_run", recording)
    ids = np.random.default_rng(3).integers(0, 50257, (10, 6))
    body = {
        "inputs": [
            {"name": "input_ids", "shape": [10, 6], "datatype": "INT64", "data": ids.ravel().tolist()},
            {"name": "attention_mask", "shape": [10, 6], "datatype": "INT64", "data": [1] * 60},
        ]
    }
    response = post(hardened, "/v2/models/encoder/infer", json=body)
    assert response.status_code == 200, response.text
    assert max(seen) <= 4 and sum(seen) == 10  # max_batch=4: chunks of 4, 4, 2
    latents = np.array(response.json()["outputs"][0]["data"], dtype=np.float32).reshape(10, 6, 64)
    with torch.no_grad():
        expected = tiny_model.encode_latents(torch.from_numpy(ids), torch.ones(10, 6, dtype=torch.bool)).numpy()
    assert np.abs(latents - expected).max() < 1e-4


def test_served_sessions_give_peak_memory_back(hardened: RunningServer) -> None:
    """ONNX Runtime's CPU arena keeps a request's peak for the session's life; the server turns it off."""
    for graph in hardened.service.graphs.values():
        assert graph.session.get_session_options().enable_cpu_mem_arena is False


# --- 2. nothing scales with a request on the event loop ----------------------------------------


def record_threads(monkeypatch) -> dict[str, str]:
    """The thread each codec call runs on, by the call's name."""
    threads: dict[str, str] = {}
    for name in ("parse_body", "encode_infer_response", "json_bytes"):
        original = getattr(server_module, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            threads[_name] = threading.current_thread().name
            return _original(*args, **kwargs)

        monkeypatch.setattr(server_module, name, recording)
    return threads


def test_json_decoding_and_encoding_run_off_the_event_loop(hardened: RunningServer, monkeypatch) -> None:
    monkeypatch.setattr(server_module, "INLINE_BODY_BYTES", 0)  # every body is "large"
    monkeypatch.setattr(server_module, "INLINE_JSON_VALUES", 0)
    threads = record_threads(monkeypatch)
    assert post(hardened, "/v2/models/encoder/infer", json=infer_body()).status_code == 200
    assert post(hardened, "/v1/encode", json={"texts": ["off the loop"]}).status_code == 200
    loop_thread = hardened.thread.name  # uvicorn's event loop runs in the RunningServer thread
    assert set(threads) == {"parse_body", "encode_infer_response", "json_bytes"}
    assert all(name != loop_thread for name in threads.values()), threads


def test_small_kserve_requests_are_coded_on_the_event_loop(hardened: RunningServer, monkeypatch) -> None:
    """Within the inline bounds a thread hop costs more than the work: decoding and encoding stay on the loop,
    and one byte over a bound sends each back to a thread."""
    threads = record_threads(monkeypatch)
    body = json.dumps(infer_body()).encode()
    response = post(hardened, "/v2/models/encoder/infer", content=body)
    assert response.status_code == 200
    values = int(np.prod(response.json()["outputs"][0]["shape"]))
    loop_thread = hardened.thread.name
    assert threads == {"parse_body": loop_thread, "encode_infer_response": loop_thread}
    content, headers = binary_ids(1, 3)
    binary = post(hardened, "/v2/models/encoder/infer", content=content, headers=headers)
    assert binary.status_code == 200 and threads["parse_body"] == loop_thread
    threads.clear()
    monkeypatch.setattr(server_module, "INLINE_BODY_BYTES", len(body) - 1)
    monkeypatch.setattr(server_module, "INLINE_JSON_VALUES", values - 1)
    assert post(hardened, "/v2/models/encoder/infer", content=body).json()["outputs"] == response.json()["outputs"]
    assert set(threads) == {"parse_body", "encode_infer_response"} and loop_thread not in threads.values(), threads


def test_large_json_is_coded_in_a_worker_process(hardened: RunningServer, tiny_model: LDLM, monkeypatch) -> None:
    """Above the thresholds, json.loads/dumps run in another process: a thread would hold the GIL."""
    monkeypatch.setattr(server_module, "INLINE_BODY_BYTES", 0)
    monkeypatch.setattr(server_module, "INLINE_JSON_VALUES", 0)
    monkeypatch.setattr(server_module, "JSON_WORKER_BYTES", 0)
    monkeypatch.setattr(server_module, "JSON_WORKER_ELEMENTS", 0)
    service = hardened.service
    submitted: list[str] = []
    original = service.submit_json
    monkeypatch.setattr(service, "submit_json", lambda fn, *args: submitted.append(fn.__name__) or original(fn, *args))
    ids = np.random.default_rng(5).integers(0, 50257, (2, 5))
    body = {
        "id": "w1",
        "inputs": [
            {"name": "input_ids", "shape": [2, 5], "datatype": "INT64", "data": ids.tolist()},
            {"name": "attention_mask", "shape": [2, 5], "datatype": "INT64", "data": [[1] * 5] * 2},
        ],
    }
    response = post(hardened, "/v2/models/encoder/infer", json=body)
    assert response.status_code == 200 and response.json()["id"] == "w1"
    latents = np.array(response.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, 5, 64)
    with torch.no_grad():
        expected = tiny_model.encode_latents(torch.from_numpy(ids), torch.ones(2, 5, dtype=torch.bool)).numpy()
    assert np.abs(latents - expected).max() < 1e-4
    bad = post(hardened, "/v2/models/encoder/infer", json=ids_input([1, True, 3]))  # a ProtocolError raised in the worker
    assert bad.status_code == 400 and "INT64 data holds bool values" in bad.json()["error"]
    assert post(hardened, "/v1/encode", json={"texts": ["worker"]}).json()["shape"] == [1, 1, 64]
    assert submitted == ["parse_body", "encode_infer_response", "parse_body", "json_bytes"]


def test_a_killed_json_worker_is_replaced(hardened: RunningServer, monkeypatch) -> None:
    monkeypatch.setattr(server_module, "JSON_WORKER_BYTES", 0)
    assert post(hardened, "/v2/models/encoder/infer", json=infer_body()).status_code == 200  # the workers are up
    pids = list(hardened.service.json_workers._processes)  # no public API lists a pool's processes
    assert pids, "the JSON worker pool has no processes, so there is nothing to kill and nothing would be replaced"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    first = post(hardened, "/v2/models/encoder/infer", json=infer_body())
    assert first.status_code in (200, 503) and set(first.json()) >= ({"error"} if first.status_code == 503 else {"outputs"})
    assert post(hardened, "/v2/models/encoder/infer", json=infer_body()).status_code == 200


# --- 3. slow and idle clients --------------------------------------------------------------------


def connect(server: RunningServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.service.settings.port))
    s.settimeout(10)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_silent_and_slow_header_clients_are_closed(hardened: RunningServer) -> None:
    silent, trickle = connect(hardened), connect(hardened)
    started = time.monotonic()
    trickle.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\n")
    for _ in range(3):  # a slowloris: one header byte now and then; its deadline does not move
        time.sleep(0.3)
        trickle.sendall(b"X")
    assert read_until_closed(silent) == b""  # recv times out (10 s) if the server keeps it open
    answer = read_until_closed(trickle)
    assert b" 408 " in answer.split(b"\r\n")[0] and b"headers did not arrive within 1 s" in answer
    assert time.monotonic() - started < 5


def test_stalled_body_gets_408(hardened: RunningServer) -> None:
    s = connect(hardened)
    s.sendall(b'POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"texts"')
    answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"body did not arrive within 1 s" in answer
    assert_alive(hardened)


def test_idle_connections_are_shed_so_clients_are_served(export_dir: Path) -> None:
    settings = ServerSettings(port=free_port(), **{**LIMITS, "header_timeout_s": 600.0})  # only the limit can close them
    hardened = RunningServer(LDLMService(str(export_dir), settings))
    idle = [connect(hardened) for _ in range(3 * LIMITS["max_connections"])]  # never send a byte
    try:
        response = post(hardened, "/v1/encode", json={"texts": ["still served"]})
        assert response.status_code == 200, response.text
        closed = 0
        for s in idle[: LIMITS["max_connections"]]:  # the oldest were shed
            s.settimeout(0.5)
            try:
                closed += s.recv(1) == b""
            except (TimeoutError, OSError):
                pass
        assert closed == LIMITS["max_connections"]
    finally:
        for s in idle:
            s.close()
        hardened.stop()


def wait_for_busy_connections(server: RunningServer, count: int, timeout_s: float = 10.0) -> None:
    """Until ``count`` of the server's connections have a request in flight (headers parsed, no response yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:  # the set belongs to the server's event loop thread: copy it, and look again if it changed meanwhile
            busy = sum(not c.is_idle() for c in list(server.server.server_state.connections))
        except RuntimeError:
            busy = -1
        if busy == count:
            return
        assert time.monotonic() < deadline, f"{busy} busy connections after {timeout_s} s; expected {count}"
        time.sleep(0.01)


def test_all_busy_connections_give_503_with_retry_after_and_json(export_dir: Path) -> None:
    settings = ServerSettings(port=free_port(), **{**LIMITS, "body_timeout_s": 30.0, "max_connections": 4})
    running = RunningServer(LDLMService(str(export_dir), settings))
    busy = []
    try:
        for _ in range(4):  # requests in flight: headers in, body pending
            s = connect(running)
            s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            busy.append(s)
        wait_for_busy_connections(running, 4)  # the 5th must meet 4 requests in flight, not 4 sockets not yet read
        answer = read_until_closed(connect(running))
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower()
        assert "busy connections" in json.loads(body)["error"]
    finally:
        for s in busy:
            s.close()
        running.stop()


def test_shutdown_is_not_held_by_a_client_stalled_mid_body(export_dir: Path) -> None:
    settings = ServerSettings(port=free_port(), **{**LIMITS, "body_timeout_s": 300.0, "request_timeout_s": 300})
    running = RunningServer(LDLMService(str(export_dir), settings))
    s = connect(running)
    s.sendall(b'POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"texts": [')
    time.sleep(0.3)
    started = time.monotonic()
    running.stop()
    assert not running.thread.is_alive() and time.monotonic() - started < 10
    s.close()


# --- 4. malformed requests get a 4xx, never a 500 ---------------------------------------------------


def raw_infer(header: dict, payload: bytes = b"") -> dict:
    head = json.dumps(header).encode()
    return {"content": head + payload, "headers": {"Inference-Header-Content-Length": str(len(head))}}


ATTACKS = [
    ("bool in shape", ids_input([1, 2, 3], shape=[True, 3]), 400, "shape [True, 3] is invalid"),
    (
        "INT64 Infinity",
        {"content": b'{"inputs":[{"name":"input_ids","shape":[1,1],"datatype":"INT64","data":[Infinity]}]}'},
        400,
        "INT64 data holds float values; allowed: integers",
    ),
    ("INT64 2**63", ids_input([1, 2, 2**63]), 400, "holds 9223372036854775808; allowed: -9223372036854775808..9223372036854775807"),
    ("INT64 -2**63-1", ids_input([1, 2, -(2**63) - 1]), 400, "allowed: -9223372036854775808..9223372036854775807"),
    ("INT64 2**64", ids_input([1, 2, 2**64]), 400, "holds 18446744073709551616"),
    (
        "INT64 10**400",
        {"content": ('{"inputs":[{"name":"input_ids","shape":[1,1],"datatype":"INT64","data":[1' + "0" * 400 + "]}]}").encode()},
        400,
        "an integer of 401 digits",
    ),
    ("request parameters string", {**infer_body(), "parameters": "x"}, 400, "'parameters' must be an object"),
    ("input parameters string", ids_input([1, 2, 3], parameters="x"), 400, "inputs[0] (input_ids): 'parameters' must be an object"),
    (
        "binary_data_size float",
        raw_infer(
            {"inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "parameters": {"binary_data_size": 32.0}}]}, b"\0" * 32
        ),
        400,
        "binary_data_size 32.0 is invalid",
    ),
    ("JSON 1000 deep", {"content": b"[" * 1000 + b"]" * 1000}, 400, "nested too deeply"),
    ("JSON 100000 deep", {"content": b'{"inputs": ' + b"[" * 100000 + b"]" * 100000 + b"}"}, 400, "nested too deeply"),
    (
        "BOOL for INT64",
        {
            "json": {
                "inputs": [
                    {"name": "input_ids", "shape": [1, 3], "datatype": "BOOL", "data": [True, False, True]},
                    {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 1, 1]},
                ]
            }
        },
        400,
        "input input_ids has datatype BOOL; allowed: INT64",
    ),
    ("bools in INT64 data", ids_input([1, True, 3]), 400, "INT64 data holds bool values; allowed: integers"),
    ("floats cast to ints", ids_input([1.5, 2, 3]), 400, "INT64 data holds float values; allowed: integers"),
    (
        "mask of 2",
        {
            "json": {
                "inputs": [
                    {"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]},
                    {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 1]},
                ]
            }
        },
        400,
        "attention_mask holds 2; allowed: 0 or 1",
    ),
    (
        "NaN input",
        {"content": b'{"inputs":[{"name":"latents","shape":[1,1,64],"datatype":"FP32","data":[NaN' + b",0" * 63 + b"]}]}"},
        400,
        "NaN or Infinity; allowed: finite numbers",
    ),
    (
        "Infinity binary",
        raw_infer(
            {"inputs": [{"name": "latents", "shape": [1, 1, 2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]},
            np.array([np.inf, 0], dtype=np.float32).tobytes(),
        ),
        400,
        "NaN or Infinity",
    ),
    (
        "FP32 overflow",
        {"json": {"inputs": [{"name": "latents", "shape": [1, 1, 1], "datatype": "FP32", "data": [1e300]}]}},
        400,
        "FP32 data holds 1e+300; allowed: magnitudes up to",
    ),
    ("id an object", {**infer_body(), "id": {"a": 1}}, 400, "field 'id' must be a string"),
    (
        "binary_data_output string",
        {**infer_body(), "parameters": {"binary_data_output": "yes"}},
        400,
        "binary_data_output='yes' is invalid",
    ),
    ("data a string", ids_input("123"), 400, "'data' must be a list, not str"),
]


@pytest.mark.parametrize(("case", "request_kwargs", "status", "message"), ATTACKS, ids=[a[0] for a in ATTACKS])
def test_malformed_infer_gets_4xx_naming_the_problem(hardened: RunningServer, case, request_kwargs, status, message) -> None:
    kwargs = request_kwargs if set(request_kwargs) & {"content", "json"} else {"json": request_kwargs}
    model = "decoder" if "latents" in json.dumps(kwargs.get("json", {})) or b"latents" in kwargs.get("content", b"")[:300] else "encoder"
    response = post(hardened, f"/v2/models/{model}/infer", **kwargs)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"} and message in response.json()["error"], response.text


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/generate", b'{"n": 1, "seed": "\xff"}', "the body is not valid UTF-8 JSON: invalid start byte at byte 18"),
        ("/v1/reconstruct", b'{"texts": ' + b"[" * 100000 + b"]" * 100000 + b"}", "the body's JSON is nested too deeply"),
        ("/v1/completions", b'{"prompt": "\xc3"}', "the body is not valid UTF-8 JSON"),
    ],
)
def test_a_v1_body_that_cannot_be_parsed_is_named(hardened: RunningServer, path: str, body: bytes, message: str) -> None:
    """FastAPI's own answer was "There was an error parsing the body" for both: it did not say which."""
    response = post(hardened, path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert message in response.text, response.text


def test_lone_surrogate_text_gets_400(hardened: RunningServer) -> None:
    body = b'{"texts": ["abc\\ud800def"]}'
    response = post(hardened, "/v1/reconstruct", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert "texts[0] is not valid Unicode (surrogates not allowed at character 3)" in response.json()["error"]


def test_chunked_body_over_the_cap_gets_413_on_every_route(hardened: RunningServer) -> None:
    for path in ("/v1/encode", "/v1/generate", "/v2/models/encoder/infer"):
        s = connect(hardened)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
        try:
            for _ in range(200 << 4):  # up to 200 MB, until the server answers and closes
                s.sendall(chunk)
        except OSError:
            pass
        answer = read_until_closed(s)
        assert answer.startswith(b"HTTP/1.1 413 "), (path, answer[:200])
        assert b"body exceeds the limit of 1048576 bytes" in answer


def test_error_shape_is_one_for_all_routes(hardened: RunningServer) -> None:
    broken = post(hardened, "/v1/generate", content=b'{"n": 2,', headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and set(broken.json()) == {"error"}
    assert broken.json()["error"].startswith("the body is not valid JSON") and "0: JSON decode error" not in broken.json()["error"]
    too_many = post(hardened, "/v1/generate", json={"n": 9})
    assert too_many.status_code == 422 and too_many.json() == {"error": "n: 9 is out of range; allowed: 1..8"}
    long_text = post(hardened, "/v1/encode", json={"texts": ["fine", "word " * 300]})
    assert long_text.status_code == 400 and set(long_text.json()) == {"error"}
    assert long_text.json()["error"].startswith("texts[1] is ") and "tokens long; allowed: 1..128 tokens" in long_text.json()["error"]
    texts = post(hardened, "/v1/encode", json={"texts": ["a"] * 9})
    assert texts.status_code == 422 and texts.json() == {"error": "texts: 9 items is out of range; allowed: 1..8"}
    wrong_item = post(hardened, "/v1/encode", json={"texts": ["a", 3]})
    assert wrong_item.status_code == 422 and wrong_item.json()["error"].startswith("texts[1]: ")
    missing = httpx.get(f"{hardened.url}/nowhere")
    assert missing.status_code == 404 and set(missing.json()) == {"error"}
    wrong_method = httpx.get(f"{hardened.url}/v1/generate")
    assert wrong_method.status_code == 405 and set(wrong_method.json()) == {"error"}


kserve_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(-3, 3), max_size=4),
)
kserve_input = st.fixed_dictionaries(
    {"name": st.sampled_from(["input_ids", "attention_mask", "x", ""])},
    optional={
        "shape": st.one_of(st.lists(st.one_of(st.integers(-2, 6), st.booleans(), st.floats(0, 4)), max_size=4), kserve_values),
        "datatype": st.sampled_from(["INT64", "INT32", "FP32", "FP16", "FP64", "BOOL", "BYTES", "int"]),
        "data": st.one_of(st.lists(kserve_values, max_size=12), st.lists(st.lists(kserve_values, max_size=4), max_size=4), kserve_values),
        "parameters": st.one_of(
            st.dictionaries(st.sampled_from(["binary_data_size", "binary_data"]), kserve_values, max_size=2), kserve_values
        ),
    },
)
kserve_body = st.fixed_dictionaries(
    {},
    optional={
        "inputs": st.one_of(st.lists(kserve_input, max_size=3), kserve_values),
        "id": kserve_values,
        "outputs": st.one_of(
            st.lists(
                st.fixed_dictionaries({"name": st.sampled_from(["latents", "nope"])}, optional={"parameters": kserve_values}), max_size=2
            ),
            kserve_values,
        ),
        "parameters": st.one_of(st.dictionaries(st.sampled_from(["binary_data_output"]), kserve_values, max_size=1), kserve_values),
    },
)


@hypothesis_settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(body=kserve_body)
def test_fuzzed_kserve_json_never_gets_5xx(hardened: RunningServer, body: dict) -> None:
    response = post(hardened, "/v2/models/encoder/infer", content=json.dumps(body, allow_nan=True).encode())
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert set(response.json()) == {"error"}, response.text


# --- 5. auth, and what the process prints --------------------------------------------------------


def test_bearer_key_is_compared_in_constant_time(export_dir: Path, monkeypatch) -> None:
    import hmac

    calls: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or original(a, b))
    running = RunningServer(LDLMService(str(export_dir), ServerSettings(port=free_port(), api_key="s3cret-key")))
    try:
        assert post(running, "/v1/encode", json={"texts": ["x"]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert post(running, "/v1/encode", json={"texts": ["x"]}, headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
    finally:
        running.stop()
    assert calls == [(b"Bearer wrong", b"Bearer s3cret-key"), (b"Bearer s3cret-key", b"Bearer s3cret-key")]


def test_busy_port_fails_cleanly_before_loading(export_dir: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "ldlm.cli", "serve", str(export_dir), "--port", str(port)], capture_output=True, text=True, timeout=120
        )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output and "serving" not in output
    assert f"port {port} on 127.0.0.1 is already in use" in output and "--port" in output


def test_key_never_printed_and_openapi_typed(export_dir: Path) -> None:
    port = free_port()
    key = "k3y-that-must-not-leak"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LDLM_API_KEY": key}
    process = subprocess.Popen(
        [sys.executable, "-m", "ldlm.cli", "serve", str(export_dir), "--port", str(port), "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", 120)
        headers = {"Authorization": f"Bearer {key}"}
        schema = httpx.get(f"http://127.0.0.1:{port}/openapi.json", headers=headers).json()
        assert httpx.post(f"http://127.0.0.1:{port}/v1/encode", json={"texts": ["x"]}, headers=headers).status_code == 200
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert key not in output and "$LDLM_API_KEY" in output, output
    bodies = schema["components"]["schemas"]
    assert (
        bodies["GenerateBody"]["properties"]["n"]["maximum"] == 64
        and bodies["GenerateBody"]["properties"]["steps"]["anyOf"][0]["maximum"] == 1000
    )
    assert bodies["GenerateBody"]["properties"]["length"]["maximum"] == 128 and bodies["TextsBody"]["properties"]["texts"]["maxItems"] == 64
    ok = schema["paths"]["/v1/encode"]["post"]["responses"]
    assert ok["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/EncodeResponse")
    assert ok["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert schema["paths"]["/v1/generate"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/GenerateResponse"
    )
