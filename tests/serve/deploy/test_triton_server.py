"""A real Triton Inference Server (nvidia-pytriton's tritonserver 2.51, Python backend) serving the
repository of ``ldlm triton-repo --graph-backend python``, checked with tritonclient over HTTP and
gRPC against independent references: ONNX Runtime run directly on the export's graphs, the ONNX
files' own I/O, and the eager pipeline's tokens. One server for the module (started once, stopped
by its PID in the last test)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest

from ldlm.model.config import SAMPLERS, LDLMConfig
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.deploy.triton_repo import write_triton_repo

pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] (the test extra) talks to the server")
ort = pytest.importorskip("onnxruntime", reason="the graph models run ONNX Runtime, and so does their reference")
import tritonclient.grpc as triton_grpc  # noqa: E402
import tritonclient.http as triton_http  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from ldlm.serve.deploy.triton_env import TritonEnv, TritonUnavailable, prepare_env  # noqa: E402
from ldlm.serve.deploy.triton_server import TritonServer, start_server  # noqa: E402
from tests import REPO  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_env")  # first: where Triton cannot be installed, skip before exporting anything
CACHE = REPO / ".cache" / "triton-env"
GRAPHS = ("encoder", "denoiser", "decoder")
MODELS = ("decoder", "denoiser", "encoder", "ldlm_generate")
MAX_BATCH, MAX_N, MAX_STEPS = 4, 8, 20  # small limits, so N above the BLS batch and the bounds are cheap to reach
# Long enough that 8 requests released together meet in the queue even on a loaded machine, short enough
# for ldlm_generate's BLS calls (a call below the preferred batch size waits this long)
QUEUE_DELAY_US = 100_000
ONNX_TO_KSERVE = {onnx.TensorProto.FLOAT: "FP32", onnx.TensorProto.INT64: "INT64"}
ATOL = 1e-5  # Triton's output against ONNX Runtime's (the reference), elementwise; rtol 0; integers exact


@pytest.fixture(scope="session")  # session, like export_dir, so pytest sets it up (or skips) before the export
def triton_env() -> TritonEnv:
    try:
        return prepare_env(CACHE)
    except TritonUnavailable as error:
        pytest.skip(
            f"nvidia-pytriton's tritonserver could not be installed here, so no real Triton ran (readiness, "
            f"metadata, graph parity, generation, limits, batching, stop were not checked): {error}"
        )


@pytest.fixture(scope="module")
def server(triton_env: TritonEnv, export_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    env = triton_env
    work = tmp_path_factory.mktemp("triton-server")
    repo = write_triton_repo(
        export_dir,
        work / "repo",
        max_batch=MAX_BATCH,
        queue_delay_us=QUEUE_DELAY_US,
        gpu=False,
        max_n=MAX_N,
        max_steps=MAX_STEPS,
        graph_backend="python",
    )
    running = start_server(repo, env, work / "server.log")
    yield running
    running.stop()  # already stopped by test_server_stops_cleanly_by_its_pid unless a test before it failed


@pytest.fixture
def http(server: TritonServer):
    client = triton_http.InferenceServerClient(server.http_url)
    yield client
    client.close()  # an open keep-alive connection would hold Triton's shutdown for its exit timeout


@pytest.fixture
def grpc(server: TritonServer):
    client = triton_grpc.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def graph_io(export_dir: Path, graph: str) -> dict[str, list[tuple[str, str, list[int]]]]:
    """(name, KServe datatype, shape with -1 for symbolic axes) per input and output, read from the ONNX file itself."""
    model = onnx.load(str(export_dir / f"{graph}.onnx"), load_external_data=False)

    def specs(values) -> list[tuple[str, str, list[int]]]:
        return [
            (
                v.name,
                ONNX_TO_KSERVE[v.type.tensor_type.elem_type],
                [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim],
            )
            for v in values
        ]

    return {"inputs": specs(model.graph.input), "outputs": specs(model.graph.output)}


def served_shape(shape: list[int]) -> list[int]:
    """What Triton reports for a batched model: -1 for the batch; a per-sample scalar [B] has dims [1]."""
    return [-1, *shape[1:]] if len(shape) > 1 else [-1, 1]


def graph_inputs(graph: str, config: LDLMConfig, batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
    """Random inputs as Triton takes them (``t`` as [B, 1]); the second sample's last two positions padded."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, length), dtype=np.int64)
    mask[1:, -2:] = 0
    latent = lambda: rng.standard_normal((batch, length, config.d_model)).astype(np.float32)  # noqa: E731
    if graph == "encoder":
        return {"input_ids": rng.integers(0, config.vocab_size, (batch, length)).astype(np.int64), "attention_mask": mask}
    if graph == "denoiser":
        return {"x_t": latent(), "t": rng.uniform(0.05, 1.0, (batch, 1)).astype(np.float32), "x0_prev": latent(), "attention_mask": mask}
    return {"latents": latent(), "attention_mask": mask}


