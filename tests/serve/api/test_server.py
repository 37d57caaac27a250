"""The HTTP service on 127.0.0.1: tritonclient (binary and JSON tensors), the text API, a battery of
bad requests each with its status code, metrics, auth, and a graceful shutdown."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch


def optional(module: str):  # type: ignore[no-untyped-def]
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# The served graphs run on ONNX Runtime; the clients under test come with .[test]. Tests that need
# none of them (settings) still run without them.
httpx = optional("httpx")
tritonclient_http = optional("tritonclient.http")
MISSING = [
    name
    for name, found in (
        ("onnxruntime", importlib.util.find_spec("onnxruntime")),
        ("httpx", httpx),
        ("tritonclient.http", tritonclient_http),
    )
    if found is None
]


RUN_WITHOUT_THE_STACK = {"test_default_bind_is_loopback"}


@pytest.fixture(autouse=True)
def _needs_the_serving_stack(request: pytest.FixtureRequest) -> None:
    if MISSING and request.function.__name__ not in RUN_WITHOUT_THE_STACK:
        pytest.skip(f"{', '.join(MISSING)} not installed (pip install -e .[cpu,test]); the service was not exercised")


from ldlm.model.ldlm import LDLM  # noqa: E402
from ldlm.pipeline import LDLMPipeline  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.queueing import QueueFullError  # noqa: E402
from tests import REPO  # noqa: E402
from tests.servers import RunningServer, free_port, infer_body, wait_ready  # noqa: E402


@pytest.fixture(scope="module")
def server(export_dir: Path):
    settings = ServerSettings(
        port=free_port(), max_batch=8, max_delay_ms=1.0, request_timeout_s=30, max_body_bytes=1 << 20, max_n=8, max_steps=100
    )
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer):
    triton = tritonclient_http.InferenceServerClient(server.url.removeprefix("http://"))
    yield triton
    triton.close()


def encoder_inputs(binary: bool):
    ids = np.random.default_rng(0).integers(0, 50257, (2, 10)).astype(np.int64)
    mask = np.ones((2, 10), dtype=np.int64)
    mask[1, 6:] = 0
    inputs = [
        tritonclient_http.InferInput("input_ids", list(ids.shape), "INT64"),
        tritonclient_http.InferInput("attention_mask", list(mask.shape), "INT64"),
    ]
    inputs[0].set_data_from_numpy(ids, binary_data=binary)
    inputs[1].set_data_from_numpy(mask, binary_data=binary)
    return ids, mask, inputs


def test_tritonclient_health_and_metadata(client) -> None:
    assert client.is_server_live() and client.is_server_ready()
    for model in ("encoder", "denoiser", "decoder"):
        assert client.is_model_ready(model)
    meta = client.get_model_metadata("denoiser")
    assert [i["name"] for i in meta["inputs"]] == ["x_t", "t", "x0_prev", "attention_mask"]
    assert meta["inputs"][0] == {"name": "x_t", "datatype": "FP32", "shape": [-1, -1, 64]}
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data", "model_configuration", "statistics", "model_repository"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_infer_matches_eager(client, tiny_model: LDLM, binary: bool) -> None:
    ids, mask, inputs = encoder_inputs(binary)
    outputs = [tritonclient_http.InferRequestedOutput("latents", binary_data=binary)]
    result = client.infer("encoder", inputs, outputs=outputs)
    latents = result.as_numpy("latents")
    with torch.no_grad():
        expected = tiny_model.encode_latents(torch.from_numpy(ids), torch.from_numpy(mask).bool()).numpy()
    valid = mask.astype(bool)
    assert latents.shape == expected.shape
    assert np.abs(latents[valid] - expected[valid]).max() < 1e-5
    # no outputs named: tritonclient asks for every output in binary
    assert client.infer("encoder", inputs).as_numpy("latents").shape == (2, 10, 64)


def test_tritonclient_denoiser_and_decoder(client, tiny_model: LDLM) -> None:
    x = np.random.default_rng(1).standard_normal((3, 7, 64)).astype(np.float32)
    t = np.array([0.2, 0.5, 0.9], dtype=np.float32)
    mask = np.ones((3, 7), dtype=np.int64)
    named = {"x_t": x, "t": t, "x0_prev": x, "attention_mask": mask}
    inputs = []
    for name, value in named.items():
        tensor = tritonclient_http.InferInput(name, list(value.shape), "FP32" if value.dtype == np.float32 else "INT64")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    x0 = client.infer("denoiser", inputs).as_numpy("x0_hat")
    with torch.no_grad():
        expected = tiny_model.denoise(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(x), torch.from_numpy(mask).bool())
    assert np.abs(x0 - expected.numpy()).max() < 1e-5
    latents = tritonclient_http.InferInput("latents", [3, 7, 64], "FP32")
    latents.set_data_from_numpy(x)
    decoder_mask = tritonclient_http.InferInput("attention_mask", [3, 7], "INT64")
    decoder_mask.set_data_from_numpy(mask)
    result = client.infer(
        "decoder",
        [latents, decoder_mask],
        outputs=[tritonclient_http.InferRequestedOutput("token_ids"), tritonclient_http.InferRequestedOutput("logits")],
    )
    np.testing.assert_array_equal(result.as_numpy("token_ids"), result.as_numpy("logits").argmax(-1))


def test_text_api(server: RunningServer, pipeline: LDLMPipeline) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"n": 2, "length": 12, "steps": 4, "seed": 7, "sampler": "ddim"}
        response = http.post("/v1/generate", json=body, headers={"X-Request-ID": "abc123"})
        assert response.status_code == 200 and response.headers["x-request-id"] == "abc123"
        expected = pipeline.generate(2, 12, 4, 7, "ddim")
        assert response.json()["token_ids"] == expected.token_ids.tolist()
        assert response.json()["texts"] == expected.texts
        texts = ["Hello there.", "A longer sentence about latent diffusion."]
        reconstructed = http.post("/v1/reconstruct", json={"texts": texts}).json()
        assert reconstructed["texts"] == pipeline.reconstruct(texts).texts
        encoded = http.post("/v1/encode", json={"texts": texts}).json()
        assert encoded["shape"][0] == 2 and encoded["shape"][2] == 64
        assert http.get("/openapi.json").json()["paths"].keys() >= {"/v1/generate", "/v1/reconstruct", "/v1/encode"}


BAD_REQUESTS = [
    (
        "malformed JSON",
        "POST",
        "/v2/models/encoder/infer",
        {"content": b"{not json"},
        400,
        "the body is not valid JSON: Expecting property name",
    ),
    (
        "wrong dtype",
        "POST",
        "/v2/models/encoder/infer",
        {
            "json": infer_body(
                inputs=[
                    {"name": "input_ids", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]},
                    {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 1, 1]},
                ]
            )
        },
        400,
        "input input_ids has datatype FP32; allowed: INT64",
    ),
    (
        "wrong shape",
        "POST",
        "/v2/models/encoder/infer",
        {
            "json": infer_body(
                inputs=[
                    {"name": "input_ids", "shape": [1, 3, 1], "datatype": "INT64", "data": [1, 2, 3]},
                    {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 1, 1]},
                ]
            )
        },
        400,
        "input_ids has shape (1, 3, 1)",
    ),
    (
        "data count",
        "POST",
        "/v2/models/encoder/infer",
        {"json": infer_body(inputs=[{"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3]}])},
        400,
        "needs 4",
    ),
    (
        "ids >= V",
        "POST",
        "/v2/models/encoder/infer",
        {
            "json": infer_body(
                inputs=[
                    {"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 50257]},
                    {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 1, 1]},
                ]
            )
        },
        400,
        "input_ids contains 50257",
    ),
    (
        "missing input",
        "POST",
        "/v2/models/encoder/infer",
        {"json": infer_body(inputs=[{"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]}])},
        400,
        "allowed: exactly",
    ),
    (
        "bad binary size",
        "POST",
        "/v2/models/encoder/infer",
        {
            "content": json.dumps(
                {"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "parameters": {"binary_data_size": 3}}]}
            ).encode()
            + b"abc",
            "headers": {
                "Inference-Header-Content-Length": str(
                    len(
                        json.dumps(
                            {"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "parameters": {"binary_data_size": 3}}]}
                        )
                    )
                )
            },
        },
        400,
        "binary_data_size 3",
    ),
    (
        "sequence too long",
        "POST",
        "/v2/models/denoiser/infer",  # every input well formed: only the length is wrong
        {
            "json": {
                "inputs": [
                    {"name": "x_t", "shape": [1, 200, 64], "datatype": "FP32", "data": [0.0] * 12800},
                    {"name": "t", "shape": [1], "datatype": "FP32", "data": [0.5]},
                    {"name": "x0_prev", "shape": [1, 200, 64], "datatype": "FP32", "data": [0.0] * 12800},
                    {"name": "attention_mask", "shape": [1, 200], "datatype": "INT64", "data": [1] * 200},
                ]
            }
        },
        400,
        "1 <= seq <= 128",
    ),
    ("unknown model", "POST", "/v2/models/gpt5/infer", {"json": infer_body()}, 404, "unknown model 'gpt5'"),
    ("unknown model metadata", "GET", "/v2/models/gpt5", {}, 404, "unknown model"),
    ("oversized body", "POST", "/v2/models/encoder/infer", {"content": b"x" * (2 << 20)}, 413, "exceeds the limit"),
    ("huge n", "POST", "/v1/generate", {"json": {"n": 100000, "length": 8, "steps": 2}}, 422, "n: 100000 is out of range; allowed: 1..8"),
    ("negative steps", "POST", "/v1/generate", {"json": {"n": 1, "length": 8, "steps": -3}}, 422, "steps"),
    (
        "length above max",
        "POST",
        "/v1/generate",
        {"json": {"n": 1, "length": 4096, "steps": 2}},
        422,
        "length: 4096 is out of range; allowed: 1..128",
    ),
    ("unknown sampler", "POST", "/v1/generate", {"json": {"sampler": "euler"}}, 422, "sampler"),
    ("wrong type", "POST", "/v1/generate", {"json": {"n": "many"}}, 422, "n:"),
    ("empty text", "POST", "/v1/reconstruct", {"json": {"texts": ["ok", ""]}}, 422, 'texts[1]: "" is empty; allowed: a non-empty text'),
    ("no texts", "POST", "/v1/encode", {"json": {"texts": []}}, 422, "texts"),
    ("texts missing", "POST", "/v1/encode", {"json": {}}, 422, "texts"),
]


@pytest.mark.parametrize(("case", "method", "path", "kwargs", "status", "message"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_battery(server: RunningServer, case, method, path, kwargs, status, message) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.request(method, path, **kwargs)
        assert response.status_code == status, response.text
        assert message in response.json()["error"]
        assert http.get("/v2/health/ready").status_code == 200  # the process survived
        ok = http.post("/v2/models/encoder/infer", json=infer_body())
        assert ok.status_code == 200 and ok.json()["outputs"][0]["shape"] == [1, 3, 64]


def test_full_queue_answers_503_with_retry_after(server: RunningServer, monkeypatch) -> None:
    def full(*args, **kwargs):
        raise QueueFullError("generation queue is full (4096 samples waiting, max 4096)")

    monkeypatch.setattr(server.service.scheduler, "submit", full)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/v1/generate", json={"n": 1, "length": 4, "steps": 1})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "queue is full" in response.json()["error"]


def test_metrics(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/v2/models/encoder/infer", json=infer_body())
        http.post("/v2/models/encoder/infer", content=b"{nope")
        text = http.get("/metrics").text
    for name in (
        'ldlm_request_success_total{model="encoder"}',
        'ldlm_request_failure_total{code="400",model="encoder"}',
        'ldlm_inference_count_total{model="encoder"}',
        'ldlm_execution_count_total{model="encoder"}',
        "ldlm_queue_duration_seconds_bucket",
        "ldlm_compute_duration_seconds_bucket",
        "ldlm_request_duration_seconds_bucket",
        "ldlm_batch_size_bucket",
    ):
        assert name in text, name


def test_bearer_auth(export_dir: Path) -> None:
    settings = ServerSettings(port=free_port(), api_key="s3cret", request_timeout_s=30)
    running = RunningServer(LDLMService(str(export_dir), settings))
    try:
        with httpx.Client(base_url=running.url, timeout=30) as http:
            assert http.get("/v2/health/live").status_code == 200  # probes stay open
            assert http.post("/v2/models/encoder/infer", json=infer_body()).status_code == 401
            wrong = http.post("/v2/models/encoder/infer", json=infer_body(), headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            good = http.post("/v2/models/encoder/infer", json=infer_body(), headers={"Authorization": "Bearer s3cret"})
            assert good.status_code == 200
    finally:
        running.stop()


def test_default_bind_is_loopback() -> None:
    assert ServerSettings().host == "127.0.0.1"
    with pytest.raises(ValueError, match="max_n=0 is out of range"):
        ServerSettings(max_n=0)


def test_graceful_shutdown_finishes_in_flight_requests(export_dir: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "ldlm.cli", "serve", str(export_dir), "--port", str(port), "--threads", "1", "--timeout-s", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, url, 60)
        result: dict = {}

        def slow_request() -> None:
            body = {"n": 8, "length": 128, "steps": 1000, "seed": 1, "sampler": "ddim"}  # seconds of work
            result["response"] = httpx.post(f"{url}/v1/generate", json=body, timeout=600)
            result["answered_at"] = time.monotonic()

        thread = threading.Thread(target=slow_request)
        thread.start()
        time.sleep(1.0)  # the request is in flight
        assert "response" not in result, "the request finished before the signal; make it slower"
        signalled_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        thread.join(600)
        assert result["response"].status_code == 200 and result["answered_at"] > signalled_at
        assert len(result["response"].json()["texts"]) == 8
        assert process.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/v2/health/live", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_load_test_script_smoke(export_dir: Path, tmp_path: Path) -> None:
    """scripts/load_test.py end to end, briefly: its own server, 2 clients, 2 s, overhead probe."""
    script = REPO / "scripts" / "load_test.py"
    out = tmp_path / "load.json"
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--source",
            str(export_dir),
            "--clients",
            "2",
            "--seconds",
            "2",
            "--overhead-requests",
            "20",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    assert report["load"]["answered"] > 0 and report["load"]["errors"] == 0 and report["load"]["lost"] == 0
    assert report["overhead"]["runner_p50_ms"] > 0 and report["server_exit_code"] == 0
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, str(script), "--url", "http://10.0.0.1:8000"], check=True, capture_output=True, timeout=60)
