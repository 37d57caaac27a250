"""The service as a Ray Serve application on a real local Ray cluster: 2 replicas with 1 intra-op
thread each, tritonclient and /v1/generate traffic checked against the eager model and pipeline,
one replica's actor killed during load (Ray replaces it; clients retry, and nothing is lost), and a
clean shutdown that leaves no process behind.

What Ray's proxy answers when a replica dies with requests in flight (Ray 2.60): a bare
``500 Internal Server Error`` in text/plain, from the proxy's uvicorn; an ldlm replica's own errors
are always JSON ``{"error": ...}``. Every ldlm endpoint is a pure function of the request (seeded
generation included), so those requests are safe to retry, and the clients here do, counting each
retry by cause. A request Ray re-routes while the replica that held it dies can also reach a new
replica without its body; the replica answers 408 once ``body_timeout_s`` has passed, and HTTP lets
a client repeat a request after a 408, so the clients retry that too (seen once in about 10 runs).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray Serve is the optional extra (pip install -e .[ray])")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra (pip install -e .[ray])")
pytest.importorskip("onnxruntime", reason="the replicas run the graphs on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
triton = pytest.importorskip("tritonclient.http", reason="the Triton client under test (pip install -e .[test])")

from tritonclient.utils import InferenceServerException  # noqa: E402

from ldlm.model.ldlm import LDLM  # noqa: E402
from ldlm.pipeline import LDLMPipeline  # noqa: E402
from ldlm.serve.api.service import ServerSettings  # noqa: E402
from ldlm.serve.deploy.ray_app import (  # noqa: E402
    APP_NAME,
    DEPLOYMENT_NAME,
    RayOptions,
    app_builder,
    build_app,
    parse_autoscale,
    patient_proxy,
)
from tests.servers import free_port  # noqa: E402

REPLICAS, REPLICA_CPUS = 2, 0.5
GENERATE = {"n": 1, "length": 16, "steps": 50, "sampler": "ddim"}
SEEDS = (0, 1, 2, 3)


def descendants(root: int) -> set[int]:
    """Every process below ``root`` (Ray's GCS, raylet, workers, replicas, proxy), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def replica_names() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::"))


def replica_states() -> dict[str, int]:
    return dict(serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states)


def kill_a_busy_replica(names: list[str], deadline: float) -> tuple[str, int]:
    """Kill a replica with requests in flight; its name and how many (Ray's own count, as its routers
    probe it), so that the kill lands on accepted requests: Ray retries those that no replica accepted
    yet. The handles are looked up first, so that nothing but the probe's answer stands between the
    count and the kill (a lookup there gave the requests time to finish on a loaded machine)."""
    handles = {name: ray.get_actor(name, namespace="serve") for name in names}
    while time.monotonic() < deadline:
        for name, handle in handles.items():
            ongoing = ray.get(handle.get_num_ongoing_requests.remote(), timeout=60)
            if ongoing >= 2:
                ray.kill(handle, no_restart=True)
                return name, ongoing
        time.sleep(0.01)
    raise AssertionError("no replica had 2 requests in flight")


def from_ray_proxy(status: int, body: str) -> bool:
    """A 500 that no ldlm replica wrote: the proxy's answer for a request whose replica died."""
    if status != 500:
        return False
    try:
        return "error" not in json.loads(body)
    except ValueError:
        return True


class Clients:
    """Retrying clients: on 503 (after Retry-After, capped at 1 s), on 408 (a body lost in a re-route),
    on the proxy's 500 for a dead replica and on connection errors; any other answer is final.
    Counts retries by cause."""

    def __init__(self) -> None:
        self.retries: Counter[str] = Counter()
        self.events: list[str] = []  # what each retry saw, for the report
        self.answered = 0
        self._lock = threading.Lock()

    def _retry(self, cause: str, detail: str, wait_s: float = 0.05) -> None:
        with self._lock:
            self.retries[cause] += 1
            self.events.append(f"{cause}: {detail[:200]}")
        time.sleep(wait_s)

    def _done(self) -> None:
        with self._lock:
            self.answered += 1

    def generate(self, http: Any, seed: int) -> list[list[int]]:
        for _ in range(50):
            try:
                response = http.post("/v1/generate", json={**GENERATE, "seed": seed})
            except httpx.TransportError as error:
                self._retry("connection", f"/v1/generate {type(error).__name__}: {error}")
                continue
            if response.status_code == 503:
                self._retry("503", f"/v1/generate {response.text}", min(float(response.headers.get("retry-after", 1)), 1.0))
            elif response.status_code == 408:
                self._retry("408", f"/v1/generate {response.text}")
            elif from_ray_proxy(response.status_code, response.text):
                self._retry("proxy_500", f"/v1/generate {response.text}")
            else:
                assert response.status_code == 200, response.text
                self._done()
                return response.json()["token_ids"]
        raise AssertionError(f"/v1/generate seed={seed} not answered after 50 tries")

    def encode(self, client: Any, ids: np.ndarray) -> np.ndarray:
        inputs = int_inputs(ids)
        for _ in range(50):
            try:
                latents = client.infer("encoder", inputs).as_numpy("latents")
            except InferenceServerException as error:
                if error.status() == "503":
                    self._retry("503", f"encoder {error.message()}", 0.5)
                    continue
                if error.status() == "408":
                    self._retry("408", f"encoder {error.message()}")
                    continue
                if from_ray_proxy(int(error.status() or 0), error.debug_details() or ""):
                    self._retry("proxy_500", f"encoder {error.debug_details()}")
                    continue
                raise
            except OSError as error:  # tritonclient's transport (geventhttpclient) raises socket errors as they are
                self._retry("connection", f"encoder {type(error).__name__}: {error}")
                continue
            self._done()
            return latents
        raise AssertionError("encoder infer not answered after 50 tries")


OTHERS_BEFORE_RAY: set[int] = set()


@pytest.fixture(scope="module")
def cluster(export_dir: Path):
    """A fresh local Ray cluster (2 logical CPUs, as CI has) serving 2 replicas of 0.5 CPU each."""
    if ray.is_initialized():
        pytest.skip("a Ray cluster is already connected in this process; this test starts its own")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # CI has no network to report to
    # Processes other tests left below this one (multiprocessing's resource tracker, say) are not Ray's.
    OTHERS_BEFORE_RAY.update(descendants(os.getpid()))
    patient_proxy()  # the proxy may take longer than Serve's 5 s to start beside other work
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=128 << 20)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = ServerSettings(threads=1, max_batch=8, request_timeout_s=60, max_n=8, max_steps=100)
    serve.run(build_app(str(export_dir), settings, RayOptions(replicas=REPLICAS, num_cpus=REPLICA_CPUS)), name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    if ray.is_initialized():  # a test failed before the shutdown test ran
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def expected(pipeline: LDLMPipeline) -> dict[int, list[list[int]]]:
    """/v1/generate's answers, from the eager pipeline run separately (no Ray, no ONNX)."""
    return {
        seed: pipeline.generate(GENERATE["n"], GENERATE["length"], GENERATE["steps"], seed, "ddim").token_ids.tolist() for seed in SEEDS
    }


def encoder_ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50257, (1, 8 + seed)).astype(np.int64)


