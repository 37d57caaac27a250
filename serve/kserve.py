"""KServe v2 / Open Inference Protocol: the request and response codec, JSON and binary tensors.

Binary tensor extension (what ``tritonclient`` sends by default): the body is a JSON header of
``Inference-Header-Content-Length`` bytes followed by the raw tensors, in input order, of every
input whose ``parameters.binary_data_size`` is set. Outputs are returned the same way when the
request asks for them in binary (per output ``binary_data``, or ``binary_data_output`` for all).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

DATATYPES: dict[str, Any] = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_}
KSERVE_NAMES = {"FLOAT": "FP32", "FLOAT16": "FP16", "INT64": "INT64", "INT32": "INT32", "BOOL": "BOOL"}
HEADER_LENGTH = "Inference-Header-Content-Length"


class ProtocolError(ValueError):
    """A request that does not follow the protocol; answered with 400 and this message."""


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]] | None  # (name, binary); None = every output
    binary_outputs: bool  # default for outputs not listed


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo Content-Encoding gzip/deflate without ever holding more than ``limit`` bytes."""
    if not encoding or encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise ProtocolError(f"Content-Encoding {encoding!r} is unsupported; allowed: gzip, deflate, identity")
    decoder = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        out = decoder.decompress(body, limit + 1)
    except zlib.error as error:
        raise ProtocolError(f"body is not valid {encoding} data: {error}") from error
    if len(out) > limit or decoder.unconsumed_tail:
        raise ProtocolError(f"decompressed body exceeds the {limit}-byte limit")
    return out


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    if header_length is not None:
        try:
            json_size = int(header_length)
        except ValueError:
            raise ProtocolError(f"{HEADER_LENGTH}={header_length!r} is not an integer") from None
        if not 0 < json_size <= len(body):
            raise ProtocolError(f"{HEADER_LENGTH}={json_size} is out of range; allowed: 1..{len(body)} (the body size)")
    else:
        json_size = len(body)
    try:
        payload = json.loads(body[:json_size])
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ProtocolError(f"malformed JSON in the request: {error}") from error
    if not isinstance(payload, dict):
        raise ProtocolError("the request must be a JSON object with an 'inputs' list")
    raw_inputs = payload.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError("field 'inputs' must be a non-empty list")
    binary = memoryview(body)[json_size:]
    offset = 0
    inputs: dict[str, np.ndarray] = {}
    for i, spec in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError(f"{where} must be an object with a string 'name'")
        name = spec["name"]
        datatype = spec.get("datatype")
        if datatype not in DATATYPES:
            raise ProtocolError(f"{where} ({name}): datatype {datatype!r} is unsupported; allowed: {', '.join(DATATYPES)}")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ProtocolError(f"{where} ({name}): shape {shape!r} must be a list of integers >= 0")
        dtype = np.dtype(DATATYPES[datatype])
        count = math.prod(shape)
        size = (spec.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if size != count * dtype.itemsize:
                raise ProtocolError(f"{where} ({name}): binary_data_size {size} != {count} elements x {dtype.itemsize} bytes")
            if offset + size > len(binary):
                raise ProtocolError(f"{where} ({name}): binary data is shorter than its binary_data_size {size}")
            array = np.frombuffer(binary[offset : offset + size], dtype=dtype).reshape(shape)
            offset += size
        else:
            if "data" not in spec:
                raise ProtocolError(f"{where} ({name}): has neither 'data' nor parameters.binary_data_size")
            try:
                array = np.asarray(spec["data"], dtype=dtype)
            except (TypeError, ValueError) as error:
                raise ProtocolError(f"{where} ({name}): data does not convert to {datatype}: {error}") from error
            if array.size != count:
                raise ProtocolError(f"{where} ({name}): {array.size} data elements but shape {shape} needs {count}")
            array = array.reshape(shape)
        inputs[name] = array
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} trailing bytes after the binary inputs")
    parameters = payload.get("parameters") or {}
    outputs = None
    if payload.get("outputs") is not None:
        if not isinstance(payload["outputs"], list):
            raise ProtocolError("field 'outputs' must be a list")
        outputs = []
        for i, out in enumerate(payload["outputs"]):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise ProtocolError(f"outputs[{i}] must be an object with a string 'name'")
            outputs.append((out["name"], bool((out.get("parameters") or {}).get("binary_data", False))))
    return InferRequest(payload.get("id"), inputs, outputs, bool(parameters.get("binary_data_output", False)))


def encode_infer_response(
    model: str, version: str, request: InferRequest, outputs: dict[str, np.ndarray]
) -> tuple[bytes, dict[str, str]]:
    """The response body and headers; binary outputs follow the JSON header."""
    wanted = request.outputs if request.outputs is not None else [(n, request.binary_outputs) for n in outputs]
    entries, blobs = [], []
    for name, binary in wanted:
        array = np.ascontiguousarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": _kserve_datatype(array.dtype), "shape": list(array.shape)}
        if binary:
            data = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        else:
            entry["data"] = array.reshape(-1).tolist()
        entries.append(entry)
    header: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request.id is not None:
        header["id"] = request.id
    head = json.dumps(header, separators=(",", ":")).encode()
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(blobs), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


def _kserve_datatype(dtype: np.dtype) -> str:
    for name, np_type in DATATYPES.items():
        if np.dtype(np_type) == dtype:
            return name
    raise ProtocolError(f"output dtype {dtype} has no KServe datatype")


def tensor_metadata(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Manifest I/O specs -> KServe metadata (symbolic axes become -1)."""
    return [
        {"name": s["name"], "datatype": KSERVE_NAMES[s["dtype"]], "shape": [d if isinstance(d, int) else -1 for d in s["shape"]]}
        for s in specs
    ]

