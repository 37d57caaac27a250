"""KServe v2 over gRPC (``inference.GRPCInferenceService``, the service tritonclient.grpc speaks): a thin
adapter over what HTTP serves, never a second stack.

Each call answers with what the HTTP route answers: the same dicts (``kserve_models``, parsed into the
protobuf messages), the same infer path (``serve_infer``: the batchers, limits, checks and statistics), the
same API key (``authorization: Bearer KEY`` metadata; health is open, as /v2/health/ is), and every refusal
with HTTP's message under the gRPC code of its HTTP status (``GRPC_CODES``). An infer request is read as the
binary-tensor body it stands for (``infer_payload``: the header that body's JSON would decode to, typed
``contents`` as its data, and raw_input_contents as its binary section), by the one codec that reads HTTP's
(``kserve.infer_request_of``), so both transports are checked alike; outputs come back in
raw_output_contents, as Triton sends them. Infer calls count in /metrics and the request log as HTTP's do.
ModelStreamInfer streams generation, as the model ``ldlm_generate`` (grpc_generate).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from ldlm.serve.api.errors import HTTPError, error_status
from ldlm.serve.api.grpc_generate import stream_generate
from ldlm.serve.api.grpc_tensors import infer_payload, infer_response
from ldlm.serve.api.http_guard import CLIENT_CLOSED
from ldlm.serve.api.kserve import InferRequest, requested_outputs
from ldlm.serve.api.kserve_models import (
    MODEL_VERSION,
    as_message,
    metrics_label,
    model_config,
    model_metadata,
    repository_index,
    served_model,
    server_metadata,
    statistics,
)
from ldlm.serve.api.offload import INLINE_BINARY_BYTES, decode_infer_payload, run_blocking
from ldlm.serve.api.service import LDLMService
from ldlm.serve.runtime.tracing import CURRENT

log = logging.getLogger("ldlm.serve")
T = TypeVar("T")
SERVICE = "/inference.GRPCInferenceService/"
UNAUTHORIZED = "missing or wrong bearer token"  # HTTP's words (http_guard)

# The one map from an error's HTTP status (errors.error_status) to its gRPC code.
GRPC_CODES = {
    200: grpc.StatusCode.OK,
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CLIENT_CLOSED: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class Encode(Protocol):
    def __call__(self, parsed: InferRequest, outputs: dict[str, np.ndarray]) -> Awaitable[service_pb2.ModelInferResponse]: ...


class Decode(Protocol):
    def __call__(self, check: Callable[[InferRequest], None]) -> Awaitable[InferRequest]: ...


class ServeInfer(Protocol):
    """``routes.kserve.serve_infer`` with its service bound: one infer request, decoded to answered."""

    def __call__(self, model: str, version: str, decode: Decode, encode: Encode) -> Awaitable[service_pb2.ModelInferResponse]: ...


class KServeServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The KServe v2 gRPC methods a model server answers, over ``service``; infer requests go to ``infer``.
    Methods it does not serve (load and unload, which say why; shared memory, trace and log settings) answer
    UNIMPLEMENTED."""

    def __init__(self, service: LDLMService, infer: ServeInfer) -> None:
        self.service, self.infer = service, infer
        key = service.settings.api_key
        self.expected_auth = f"Bearer {key}".encode() if key else None

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.service.ready)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def answer() -> Any:
            served_model(self.service, request.name, request.version)
            return service_pb2.ModelReadyResponse(ready=self.service.ready)

        return await self._answer(context, "ModelReady", answer)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def answer() -> Any:
            return as_message(server_metadata(), service_pb2.ServerMetadataResponse())

        return await self._answer(context, "ServerMetadata", answer)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def answer() -> Any:
            return as_message(model_metadata(self.service, request.name, request.version), service_pb2.ModelMetadataResponse())

        return await self._answer(context, "ModelMetadata", answer)

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def answer() -> Any:
            config = as_message(model_config(self.service, request.name, request.version), model_config_pb2.ModelConfig())
            return service_pb2.ModelConfigResponse(config=config)

        return await self._answer(context, "ModelConfig", answer)

    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def answer() -> Any:
            return as_message(statistics(self.service, request.name, request.version), service_pb2.ModelStatisticsResponse())

        return await self._answer(context, "ModelStatistics", answer)

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def answer() -> Any:
            return as_message({"models": repository_index(self.service, request.ready)}, service_pb2.RepositoryIndexResponse())

        return await self._answer(context, "RepositoryIndex", answer)

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        message = f"model {request.model_name!r} cannot be loaded or unloaded: ldlm serve serves its artifact's graphs as started"
        await abort(context, grpc.StatusCode.UNIMPLEMENTED, message + " (start another ldlm serve for another artifact)", ())

    RepositoryModelUnload = RepositoryModelLoad

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        model = request.model_name
        label = metrics_label(self.service, model)

        async def answer() -> Any:
            served_model(self.service, model, request.model_version)  # an unknown model is 404 before the tensors are read
            payload, binary, values = infer_payload(request)
            version = request.model_version or MODEL_VERSION

            def decode(check: Callable[[InferRequest], None]) -> Awaitable[InferRequest]:
                return decode_infer_payload(self.service, payload, binary, values, check)

            async def encode(parsed: InferRequest, outputs: dict[str, np.ndarray]) -> Any:
                if sum(outputs[name].nbytes for name, _ in requested_outputs(parsed, outputs)) <= INLINE_BINARY_BYTES:
                    return infer_response(model, version, parsed, outputs)
                timeout_s = self.service.settings.request_timeout_s
                return await run_blocking(infer_response, model, version, parsed, outputs, timeout_s=timeout_s)

            return await self.infer(model, request.model_version, decode, encode)

        return await self._answer(context, "ModelInfer", answer, label, traced=model)

    async def ModelStreamInfer(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        """``ldlm_generate``'s previews and results, on a stream (grpc_generate)."""
        metadata = dict(context.invocation_metadata() or ())
        if not self._authorized(metadata):
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED, ())
        async for response in stream_generate(self.service, request_iterator, metadata):
            yield response

    def _authorized(self, metadata: dict[str, Any]) -> bool:
        """No key is set, or the call's ``authorization`` metadata is ``Bearer KEY`` (compared in constant time)."""
        given = str(metadata.get("authorization", "")).encode()
        return self.expected_auth is None or hmac.compare_digest(given, self.expected_auth)

    async def _answer(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        answer: Callable[[], Awaitable[T]],
        model: str | None = None,
        traced: str | None = None,
    ) -> T:
        """``answer()`` once the caller's key is checked; an error is aborted with HTTP's message under its status's
        gRPC code. Logged as HTTP requests are, an infer call counted in its metrics under ``model`` (its label), and
        one of the model ``traced`` (as the call names it) traced while tracing is on."""
        metadata = dict(context.invocation_metadata() or ())
        request_id = str(metadata.get("x-request-id") or uuid.uuid4().hex)
        started, status = time.perf_counter(), 200
        tracing = self.service.tracing
        trace = None if tracing is None or traced is None else tracing.rpc_request(SERVICE + method, metadata, request_id, traced)
        if trace is not None:
            CURRENT.set(trace)  # this call's own task: the handler's context ends with it
        try:
            if not self._authorized(metadata):
                raise HTTPError(401, UNAUTHORIZED)
            return await answer()
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed: grpc cancels the handler
            status = CLIENT_CLOSED
            raise
        except Exception as error:
            status, message, headers = error_status(error)
            if status == 500:  # the process survives; the client learns nothing internal
                log.exception("unhandled error", extra={"request_id": request_id})
                message = f"internal error ({type(error).__name__}); request id {request_id}"
            trailers = (("x-request-id", request_id), *((k.lower(), v) for k, v in headers.items()))
            await abort(context, GRPC_CODES.get(status, grpc.StatusCode.UNKNOWN), message, trailers)
        finally:
            elapsed = time.perf_counter() - started
            if model is not None:
                self.service.metrics.count_request(model, status, elapsed, disconnected=status == CLIENT_CLOSED)
            if trace is not None:
                trace.attributes["rpc.grpc.status_code"] = GRPC_CODES.get(200 if status < 400 else status, grpc.StatusCode.UNKNOWN).value[0]
                trace.end(status)
            log.info(
                "request",
                extra={
                    "request_id": request_id,
                    "method": "gRPC",
                    "path": SERVICE + method,
                    "status": status,
                    "ms": round(1000 * elapsed, 3),
                },
            )


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...]) -> NoReturn:
    """``context.abort``, which ends the call with ``code`` by raising, typed as never returning."""
    await context.abort(code, message, trailers)
    raise RuntimeError("grpc's context.abort returned")  # it raises, always
