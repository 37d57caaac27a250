"""The same tritonclient calls, over HTTP and gRPC, against ``ldlm serve`` and against the real tritonserver
serving ``ldlm triton-repo``'s repository of the same export, and what each server says compared: health,
metadata, config, statistics and repository index; the graphs' outputs (each within ATOL of the other's);
``ldlm_generate``'s tokens, texts and plan against /v1/generate's at the same seed, prompt and grid; and the
error codes for the same bad requests. Where the two differ by design, the difference is asserted and said why.
One tritonserver for the module (started once)."""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ldlm.serve.deploy.triton_repo import write_triton_repo

pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] (the test extra) talks to both servers")
pytest.importorskip("onnxruntime", reason="both servers run the graphs on ONNX Runtime")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
import tritonclient.grpc as triton_grpc  # noqa: E402
import tritonclient.http as triton_http  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.deploy.triton_env import TritonEnv  # noqa: E402
from ldlm.serve.deploy.triton_server import start_server  # noqa: E402
from tests.serve.deploy import test_triton_server as one_server  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

ATOL, GRAPHS, graph_inputs = one_server.ATOL, one_server.GRAPHS, one_server.graph_inputs  # its tolerance, graphs and inputs
triton_env = one_server.triton_env  # its fixture: the environment prepared once (or the skip that says why not)

# first: where Triton cannot be installed, skip before exporting anything; slow: it starts tritonserver
pytestmark = [pytest.mark.usefixtures("triton_env"), pytest.mark.slow]
MAX_BATCH, MAX_N, MAX_STEPS = 4, 8, 20  # the same limits on both servers
MODULES = {"http": triton_http, "grpc": triton_grpc}


class Servers:
    """Both servers' addresses, and a client of either kind for either."""

    def __init__(self, triton: Any, serve: RunningServer) -> None:
        self.urls = {
            ("triton", "http"): triton.http_url,
            ("triton", "grpc"): triton.grpc_url,
            ("serve", "http"): serve.url.removeprefix("http://"),
            ("serve", "grpc"): serve.grpc_url,
        }
        self.serve_url = serve.url

    def client(self, server: str, kind: str) -> Any:
        return MODULES[kind].InferenceServerClient(self.urls[(server, kind)])


