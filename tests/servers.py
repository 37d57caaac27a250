"""The real server on 127.0.0.1 for the HTTP tests: in a thread of the test process (``RunningServer``),
or in its own process (``wait_ready`` for a ``python -m ldlm.cli serve`` child)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from ldlm.serve.api.server import create_app, server_config
from ldlm.serve.api.service import LDLMService

# One port picker and one readiness wait (for a server in its own process) for the scripts and the tests.
from scripts.harness.loopback import free_port, wait_ready  # noqa: F401


class RunningServer:
    """``service`` behind the production uvicorn configuration (guards, timeouts), started and ready."""

    def __init__(self, service: LDLMService, start_timeout_s: float = 60.0) -> None:
        self.service = service
        self.url = f"http://127.0.0.1:{service.settings.port}"
        self.server = uvicorn.Server(server_config(create_app(service), service.settings))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + start_timeout_s
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def infer_body(**overrides: object) -> dict[str, object]:
    """A valid KServe v2 infer request for the encoder (one sequence of 3 tokens), fields overridable."""
    body: dict[str, object] = {
        "inputs": [
            {"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]},
            {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 1, 1]},
        ]
    }
    body.update(overrides)
    return body


@contextmanager
def openai_client(server: RunningServer) -> Iterator[Any]:
    """The official OpenAI client on ``server``'s /v1, no retries (a refusal must show as it is)."""
    import openai  # a test extra: the modules that use this skip first without it

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client
