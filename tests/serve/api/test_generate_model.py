"""``ldlm_generate`` as one of ldlm serve's KServe v2 models, driven by tritonclient's HTTP and gRPC clients against
the real server: infer answers /v1/generate's texts, token ids and plan for the same request (JSON and binary
outputs, with and without a prompt); the model is listed, described, configured and ready as the graphs are, on
both transports; its refusals are /v1/generate's words under 400 / INVALID_ARGUMENT; its requests count in its
statistics and under /metrics' generation label."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
tritonclient_http = pytest.importorskip("tritonclient.http", reason="Triton's clients (pip install -e .[test])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

MODULES = {"http": tritonclient_http, "grpc": grpcclient}
PROMPTED = {"prompt": "It is a truth", "n": 2, "length": 12, "steps": 6, "seed": 3, "grid": "uniform", "prompt_strength": 1.5}
PLAIN = {"n": 3, "length": 10, "steps": 9, "seed": 5, "sampler": "ddim"}


@pytest.fixture(scope="module")
def served(export_dir: Path):
    grpc_port = free_port()
    settings = ServerSettings(grpc_port=grpc_port, port=free_port(), max_n=8, max_steps=2000, request_timeout_s=300)
    running = RunningServer(LDLMService(str(export_dir), settings))
    running.grpc_url = f"127.0.0.1:{grpc_port}"
    yield running
    running.stop()


def client(served: RunningServer, kind: str) -> Any:
    return MODULES[kind].InferenceServerClient(served.url.removeprefix("http://") if kind == "http" else served.grpc_url)


def tensors(module: Any, fields: dict[str, Any], binary: bool = True) -> list[Any]:
    """Each /v1/generate field as ldlm_generate's input of the same name in upper case, one value."""
    out = []
    for name, value in fields.items():
        datatype, dtype = {int: ("INT64", np.int64), float: ("FP32", np.float32), str: ("BYTES", np.object_)}[type(value)]
        tensor = module.InferInput(name.upper(), [1], datatype)
        array = np.array([value.encode() if isinstance(value, str) else value], dtype=dtype)
        tensor.set_data_from_numpy(array, **({"binary_data": binary} if module is tritonclient_http else {}))
        out.append(tensor)
    return out


def v1_generate(served: RunningServer, fields: dict[str, Any]) -> dict[str, Any]:
    with httpx.Client(base_url=served.url, timeout=60) as http:
        response = http.post("/v1/generate", json=fields)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("fields", [PLAIN, PROMPTED], ids=["plain", "prompted"])
@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_infer_answers_v1_generates_result(served: RunningServer, kind: str, fields: dict[str, Any]) -> None:
    body = v1_generate(served, fields)
    with client(served, kind) as triton:
        result = triton.infer("ldlm_generate", tensors(MODULES[kind], fields))
    assert [t.decode() for t in result.as_numpy("TEXTS")] == body["texts"]
    token_ids = result.as_numpy("TOKEN_IDS")
    assert token_ids.dtype == np.int64 and token_ids.shape == (fields["n"], fields["length"])
    assert [row[: len(ids)].tolist() for row, ids in zip(token_ids, body["token_ids"], strict=True)] == body["token_ids"]
    assert json.loads(result.as_numpy("PLAN")[0]) == body["plan"]
    if "prompt" in fields:
        assert all(text.decode().startswith(fields["prompt"]) for text in result.as_numpy("TEXTS"))


