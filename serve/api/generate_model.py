"""The model ``ldlm_generate`` among ldlm serve's KServe v2 models, as Triton serves the model of that name
(serve/deploy/triton_generate.py), so that one client works against both: ModelInfer, over HTTP and gRPC,
answers a generation's result; gRPC's ModelStreamInfer also streams its previews (grpc_generate).

Inputs and outputs are ``kserve_models.GENERATE_INPUTS`` and ``GENERATE_OUTPUTS``: one value per input (shape
[1]), each /v1/generate's field of the same name in upper case, with its meaning and range. N and LENGTH are
required; one left out is filled in by ``ldlm.sampling.resolve``, as on /v1/generate. PROMPT is text to
continue: LENGTH counts its tokens, and the texts and token ids start with it verbatim. The answer is TEXTS
[N] (BYTES, UTF-8), TOKEN_IDS [N, LENGTH] (INT64) and PLAN [1] (the plan that ran, as JSON). A request is read
by the one KServe codec, whichever transport brought it, then checked here; it runs as /v1/generate's does
(``streaming.generate_texts``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from ldlm.pipeline import TextResult
from ldlm.sampling import GenerateRequest
from ldlm.serve.api.errors import HTTPError
from ldlm.serve.api.kserve import InferRequest, kserve_datatype
from ldlm.serve.api.kserve_models import GENERATE_INPUTS, GENERATE_MODEL, GENERATE_OUTPUTS
from ldlm.serve.api.kserve_tensors import ProtocolError, object_array
from ldlm.serve.api.offload import Deadline
from ldlm.serve.api.service import LDLMService
from ldlm.serve.api.streaming import generate_texts, ran

INPUTS = {tensor.name: tensor for tensor in GENERATE_INPUTS}
OUTPUTS = [tensor.name for tensor in GENERATE_OUTPUTS]


def generate_fields(service: LDLMService, inputs: Mapping[str, np.ndarray]) -> tuple[GenerateRequest, str]:
    """The GenerateRequest an infer request's decoded ``inputs`` ask for, and its prompt ("": none): every input
    one of the model's, of its datatype and shape [1], each value checked against /v1/generate's range under the
    input's own name (N=0 is out of range ...)."""
    ranges = service.request_ranges
    fields: dict[str, Any] = {}
    for name, array in inputs.items():
        spec = INPUTS.get(name)
        if spec is None:
            raise ProtocolError(f"input {name}: {GENERATE_MODEL} has no such input; allowed: {', '.join(INPUTS)}")
        datatype = kserve_datatype(array.dtype)
        if datatype != spec.datatype:
            raise ProtocolError(f"input {name}: datatype {datatype!r}; allowed: {spec.datatype}")
        if array.shape != (1,):
            raise ProtocolError(f"input {name}: shape {list(array.shape)}; allowed: [1] (one value)")
        value = python_value(array[0], name)
        if spec.field in ranges:
            ranges[spec.field].check(name, value)
        fields[spec.field] = value
    missing = [spec.name for spec in GENERATE_INPUTS if spec.required and spec.field not in fields]
    if missing:
        raise ProtocolError(f"{GENERATE_MODEL} needs input {' and '.join(missing)} (INT64, shape [1])")
    prompt = fields.pop("prompt", "")
    return GenerateRequest(**fields), prompt


def python_value(value: Any, name: str) -> Any:
    """A decoded input's one value as Python's: text from UTF-8 bytes, an int or a float from a NumPy scalar."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise ProtocolError(f"input {name}: not UTF-8 text; allowed: UTF-8 text") from None
    return value.item()


def check_outputs(parsed: InferRequest) -> None:
    """What a decoded infer request of ldlm_generate must ask for: outputs the model has (its inputs are read, and
    checked, once, as it runs: ``infer_generate``)."""
    unknown = [name for name, _ in parsed.outputs or [] if name not in OUTPUTS]
    if unknown:
        raise HTTPError(400, f"unknown outputs {unknown}; {GENERATE_MODEL} has {OUTPUTS}")


async def infer_generate(service: LDLMService, parsed: InferRequest) -> dict[str, np.ndarray]:
    """One infer request of ldlm_generate (decoded, its outputs checked), its inputs read and checked
    (``generate_fields``), run as /v1/generate runs it: its outputs."""
    spec, prompt = generate_fields(service, parsed.inputs)
    result = await generate_texts(service, spec, prompt, Deadline(service.settings.request_timeout_s))
    return result_outputs(result)


def result_outputs(result: TextResult) -> dict[str, np.ndarray]:
    """A generation's answer as ldlm_generate's outputs: TEXTS, TOKEN_IDS and PLAN (the plan that ran, as JSON)."""
    return {
        "TEXTS": object_array([text.encode() for text in result.texts]),
        "TOKEN_IDS": result.token_ids.cpu().numpy().astype(np.int64),
        "PLAN": object_array([json.dumps(ran(result)).encode()]),
    }