def int_inputs(ids: np.ndarray) -> list[Any]:
    """tritonclient inputs (binary tensors) for the encoder: ids and an all-ones mask."""
    inputs = [triton.InferInput("input_ids", list(ids.shape), "INT64"), triton.InferInput("attention_mask", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(np.ones_like(ids))
    return inputs


def eager_latents(model: LDLM, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.encode_latents(torch.from_numpy(ids), torch.ones(ids.shape, dtype=torch.bool)).numpy()


def test_two_replicas_each_hold_their_cpu_share(cluster: str) -> None:
    assert replica_states() == {"RUNNING": REPLICAS}
    assert len(replica_names()) == REPLICAS
    # Ray's own accounting: each replica reserved num_cpus=0.5 of the cluster's 2 CPUs.
    assert ray.available_resources().get("CPU", 0.0) == pytest.approx(2 - REPLICAS * REPLICA_CPUS)


def test_answers_equal_the_single_process_references(
    cluster: str, tiny_model: LDLM, pipeline: LDLMPipeline, expected: dict[int, list[list[int]]]
) -> None:
    client = triton.InferenceServerClient(cluster.removeprefix("http://"))
    try:
        assert client.is_server_ready() and client.is_model_ready("denoiser")
        assert [i["name"] for i in client.get_model_metadata("denoiser")["inputs"]] == ["x_t", "t", "x0_prev", "attention_mask"]
        for seed in range(3):
            ids = encoder_ids(seed)
            latents = client.infer("encoder", int_inputs(ids)).as_numpy("latents")
            assert np.abs(latents - eager_latents(tiny_model, ids)).max() < 1e-5
    finally:
        client.close()
    with httpx.Client(base_url=cluster, timeout=60) as http:
        for seed in SEEDS:
            response = http.post("/v1/generate", json={**GENERATE, "seed": seed}, headers={"X-Request-ID": f"r{seed}"})
            assert response.status_code == 200, response.text
            assert response.json()["token_ids"] == expected[seed]
            assert response.headers.get_list("x-request-id") == [f"r{seed}"]  # once, as from `ldlm serve`
        texts = ["Hello there.", "A longer sentence about latent diffusion."]
        assert http.post("/v1/reconstruct", json={"texts": texts}).json()["texts"] == pipeline.reconstruct(texts).texts
        bad = http.post("/v1/generate", json={"n": 100, "length": 8, "steps": 2})  # the replica's own error shape
        assert bad.status_code == 422 and "n: 100 is out of range" in bad.json()["error"]
        assert "ldlm_request_success_total" in http.get("/metrics").text
        assert {"/v1/generate", "/v2/models/{model}/infer"} <= http.get("/openapi.json").json()["paths"].keys()


def test_replica_killed_during_load_loses_no_request(cluster: str, tiny_model: LDLM, expected: dict[int, list[list[int]]]) -> None:
    clients = Clients()
    # each client sends until the kill is done, then `after_kill` more: the load cannot run out before the
    # kill, however long the main thread takes to find a busy replica
    after_kill, kill_after = 10, 20
    kill_done = threading.Event()
    reference = {seed: eager_latents(tiny_model, encoder_ids(seed)) for seed in range(3)}
    failures: list[str] = []
    killed: dict[str, Any] = {}

    def requests() -> Iterator[int]:
        i = 0
        while not kill_done.is_set():
            yield i
            i += 1
        yield from range(i, i + after_kill)

    def generate_client(index: int) -> None:
        with httpx.Client(base_url=cluster, timeout=60) as http:
            for i in requests():
                sent[index] += 1
                seed = SEEDS[(index + i) % len(SEEDS)]
                if clients.generate(http, seed) != expected[seed]:
                    failures.append(f"generate seed={seed}: tokens differ from the eager pipeline")

    def triton_client(index: int) -> None:
        client = triton.InferenceServerClient(cluster.removeprefix("http://"), connection_timeout=60, network_timeout=60)
        try:
            for i in requests():
                sent[index] += 1
                seed = (index + i) % 3
                if np.abs(clients.encode(client, encoder_ids(seed)) - reference[seed]).max() >= 1e-5:
                    failures.append(f"encoder seed={seed}: latents differ from the eager model")
        finally:
            client.close()

    def guarded(target: Any, index: int) -> None:
        try:
            target(index)
        except BaseException as error:  # the main thread reports it
            failures.append(f"{target.__name__}[{index}]: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=guarded, args=(target, i)) for i, target in enumerate([generate_client] * 3 + [triton_client])]
    sent = [0] * len(threads)
    before = replica_names()
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 300
        while clients.answered < kill_after and time.monotonic() < deadline:
            time.sleep(0.01)
        victim, in_flight = kill_a_busy_replica(before, deadline + 300)
        killed["answered_before"] = clients.answered
    finally:
        kill_done.set()
    for thread in threads:
        thread.join(300)
    assert not any(thread.is_alive() for thread in threads), "a client hung"
    assert not failures, failures
    total = sum(sent)
    assert clients.answered == total, f"{total - clients.answered} requests lost"
    assert killed["answered_before"] < total, "the kill came after the load"
    # The kill landed on requests in flight: without the retries those requests would be lost.
    assert sum(clients.retries.values()) >= 1, f"the killed replica had nothing in flight; retries: {dict(clients.retries)}"
    print(
        f"\nreplica killed with {in_flight} requests in flight after {killed['answered_before']}/{total} answers; "
        f"retries: {dict(clients.retries)}"
    )
    print("\n".join(clients.events))

    def recovered() -> bool:  # the controller notices the death (health checks), then starts a new replica
        names = replica_names()
        return victim not in names and len(names) == REPLICAS and replica_states() == {"RUNNING": REPLICAS}

    deadline = time.monotonic() + 120
    while not recovered() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert recovered(), f"not replaced in 120 s: {replica_names()}, {replica_states()}"
    with httpx.Client(base_url=cluster, timeout=60) as http:  # and the recovered deployment answers correctly
        for seed in SEEDS:
            assert http.post("/v1/generate", json={**GENERATE, "seed": seed}).json()["token_ids"] == expected[seed]


def test_app_builder_arguments() -> None:
    """``serve run ldlm.serve.deploy.ray_app:app_builder key=value ...`` hands strings; bad keys are named."""
    with pytest.raises(ValueError, match="needs source="):
        app_builder({"replicas": "2"})
    with pytest.raises(ValueError, match="unknown argument.*replica_count.*allowed: source"):
        app_builder({"source": "x", "replica_count": "2"})
    with pytest.raises(ValueError, match="threads='one' is not a valid int"):
        app_builder({"source": "x", "threads": "one"})
    with pytest.raises(ValueError, match="min_replicas and max_replicas go together"):
        RayOptions(min_replicas=1)
    with pytest.raises(ValueError, match="num_cpus=-1"):
        RayOptions(num_cpus=-1)
    options = RayOptions(replicas=2, min_replicas=1, max_replicas=4, num_gpus=0.5).deployment_options()
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2, "target_ongoing_requests": 8.0}
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5} and "num_replicas" not in options
    assert RayOptions(replicas=3).deployment_options()["num_replicas"] == 3


def test_app_builder_values_take_the_types_fields_declare() -> None:
    """Strings become the declared type: bools from true/false/1/0 (``bool("false")`` is True), ``int | None`` as int."""
    from ldlm.serve.deploy.ray_app import _typed

    assert _typed(ServerSettings, {"trt_cuda_graphs": "false"}) == {"trt_cuda_graphs": False}
    assert _typed(ServerSettings, {"trt_cuda_graphs": "0"}) == {"trt_cuda_graphs": False}
    assert _typed(ServerSettings, {"trt_cuda_graphs": "True"}) == {"trt_cuda_graphs": True}
    assert _typed(ServerSettings, {"trt_cuda_graphs": "1"}) == {"trt_cuda_graphs": True}
    assert _typed(ServerSettings, {"threads": "3", "max_delay_ms": "2.5", "api_key": "123"}) == {
        "threads": 3,
        "max_delay_ms": 2.5,
        "api_key": "123",
    }
    assert _typed(RayOptions, {"min_replicas": "1", "max_replicas": "4", "num_gpus": "0.5"}) == {
        "min_replicas": 1,
        "max_replicas": 4,
        "num_gpus": 0.5,
    }
    with pytest.raises(ValueError, match="trt_cuda_graphs='yes' is not a valid bool; allowed: true, false, 1, 0"):
        _typed(ServerSettings, {"trt_cuda_graphs": "yes"})
    with pytest.raises(ValueError, match="min_replicas='two' is not a valid int"):
        _typed(RayOptions, {"min_replicas": "two"})


def test_parse_autoscale() -> None:
    assert parse_autoscale("1:4") == (1, 4)
    with pytest.raises(ValueError, match="autoscale '1-4' is not MIN:MAX"):
        parse_autoscale("1-4")


def test_cluster_shuts_down_cleanly(cluster: str) -> None:
    ray_processes = descendants(os.getpid()) - OTHERS_BEFORE_RAY
    assert len(ray_processes) >= 2 + REPLICAS, "expected Ray's GCS, raylet and the replicas below this process"
    serve.shutdown()
    ray.shutdown()
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in ray_processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in ray_processes if running(pid)], "Ray processes left behind"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{cluster}/v2/health/live", timeout=2)