def test_json_inputs_and_outputs_over_http(served: RunningServer) -> None:
    """BYTES inputs as JSON strings, and every output asked for as JSON, answer what binary ones do."""
    body = v1_generate(served, PROMPTED)
    outputs = [tritonclient_http.InferRequestedOutput(name, binary_data=False) for name in ("TEXTS", "TOKEN_IDS", "PLAN")]
    with client(served, "http") as triton:
        result = triton.infer("ldlm_generate", tensors(tritonclient_http, PROMPTED, binary=False), outputs=outputs)
    raw = result.get_response()
    assert all("parameters" not in output for output in raw["outputs"])  # as JSON, not binary
    assert [t.decode() if isinstance(t, bytes) else t for t in result.as_numpy("TEXTS")] == body["texts"]
    assert result.as_numpy("TOKEN_IDS").tolist() == body["token_ids"]


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_listed_described_configured_and_ready_as_the_graphs(served: RunningServer, kind: str) -> None:
    with client(served, kind) as triton:
        as_json = {"as_json": True} if kind == "grpc" else {}
        index = triton.get_model_repository_index(**as_json)
        names = [m["name"] for m in (index if isinstance(index, list) else index["models"])]
        assert sorted(names) == ["decoder", "denoiser", "encoder", "ldlm_generate"]
        assert triton.is_model_ready("ldlm_generate")
        metadata = triton.get_model_metadata("ldlm_generate", **as_json)
        inputs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in metadata["inputs"]}
        assert inputs["N"] == ("INT64", [1]) and inputs["PROMPT"] == ("BYTES", [1]) and inputs["T_MIN"] == ("FP32", [1])
        assert [t["name"] for t in metadata["outputs"]] == ["TEXTS", "TOKEN_IDS", "PLAN"]
        config = triton.get_model_config("ldlm_generate", **as_json)
        config = config.get("config", config)
        assert int(config.get("max_batch_size", 0)) == 0  # one request at a time, no batch axis: Triton's model's
        optional = {t["name"]: bool(t.get("optional")) for t in config["input"]}
        assert optional["N"] is False and optional["LENGTH"] is False and optional["SEED"] is True and optional["PROMPT"] is True
        assert config["parameters"]["max_n"]["string_value"] == "8"


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_refusals_are_v1_generates_words(served: RunningServer, kind: str) -> None:
    cases = [
        ({"n": 0, "length": 8}, "N=0 is out of range; allowed: 1..8"),
        ({"n": 1}, "ldlm_generate needs input LENGTH (INT64, shape [1])"),
        ({"n": 1, "length": 8, "steps": 2001}, "STEPS=2001 is out of range; allowed: 1..2000"),
        ({"n": 1, "length": 3, "prompt": "It is a truth universally"}, "allowed: 1..2 tokens (fewer than length=3)"),
        ({"n": 1, "length": 8, "t_min": 1.5}, "T_MIN=1.5 is out of range; allowed:"),
    ]
    with client(served, kind) as triton:
        for fields, message in cases:
            with pytest.raises(InferenceServerException) as refused:
                triton.infer("ldlm_generate", tensors(MODULES[kind], fields))
            status = refused.value.status()
            assert status == {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}[kind], (fields, refused.value)
            assert message in refused.value.message(), (fields, refused.value)
        wrong = MODULES[kind].InferInput("N", [1], "FP32")
        wrong.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        with pytest.raises(InferenceServerException, match=r"input N: datatype 'FP32'; allowed: INT64"):
            triton.infer("ldlm_generate", [wrong, *tensors(MODULES[kind], {"length": 8})])
        outputs = [MODULES[kind].InferRequestedOutput("NOPE")]
        with pytest.raises(
            InferenceServerException, match=r"unknown outputs \['NOPE'\]; ldlm_generate has \['TEXTS', 'TOKEN_IDS', 'PLAN'\]"
        ):
            triton.infer("ldlm_generate", tensors(MODULES[kind], {"n": 1, "length": 4}), outputs=outputs)


def metric(served: RunningServer, sample: str) -> float:
    with httpx.Client(base_url=served.url, timeout=30) as http:
        match = re.search(rf"^{re.escape(sample)} (\S+)$", http.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_requests_count_in_its_statistics_and_metrics(served: RunningServer) -> None:
    def success() -> int:
        with client(served, "http") as triton:
            stats = triton.get_inference_statistics("ldlm_generate")["model_stats"][0]
        assert stats["name"] == "ldlm_generate"
        return int(stats["inference_stats"]["success"]["count"])

    before, counted = success(), metric(served, 'ldlm_request_success_total{model="generate"}')
    for kind in ("http", "grpc"):
        with client(served, kind) as triton:
            triton.infer("ldlm_generate", tensors(MODULES[kind], {"n": 1, "length": 4, "steps": 2}))
    v1_generate(served, {"n": 1, "length": 4, "steps": 2})
    assert success() - before == 2  # ldlm_generate's own requests
    assert metric(served, 'ldlm_request_success_total{model="generate"}') - counted == 3  # every generation's
