"""The HTTP service's answers checked by value against single eager runs of the model, its limits
each triggered once, and its metrics read back as numbers."""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.model.ldlm import LDLM  # noqa: E402
from ldlm.model.tokenizer import TextTokenizer  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.batcher import DynamicBatcher  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

KEY = {"Authorization": "Bearer k3y"}


@pytest.fixture(scope="module")
def batching_server(export_dir: Path):
    """Pairs only: two one-row requests fill a batch (max_batch 2) long before the 30 s delay ends."""
    settings = ServerSettings(port=free_port(), max_batch=2, max_delay_ms=30_000, request_timeout_s=60, api_key="k3y")
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def limits_server(export_dir: Path):
    settings = ServerSettings(
        port=free_port(), max_batch=8, max_delay_ms=0, request_timeout_s=60, max_body_bytes=64 << 10, max_n=4, max_steps=1000, max_texts=2
    )
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


@pytest.fixture
def impatient_server(export_dir: Path):
    running = RunningServer(LDLMService(str(export_dir), ServerSettings(port=free_port(), request_timeout_s=0.5)))
    yield running
    running.stop()


def eager_latents(model: LDLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.encode_latents(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))[0].numpy()


def eager_round_trip(model: LDLM, ids: list[int]) -> list[int]:
    with torch.no_grad():
        latents = model.encode_latents(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))
        return model.decode_tokens(latents, torch.ones(1, len(ids), dtype=torch.bool))[0].tolist()


