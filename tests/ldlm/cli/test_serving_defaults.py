"""``ldlm serve`` hands the server ``ServerSettings``' own defaults for every option left out: it binds
127.0.0.1 unless ``--host`` says otherwise, and its limits are the documented ones. The server itself is
replaced by a recorder, so nothing loads or listens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.serve.api import server
from ldlm.serve.api.export_cache import cache_root
from ldlm.serve.api.service import ServerSettings


def served_settings(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> ServerSettings:
    """The settings ``ldlm serve ARGV`` would start a server with."""
    given: list[ServerSettings] = []
    monkeypatch.delenv("LDLM_API_KEY", raising=False)
    monkeypatch.setattr(server, "serve", lambda source, settings, log_level: given.append(settings))
    assert main(["serve", *argv]) == 0
    assert len(given) == 1
    return given[0]


def test_options_left_out_are_the_servers_own_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = served_settings([str(tmp_path)], monkeypatch)
    assert settings.host == "127.0.0.1"
    # gRPC beside HTTP on --port + 1, as Triton's 8001 beside 8000 (HTTP alone when another server holds 8001);
    # settings made in Python serve no gRPC unless they name a port
    assert settings.grpc_port in (8001, None) and ServerSettings().grpc_port is None
    assert settings == dataclasses.replace(ServerSettings(), export_cache=str(cache_root()), grpc_port=settings.grpc_port)


def test_another_address_is_bound_only_when_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert served_settings([str(tmp_path), "--host", "0.0.0.0"], monkeypatch).host == "0.0.0.0"
