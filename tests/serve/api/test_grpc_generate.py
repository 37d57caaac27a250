"""``ldlm_generate`` over gRPC's ModelStreamInfer, driven by tritonclient.grpc's stream against the real server:
previews in step order then the result, which is /v1/generate's for the same request; refusals answered in the
stream, which goes on; a client that cancels its stream cancels the generation; a wrong key is UNAUTHENTICATED."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

KEY = "s3cret"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(export_dir: Path):
    grpc_port = free_port()
    settings = ServerSettings(grpc_port=grpc_port, port=free_port(), max_n=8, max_steps=2000, request_timeout_s=300, api_key=KEY)
    running = RunningServer(LDLMService(str(export_dir), settings))
    running.grpc_url = f"127.0.0.1:{grpc_port}"
    yield running
    running.stop()


def scalar(name: str, value: Any) -> Any:
    datatype, dtype = {int: ("INT64", np.int64), float: ("FP32", np.float32), str: ("BYTES", np.object_)}[type(value)]
    tensor = grpcclient.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(np.array([value.encode() if isinstance(value, str) else value], dtype=dtype))
    return tensor


class Stream:
    """One tritonclient.grpc stream; its answers (result or error) in a queue."""

    def __init__(self, served: RunningServer, headers: dict[str, str] | None = AUTH) -> None:
        self.client = grpcclient.InferenceServerClient(served.grpc_url)
        self.answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)), headers=headers)

    def send(self, request_id: str, preview_every: int = 0, **inputs: Any) -> None:
        tensors = [scalar(name, value) for name, value in inputs.items()]
        parameters = {"preview_every": preview_every} if preview_every else None
        self.client.async_stream_infer("ldlm_generate", tensors, request_id=request_id, parameters=parameters)

    def next(self) -> tuple[Any, Any]:
        return self.answers.get(timeout=60)

    def until_final(self) -> list[Any]:
        """The responses of one request, its result last."""
        responses = []
        while True:
            result, error = self.next()
            assert error is None, error
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses


def test_previews_then_the_result_of_v1_generate(served: RunningServer) -> None:
    stream = Stream(served)
    stream.send("r1", preview_every=3, N=3, LENGTH=10, STEPS=9, SEED=5, SAMPLER="ddim")
    *previews, final = stream.until_final()
    stream.client.stop_stream()
    params = [p.get_response().parameters for p in previews]
    assert [p["step"].int64_param for p in params] == [3, 6]  # every 3 steps, in order; the last step is the result
    assert all(p["preview"].bool_param and p["steps"].int64_param == 9 and p["indices"].string_param == "0,1,2" for p in params)
    assert all(len(p.as_numpy("TEXTS")) == 3 for p in previews)
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as http:
        body = http.post("/v1/generate", json={"n": 3, "length": 10, "steps": 9, "seed": 5, "sampler": "ddim"}).json()
    response = final.get_response()
    assert response.id == "r1" and response.model_name == "ldlm_generate"
    assert not response.parameters["preview"].bool_param
    assert [t.decode() for t in final.as_numpy("TEXTS")] == body["texts"]
    token_ids = final.as_numpy("TOKEN_IDS")
    assert token_ids.dtype == np.int64 and token_ids.shape == (3, 10)
    assert [row[: len(ids)].tolist() for row, ids in zip(token_ids, body["token_ids"])] == body["token_ids"]
    assert json.loads(response.parameters["plan"].string_param) == body["plan"]
    assert json.loads(final.as_numpy("PLAN")[0]) == body["plan"]  # the output Triton's model of that name answers


def test_a_prompted_gridded_request_is_v1_generates(served: RunningServer) -> None:
    """PROMPT, GRID and PROMPT_STRENGTH mean what /v1/generate's fields do: LENGTH counts the prompt, which the
    texts and token ids start with verbatim; the plan names the grid."""
    inputs = {"prompt": "It is a truth", "n": 2, "length": 12, "steps": 6, "seed": 3, "grid": "uniform", "prompt_strength": 1.5}
    stream = Stream(served)
    stream.send("p", preview_every=2, **{name.upper(): value for name, value in inputs.items()})
    *previews, final = stream.until_final()
    stream.client.stop_stream()
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as http:
        body = http.post("/v1/generate", json=inputs).json()
    assert [t.decode() for t in final.as_numpy("TEXTS")] == body["texts"]
    assert all(t.startswith("It is a truth") for t in body["texts"])
    assert final.as_numpy("TOKEN_IDS").tolist() == body["token_ids"]
    assert json.loads(final.as_numpy("PLAN")[0]) == body["plan"] and body["plan"]["grid"] == "uniform"
    assert previews and all(t.decode().startswith("It is a truth") for p in previews for t in p.as_numpy("TEXTS"))


def test_refusals_are_answered_in_the_stream_which_goes_on(served: RunningServer) -> None:
    stream = Stream(served)
    refusals = [
        ({"N": 0, "LENGTH": 8}, "N=0 is out of range; allowed: 1..8"),
        ({"N": 1}, "ldlm_generate needs input LENGTH (INT64, shape [1])"),
        ({"N": 1, "LENGTH": 8, "SAMPLER": "nope"}, "sampler='nope' is unknown; allowed:"),
        ({"N": 1, "LENGTH": 8, "T_MIN": 1.5}, "T_MIN=1.5 is out of range; allowed:"),
        ({"N": 1, "LENGTH": 8, "STEPS": 2001}, "STEPS=2001 is out of range; allowed: 1..2000"),
        ({"N": 1, "LENGTH": 3, "PROMPT": "It is a truth universally"}, "allowed: 1..2 tokens (fewer than length=3)"),
        ({"N": 1, "LENGTH": 8, "GRID": "nope"}, "grid='nope'"),
        ({"N": 1, "LENGTH": 8, "PROMPT": "   "}, "is blank"),
    ]
    for i, (inputs, message) in enumerate(refusals):
        stream.send(f"bad{i}", **inputs)
        result, error = stream.next()
        assert result is None and message in error.message(), (inputs, error)
    stream.send("good", N=1, LENGTH=4, STEPS=2)
    assert stream.until_final()[-1].as_numpy("TOKEN_IDS").shape == (1, 4)
    stream.client.stop_stream()


def metric(served: RunningServer, sample: str) -> float:
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as http:
        match = re.search(rf"^{re.escape(sample)} (\S+)$", http.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_cancelled_stream_cancels_its_generation(served: RunningServer) -> None:
    dropped = 'ldlm_cancelled_samples_total{model="generate"}'
    cancelled = 'ldlm_request_cancelled_total{model="generate",reason="disconnect"}'
    before = metric(served, dropped), metric(served, cancelled)
    stream = Stream(served)
    stream.send("long", preview_every=1, N=4, LENGTH=64, STEPS=2000)  # seconds of work on this model
    result, error = stream.next()
    assert error is None and result.get_response().parameters["preview"].bool_param, error  # it runs (not refused as too long)
    stream.client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 30
    while metric(served, "ldlm_generate_in_flight") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(served, "ldlm_generate_in_flight") == 0  # freed long before its 2000 steps
    assert metric(served, dropped) - before[0] == 4 and metric(served, cancelled) - before[1] == 1


def test_a_stream_without_the_key_is_unauthenticated(served: RunningServer) -> None:
    stream = Stream(served, headers={"authorization": "Bearer wrong"})
    with contextlib.suppress(InferenceServerException):  # the stream may be refused before the request is sent
        stream.send("x", N=1, LENGTH=4)
    result, error = stream.next()
    assert result is None and error.status() == "StatusCode.UNAUTHENTICATED" and error.message() == "missing or wrong bearer token"
    stream.client.stop_stream()
