"""The service's outer guards in-process, without a model: GuardMiddleware around a stand-in app
(driven through httpx's ASGI transport), read_body's caps at their edges, the SSE framing and the
OpenAI error shapes. Expectations are the documented statuses and messages, written out."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.serve.api.errors import HTTPError, error_body, error_status, openai_error  # noqa: E402
from ldlm.serve.api.http_guard import GuardMiddleware, read_body  # noqa: E402
from ldlm.serve.api.kserve_tensors import ProtocolError  # noqa: E402
from ldlm.serve.api.metrics import Metrics  # noqa: E402
from ldlm.serve.api.service import ServerSettings  # noqa: E402
from ldlm.serve.api.streaming import sse  # noqa: E402
from ldlm.serve.runtime.graph_backend import BackendError  # noqa: E402
from ldlm.serve.runtime.queueing import QueueFullError  # noqa: E402

RAISES = {
    "/v1/protocol": ProtocolError("inputs[0] (x): bad"),
    "/v1/backend": BackendError("decoder: bad shape"),
    "/v1/value": ValueError("n=0 is out of range"),
    "/v1/queue": QueueFullError("generation queue is full"),
    "/v1/http": HTTPError(504, "request timed out after 1 s"),
    "/v1/crash": KeyError("secret internals"),
    "/v1/completions": HTTPError(404, "model 'gpt-4' does not exist"),
}


async def stand_in_app(scope, receive, send) -> None:
    """Echoes the body it was given (as the middleware replays it), or raises what RAISES names."""
    if scope["path"] in RAISES:
        raise RAISES[scope["path"]]
    message = await receive()
    body = json.dumps({"bytes": len(message["body"]), "more_body": message["more_body"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


ROUTES = [types.SimpleNamespace(path=path) for path in (*RAISES, "/v1/echo")]  # the stand-in app's /v1 routes


def guarded(**settings) -> tuple[GuardMiddleware, Metrics]:
    metrics = Metrics()
    service = types.SimpleNamespace(settings=ServerSettings(**settings), metrics=metrics, graphs={"encoder": None})
    return GuardMiddleware(stand_in_app, service, routes=ROUTES), metrics  # type: ignore[arg-type]


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_errors_map_to_statuses_and_one_shape() -> None:
    app, metrics = guarded()
    expected = {
        "/v1/protocol": (400, "inputs[0] (x): bad"),
        "/v1/backend": (400, "decoder: bad shape"),
        "/v1/value": (400, "n=0 is out of range"),
        "/v1/queue": (503, "generation queue is full"),
        "/v1/http": (504, "request timed out after 1 s"),
    }
    for path, (status, message) in expected.items():
        response = call(app, "POST", path)
        assert (response.status_code, response.json()) == (status, {"error": message}), path
        assert response.headers["x-request-id"]
    assert call(app, "POST", "/v1/queue").headers["retry-after"] == "1"
    crash = call(app, "POST", "/v1/crash", headers={"X-Request-ID": "abc123"})
    assert crash.status_code == 500 and crash.json() == {"error": "internal error (KeyError); request id abc123"}
    assert "secret" not in crash.text and crash.headers["x-request-id"] == "abc123"
    openai = call(app, "POST", "/v1/completions")  # the OpenAI routes answer in OpenAI's shape
    assert openai.status_code == 404 and openai.json() == {
        "error": {"message": "model 'gpt-4' does not exist", "type": "not_found_error", "param": None, "code": None}
    }
    rendered = metrics.render().decode()
    assert 'ldlm_request_failure_total{code="503",model="queue"} 2.0' in rendered
    assert 'ldlm_request_failure_total{code="404",model="completions"} 1.0' in rendered


def test_bearer_key_guards_every_path_but_health() -> None:
    app, metrics = guarded(api_key="k3y")
    for path in ("/v1/echo", "/v2/models/encoder/infer", "/metrics", "/v2/health-not", "/v2/healthy", "/healthz", "/health/x"):
        response = call(app, "POST", path, content=b"{}")
        assert response.status_code == 401 and response.json() == {"error": "missing or wrong bearer token"}, path
        assert response.headers["www-authenticate"] == "Bearer"
    assert call(app, "POST", "/v1/echo", content=b"{}", headers={"Authorization": "Bearer k3y "}).status_code == 401
    assert call(app, "POST", "/v1/echo", content=b"{}", headers={"Authorization": "bearer k3y"}).status_code == 401
    assert call(app, "POST", "/v1/echo", content=b"{}", headers={"Authorization": "Bearer k3y"}).status_code == 200
    assert call(app, "GET", "/v2/health/live").status_code == 200  # probes stay open: KServe's and vLLM's
    assert call(app, "GET", "/health").status_code == 200
    rendered = metrics.render().decode()
    assert 'ldlm_request_failure_total{code="401",model="encoder"} 1.0' in rendered
    assert 'ldlm_request_success_total{model="echo"} 1.0' in rendered


def test_body_cap_at_its_edge_on_content_length_and_chunked_bodies() -> None:
    app, _ = guarded(max_body_bytes=1024)
    exact = call(app, "POST", "/v1/echo", content=b"x" * 1024)
    assert exact.status_code == 200 and exact.json() == {"bytes": 1024, "more_body": False}
    over = call(app, "POST", "/v1/echo", content=b"x" * 1025)
    assert over.status_code == 413 and over.json() == {"error": "body of 1025 bytes exceeds the limit of 1024 bytes (--max-body-mb)"}

    def chunks(total: int):
        async def gen():
            for _ in range(total // 256):
                yield b"y" * 256
            yield b"y" * (total % 256)

        return gen()

    assert call(app, "POST", "/v1/echo", content=chunks(1024)).json() == {"bytes": 1024, "more_body": False}
    chunked = call(app, "POST", "/v1/echo", content=chunks(1025))
    assert chunked.status_code == 413 and chunked.json() == {"error": "body exceeds the limit of 1024 bytes (--max-body-mb)"}


def receiver(*messages: dict, then_wait: bool = False):
    queue = list(messages)

    async def receive() -> dict:
        if queue:
            return queue.pop(0)
        if then_wait:
            await asyncio.sleep(3600)
        raise AssertionError("read past the body")

    return receive


def test_read_body_edges() -> None:
    def read(receive, length: str | None, limit: int = 10, timeout_s: float = 5.0) -> bytes:
        return asyncio.run(read_body(receive, length, limit, timeout_s))

    body = {"type": "http.request", "body": b"0123456789", "more_body": False}
    assert read(receiver(body), "10") == b"0123456789"
    assert (
        read(
            receiver(
                {"type": "http.request", "body": b"01234", "more_body": True},
                {"type": "http.request", "body": b"56789", "more_body": False},
            ),
            None,
        )
        == b"0123456789"
    )
    for length, message in (
        ("11", "body of 11 bytes exceeds the limit of 10 bytes"),
        ("-1", "body of -1 bytes exceeds"),
        ("1e3", "body of 1e3 bytes exceeds"),
    ):
        with pytest.raises(HTTPError, match=message) as error:
            read(receiver(body), length)
        assert error.value.status == 413
    with pytest.raises(HTTPError, match="body exceeds the limit of 10 bytes") as error:
        read(
            receiver(
                {"type": "http.request", "body": b"012345", "more_body": True},
                {"type": "http.request", "body": b"67890", "more_body": False},
            ),
            None,
        )
    assert (error.value.status, error.value.headers) == (413, {"Connection": "close"})
    with pytest.raises(HTTPError, match="the client disconnected before sending the whole body") as error:
        read(receiver({"type": "http.request", "body": b"01", "more_body": True}, {"type": "http.disconnect"}), None)
    assert error.value.status == 400
    with pytest.raises(HTTPError, match="the request body did not arrive within 0.05 s") as error:
        read(receiver({"type": "http.request", "body": b"01", "more_body": True}, then_wait=True), None, timeout_s=0.05)
    assert (error.value.status, error.value.headers) == (408, {"Connection": "close"})


def test_error_shapes() -> None:
    assert json.loads(error_body("bad", 400, "/v2/models/x/infer")) == {"error": "bad"}
    assert json.loads(error_body("bad", 400, "/v1/models")) == openai_error(400, "bad")
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "server_error",
        504: "timeout",
    }
    assert {status: openai_error(status, "m")["error"]["type"] for status in kinds} == kinds
    assert openai_error(400, "m", "n") == {"error": {"message": "m", "type": "invalid_request_error", "param": "n", "code": None}}
    statuses = [
        error_status(e)[0]
        for e in (HTTPError(413, "x"), QueueFullError("x"), TimeoutError("x"), BackendError("x"), ValueError("x"), RuntimeError("x"))
    ]
    assert statuses == [413, 503, 504, 400, 400, 500]


def test_sse_framing() -> None:
    assert sse({"a": 1, "b": [1, 2]}) == b'data: {"a":1,"b":[1,2]}\n\n'
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"x": "y"}, "preview") == b'event: preview\ndata: {"x":"y"}\n\n'


def test_requests_are_counted_under_served_graphs_and_routes_only() -> None:
    """A name only the request has (an unknown model, a /v1 path no route serves) is no label: however many a
    client sends, /metrics keeps the labels of the served graphs and the app's routes."""
    app, metrics = guarded()
    for i in range(20):
        call(app, "POST", f"/v2/models/x{i}/infer", content=b"{}")
        call(app, "POST", f"/v1/x{i}", content=b"{}")
    call(app, "POST", "/v2/models/encoder/infer", content=b"{}")
    call(app, "POST", "/v1/echo", content=b"{}")
    rendered = metrics.render().decode()
    assert 'model="x' not in rendered
    assert 'ldlm_request_success_total{model="encoder"} 1.0' in rendered
    assert 'ldlm_request_success_total{model="echo"} 1.0' in rendered