def encoder_body(ids: list[int]) -> dict:
    return {
        "inputs": [
            {"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, len(ids)], "datatype": "INT64", "data": [1] * len(ids)},
        ]
    }


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    for line in text.splitlines():
        match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if match and match.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if found == labels:
                return float(match.group(3))
    return 0.0


def wait_for_company(batcher: DynamicBatcher) -> None:
    """As if a batch were running: requests that arrive now wait for company (up to the window, or a full
    batch) rather than run at once as they do at an idle batcher."""
    with batcher._cond:
        batcher._running = True


def test_concurrent_requests_of_two_lengths_get_their_single_run_values(batching_server: RunningServer, tiny_model: LDLM) -> None:
    rows = [[464, 2068, 7586, 21831], [40, 1101, 257, 890, 6827, 546, 41270, 44258, 11, 290, 1110]]
    with httpx.Client(base_url=batching_server.url, timeout=60, headers=KEY) as http:
        before = http.get("/metrics").text
        answers: dict[int, httpx.Response] = {}
        paths = ["/v2/models/encoder/infer", "/v2/models/encoder/versions/1/infer"]  # both routes, one batch
        wait_for_company(batching_server.service.batchers["encoder"])  # at an idle batcher the first would run alone

        def send(i: int) -> None:
            answers[i] = http.post(paths[i], json=encoder_body(rows[i]))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        after = http.get("/metrics").text
    for i, ids in enumerate(rows):
        assert answers[i].status_code == 200, answers[i].text
        output = answers[i].json()["outputs"][0]
        assert output["shape"] == [1, len(ids), 64]
        got = np.asarray(output["data"], dtype=np.float32).reshape(len(ids), 64)
        np.testing.assert_allclose(got, eager_latents(tiny_model, ids), atol=2e-5, rtol=1e-4)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("ldlm_execution_count_total", model="encoder") == 1  # one batch ...
    assert delta("ldlm_inference_count_total", model="encoder") == 2  # ... of two samples
    assert delta("ldlm_batch_size_count", model="encoder") == 1 and delta("ldlm_batch_size_sum", model="encoder") == 2
    assert (
        delta("ldlm_batch_size_bucket", model="encoder", le="1.0") == 0 and delta("ldlm_batch_size_bucket", model="encoder", le="2.0") == 1
    )
    assert delta("ldlm_request_success_total", model="encoder") == 2
    assert delta("ldlm_request_duration_seconds_count", model="encoder") == 2


def test_auth_covers_metrics_and_failures_are_counted(batching_server: RunningServer) -> None:
    with httpx.Client(base_url=batching_server.url, timeout=30) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/v2/health/ready").status_code == 200  # probes stay open
        before = http.get("/metrics", headers=KEY).text
        assert http.post("/v2/models/encoder/infer", content=b"{nope", headers=KEY).status_code == 400
        assert http.post("/v2/models/encoder/infer", json=encoder_body([1, 2])).status_code == 401
        after = http.get("/metrics", headers=KEY).text
    assert (
        metric(after, "ldlm_request_failure_total", code="400", model="encoder")
        - metric(before, "ldlm_request_failure_total", code="400", model="encoder")
        == 1
    )
    assert (
        metric(after, "ldlm_request_failure_total", code="401", model="encoder")
        - metric(before, "ldlm_request_failure_total", code="401", model="encoder")
        == 1
    )
    assert metric(after, "ldlm_execution_count_total", model="encoder") == metric(before, "ldlm_execution_count_total", model="encoder")


def test_text_routes_equal_single_eager_runs(limits_server: RunningServer, tiny_model: LDLM, tokenizer: TextTokenizer) -> None:
    texts = ["five", "A sentence that is a good deal longer than the first one."]
    ids = tokenizer.encode(texts)
    with httpx.Client(base_url=limits_server.url, timeout=60) as http:
        reconstructed = http.post("/v1/reconstruct", json={"texts": texts})
        encoded = http.post("/v1/encode", json={"texts": texts})
    assert reconstructed.status_code == 200 and encoded.status_code == 200
    body = encoded.json()
    assert body["shape"] == [2, max(len(r) for r in ids), 64]
    assert [sum(m) for m in body["attention_mask"]] == [len(r) for r in ids]
    latents = np.asarray(body["latents"], dtype=np.float32)
    for i, row in enumerate(ids):
        np.testing.assert_allclose(latents[i, : len(row)], eager_latents(tiny_model, row), atol=2e-5, rtol=1e-4)
        expected = eager_round_trip(tiny_model, row)
        assert reconstructed.json()["token_ids"][i][: len(row)] == expected, texts[i]
        assert reconstructed.json()["texts"][i] == tokenizer.decode(expected), texts[i]


def test_versioned_routes(limits_server: RunningServer) -> None:
    with httpx.Client(base_url=limits_server.url, timeout=30) as http:
        plain, versioned = http.get("/v2/models/decoder").json(), http.get("/v2/models/decoder/versions/1").json()
        assert plain == versioned and versioned["versions"] == ["1"]
        assert [o["name"] for o in versioned["outputs"]] == ["token_ids", "logits"]
        assert http.get("/v2/models/decoder/versions/1/ready").status_code == 200
        assert http.get("/v2/models/gpt5/versions/1/ready").status_code == 404


def test_gzip_bodies_and_compressed_bombs(limits_server: RunningServer) -> None:
    body = json.dumps(encoder_body([10, 20, 30, 40, 50])).encode()
    with httpx.Client(base_url=limits_server.url, timeout=30) as http:
        plain = http.post("/v2/models/encoder/infer", content=body, headers={"Content-Type": "application/json"})
        zipped = http.post("/v2/models/encoder/infer", content=gzip.compress(body), headers={"Content-Encoding": "gzip"})
        assert plain.status_code == 200 and zipped.status_code == 200, zipped.text
        assert zipped.json()["outputs"] == plain.json()["outputs"]
        bomb = gzip.compress(b" " * (1 << 20))  # 1 MiB of spaces in ~1 KiB, over the 64 KiB cap once inflated
        response = http.post("/v2/models/encoder/infer", content=bomb, headers={"Content-Encoding": "gzip"})
        assert response.status_code == 400 and "exceeds the 65536-byte limit" in response.json()["error"]
        assert http.get("/v2/health/ready").status_code == 200


def test_streamed_body_over_the_cap_is_refused(limits_server: RunningServer) -> None:
    def chunks():  # no Content-Length: the cap must hold on the bytes received
        for _ in range(20):
            yield b" " * 8192

    with httpx.Client(base_url=limits_server.url, timeout=30) as http:
        response = http.post("/v2/models/encoder/infer", content=chunks())
        assert response.status_code == 413 and "exceeds the limit of 65536" in response.json()["error"]
        assert http.post("/v2/models/encoder/infer", json=encoder_body([1, 2, 3])).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/generate", {"n": 1, "length": 4, "steps": 1001}, "steps: 1001 is out of range; allowed: 1..1000"),
        ("/v1/generate", {"n": 5, "length": 4, "steps": 2}, "n: 5 is out of range; allowed: 1..4"),
        ("/v1/reconstruct", {"texts": ["a", "b", "c"]}, "texts: 3 items is out of range; allowed: 1..2"),
        ("/v1/encode", {"texts": ["a", "b", "c"]}, "texts: 3 items is out of range; allowed: 1..2"),
    ],
    ids=["max_steps", "max_n", "max_texts-reconstruct", "max_texts-encode"],
)
def test_configured_limits(limits_server: RunningServer, path: str, body: dict, message: str) -> None:
    with httpx.Client(base_url=limits_server.url, timeout=30) as http:
        response = http.post(path, json=body)
    assert response.status_code == 422 and message in response.json()["error"], response.text