@pytest.fixture(scope="module")
def servers(triton_env: TritonEnv, export_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("triton-clients")
    repo = write_triton_repo(
        export_dir, work / "repo", max_batch=MAX_BATCH, gpu=False, max_n=MAX_N, max_steps=MAX_STEPS, graph_backend="python"
    )
    triton = start_server(repo, triton_env, work / "server.log")
    grpc_port = free_port()
    settings = ServerSettings(
        grpc_port=grpc_port, port=free_port(), max_batch=MAX_BATCH, max_n=MAX_N, max_steps=MAX_STEPS, max_request_samples=MAX_BATCH
    )
    serve = RunningServer(LDLMService(str(export_dir), settings))
    serve.grpc_url = f"127.0.0.1:{grpc_port}"
    yield Servers(triton, serve)
    serve.stop()
    triton.stop()


@pytest.fixture
def clients(servers: Servers):
    """{(server, kind): client} for the four pairs, closed after the test (an open keep-alive holds Triton's stop)."""
    made = {(server, kind): servers.client(server, kind) for server in ("triton", "serve") for kind in MODULES}
    yield made
    for client in made.values():
        client.close()


def metadata(client: Any, model: str) -> dict[str, Any]:
    answer = client.get_model_metadata(model) if isinstance(client, triton_http.InferenceServerClient) else None
    return answer if answer is not None else client.get_model_metadata(model, as_json=True)


def io_of(answer: dict[str, Any]) -> dict[str, list[tuple[str, str, list[int]]]]:
    return {s: [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in answer[s]] for s in ("inputs", "outputs")}


def config_of(client: Any, model: str) -> dict[str, Any]:
    if isinstance(client, triton_http.InferenceServerClient):
        return client.get_model_config(model)
    return client.get_model_config(model, as_json=True)["config"]


def test_health_metadata_config_statistics_and_index_agree(clients) -> None:
    for (server, kind), client in clients.items():
        where = f"{server} over {kind}"
        assert client.is_server_live() and client.is_server_ready(), where
        assert all(client.is_model_ready(graph) for graph in GRAPHS), where
        assert {"statistics", "model_repository"} <= set(as_json(client.get_server_metadata(), client)["extensions"]), where
        index = as_json(client.get_model_repository_index(), client)
        names = {m["name"] for m in (index if isinstance(index, list) else index["models"])}
        assert names == {*GRAPHS, "ldlm_generate"} and client.is_model_ready("ldlm_generate"), where
        stats = as_json(client.get_inference_statistics("denoiser"), client)["model_stats"]
        assert [s["name"] for s in stats] == ["denoiser"], where
    for kind in MODULES:
        for graph in GRAPHS:
            triton, serve = (io_of(metadata(clients[(s, kind)], graph)) for s in ("triton", "serve"))
            # The one difference: a per-sample scalar (the denoiser's t, graph shape [batch]). Triton's metadata
            # shows its config dims [1] ([-1, 1] with the batch); ldlm serve's the graph's own shape ([-1]).
            # Both configs say the same (dims [1] reshaped to []), asserted below.
            scalar = [(n, d, [-1, 1]) for n, d, s in serve["inputs"] if s == [-1]]
            assert triton["inputs"] == [(n, d, [-1, 1]) if s == [-1] else (n, d, s) for n, d, s in serve["inputs"]], (graph, kind)
            assert triton["outputs"] == serve["outputs"], (graph, kind)
            assert bool(scalar) == (graph == "denoiser")
            t_conf, s_conf = (config_of(clients[(s, kind)], graph) for s in ("triton", "serve"))
            assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]], "reshape" in t) for t in t_conf["input"]] == [
                (t["name"], t["data_type"], [int(d) for d in t["dims"]], "reshape" in t) for t in s_conf["input"]
            ], (graph, kind)
            assert int(t_conf["max_batch_size"]) == int(s_conf["max_batch_size"]) == MAX_BATCH
        triton, serve = (io_of(metadata(clients[(s, kind)], "ldlm_generate")) for s in ("triton", "serve"))
        assert triton == serve, kind  # ldlm_generate's inputs and outputs: names, datatypes, shapes
        t_conf, s_conf = (config_of(clients[(s, kind)], "ldlm_generate") for s in ("triton", "serve"))
        described = [
            [(t["name"], t["data_type"], [int(d) for d in t["dims"]], bool(t.get("optional"))) for t in conf[section]]
            for conf in (t_conf, s_conf)
            for section in ("input", "output")
        ]
        assert described[:2] == described[2:] and int(t_conf.get("max_batch_size", 0)) == int(s_conf.get("max_batch_size", 0)) == 0, kind


def as_json(answer: Any, client: Any) -> Any:
    """A gRPC client's protobuf answer as the HTTP client's JSON (an HTTP answer as it is)."""
    if isinstance(client, triton_http.InferenceServerClient):
        return answer
    from google.protobuf import json_format  # tritonclient.grpc's dependency

    return json_format.MessageToDict(answer, preserving_proto_field_name=True)


