"""Generation over gRPC's ModelStreamInfer: the model ``ldlm_generate``, as Triton serves the decoupled model
of that name (serve/deploy/triton_generate.py), through the same scheduler, limits and previews as /v1/generate
with ``stream: true`` (``GenerationStream``).

Inputs and outputs are ``kserve_models.GENERATE_INPUTS`` and ``GENERATE_OUTPUTS``, Triton's model's own: one value
per input (shape [1]), each /v1/generate's field of the same name in upper case, with its meaning and range. N and
LENGTH are required; one left out is filled in by ``ldlm.sampling.resolve``, as on /v1/generate. PROMPT is text to
continue: LENGTH counts its tokens, and the texts and token ids start with it verbatim. The request parameter
``preview_every`` (k) asks for a preview every k steps. Each request is answered on the stream by one response per
previewed step (TEXTS: the previewed samples' texts; parameters ``preview`` true, ``step``, ``steps`` and
``indices``, the samples' indices as "0,1,..."), then by its result (TEXTS, TOKEN_IDS and PLAN, the plan's JSON, as
Triton's model answers; parameters ``plan``, the same JSON, and ``triton_final_response`` true). A refused or
failed request is one response with its ``error_message``, and the stream goes on. A client that cancels the
stream, or leaves, cancels its requests: the scheduler drops their samples at its next step.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor

from ldlm.pipeline import TextResult, keep_prompt
from ldlm.sampling import GenerateRequest
from ldlm.serve.api.errors import error_status
from ldlm.serve.api.http_guard import CLIENT_CLOSED
from ldlm.serve.api.kserve_models import GENERATE_INPUTS, GENERATE_MODEL, MODEL_VERSION
from ldlm.serve.api.kserve_tensors import ProtocolError
from ldlm.serve.api.offload import Deadline, run_blocking, run_submit
from ldlm.serve.api.prompted import prompt_prefix
from ldlm.serve.api.service import LDLMService
from ldlm.serve.api.streaming import GenerationStream, ran

log = logging.getLogger("ldlm.serve")
INPUTS = {tensor.name: tensor for tensor in GENERATE_INPUTS}
DTYPES = {"INT64": np.int64, "FP32": np.float32}  # of the raw numeric inputs
CONTENTS = {"INT64": "int64_contents", "FP32": "fp32_contents", "BYTES": "bytes_contents"}  # the typed field of each datatype
METRICS_MODEL = "generate"  # /v1/generate's label in /metrics: one count of generations, whichever way they came


async def stream_generate(service: LDLMService, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The ModelStreamInferResponses of a stream of ModelInferRequests for ``ldlm_generate``, each request run
    as it arrives and its answers sent as they come. Leaving the iteration (the client cancelled or left)
    cancels every request still running."""
    answers: asyncio.Queue[Any] = asyncio.Queue()
    running: set[asyncio.Task[None]] = set()

    async def read() -> None:
        try:
            async for request in requests:
                running.add(asyncio.ensure_future(answer(service, request, answers)))
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


async def answer(service: LDLMService, request: Any, answers: asyncio.Queue[Any]) -> None:
    """One request's responses onto ``answers``: its previews and result, or its error; counted and logged
    as a /v1/generate request is."""
    started, status = time.perf_counter(), 200
    try:
        async for response in generate(service, request):
            answers.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))
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
        service.metrics.count_request(METRICS_MODEL, status, elapsed, disconnected=status == CLIENT_CLOSED)
        path = "/inference.GRPCInferenceService/ModelStreamInfer"
        log.info(
            "request", extra={"request_id": request.id, "method": "gRPC", "path": path, "status": status, "ms": round(1000 * elapsed, 3)}
        )


async def generate(service: LDLMService, request: Any) -> AsyncIterator[Any]:
    """One generation's ModelInferResponses: a preview per previewed step, then the result."""
    if request.model_name != GENERATE_MODEL:
        raise ProtocolError(f"model {request.model_name!r} has no stream; allowed: {GENERATE_MODEL} (the others answer ModelInfer)")
    spec, prompt, every = generate_request(service, request)
    deadline = Deadline(service.settings.request_timeout_s)
    steps = service.scheduler.plan(spec).steps  # bad input is refused here, before anything is queued
    prefix, ids = None, []
    if prompt:  # its tokens are encoded (the encoder runs): off the event loop, as /v1/generate does
        prefix, ids = await run_blocking(prompt_prefix, service.pipeline, prompt, spec.length, timeout_s=deadline.left())
    submit = functools.partial(service.submit_generation, deadline_s=deadline.left())
    tokenizer, loop = service.pipeline.tokenizer, asyncio.get_running_loop()
    start = functools.partial(GenerationStream, submit, tokenizer, spec, every, prefix, loop=loop, prompt_ids=ids, steps=steps)
    stream = await run_submit(start, cancel=lambda s: s.future.cancel(), timeout_s=deadline.left())
    async for kind, payload in stream.events(deadline.left()):
        if kind == "preview":
            yield preview_response(request, steps, payload)
        else:
            yield result_response(request, keep_prompt(payload, ids, tokenizer) if ids else payload)


