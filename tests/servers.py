"""The real server on 127.0.0.1, in a thread of the test process, for the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from ldlm.serve.api.server import LDLMService, create_app, server_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