def test_a_request_past_its_timeout_gets_504_and_is_cancelled(impatient_server: RunningServer, monkeypatch) -> None:
    """The scheduler is replaced by one that never answers, so the 0.5 s timeout is what ends the request."""
    pending: list[Future] = []

    def never(spec, *rest):
        future: Future = Future()
        pending.append(future)
        return future

    monkeypatch.setattr(impatient_server.service.scheduler, "submit", never)
    with httpx.Client(base_url=impatient_server.url, timeout=30) as http:
        started = time.monotonic()
        response = http.post("/v1/generate", json={"n": 1, "length": 4, "steps": 2})
        waited = time.monotonic() - started
    assert response.status_code == 504 and "timed out after 0.5 s" in response.json()["error"]
    assert 0.5 <= waited < 20
    assert len(pending) == 1 and pending[0].cancelled()  # the scheduler may drop it


def test_a_request_names_its_step_grid(limits_server: RunningServer, pipeline) -> None:
    """grid travels to the sampling engine: "power" gives the pipeline's power-grid tokens, "tuned" on a
    checkpoint with no tuned schedules is refused naming why (a dropped grid would run it), an unknown grid
    names the allowed ones."""
    body = {"n": 1, "length": 8, "steps": 6, "seed": 3, "sampler": "ddim"}
    with httpx.Client(base_url=limits_server.url, timeout=60) as http:
        power = http.post("/v1/generate", json={**body, "grid": "power"})
        uniform = http.post("/v1/generate", json={**body, "grid": "uniform"})
        tuned = http.post("/v1/generate", json={**body, "grid": "tuned"})
        unknown = http.post("/v1/generate", json={**body, "grid": "cosine"})
    expected = pipeline.generate(1, 8, 6, 3, "ddim", grid="power").ids()
    assert power.status_code == 200 and power.json()["token_ids"] == expected, power.text
    assert uniform.json()["token_ids"] == pipeline.generate(1, 8, 6, 3, "ddim", grid="uniform").ids()
    assert tuned.status_code == 400 and "grid='tuned' is unavailable: this checkpoint has no tuned schedules" in tuned.json()["error"]
    assert unknown.status_code == 422 and "grid" in unknown.json()["error"] and "logsnr" in unknown.json()["error"], unknown.text


def test_a_request_sets_its_prior_temperature(limits_server: RunningServer, pipeline) -> None:
    """prior_temperature travels to the sampling engine: the pipeline's tokens at that temperature, which
    are not those of the unit prior at the same seed."""
    body = {"n": 2, "length": 8, "steps": 6, "seed": 3, "sampler": "ddim"}
    with httpx.Client(base_url=limits_server.url, timeout=60) as http:
        cooled = http.post("/v1/generate", json={**body, "prior_temperature": 0.5})
    expected = pipeline.generate(2, 8, 6, 3, "ddim", prior_temperature=0.5).ids()
    assert cooled.status_code == 200 and cooled.json()["token_ids"] == expected, cooled.text
    assert expected != pipeline.generate(2, 8, 6, 3, "ddim").ids()


def test_a_body_without_json_content_type_and_a_flood_of_unknown_keys_get_short_useful_errors(limits_server: RunningServer) -> None:
    with httpx.Client(base_url=limits_server.url, timeout=60) as http:
        form = http.post("/v1/generate", content=b'{"n": 1, "length": 4}', headers={"Content-Type": "text/plain"})
        flood = http.post(
            "/v1/generate",
            content=json.dumps({f"k{i}": 0 for i in range(20_000)}).encode()[: 60 << 10].rsplit(b",", 1)[0] + b"}",
            headers={"Content-Type": "application/json"},
        )
    assert form.status_code == 422, form.text
    assert "the body is not a JSON object (it was sent as text/plain: send Content-Type: application/json)" in form.json()["error"]
    assert flood.status_code == 422, flood.text
    message = flood.json()["error"]
    assert message.startswith("unknown fields 'k0', 'k1', 'k2'") and " more; allowed: " in message and len(message) < 1000
