"""The KServe v2 gRPC endpoint beside HTTP, as Triton serves gRPC on 8001 beside HTTP on 8000: started with
the app and stopped before it drains (``grpc_endpoint``, the KServe router's lifespan), on the app's event
loop, bound to the app's host, on the settings' ``grpc_port`` (None: no endpoint).

``ldlm serve`` sets it from --grpc-port, by default the HTTP port + 1 (``default_grpc_port``).
``check_grpc_port`` refuses a port that another server listens on before anything loads, as the HTTP port is
bound first.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import AsyncIterator

import grpc
from tritonclient.grpc import service_pb2_grpc

from ldlm.serve.api.grpc_kserve import KServeServicer, ServeInfer
from ldlm.serve.api.service import LDLMService


class GrpcPortInUseError(RuntimeError):
    """The gRPC port is taken; the message names it and how to choose another."""


def default_grpc_port(http_port: int) -> int:
    """The HTTP port + 1, as Triton pairs 8001 with 8000; 0 (the OS picks) when HTTP's is 0 or the last port."""
    return http_port + 1 if 0 < http_port < 65535 else 0


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_grpc_port(host: str, port: int) -> None:
    """Refuse ``port`` on ``host`` when a server listens there already: at start, before the graphs load."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds: a closed connection's TIME_WAIT is no listener
        try:
            probe.bind((host, port))
        except OSError as error:
            raise port_error(host, port, error.strerror if error.errno != errno.EADDRINUSE else None) from None


def port_error(host: str, port: int, why: str | None) -> GrpcPortInUseError:
    """What to say when the gRPC port cannot be bound: ``why`` (None: another server holds it) and the fix."""
    reason = "already in use (another `ldlm serve`, or a Triton?)" if why is None else f"not available ({why})"
    return GrpcPortInUseError(
        f"gRPC port {port} on {host} is {reason}; choose another with --grpc-port, e.g. --grpc-port {port + 1 if port < 65535 else 8001}, "
        "or serve HTTP alone with --no-grpc"
    )


@contextlib.asynccontextmanager
async def grpc_endpoint(service: LDLMService, infer: ServeInfer) -> AsyncIterator[int | None]:
    """Serve KServe v2 over gRPC for ``service`` within the block, on its settings' ``grpc_port``, and give the
    bound port (None: no endpoint). Messages are capped as HTTP bodies are (--max-body-mb), and calls in flight
    as HTTP's connections are (--max-connections); at the end, calls in flight get the request timeout to finish
    before the app drains the batchers."""
    settings = service.settings
    port = settings.grpc_port
    if port is None:
        yield None
        return
    server = grpc.aio.server(
        maximum_concurrent_rpcs=settings.max_connections,  # beyond: RESOURCE_EXHAUSTED, as HTTP's limit answers 503
        options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),  # answers are as large as their outputs, as over HTTP
            ("grpc.so_reuseport", 0),  # a second server on the same port fails, not shares its calls
        ],
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(service, infer), server)
    try:
        bound = server.add_insecure_port(address(settings.host, port))
    except RuntimeError:
        raise port_error(settings.host, port, None) from None
    await server.start()
    print(f"grpc: {address(settings.host, bound)} (KServe v2, as Triton's; tritonclient.grpc)", flush=True)
    try:
        yield bound
    finally:
        await server.stop(grace=settings.request_timeout_s)
