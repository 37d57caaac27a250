"""Generation over gRPC's ModelStreamInfer: the model ``ldlm_generate`` (generate_model), as Triton serves the
model of that name (serve/deploy/triton_generate.py), through the same scheduler, limits and previews as
/v1/generate with ``stream: true`` (``GenerationStream``).

A request is read as an infer request of ldlm_generate is (``generate_model.generate_fields``, after the one
KServe codec). The request parameter ``preview_every`` (k) asks for a preview every k steps. Each request is
answered on the stream by one response per previewed step (TEXTS: the previewed samples' texts; parameters
``preview`` true, ``step``, ``steps`` and ``indices``, the samples' indices as "0,1,..."), then by its result
(TEXTS, TOKEN_IDS and PLAN, as an infer request's; parameters ``plan``, the same JSON, and
``triton_final_response`` true). A refused or failed request is one response with its ``error_message``, and the
stream goes on. A client that cancels the stream, or leaves, cancels its requests: the scheduler drops their
samples at its next step. Requests count in ldlm_generate's statistics as its infer requests do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from tritonclient.grpc import service_pb2

from ldlm.pipeline import TextResult, keep_prompt
from ldlm.sampling import GenerateRequest
from ldlm.serve.api.errors import error_status
from ldlm.serve.api.generate_model import generate_fields, result_outputs
from ldlm.serve.api.grpc_tensors import infer_payload, with_outputs
from ldlm.serve.api.http_guard import CLIENT_CLOSED
from ldlm.serve.api.kserve import infer_request_of
from ldlm.serve.api.kserve_models import GENERATE_LABEL, GENERATE_MODEL, MODEL_VERSION
from ldlm.serve.api.kserve_tensors import ProtocolError, object_array
from ldlm.serve.api.metrics import InferClock
from ldlm.serve.api.offload import Deadline
from ldlm.serve.api.service import LDLMService
from ldlm.serve.api.streaming import start_stream
from ldlm.serve.runtime.tracing import CURRENT

log = logging.getLogger("ldlm.serve")
STREAM_PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


async def stream_generate(service: LDLMService, requests: AsyncIterator[Any], metadata: Mapping[str, Any]) -> AsyncIterator[Any]:
    """The ModelStreamInferResponses of a stream of ModelInferRequests for ``ldlm_generate``, each request run
    as it arrives and its answers sent as they come. Leaving the iteration (the client cancelled or left)
    cancels every request still running. ``metadata``: the stream's (a ``traceparent`` in it is each request's parent)."""
    answers: asyncio.Queue[Any] = asyncio.Queue()
    running: set[asyncio.Task[None]] = set()

    async def read() -> None:
        try:
            async for request in requests:
                running.add(asyncio.ensure_future(answer(service, request, answers, metadata)))
            await asyncio.gather(*running)  # the client is done sending: its requests still finish
        finally:
            answers.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        while (response := await answers.get()) is not None:
            yield response
        await reader  # an error reading the stream ends it, as such
    finally:
        for task in (reader, *running):
            task.cancel()


async def answer(service: LDLMService, request: Any, answers: asyncio.Queue[Any], metadata: Mapping[str, Any]) -> None:
    """One request's responses onto ``answers``: its previews and result, or its error; counted, logged and traced
    as a /v1/generate request is (its own task: the trace set here is its own)."""
    started, status = time.perf_counter(), 200
    trace = None if service.tracing is None else service.tracing.rpc_request(STREAM_PATH, metadata, request.id, GENERATE_MODEL)
    if trace is not None:
        CURRENT.set(trace)
    try:
        with service.metrics.timed_infer(GENERATE_LABEL) as clock:
            async for response in generate(service, request, clock):
                answers.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))
        if trace is not None:
            trace.delivered = time.perf_counter()
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    except Exception as error:
        status, message, _ = error_status(error)
        if status == 500:  # the client learns nothing internal
            log.exception("unhandled error")
            message = f"internal error ({type(error).__name__})"
        refused = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        answers.put_nowait(service_pb2.ModelStreamInferResponse(error_message=message, infer_response=refused))
    finally:
        elapsed = time.perf_counter() - started
        service.metrics.count_request(GENERATE_LABEL, status, elapsed, disconnected=status == CLIENT_CLOSED)
        log.info(
            "request",
            extra={"request_id": request.id, "method": "gRPC", "path": STREAM_PATH, "status": status, "ms": round(1000 * elapsed, 3)},
        )
        if trace is not None:
            trace.end(status)  # a request on a stream has no gRPC status of its own: its error is in-band


async def generate(service: LDLMService, request: Any, clock: InferClock) -> AsyncIterator[Any]:
    """One generation's ModelInferResponses: a preview per previewed step, then the result; ``clock`` marks when
    the request was read and when its result came."""
    if request.model_name != GENERATE_MODEL:
        raise ProtocolError(f"model {request.model_name!r} has no stream; allowed: {GENERATE_MODEL} (the others answer ModelInfer)")
    spec, prompt, every = stream_request(service, request)
    clock.decoded = time.perf_counter()
    deadline = Deadline(service.settings.request_timeout_s)
    stream, ids, steps = await start_stream(service, spec, prompt, every, deadline, STREAM_PATH)
    async for kind, payload in stream.events(deadline.left()):
        if kind == "preview":
            yield preview_response(request, steps, payload)
        else:
            clock.computed = time.perf_counter()
            yield result_response(request, keep_prompt(payload, ids, service.pipeline.tokenizer) if ids else payload)


def stream_request(service: LDLMService, request: Any) -> tuple[GenerateRequest, str, int]:
    """The GenerateRequest a ModelInferRequest for ``ldlm_generate`` asks for, its prompt ("": none) and its preview
    cadence (0: none): read by the KServe codec, then as an infer request of the model is."""
    payload, binary, _ = infer_payload(request)
    spec, prompt = generate_fields(service, infer_request_of(payload, memoryview(binary)).inputs)
    every = request.parameters["preview_every"].int64_param if "preview_every" in request.parameters else 0
    if every:
        service.request_ranges["preview_every"].check("preview_every", every)
    return spec, prompt, every


def preview_response(request: Any, steps: int, previews: list[dict[str, Any]]) -> Any:
    """One step's previews: TEXTS, and which samples they are of."""
    response = with_outputs(_response(request), [("TEXTS", object_array([p["text"].encode() for p in previews]))])
    response.parameters["preview"].bool_param = True
    response.parameters["step"].int64_param = previews[0]["step"]
    response.parameters["steps"].int64_param = steps
    response.parameters["indices"].string_param = ",".join(str(p["index"]) for p in previews)
    return response


def result_response(request: Any, result: TextResult) -> Any:
    """The result, as an infer request of ldlm_generate answers it (TEXTS, TOKEN_IDS and PLAN), with the plan's JSON
    also in the parameter ``plan``, which earlier clients read."""
    outputs = result_outputs(result)
    response = with_outputs(_response(request), list(outputs.items()))
    response.parameters["preview"].bool_param = False
    response.parameters["plan"].string_param = outputs["PLAN"][0].decode()
    response.parameters["triton_final_response"].bool_param = True  # what Triton marks a decoupled model's last response with
    return response


def _response(request: Any) -> Any:
    return service_pb2.ModelInferResponse(model_name=GENERATE_MODEL, model_version=MODEL_VERSION, id=request.id)
