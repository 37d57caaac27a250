"""KServe v2 over gRPC against the real server on 127.0.0.1, driven by tritonclient's gRPC and HTTP clients side
by side: every method a model server answers (health, metadata, config, statistics, repository index, infer
sync and async) says over gRPC what it says over HTTP, infer's values are the eager model's, bad input gets
HTTP's message under the gRPC code of HTTP's status, a wrong key is UNAUTHENTICATED, and the server keeps
serving after each refusal. The server requires an API key; the clients send it with a plugin."""

from __future__ import annotations

import queue
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient's gRPC client (pip install -e .[test])")
httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient's HTTP client (pip install -e .[test])")

import grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from tritonclient._plugin import InferenceServerClientPlugin  # noqa: E402
from tritonclient.grpc import model_config_pb2, service_pb2  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from ldlm.model.ldlm import LDLM  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

KEY = "s3cret"
MODELS = ("encoder", "denoiser", "decoder")
VOCAB = 50257  # GPT-2's, the tiny preset's gpt2_vocab_size


class Bearer(InferenceServerClientPlugin):
    """Sends ``authorization: Bearer KEY`` with every call, as header (HTTP) or metadata (gRPC)."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, request: Any) -> None:
        request.headers["authorization"] = f"Bearer {self.key}"


@pytest.fixture(scope="module")
def served(export_dir: Path):
    grpc_port = free_port()
    settings = ServerSettings(
        grpc_port=grpc_port,
        port=free_port(),
        max_batch=8,
        max_delay_ms=0.0,
        request_timeout_s=30,
        max_request_samples=4,
        api_key=KEY,
        max_body_bytes=1 << 20,
    )
    running = RunningServer(LDLMService(str(export_dir), settings))
    running.grpc_url = f"127.0.0.1:{grpc_port}"
    yield running
    running.stop()


@pytest.fixture(scope="module")
def clients(served: RunningServer):
    """(gRPC, HTTP) tritonclients with the key."""
    over_grpc = grpcclient.InferenceServerClient(served.grpc_url)
    over_http = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
    for client in (over_grpc, over_http):
        client.register_plugin(Bearer(KEY))
    yield over_grpc, over_http
    over_grpc.close()
    over_http.close()


def tensors(module: Any, named: dict[str, np.ndarray]) -> list[Any]:
    """``module``'s InferInputs (tritonclient.grpc or .http) holding ``named``, binary."""
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.float16): "FP16"}
    inputs = []
    for name, array in named.items():
        tensor = module.InferInput(name, list(array.shape), datatypes[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def encoder_arrays(ids_dtype: type = np.int64) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 9)).astype(ids_dtype)
    mask = np.ones((2, 9), dtype=np.int64)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def as_dict(message: Any) -> dict[str, Any]:
    """A protobuf answer as JSON with its integers as numbers (proto3's JSON writes int64 as strings)."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def parsed(payload: Any, message: Any) -> dict[str, Any]:
    """An HTTP answer in the gRPC message's form, by protobuf's own parser (unknown fields refused)."""
    return as_dict(json_format.ParseDict(payload, message))


# --- health, metadata, config, repository index ----------------------------------------------------------


def test_health_and_metadata_say_over_grpc_what_http_says(clients) -> None:
    over_grpc, over_http = clients
    for client in clients:
        assert client.is_server_live() and client.is_server_ready()
        assert all(client.is_model_ready(model) for model in MODELS)
        assert client.is_model_ready("encoder", "1")
    server = over_grpc.get_server_metadata(as_json=True)
    assert server == over_http.get_server_metadata()
    assert {"binary_tensor_data", "model_configuration", "statistics", "model_repository"} <= set(server["extensions"])
    for model in MODELS:
        over = over_http.get_model_metadata(model)
        assert over["versions"] == ["1"] and over["name"] == model
        message = over_grpc.get_model_metadata(model)
        over.pop("precision")  # beside KServe's fields over HTTP; its message has no place for it
        assert as_dict(message) == parsed(over, service_pb2.ModelMetadataResponse())
    meta = over_grpc.get_model_metadata("encoder", as_json=True)
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("input_ids", "INT64", ["-1", "-1"]),
        ("attention_mask", "INT64", ["-1", "-1"]),
    ]


def test_model_config_is_tritons_over_both(clients, served: RunningServer) -> None:
    over_grpc, over_http = clients
    for model in MODELS:
        config = over_http.get_model_config(model)
        assert as_dict(over_grpc.get_model_config(model).config) == parsed(config, model_config_pb2.ModelConfig())
        assert over_http.get_model_config(model, "1") == config
    encoder, denoiser = over_http.get_model_config("encoder"), over_http.get_model_config("denoiser")
    # Triton's dims leave out the batch axis; a per-sample scalar is dims [1] reshaped to []
    assert encoder["input"] == [
        {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]},
        {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": [-1]},
    ]
    assert encoder["output"] == [{"name": "latents", "data_type": "TYPE_FP32", "dims": [-1, 64]}]
    assert denoiser["input"][1] == {"name": "t", "data_type": "TYPE_FP32", "dims": [1], "reshape": {"shape": []}}
    assert encoder["max_batch_size"] == 4  # --max-request-samples: what one request may send
    assert encoder["dynamic_batching"] == {
        "preferred_batch_size": [8],  # --max-batch: what one execution runs
        "max_queue_delay_microseconds": 0,
        "default_queue_policy": {"max_queue_size": served.service.settings.max_queue},
    }
    assert encoder["instance_group"][0]["kind"] == "KIND_CPU"
    assert encoder["parameters"]["precision"] == {"string_value": "fp32"}


def test_repository_index_lists_the_served_models(clients, served: RunningServer) -> None:
    over_grpc, over_http = clients
    expected = [{"name": m, "version": "1", "state": "READY", "reason": ""} for m in (*MODELS, "ldlm_generate")]
    assert over_http.get_model_repository_index() == expected
    assert as_dict(over_grpc.get_model_repository_index()) == {"models": expected}
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http:
        assert http.post("/v2/repository/index", json={"ready": True}).json() == expected
        refused = http.post("/v2/repository/index", json={"ready": 1})
        assert (refused.status_code, refused.json()) == (400, {"error": "field 'ready' is 1; allowed: true or false"})
    for call in (over_grpc.load_model, over_grpc.unload_model):  # the models are fixed at start
        with pytest.raises(InferenceServerException) as error:
            call("encoder")
        assert error.value.status() == str(grpc.StatusCode.UNIMPLEMENTED) and "cannot be loaded or unloaded" in error.value.message()


# --- infer --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids_dtype", [np.int64, np.int32], ids=["INT64", "INT32"])
def test_infer_over_grpc_is_http_and_the_eager_model(clients, tiny_model: LDLM, ids_dtype: type) -> None:
    over_grpc, over_http = clients
    arrays = encoder_arrays(ids_dtype)
    by_grpc = over_grpc.infer("encoder", tensors(grpcclient, arrays), request_id="r1")
    by_http = over_http.infer("encoder", tensors(httpclient, arrays))
    latents = by_grpc.as_numpy("latents")
    assert latents.dtype == np.float32 and latents.shape == (2, 9, 64)
    assert by_grpc.get_response().id == "r1" and by_grpc.get_response().model_version == "1"
    np.testing.assert_array_equal(latents, by_http.as_numpy("latents"))
    with torch.no_grad():
        ids, mask = torch.from_numpy(arrays["input_ids"].astype(np.int64)), torch.from_numpy(arrays["attention_mask"]).bool()
        expected = tiny_model.encode_latents(ids, mask).numpy()
    valid = arrays["attention_mask"].astype(bool)
    assert np.abs(latents[valid] - expected[valid]).max() < 1e-5


def test_infer_json_over_http_takes_int32_ids(clients) -> None:
    _, over_http = clients
    arrays = encoder_arrays(np.int32)
    inputs = tensors(httpclient, arrays)
    inputs[0].set_data_from_numpy(arrays["input_ids"], binary_data=False)
    as_json = over_http.infer("encoder", inputs, outputs=[httpclient.InferRequestedOutput("latents", binary_data=False)])
    wide = over_http.infer("encoder", tensors(httpclient, {**arrays, "input_ids": arrays["input_ids"].astype(np.int64)}))
    np.testing.assert_array_equal(as_json.as_numpy("latents"), wide.as_numpy("latents"))


def test_denoiser_and_decoder_over_grpc(clients, tiny_model: LDLM) -> None:
    over_grpc, over_http = clients
    x = np.random.default_rng(1).standard_normal((3, 7, 64)).astype(np.float32)
    mask = np.ones((3, 7), dtype=np.int64)
    named = {"x_t": x, "t": np.array([0.2, 0.5, 0.9], dtype=np.float32), "x0_prev": x, "attention_mask": mask}
    x0 = over_grpc.infer("denoiser", tensors(grpcclient, named)).as_numpy("x0_hat")
    with torch.no_grad():
        expected = tiny_model.denoise(*(torch.from_numpy(named[n]) for n in ("x_t", "t", "x0_prev")), torch.from_numpy(mask).bool())
    assert np.abs(x0 - expected.numpy()).max() < 1e-5
    decoder = {"latents": x, "attention_mask": mask}
    only_ids = over_grpc.infer("decoder", tensors(grpcclient, decoder), outputs=[grpcclient.InferRequestedOutput("token_ids")])
    assert [o.name for o in only_ids.get_response().outputs] == ["token_ids"]
    both = over_http.infer("decoder", tensors(httpclient, decoder))
    token_ids = only_ids.as_numpy("token_ids")
    assert token_ids.dtype == np.int64 and token_ids.shape == (3, 7)
    np.testing.assert_array_equal(token_ids, both.as_numpy("logits").argmax(-1))


def test_async_infer_over_both(clients) -> None:
    over_grpc, over_http = clients
    arrays = encoder_arrays()
    reference = over_http.infer("encoder", tensors(httpclient, arrays)).as_numpy("latents")
    answers: queue.Queue = queue.Queue()
    for _ in range(3):
        over_grpc.async_infer("encoder", tensors(grpcclient, arrays), callback=lambda result, error: answers.put((result, error)))
    pending = [over_http.async_infer("encoder", tensors(httpclient, arrays)) for _ in range(3)]
    for _ in range(3):
        result, error = answers.get(timeout=60)
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("latents"), reference)
    for request in pending:
        np.testing.assert_array_equal(request.get_result(timeout=60).as_numpy("latents"), reference)


# --- statistics -------------------------------------------------------------------------------------------


def test_statistics_count_as_triton_does_from_the_metrics(clients, served: RunningServer) -> None:
    over_grpc, over_http = clients
    before = over_http.get_inference_statistics("encoder")["model_stats"][0]
    arrays = encoder_arrays()  # 2 samples a request: each request runs alone (sequential calls, no batching delay)
    over_grpc.infer("encoder", tensors(grpcclient, arrays))
    over_http.infer("encoder", tensors(httpclient, arrays))
    one = {name: array[:1] for name, array in arrays.items()}
    over_grpc.infer("encoder", tensors(grpcclient, one))
    with pytest.raises(InferenceServerException):
        over_grpc.infer("encoder", tensors(grpcclient, {**one, "input_ids": np.full((1, 9), VOCAB, dtype=np.int64)}))
    # A request's statistics are recorded as its answer goes out: the client can ask before the last one is in.
    deadline = time.monotonic() + 10
    after = over_http.get_inference_statistics("encoder")["model_stats"][0]
    while (
        after["inference_stats"]["fail"]["count"] + after["inference_stats"]["success"]["count"]
        < (before["inference_stats"]["fail"]["count"] + before["inference_stats"]["success"]["count"] + 4)
        and time.monotonic() < deadline
    ):
        after = over_http.get_inference_statistics("encoder")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 5
    assert after["execution_count"] - before["execution_count"] == 3

    def grew(stage: str) -> int:
        return after["inference_stats"][stage]["count"] - before["inference_stats"][stage]["count"]

    assert (grew("success"), grew("fail"), grew("compute_input"), grew("compute_output")) == (3, 1, 3, 3)  # requests
    assert (grew("queue"), grew("compute_infer")) == (3, 3)  # executions
    for stage in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert after["inference_stats"][stage]["ns"] > before["inference_stats"][stage]["ns"], stage

    def took(stage: str) -> int:
        return after["inference_stats"][stage]["ns"] - before["inference_stats"][stage]["ns"]

    # a successful request's time holds its decoding, its execution (run alone) and its encoding
    assert took("success") > took("compute_input") + took("compute_infer") + took("compute_output")
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    old_sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
    assert (sizes[2] - old_sizes.get(2, 0), sizes[1] - old_sizes.get(1, 0)) == (2, 1)
    assert sum(b["compute_infer"]["ns"] for b in after["batch_stats"]) == pytest.approx(
        after["inference_stats"]["compute_infer"]["ns"], rel=1e-6
    )
    # the /metrics counters they are read from, and gRPC's view of the same numbers
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http:
        text = http.get("/metrics").text
    assert prometheus(text, 'ldlm_execution_count_total{model="encoder"}') == after["execution_count"]
    assert prometheus(text, 'ldlm_queue_duration_seconds_count{model="encoder"}') == after["inference_stats"]["queue"]["count"]
    over = over_grpc.get_inference_statistics("encoder", as_json=True)["model_stats"][0]
    assert int(over["execution_count"]) == after["execution_count"]
    every = over_http.get_inference_statistics()["model_stats"]
    assert [s["name"] for s in every] == [*MODELS, "ldlm_generate"] and every[0]["execution_count"] == after["execution_count"]
    assert over_http.get_inference_statistics("encoder", "1")["model_stats"][0]["execution_count"] == after["execution_count"]


def prometheus(text: str, sample: str) -> float:
    """One sample's value in a /metrics page."""
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert match, sample
    return float(match.group(1))


