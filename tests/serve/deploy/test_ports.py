"""free_port: a loopback port that a server can bind, outside the range the kernel hands to outgoing
connections (which could take a bind(0) port before the server binds it)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ldlm.serve.deploy.ports import PORT_RANGE, free_port


def ephemeral_range() -> range:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return range(int(low), int(high) + 1)


def test_the_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    if not Path("/proc/sys/net/ipv4/ip_local_port_range").is_file():
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here: the kernel's ephemeral range is unknown")
    ephemeral = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert all(p in PORT_RANGE and p not in ephemeral for p in ports), (ports, ephemeral)
    assert len(set(ports)) > 10  # drawn at random, not the same port each time
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports[0]))  # the port is free: a server can take it


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        monkeypatch.setattr("ldlm.serve.deploy.ports.PORT_RANGE", range(taken, taken + 1))
        with pytest.raises(RuntimeError, match=f"no free loopback port in {taken}..{taken}"):
            free_port()


def test_ports_already_drawn_for_a_server_are_not_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    free = free_port()
    monkeypatch.setattr("ldlm.serve.deploy.ports.PORT_RANGE", range(free, free + 1))
    assert free_port() == free  # it binds: only `taken` keeps it out
    with pytest.raises(RuntimeError, match=f"no free loopback port in {free}..{free}"):
        free_port(taken=[free])