def infer_inputs(module: Any, named: dict[str, np.ndarray]) -> list[Any]:
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.object_): "BYTES"}
    inputs = []
    for name, array in named.items():
        tensor = module.InferInput(name, list(array.shape), datatypes[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def for_server(server: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each server's form of a per-sample scalar: Triton's [B, 1] (its config dims), ldlm serve's graph shape [B]."""
    return {n: v.reshape(-1) if n == "t" and server == "serve" else v for n, v in inputs.items()}


@pytest.mark.parametrize("graph", GRAPHS)
def test_infer_and_async_infer_answer_alike(clients, pipeline, graph: str) -> None:
    inputs = graph_inputs(graph, pipeline.config, 2, 11, seed=7)
    answers = {}
    for (server, kind), client in clients.items():
        module, feed = MODULES[kind], for_server(server, inputs)
        answers[(server, kind, "infer")] = client.infer(graph, infer_inputs(module, feed))
        if kind == "http":
            answers[(server, kind, "async")] = client.async_infer(graph, infer_inputs(module, feed)).get_result()
        else:
            answers[(server, kind, "async")] = grpc_async_infer(client, graph, infer_inputs(module, feed))
    output = {"encoder": "latents", "denoiser": "x0_hat", "decoder": "token_ids"}[graph]
    want = answers[("serve", "http", "infer")].as_numpy(output)
    for where, result in answers.items():
        got = result.as_numpy(output)
        assert got.dtype == want.dtype and got.shape == want.shape, where
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=str(where))


def grpc_async_infer(client: Any, model: str, inputs: list[Any]) -> Any:
    """tritonclient.grpc's async_infer, its result waited for (its callback gets it)."""
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.async_infer(model, inputs, callback=lambda result, error: done.put((result, error)))
    result, error = done.get(timeout=60)
    assert error is None, error
    return result


def generate_tensors(module: Any, **values: object) -> list[Any]:
    named = {
        name: np.array([value.encode()], dtype=np.object_)
        if isinstance(value, str)
        else np.array([value], dtype=np.float32 if isinstance(value, float) else np.int64)
        for name, value in values.items()
    }
    return infer_inputs(module, named)


def v1_generate(servers: Servers, **body: object) -> httpx.Response:
    with httpx.Client(base_url=servers.serve_url, timeout=120) as http:
        return http.post("/v1/generate", json=body)


def triton_generate(client: Any, module: Any, **values: object) -> dict[str, Any]:
    result = client.infer("ldlm_generate", generate_tensors(module, **values))
    return {
        "texts": [t.decode() for t in result.as_numpy("TEXTS")],
        "token_ids": result.as_numpy("TOKEN_IDS").tolist(),
        "plan": json.loads(result.as_numpy("PLAN")[0]),
    }


# (Triton's inputs, /v1/generate's body): the same request; t_min and prompt_strength are exact in FP32
REQUESTS = [
    ({"N": 6, "LENGTH": 12, "STEPS": 4, "SEED": 3, "SAMPLER": "ddim"}, {"n": 6, "length": 12, "steps": 4, "seed": 3, "sampler": "ddim"}),
    ({"N": 2, "LENGTH": 10, "STEPS": 3}, {"n": 2, "length": 10, "steps": 3}),  # no seed: seed 0 on both
    (
        {"N": 3, "LENGTH": 12, "STEPS": 5, "SEED": 9, "SAMPLER": "dpm2m", "GRID": "power", "T_MIN": 0.0625, "PROMPT": " The cat sat"},
        {"n": 3, "length": 12, "steps": 5, "seed": 9, "sampler": "dpm2m", "grid": "power", "t_min": 0.0625, "prompt": " The cat sat"},
    ),
    (
        {"N": 2, "LENGTH": 9, "STEPS": 4, "SEED": 1, "PROMPT": " Once upon", "PROMPT_STRENGTH": 2.5, "PRIOR_TEMPERATURE": 0.75},
        {"n": 2, "length": 9, "steps": 4, "seed": 1, "prompt": " Once upon", "prompt_strength": 2.5, "prior_temperature": 0.75},
    ),
]


@pytest.mark.parametrize("request_pair", REQUESTS, ids=["n6-ddim", "no-seed", "prompt-grid", "prompt-strength"])
def test_ldlm_generate_answers_as_v1_generate(servers: Servers, clients, request_pair) -> None:
    """ldlm_generate over HTTP, gRPC and gRPC's stream, Triton's and ldlm serve's: /v1/generate's tokens, texts and plan."""
    inputs, body = request_pair
    response = v1_generate(servers, **body)
    assert response.status_code == 200, response.text
    want = response.json()
    for server in ("triton", "serve"):
        for kind in MODULES:
            assert triton_generate(clients[(server, kind)], MODULES[kind], **inputs) == want, (server, kind)
    if "PROMPT" in inputs:
        assert all(text.startswith(body["prompt"]) for text in want["texts"])  # the prompt verbatim, its tokens counted
    streamed = stream_answers(clients[("triton", "grpc")], inputs)
    assert len(streamed) == 1 and streamed[0][1] is None, streamed  # Triton's model is not decoupled: one response, no previews
    result = streamed[0][0]
    assert [t.decode() for t in result.as_numpy("TEXTS")] == want["texts"]
    assert json.loads(result.as_numpy("PLAN")[0]) == want["plan"]
    (served, error), *_ = stream_answers(clients[("serve", "grpc")], inputs)[-1:]  # its previews (none asked) then its result
    assert error is None, error
    assert [t.decode() for t in served.as_numpy("TEXTS")] == want["texts"]
    assert served.as_numpy("TOKEN_IDS").tolist() == want["token_ids"]
    assert json.loads(served.as_numpy("PLAN")[0]) == want["plan"]  # the output Triton's model answers, on both


def stream_answers(client: Any, inputs: dict[str, object]) -> list[tuple[Any, Any]]:
    """(result, error) for each response to one request on a gRPC stream, up to its final one (or its error)."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("ldlm_generate", generate_tensors(triton_grpc, **inputs), request_id="r1")
        got = [answers.get(timeout=120)]
        while got[-1][1] is None and not got[-1][0].get_response().parameters["triton_final_response"].bool_param:
            got.append(answers.get(timeout=120))
        return got
    finally:
        client.stop_stream()


def status(error: InferenceServerException) -> str:
    """An error's status as both clients report it: HTTP's code ("400") or gRPC's ("StatusCode.INVALID_ARGUMENT")."""
    return str(error.status())


def refused(call: Any, *args: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call(*args)
    return caught.value


def test_the_same_bad_requests_get_the_same_codes(clients, pipeline) -> None:
    encoder = graph_inputs("encoder", pipeline.config, 1, 5, seed=0)
    bad = {
        "wrong dtype": {**encoder, "input_ids": encoder["input_ids"].astype(np.float32)},
        "wrong shape": {**encoder, "attention_mask": encoder["attention_mask"].reshape(1, 1, 5)},
    }
    want = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
    for (server, kind), client in clients.items():
        module = MODULES[kind]
        for case, feed in bad.items():
            assert status(refused(client.infer, "encoder", infer_inputs(module, feed))) == want[kind], (server, kind, case)
        unknown = refused(client.infer, "nonesuch", infer_inputs(module, encoder))
        assert status(unknown) == {"http": "404", "grpc": "StatusCode.NOT_FOUND"}[kind], (server, kind, "unknown model")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"N": 0}, f"N=0 is out of range; allowed: 1..{MAX_N}"),
        ({"STEPS": MAX_STEPS + 1}, f"STEPS={MAX_STEPS + 1} is out of range; allowed: 1..{MAX_STEPS}"),
        ({"GRID": "tuned"}, "grid='tuned' is unavailable: this checkpoint has no tuned schedules (run `ldlm tune-schedule`)"),
        ({"PROMPT": " one two three four five six"}, "the prompt is 6 tokens long; allowed: 1..4 tokens (fewer than length=5)"),
    ],
    ids=["n0", "steps", "grid", "prompt"],
)
def test_ldlm_generate_refusals_are_400_with_v1_generates_words(servers: Servers, clients, change, message) -> None:
    inputs = {"N": 1, "LENGTH": 5, "STEPS": 2, **change}
    for server in ("triton", "serve"):
        for kind, code in (("http", "400"), ("grpc", "StatusCode.INVALID_ARGUMENT")):
            error = refused(clients[(server, kind)].infer, "ldlm_generate", generate_tensors(MODULES[kind], **inputs))
            assert status(error) == code and message in error.message(), (server, kind, error)
    answer = v1_generate(servers, **{name.lower(): value for name, value in inputs.items()})
    if "N" in change or "STEPS" in change:
        # /v1/generate's body validation answers a field out of range 422 and names it as the body does ("n: 0");
        # the range is the same
        assert answer.status_code == 422 and message.split("is out of range")[1] in answer.json()["error"]
    else:
        assert answer.status_code == 400 and answer.json()["error"] == message
    assert clients[("triton", "http")].is_server_live()