def generate_request(service: LDLMService, request: Any) -> tuple[GenerateRequest, str, int]:
    """The GenerateRequest a ModelInferRequest for ``ldlm_generate`` asks for, its prompt ("": none) and its preview
    cadence (0: none), each value checked against /v1/generate's range under the input's own name."""
    ranges = service.body_limits().ranges()
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs; allowed: one per input, in input order"
        )
    fields: dict[str, Any] = {}
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name})"
        spec = INPUTS.get(tensor.name)
        if spec is None:
            raise ProtocolError(f"{where}: {GENERATE_MODEL} has no such input; allowed: {', '.join(INPUTS)}")
        if tensor.datatype != spec.datatype:
            raise ProtocolError(f"{where}: datatype {tensor.datatype!r}; allowed: {spec.datatype}")
        value = scalar(tensor, raw[i] if raw else None, where)
        if spec.field in ranges:
            ranges[spec.field].check(tensor.name, value)
        fields[spec.field] = value
    missing = [spec.name for spec in GENERATE_INPUTS if spec.required and spec.field not in fields]
    if missing:
        raise ProtocolError(f"{GENERATE_MODEL} needs input {' and '.join(missing)} (INT64, shape [1])")
    every = request.parameters["preview_every"].int64_param if "preview_every" in request.parameters else 0
    if every:
        ranges["preview_every"].check("preview_every", every)
    prompt = fields.pop("prompt", "")
    return GenerateRequest(**fields), prompt, every


def scalar(tensor: Any, raw: bytes | None, where: str) -> Any:
    """The one value of a [1] input, from its raw bytes or its typed contents."""
    if list(tensor.shape) != [1]:
        raise ProtocolError(f"{where}: shape {list(tensor.shape)}; allowed: [1] (one value)")
    if raw is not None:
        values = deserialize_bytes_tensor(raw) if tensor.datatype == "BYTES" else np.frombuffer(raw, DTYPES[tensor.datatype])
    else:
        values = list(getattr(tensor.contents, CONTENTS[tensor.datatype]))
    if len(values) != 1:
        raise ProtocolError(f"{where}: {len(values)} values; allowed: one")
    value = values[0]
    if tensor.datatype == "BYTES":
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            raise ProtocolError(f"{where}: not UTF-8 text; allowed: UTF-8 text") from None
    number = float(value) if tensor.datatype == "FP32" else int(value)
    if not np.isfinite(number):
        raise ProtocolError(f"{where}: data holds NaN or Infinity; allowed: finite numbers")
    return number


def preview_response(request: Any, steps: int, previews: list[dict[str, Any]]) -> Any:
    """One step's previews: TEXTS, and which samples they are of."""
    response = _response(request, {"TEXTS": [p["text"] for p in previews]})
    response.parameters["preview"].bool_param = True
    response.parameters["step"].int64_param = previews[0]["step"]
    response.parameters["steps"].int64_param = steps
    response.parameters["indices"].string_param = ",".join(str(p["index"]) for p in previews)
    return response


def result_response(request: Any, result: TextResult) -> Any:
    """The result, as serve/deploy/triton_generate.py's model answers: TEXTS, TOKEN_IDS and PLAN (the plan that ran,
    as JSON; also the parameter ``plan``, which earlier clients read)."""
    plan = json.dumps(ran(result))
    response = _response(request, {"TEXTS": result.texts, "TOKEN_IDS": result.token_ids.cpu().numpy().astype(np.int64), "PLAN": [plan]})
    response.parameters["preview"].bool_param = False
    response.parameters["plan"].string_param = plan
    response.parameters["triton_final_response"].bool_param = True  # what Triton marks a decoupled model's last response with
    return response


def _response(request: Any, outputs: dict[str, Any]) -> Any:
    response = service_pb2.ModelInferResponse(model_name=GENERATE_MODEL, model_version=MODEL_VERSION, id=request.id)
    for name, value in outputs.items():
        if isinstance(value, list):  # texts: BYTES, each UTF-8 with its 4-byte length before it
            raw = b"".join(struct.pack("<I", len(text)) + text for text in (t.encode() for t in value))
            response.outputs.add(name=name, datatype="BYTES", shape=[len(value)])
        else:
            raw = np.ascontiguousarray(value).tobytes()
            response.outputs.add(name=name, datatype="INT64", shape=list(value.shape))
        response.raw_output_contents.append(raw)
    return response
