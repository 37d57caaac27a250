"""A gRPC ModelInferRequest read as the KServe v2 binary-tensor body it stands for, and a ModelInferResponse
written from outputs: how gRPC's infer calls (grpc_kserve) and ldlm_generate's stream (grpc_generate) meet the
one codec that reads and writes HTTP's bodies (``kserve``), so both transports are read and checked alike."""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from ldlm.serve.api.kserve import InferRequest, kserve_datatype, requested_outputs
from ldlm.serve.api.kserve_tensors import ProtocolError, tensor_bytes

# The typed field of InferTensorContents that holds each datatype's values (FP16 has none: raw only).
CONTENTS = {
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "INT64": "int64_contents",
    "INT32": "int_contents",
    "BOOL": "bool_contents",
    "BYTES": "bytes_contents",
}


def infer_payload(request: Any) -> tuple[dict[str, Any], bytes, int]:
    """What the KServe v2 binary-tensor body a ModelInferRequest stands for decodes to: its JSON header (each
    ``raw_input_contents[i]`` input i's binary data, each input's typed ``contents`` its JSON data), its binary
    section, and the number of typed values in the header."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs; allowed: one per input, in input order"
        )
    inputs: list[dict[str, Any]] = []
    values = 0
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name})"
        spec: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if raw:
            if tensor.HasField("contents"):
                raise ProtocolError(f"{where}: has both contents and raw_input_contents; allowed: one of them for every input")
            spec["parameters"] = {"binary_data_size": len(raw[i])}
        elif tensor.HasField("contents"):
            spec["data"] = typed_contents(tensor, where)
            values += len(spec["data"])
        inputs.append(spec)
    payload: dict[str, Any] = {"inputs": inputs, "outputs": [{"name": out.name} for out in request.outputs] or None}
    if request.id:
        payload["id"] = request.id
    return payload, b"".join(raw), values


def typed_contents(tensor: Any, where: str) -> list[Any]:
    """An input's values from the one typed field of ``contents`` its datatype reads."""
    field = CONTENTS.get(tensor.datatype)
    given = [descriptor.name for descriptor, _ in tensor.contents.ListFields()]
    if field is None and tensor.datatype == "FP16":
        raise ProtocolError(f"{where}: FP16 data has no contents field; allowed: raw_input_contents")
    if field is not None and given not in ([field], []):
        raise ProtocolError(f"{where}: {tensor.datatype} data is in contents.{', contents.'.join(given)}; allowed: contents.{field}")
    return list(getattr(tensor.contents, field)) if field is not None else []


def infer_response(model: str, version: str, parsed: InferRequest, outputs: dict[str, np.ndarray]) -> Any:
    """The ModelInferResponse of ``outputs``: the outputs asked for (or all), in raw_output_contents."""
    response = service_pb2.ModelInferResponse(model_name=model, model_version=version, id=parsed.id or "")
    return with_outputs(response, [(name, outputs[name]) for name, _ in requested_outputs(parsed, outputs)])


def with_outputs(response: Any, outputs: list[tuple[str, np.ndarray]]) -> Any:
    """``response`` (a ModelInferResponse) with ``outputs`` added, in order, their data in raw_output_contents."""
    for name, array in outputs:
        response.outputs.add(name=name, datatype=kserve_datatype(array.dtype), shape=array.shape)
        response.raw_output_contents.append(tensor_bytes(array))
    return response
