"""The KServe infer route the guard runs in place of FastAPI's routing: which requests it claims, and that
its answers (outputs, headers, every refusal's status and shape) are those of the FastAPI route, the
independent reference, request for request."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.serve.api import server  # noqa: E402
from ldlm.serve.api.routes import kserve  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import infer_body  # noqa: E402


def scope(method: str, path: str) -> dict[str, object]:
    return {"type": "http", "method": method, "path": path, "headers": []}


@pytest.mark.parametrize(
    ("method", "path", "claimed"),
    [
        ("POST", "/v2/models/encoder/infer", True),
        ("POST", "/v2/models/encoder/versions/1/infer", True),
        ("POST", "/v2/models/nope/infer", True),  # an unknown model is the route's 404, as FastAPI's route answers it
        ("GET", "/v2/models/encoder/infer", False),  # FastAPI's 405
        ("POST", "/v2/models/encoder/infer/", False),  # FastAPI's redirect
        ("POST", "/v2/models//infer", False),
        ("POST", "/v2/models/encoder/versions//infer", False),
        ("POST", "/v2/models/encoder/other/1/infer", False),
        ("POST", "/v2/models/a/b/infer", False),
        ("POST", "/v1/models/encoder/infer", False),
        ("POST", "/v2/models/encoder/ready", False),
    ],
)
def test_the_shortcut_claims_exactly_the_infer_routes(method: str, path: str, claimed: bool) -> None:
    route = kserve.infer_shortcut(None)  # type: ignore[arg-type]  # matching needs no service
    assert (route(scope(method, path)) is not None) is claimed


@pytest.fixture(scope="module")
def service(export_dir: Path):
    service = LDLMService(str(export_dir), ServerSettings(max_delay_ms=0.0, max_request_samples=4, max_body_bytes=1 << 16))
    yield service
    service.close()


def binary_body(ids: np.ndarray, mask: np.ndarray, binary_out: bool) -> tuple[bytes, dict[str, str]]:
    inputs = [
        {"name": n, "shape": list(a.shape), "datatype": "INT64", "parameters": {"binary_data_size": a.nbytes}}
        for n, a in (("input_ids", ids), ("attention_mask", mask))
    ]
    head = json.dumps({"id": "b", "inputs": inputs, "parameters": {"binary_data_output": binary_out}}).encode()
    return head + ids.tobytes() + mask.tobytes(), {"Inference-Header-Content-Length": str(len(head))}


def requests() -> list[tuple[str, bytes, dict[str, str]]]:
    ids = np.array([[5, 6, 7, 8]], dtype=np.int64)
    ones = np.ones_like(ids)
    big = np.ones((5, 4), dtype=np.int64)
    return [
        ("/v2/models/encoder/infer", json.dumps(infer_body(id="j")).encode(), {}),
        ("/v2/models/encoder/versions/1/infer", *binary_body(ids, ones, True)),
        ("/v2/models/encoder/infer", *binary_body(ids, ones, False)),
        ("/v2/models/nope/infer", json.dumps(infer_body()).encode(), {}),  # 404
        ("/v2/models/encoder/infer", b"{not json", {}),  # 400, the codec's message
        ("/v2/models/encoder/infer", *binary_body(ids, np.zeros_like(ids), True)),  # 400, a row without a real position
        ("/v2/models/encoder/infer", json.dumps(infer_body(outputs=[{"name": "nope"}])).encode(), {}),  # 400, unknown output
        ("/v2/models/encoder/infer", *binary_body(big, big, True)),  # 413, samples over the cap
        ("/v2/models/encoder/infer", b"x" * (1 << 17), {}),  # 413, the body cap (the guard's, before either route)
    ]


def answers(service: LDLMService, shortcut: bool) -> list[tuple[int, dict[str, str], bytes]]:
    app = server.create_app(service)
    if not shortcut:
        app.user_middleware[0].kwargs["shortcut"] = None  # the guard alone, FastAPI's route behind it
    out = []

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            for path, content, headers in requests():
                response = await client.post(path, content=content, headers=headers)
                kept = {k: v for k, v in response.headers.items() if k not in ("x-request-id", "date", "server")}
                out.append((response.status_code, kept, response.content))

    asyncio.run(go())
    return out


def test_the_shortcut_answers_as_the_fastapi_route_does(service: LDLMService) -> None:
    direct, routed = answers(service, shortcut=True), answers(service, shortcut=False)
    assert [a[0] for a in routed] == [200, 200, 200, 404, 400, 400, 400, 413, 413]
    for got, want in zip(direct, routed, strict=True):
        assert got == want, (got[:2], want[:2])
    assert direct[1][1]["content-type"] == "application/octet-stream" and "inference-header-content-length" in direct[1][1]