def reference(export_dir: Path, graph: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX Runtime on the export's own file (not the repository's copy), ``t`` as the graph's [B]."""
    session = ort.InferenceSession(str(export_dir / f"{graph}.onnx"), providers=["CPUExecutionProvider"])
    feed = {name: value.reshape(-1) if name == "t" else value for name, value in inputs.items()}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))


def assert_matches(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
    if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=what)


def http_request(inputs: dict[str, np.ndarray], outputs: list[str], binary: bool = True) -> tuple[list, list]:
    """tritonclient's (inputs, requested outputs) for named arrays, as JSON or binary tensors."""
    tensors = []
    for name, value in inputs.items():
        datatype = "BYTES" if value.dtype == np.object_ else {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}[value.dtype]
        tensor = triton_http.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value, binary_data=binary)
        tensors.append(tensor)
    return tensors, [triton_http.InferRequestedOutput(n, binary_data=binary) for n in outputs]


def http_infer(client, model: str, inputs: dict[str, np.ndarray], outputs: list[str], binary: bool = True) -> dict[str, np.ndarray]:
    tensors, requested = http_request(inputs, outputs, binary)
    result = client.infer(model, tensors, outputs=requested)
    return {name: result.as_numpy(name) for name in outputs}


def generate_inputs(**values: object) -> dict[str, np.ndarray]:
    return {
        name: np.array([value.encode()], dtype=np.object_)
        if isinstance(value, str)
        else np.array([value], dtype=np.float32 if isinstance(value, float) else np.int64)
        for name, value in values.items()
    }


def test_every_model_is_ready_over_http_and_grpc(server: TritonServer, http, grpc) -> None:
    assert http.is_server_live() and http.is_server_ready() and grpc.is_server_live() and grpc.is_server_ready()
    for model in MODELS:
        assert http.is_model_ready(model) and grpc.is_model_ready(model), model
    index = http.get_model_repository_index()
    assert sorted((m["name"], m["state"]) for m in index) == [(m, "READY") for m in MODELS]


def test_metadata_and_config_report_the_graphs_shapes_and_datatypes(export_dir: Path, http, grpc) -> None:
    for graph in GRAPHS:
        io = graph_io(export_dir, graph)
        want = {section: [{"name": n, "datatype": d, "shape": served_shape(s)} for n, d, s in specs] for section, specs in io.items()}
        over_http = http.get_model_metadata(graph)
        over_grpc = grpc.get_model_metadata(graph, as_json=True)
        for metadata in (over_http, over_grpc):
            for section in ("inputs", "outputs"):
                got = [{"name": t["name"], "datatype": t["datatype"], "shape": [int(d) for d in t["shape"]]} for t in metadata[section]]
                assert got == want[section], (graph, section)
        for config in (http.get_model_config(graph), grpc.get_model_config(graph, as_json=True)["config"]):
            assert config["backend"] == "python" and int(config["max_batch_size"]) == MAX_BATCH
            assert [int(b) for b in config["dynamic_batching"]["preferred_batch_size"]] == [MAX_BATCH]
            assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == QUEUE_DELAY_US
            assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]] == [
                (n, "TYPE_" + d, served_shape(s)[1:]) for n, d, s in io["inputs"]
            ]
            assert len(config["model_warmup"]) == 1
    generate = http.get_model_metadata("ldlm_generate")
    assert [(t["name"], t["datatype"], t["shape"]) for t in generate["inputs"]] == [
        ("N", "INT64", [1]),
        ("LENGTH", "INT64", [1]),
        ("STEPS", "INT64", [1]),
        ("SEED", "INT64", [1]),
        ("SAMPLER", "BYTES", [1]),
        ("T_MIN", "FP32", [1]),
        ("PRIOR_TEMPERATURE", "FP32", [1]),
        ("GRID", "BYTES", [1]),
        ("PROMPT", "BYTES", [1]),
        ("PROMPT_STRENGTH", "FP32", [1]),
    ]
    assert [(t["name"], t["datatype"], t["shape"]) for t in generate["outputs"]] == [
        ("TEXTS", "BYTES", [-1]),
        ("TOKEN_IDS", "INT64", [-1, -1]),
        ("PLAN", "BYTES", [1]),
    ]


