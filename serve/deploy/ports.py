"""Free loopback ports for servers started in child processes (``ldlm serve``, tritonserver)."""

from __future__ import annotations

import random
import socket
from collections.abc import Collection

# Below Linux's default ephemeral range (32768-60999). A port the kernel hands out for bind(0) comes
# from that range, and any outgoing connection on the machine (another test's clients) may take it
# between the check here and the server's own bind: the server then dies with EADDRINUSE.
PORT_RANGE = range(20000, 32768)


def free_port(taken: Collection[int] = ()) -> int:
    """A loopback port nothing listens on, drawn at random (from the OS's entropy, so parallel test
    workers with one seed do not draw alike) from PORT_RANGE; never one of ``taken`` (the ports already
    drawn for the same server, which nothing listens on yet either)."""
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.choice(PORT_RANGE)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {PORT_RANGE.start}..{PORT_RANGE.stop - 1} after 200 draws")
