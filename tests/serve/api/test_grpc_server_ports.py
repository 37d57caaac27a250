"""The gRPC port's range, 0..65535, at both ends on each path that takes it: ``ldlm serve --grpc-port`` (the
last port and the OS's pick taken, one past either end refused by the option itself, naming it), its default of
--port + 1 (up to the last port; past it the OS picks), what a held last port suggests instead, and the real
gRPC endpoint served on the last port. ``ServerSettings``' own check is tests/e2e/test_bounds_every_path.py's."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient's gRPC client (pip install -e .[test])")

from ldlm.cli import main  # noqa: E402
from ldlm.serve.api import grpc_server, server  # noqa: E402
from ldlm.serve.api.service import ServerSettings  # noqa: E402

LAST = 65535


def free_on_loopback(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def last_port_free() -> None:
    if not free_on_loopback(LAST):
        pytest.skip(f"port {LAST} on 127.0.0.1 is held by another process: the endpoint cannot be served there now")


def serve_cli(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, list[ServerSettings], str]:
    """``ldlm serve export-dir ARGV`` up to the server's start (replaced by a recorder): exit code, settings it would
    serve with (none when refused), stderr."""
    started: list[ServerSettings] = []
    monkeypatch.delenv("LDLM_API_KEY", raising=False)
    monkeypatch.setattr(server, "serve", lambda source, settings, log_level: started.append(settings))
    try:
        code = main(["serve", "export-dir", *argv])
    except SystemExit as exit_info:  # argparse's refusals
        code = int(exit_info.code or 0)
    return code, started, capsys.readouterr().err


@pytest.mark.parametrize("port", [0, LAST], ids=["the OS picks", "the last port"])
def test_grpc_port_at_either_end_is_served(port: int, last_port_free: None, monkeypatch, capsys) -> None:
    code, started, err = serve_cli(["--grpc-port", str(port)], monkeypatch, capsys)
    assert code == 0, err
    assert [s.grpc_port for s in started] == [port]


@pytest.mark.parametrize("port", [-1, LAST + 1], ids=["below 0", "past the last port"])
def test_grpc_port_past_either_end_is_refused_by_its_option(port: int, monkeypatch, capsys) -> None:
    code, started, err = serve_cli(["--grpc-port", str(port)], monkeypatch, capsys)
    assert code == 2 and not started, err
    assert f"argument --grpc-port: {port} is out of range; allowed: 0..65535" in err, err


def test_the_default_grpc_port_is_the_next_one_up_to_the_last(last_port_free: None, monkeypatch, capsys) -> None:
    code, started, err = serve_cli(["--port", str(LAST - 1)], monkeypatch, capsys)
    assert code == 0 and [s.grpc_port for s in started] == [LAST], err
    code, started, err = serve_cli(["--port", str(LAST)], monkeypatch, capsys)
    assert code == 0 and [s.grpc_port for s in started] == [0], err  # no port past the last: the OS picks one
    assert [grpc_server.default_grpc_port(p) for p in (0, 1, LAST - 1, LAST)] == [0, 2, LAST, 0]


@contextlib.contextmanager
def held(port: int) -> Iterator[None]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        yield


@pytest.mark.parametrize(("port", "suggested"), [(LAST - 1, LAST), (LAST, 8001)])
def test_a_held_port_suggests_one_in_range(port: int, suggested: int, monkeypatch, capsys) -> None:
    if not free_on_loopback(port):
        pytest.skip(f"port {port} on 127.0.0.1 is held by another process")
    with held(port):
        code, started, err = serve_cli(["--grpc-port", str(port)], monkeypatch, capsys)
    assert code == 2 and not started, err
    assert f"gRPC port {port} on 127.0.0.1 is already in use" in err and f"e.g. --grpc-port {suggested}," in err, err


def test_the_endpoint_serves_on_the_last_port(last_port_free: None) -> None:
    """The real gRPC server bound to 65535, answering tritonclient; its calls need no graphs (ServerLive)."""
    service = SimpleNamespace(settings=ServerSettings(grpc_port=LAST))

    async def live() -> tuple[int | None, bool]:
        async with grpc_server.grpc_endpoint(service, infer=None) as bound:  # type: ignore[arg-type]
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{bound}")
            try:
                return bound, await asyncio.to_thread(client.is_server_live, client_timeout=30)
            finally:
                client.close()

    assert asyncio.run(live()) == (LAST, True)