@pytest.mark.parametrize("route", ["http-json", "http-binary", "grpc"])
@pytest.mark.parametrize("graph", GRAPHS)
def test_graph_outputs_equal_onnx_runtime_run_directly(
    export_dir: Path, pipeline: LDLMPipeline, http, grpc, graph: str, route: str
) -> None:
    inputs = graph_inputs(graph, pipeline.config, 2, 11, seed=GRAPHS.index(graph))
    outputs = [name for name, _, _ in graph_io(export_dir, graph)["outputs"]]
    if route == "grpc":
        tensors = []
        for name, value in inputs.items():
            tensor = triton_grpc.InferInput(name, list(value.shape), "FP32" if value.dtype == np.float32 else "INT64")
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        result = grpc.infer(graph, tensors, outputs=[triton_grpc.InferRequestedOutput(n) for n in outputs])
        got = {name: result.as_numpy(name) for name in outputs}
    else:
        got = http_infer(http, graph, inputs, outputs, binary=route == "http-binary")
    want = reference(export_dir, graph, inputs)
    for name in outputs:
        assert_matches(got[name], want[name], f"{graph}.{name} over {route}")


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_generate_gives_the_eager_pipelines_tokens(pipeline: LDLMPipeline, http, sampler: str) -> None:
    """N=6 runs in BLS calls of MAX_BATCH=4 and 2 samples; every sampler the package knows."""
    n, length, steps, seed = 6, 12, 4, 3
    assert n > MAX_BATCH
    got = http_infer(
        http, "ldlm_generate", generate_inputs(N=n, LENGTH=length, STEPS=steps, SEED=seed, SAMPLER=sampler), ["TOKEN_IDS", "TEXTS"]
    )
    expected = pipeline.generate(n, length, steps, seed, sampler)
    np.testing.assert_array_equal(got["TOKEN_IDS"], expected.token_ids.numpy())
    assert [t.decode() for t in got["TEXTS"]] == expected.texts


def test_out_of_range_requests_get_tritons_error_and_the_server_stays_up(server: TritonServer, pipeline: LDLMPipeline, http, grpc) -> None:
    max_len = pipeline.config.max_seq_len
    good = dict(N=1, LENGTH=8, STEPS=2, SEED=0, SAMPLER=SAMPLERS[0])
    cases = [
        ({"N": MAX_N + 1}, f"N={MAX_N + 1} is out of range; allowed: 1..{MAX_N}"),
        ({"N": 0}, f"N=0 is out of range; allowed: 1..{MAX_N}"),
        ({"LENGTH": max_len + 1}, f"LENGTH={max_len + 1} is out of range; allowed: 1..{max_len}"),
        ({"STEPS": MAX_STEPS + 1}, f"STEPS={MAX_STEPS + 1} is out of range; allowed: 1..{MAX_STEPS}"),
        ({"SAMPLER": "leapfrog"}, f"SAMPLER='leapfrog' is unknown; allowed: {', '.join(SAMPLERS)}"),
    ]
    for change, message in cases:
        with pytest.raises(InferenceServerException, match=message.replace(".", r"\.")):
            http_infer(http, "ldlm_generate", generate_inputs(**{**good, **change}), ["TOKEN_IDS"])
    too_big = graph_inputs("decoder", pipeline.config, MAX_BATCH + 1, 6, seed=0)  # Triton's own batch limit
    with pytest.raises(InferenceServerException, match=f"batch-size must be <= {MAX_BATCH} for 'decoder'"):
        http_infer(http, "decoder", too_big, ["token_ids"])
    assert server.process.poll() is None and http.is_server_live() and grpc.is_server_ready()
    tokens = http_infer(http, "ldlm_generate", generate_inputs(**good), ["TOKEN_IDS"])["TOKEN_IDS"]
    np.testing.assert_array_equal(tokens, pipeline.generate(1, 8, 2, 0, SAMPLERS[0]).token_ids.numpy())


