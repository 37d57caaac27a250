"""The server's listening socket: every connection it accepts has Nagle's algorithm off.

With Nagle on, a response written as headers then body holds the body back until the client
acknowledges the headers, and a client's delayed ACK makes that about 40 ms per response on Linux's
loopback. asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are TCP, so the check
is on a connection accepted by asyncio from ``bind_socket``'s socket, as uvicorn accepts them.
"""

from __future__ import annotations

import asyncio
import socket

from ldlm.serve.api.server import bind_socket


async def accepted_nodelay(listener: socket.socket) -> int:
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
    try:
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        value = await asyncio.wait_for(seen, 30)
        writer.close()
        return value
    finally:
        server.close()
        await server.wait_closed()


def test_accepted_connections_have_nagle_off() -> None:
    listener = bind_socket("127.0.0.1", 0)
    assert listener.proto == socket.IPPROTO_TCP
    assert asyncio.run(accepted_nodelay(listener)) != 0