def test_grpc_infer_counts_in_the_request_metrics(clients, served: RunningServer) -> None:
    over_grpc, _ = clients
    counters = ('ldlm_request_success_total{model="encoder"}', 'ldlm_request_failure_total{code="400",model="encoder"}')
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http:

        def read() -> list[float]:
            text = http.get("/metrics").text
            return [prometheus(text, c) if c in text else 0.0 for c in counters]

        before = read()
        over_grpc.infer("encoder", tensors(grpcclient, encoder_arrays()))
        with pytest.raises(InferenceServerException):
            over_grpc.infer("encoder", tensors(grpcclient, {**encoder_arrays(), "attention_mask": np.full((2, 9), 2, dtype=np.int64)}))
        assert [a - b for a, b in zip(read(), before)] == [1.0, 1.0]


# --- refusals ---------------------------------------------------------------------------------------------


def bad_requests() -> list[tuple[str, str, dict[str, np.ndarray], grpc.StatusCode, str]]:
    """(case, model, inputs, gRPC code, HTTP status) of requests the server refuses."""
    good = encoder_arrays()
    x = np.zeros((1, 3, 64), dtype=np.float32)
    denoiser = {"x_t": x, "t": np.array([0.5], dtype=np.float32), "x0_prev": x, "attention_mask": np.ones((1, 3), dtype=np.int64)}
    return [
        (
            "id outside the vocabulary",
            "encoder",
            {**good, "input_ids": np.full((2, 9), VOCAB, dtype=np.int64)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "400",
        ),
        ("mask of 2", "encoder", {**good, "attention_mask": np.full((2, 9), 2, dtype=np.int64)}, grpc.StatusCode.INVALID_ARGUMENT, "400"),
        ("FP32 ids", "encoder", {**good, "input_ids": good["input_ids"].astype(np.float32)}, grpc.StatusCode.INVALID_ARGUMENT, "400"),
        (
            "NaN latents",
            "denoiser",
            {**denoiser, "x_t": np.full((1, 3, 64), np.nan, dtype=np.float32)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "400",
        ),
        ("t above 1", "denoiser", {**denoiser, "t": np.array([5.0], dtype=np.float32)}, grpc.StatusCode.INVALID_ARGUMENT, "400"),
        (
            "lengths disagree",
            "encoder",
            {**good, "attention_mask": np.ones((2, 5), dtype=np.int64)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "400",
        ),
        ("missing input", "encoder", {"input_ids": good["input_ids"]}, grpc.StatusCode.INVALID_ARGUMENT, "400"),
        (
            "5 samples, cap 4",
            "encoder",
            {n: np.concatenate([a, a, a])[:5] for n, a in good.items()},
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "413",
        ),
        ("unknown model", "encoderr", good, grpc.StatusCode.NOT_FOUND, "404"),
    ]


def test_bad_input_over_grpc_gets_https_message_and_the_server_goes_on(clients) -> None:
    over_grpc, over_http = clients
    for case, model, arrays, code, status in bad_requests():
        with pytest.raises(InferenceServerException) as over_http_error:
            over_http.infer(model, tensors(httpclient, arrays))
        with pytest.raises(InferenceServerException) as over_grpc_error:
            over_grpc.infer(model, tensors(grpcclient, arrays))
        assert over_http_error.value.status() == status, case
        assert over_grpc_error.value.status() == str(code), case
        assert over_grpc_error.value.message() == over_http_error.value.message(), case
    with pytest.raises(InferenceServerException) as unknown_output:
        over_grpc.infer("encoder", tensors(grpcclient, encoder_arrays()), outputs=[grpcclient.InferRequestedOutput("logits")])
    assert unknown_output.value.message() == "unknown outputs ['logits']; encoder has ['latents']"
    for call in (
        lambda c: c.get_model_config("nope"),
        lambda c: c.get_inference_statistics("nope"),
        lambda c: c.get_model_metadata("encoder", "2"),
    ):
        with pytest.raises(InferenceServerException) as over_http_error:
            call(over_http)
        with pytest.raises(InferenceServerException) as over_grpc_error:
            call(over_grpc)
        assert over_grpc_error.value.status() == str(grpc.StatusCode.NOT_FOUND) and over_http_error.value.status() == "404"
        assert over_grpc_error.value.message() == over_http_error.value.message()
    assert over_grpc.infer("encoder", tensors(grpcclient, encoder_arrays())).as_numpy("latents").shape == (2, 9, 64)


def test_a_wrong_or_missing_key_is_unauthenticated(served: RunningServer, clients) -> None:
    for plugin in (None, Bearer("wrong")):
        client = grpcclient.InferenceServerClient(served.grpc_url)
        if plugin is not None:
            client.register_plugin(plugin)
        assert client.is_server_live() and client.is_server_ready()  # health is open, as /v2/health/ is
        for call in (
            lambda c: c.infer("encoder", tensors(grpcclient, encoder_arrays())),
            lambda c: c.get_model_metadata("encoder"),
            lambda c: c.get_inference_statistics(),
        ):
            with pytest.raises(InferenceServerException) as error:
                call(client)
            assert (error.value.status(), error.value.message()) == (str(grpc.StatusCode.UNAUTHENTICATED), "missing or wrong bearer token")
        client.close()
    with httpx.Client(base_url=served.url, timeout=30) as http:
        assert http.post("/v2/repository/index").status_code == 401
    over_grpc, _ = clients
    assert over_grpc.infer("encoder", tensors(grpcclient, encoder_arrays())).as_numpy("latents").shape == (2, 9, 64)
