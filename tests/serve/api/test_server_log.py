"""serve()'s request log: JSON lines on stderr at the chosen level while it serves, and the
"ldlm.serve" logger as it was once serve() returns. serve() may be called from Python, whose stderr
may be closed by then: a handler left behind would fail on every later request logged in the process."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ldlm.serve.api import server
from ldlm.serve.api.service import ServerSettings


def test_serve_logs_json_lines_while_it_serves_and_leaves_the_logger_as_it_was(
    export_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = logging.getLogger("ldlm.serve")
    before = (logger.handlers[:], logger.level, logger.propagate)

    def serve_one_request(self: server.GracefulServer, sockets: list) -> None:
        self.started = True  # as uvicorn's run sets it once it listens
        logger.info("request", extra={"request_id": "r-1", "method": "POST", "path": "/v1/generate", "status": 200, "ms": 1.5})
        logger.debug("below the level")

    monkeypatch.setattr(server.GracefulServer, "run", serve_one_request)
    server.serve(str(export_dir), ServerSettings(port=0), log_level="info")
    logged = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert [{k: v for k, v in entry.items() if k != "ts"} for entry in logged] == [
        {"level": "INFO", "msg": "request", "request_id": "r-1", "method": "POST", "path": "/v1/generate", "status": 200, "ms": 1.5}
    ]
    assert (logger.handlers, logger.level, logger.propagate) == before