def test_dynamic_batching_merges_concurrent_requests(server: TritonServer, export_dir: Path, pipeline: LDLMPipeline, http) -> None:
    """8 batch-1 denoiser requests released together: the statistics extension shows fewer executions
    than requests, and each answer is still ONNX Runtime's answer to that request alone."""
    requests = [graph_inputs("denoiser", pipeline.config, 1, 9, seed=100 + i) for i in range(8)]
    before = http.get_inference_statistics("denoiser")["model_stats"][0]
    answers: list[np.ndarray | BaseException | None] = [None] * len(requests)
    clients = [triton_http.InferenceServerClient(server.http_url) for _ in requests]
    bodies = [http_request(r, ["x0_hat"]) for r in requests]  # built before the release, so the sends bunch up
    barrier = threading.Barrier(len(requests))

    def send(i: int) -> None:
        try:
            clients[i].is_server_live()  # connected before the release too
            barrier.wait(30)
            answers[i] = clients[i].infer("denoiser", bodies[i][0], outputs=bodies[i][1]).as_numpy("x0_hat")
        except BaseException as error:  # noqa: BLE001 (reported below, per request)
            answers[i] = error

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for client in clients:
        client.close()
    after = http.get_inference_statistics("denoiser")["model_stats"][0]
    for i, answer in enumerate(answers):
        assert isinstance(answer, np.ndarray), f"request {i}: {answer!r}"
        assert_matches(answer, reference(export_dir, "denoiser", requests[i])["x0_hat"], f"merged request {i}")
    requests_done = int(after["inference_stats"]["success"]["count"]) - int(before["inference_stats"]["success"]["count"])
    inferences = int(after["inference_count"]) - int(before["inference_count"])
    executions = int(after["execution_count"]) - int(before["execution_count"])
    assert requests_done == inferences == len(requests)
    assert 1 <= executions < len(requests), f"{executions} executions for {len(requests)} requests: nothing was merged"


def test_server_stops_cleanly_by_its_pid(server: TritonServer) -> None:
    pid = server.pid
    assert server.stop(timeout_s=60) == 0, server.log_tail()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone (and reaped)
    assert "successfully unloaded 'ldlm_generate' version 1" in server.log_path.read_text()


def test_an_int8_repository_serves_the_exports_int8_variants(triton_env: TritonEnv, int8_export_dir: Path, tmp_path: Path) -> None:
    """A second server, on `ldlm triton-repo --precision int8`: its configs name each model's precision,
    its denoiser answers as ONNX Runtime runs the INT8 variant (and not as the fp32 graph does), and
    ldlm_generate gives the tokens of the project's own int8 runner."""
    from ldlm.serve.runtime.backends import BackendGraphs, open_graphs

    repo = write_triton_repo(
        int8_export_dir,
        tmp_path / "repo",
        max_batch=MAX_BATCH,
        gpu=False,
        max_n=MAX_N,
        max_steps=MAX_STEPS,
        graph_backend="python",
        precision="int8",
    )
    running = start_server(repo, triton_env, tmp_path / "server.log")
    client = triton_http.InferenceServerClient(running.http_url)
    try:
        assert {g: client.get_model_config(g)["parameters"]["precision"]["string_value"] for g in GRAPHS} == {
            "encoder": "fp32",
            "denoiser": "int8",
            "decoder": "int8",
        }
        backends, config, tokenizer = open_graphs("ort", int8_export_dir, "int8")
        inputs = graph_inputs("denoiser", config, 2, 11, seed=5)
        got = http_infer(client, "denoiser", inputs, ["x0_hat"])["x0_hat"]
        feed = {name: value.reshape(-1) if name == "t" else value for name, value in inputs.items()}
        variant = ort.InferenceSession(str(int8_export_dir / "denoiser.int8.onnx"), providers=["CPUExecutionProvider"])
        assert_matches(got, variant.run(["x0_hat"], feed)[0], "int8 denoiser")
        assert np.abs(got - reference(int8_export_dir, "denoiser", inputs)["x0_hat"]).max() > 1e-4  # not the fp32 graph
        tokens = http_infer(client, "ldlm_generate", generate_inputs(N=3, LENGTH=12, STEPS=4, SEED=3, SAMPLER="ddim"), ["TOKEN_IDS"])
        expected = LDLMPipeline(BackendGraphs(backends), tokenizer, config=config).generate(3, 12, 4, 3, "ddim").token_ids
        np.testing.assert_array_equal(tokens["TOKEN_IDS"], expected.numpy())
    finally:
        client.close()
        running.stop()
