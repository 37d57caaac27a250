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

from ldlm.serve.api.kserve_tensors import DATATYPES, ProtocolError, bytes_tensor, json_tensor, tensor_bytes

KSERVE_NAMES = {"FLOAT": "FP32", "FLOAT16": "FP16", "INT64": "INT64", "INT32": "INT32", "BOOL": "BOOL"}
HEADER_LENGTH = "Inference-Header-Content-Length"


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


# The protocol's fields (KServe v2 / Triton): a misspelled one ("outptus") is refused, not ignored.
REQUEST_FIELDS = ("id", "parameters", "inputs", "outputs")
INPUT_FIELDS = ("name", "shape", "datatype", "parameters", "data")
OUTPUT_FIELDS = ("name", "parameters")


def refuse_unknown_fields(holder: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = [key for key in holder if key not in allowed]
    if unknown:
        raise ProtocolError(f"{where}: unknown field {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """Decode a KServe v2 infer body. Every value is checked before it becomes an array: types are
    exact (no bool for an integer, no float silently cast to an int), integers fit their datatype,
    floats are finite, and the tensor names its place in the request (``inputs[1] (attention_mask)``)."""
    json_size = _json_header_size(body, header_length)
    return infer_request_of(load_json(body[:json_size]), memoryview(body)[json_size:])


def infer_request_of(payload: Any, binary: memoryview) -> InferRequest:
    """The checks of ``parse_infer_request`` on a header already decoded (``payload``, JSON's types) and the
    binary section after it: what a gRPC request is read as, without writing and reading JSON text."""
    if not isinstance(payload, dict):
        raise ProtocolError("the request must be a JSON object with an 'inputs' list")
    refuse_unknown_fields(payload, REQUEST_FIELDS, "the request")
    raw_inputs = payload.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError("field 'inputs' must be a non-empty list")
    if payload.get("id") is not None and not isinstance(payload["id"], str):
        raise ProtocolError(f"field 'id' must be a string, not {type(payload['id']).__name__}")
    offset = 0
    inputs: dict[str, np.ndarray] = {}
    for i, spec in enumerate(raw_inputs):
        name, where = _input_name(spec, i)
        if name in inputs:
            raise ProtocolError(f"{where}: input {name!r} is given twice")
        inputs[name], offset = _input_tensor(spec, where, binary, offset)
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} trailing bytes after the binary inputs")
    parameters = _parameters(payload, "the request")
    return InferRequest(payload.get("id"), inputs, _output_requests(payload), _flag(parameters, "binary_data_output", "the request"))


def _json_header_size(body: bytes, header_length: str | None) -> int:
    """The JSON header's length: the whole body, or Inference-Header-Content-Length bytes of it."""
    if header_length is None:
        return len(body)
    try:
        json_size = int(header_length)
    except ValueError:
        raise ProtocolError(f"{HEADER_LENGTH}={header_length!r} is not an integer") from None
    if not 0 < json_size <= len(body):
        raise ProtocolError(f"{HEADER_LENGTH}={json_size} is out of range; allowed: 1..{len(body)} (the body size)")
    return json_size


def _input_name(spec: Any, i: int) -> tuple[str, str]:
    """Input ``i``'s name, and where it is in the request for messages, once its fields are known ones."""
    where = f"inputs[{i}]"
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ProtocolError(f"{where} must be an object with a string 'name'")
    name = spec["name"]
    where = f"{where} ({name})"
    refuse_unknown_fields(spec, INPUT_FIELDS, where)
    return name, where


def _input_tensor(spec: dict[str, Any], where: str, binary: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """One input as an array, from its JSON data or from the binary section at ``offset``, and the
    offset of the next binary input."""
    datatype = spec.get("datatype")
    if datatype not in DATATYPES:
        raise ProtocolError(f"{where}: datatype {datatype!r} is unsupported; allowed: {', '.join(DATATYPES)}")
    shape = spec.get("shape")
    # type() is int: JSON true/false are Python bools, which isinstance(..., int) accepts
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**31 for d in shape) or len(shape) > 8:
        raise ProtocolError(f"{where}: shape {shape!r} is invalid; allowed: a list of at most 8 integers in 0..2**31-1")
    dtype = np.dtype(DATATYPES[datatype])
    count = math.prod(shape)
    size = _parameters(spec, where).get("binary_data_size")
    if size is not None:
        if dtype.kind == "O" and (type(size) is not int or size < 0):  # BYTES: elements of their own lengths
            raise ProtocolError(f"{where}: binary_data_size {size!r} is invalid; allowed: the byte size of the BYTES data")
        if dtype.kind != "O" and (type(size) is not int or size != count * dtype.itemsize):
            raise ProtocolError(
                f"{where}: binary_data_size {size!r} is invalid; allowed: {count} elements x {dtype.itemsize} bytes "
                f"= {count * dtype.itemsize}"
            )
        if offset + size > len(binary):
            raise ProtocolError(f"{where}: binary data is shorter than its binary_data_size {size}")
        data = binary[offset : offset + size]
        array = bytes_tensor(data, count, where) if dtype.kind == "O" else np.frombuffer(data, dtype=dtype)
        array = array.reshape(shape)
        offset += size
    else:
        if "data" not in spec:
            raise ProtocolError(f"{where}: has neither 'data' nor parameters.binary_data_size")
        array = json_tensor(spec["data"], datatype, dtype, where)
        if array.size != count:
            raise ProtocolError(f"{where}: {array.size} data elements but shape {shape} needs {count}")
        array = array.reshape(shape)
    if dtype.kind == "f" and not np.isfinite(array).all():
        raise ProtocolError(f"{where}: data holds NaN or Infinity; allowed: finite numbers")
    return array, offset


def _output_requests(payload: dict[str, Any]) -> list[tuple[str, bool]] | None:
    """(name, binary) of each output the request lists, or None when it lists none (every output)."""
    if payload.get("outputs") is None:
        return None
    if not isinstance(payload["outputs"], list):
        raise ProtocolError("field 'outputs' must be a list")
    outputs = []
    for i, out in enumerate(payload["outputs"]):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise ProtocolError(f"outputs[{i}] must be an object with a string 'name'")
        refuse_unknown_fields(out, OUTPUT_FIELDS, f"outputs[{i}] ({out['name']})")
        outputs.append((out["name"], _flag(_parameters(out, f"outputs[{i}]"), "binary_data", f"outputs[{i}]")))
    return outputs


def load_json(text: bytes | str) -> Any:
    """json.loads with the failures a client can cause turned into one readable ProtocolError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ProtocolError(f"the body is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    except UnicodeDecodeError as error:
        raise ProtocolError(f"the body is not valid UTF-8 JSON: {error.reason} at byte {error.start}") from None
    except RecursionError:  # the C decoder recurses once per nesting level
        raise ProtocolError("the body's JSON is nested too deeply; allowed: a few levels (tensors are flat or nested by shape)") from None


def _parameters(holder: dict[str, Any], where: str) -> dict[str, Any]:
    parameters = holder.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise ProtocolError(f"{where}: 'parameters' must be an object, not {type(parameters).__name__}")
    return parameters


def _flag(parameters: dict[str, Any], key: str, where: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError(f"{where}: parameters.{key}={value!r} is invalid; allowed: true or false")
    return value


def encode_infer_response(model: str, version: str, request: InferRequest, outputs: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response body and headers; binary outputs follow the JSON header."""
    entries: list[str] = []
    blobs: list[memoryview] = []
    for name, binary in requested_outputs(request, outputs):
        array = np.ascontiguousarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": kserve_datatype(array.dtype), "shape": list(array.shape)}
        if binary:
            # a view (the join below is the one copy); BYTES: its elements, each after its length
            blob = memoryview(tensor_bytes(array)) if array.dtype.kind == "O" else array.reshape(-1).view(np.uint8).data
            entry["parameters"] = {"binary_data_size": blob.nbytes}
            blobs.append(blob)
            entries.append(json.dumps(entry, separators=(",", ":")))
        else:
            entries.append(json.dumps(entry, separators=(",", ":"))[:-1] + ',"data":' + json_data(array) + "}")
    header = json.dumps({"model_name": model, "model_version": version}, separators=(",", ":"))[:-1]
    identity = "" if request.id is None else ',"id":' + json.dumps(request.id)
    head = f'{header},"outputs":[{",".join(entries)}]{identity}}}'.encode()
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return b"".join([head, *blobs]), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


def json_data(array: np.ndarray) -> str:
    """A tensor's values as a flat JSON list. Finite FP32 and FP16 values are written with 9 significant
    digits, which give back every float32 exactly, at a third of the cost of the shortest float64 form
    json.dumps writes (1 ms for 1024 values on a slow core); everything else as json.dumps writes it."""
    values = array.reshape(-1).tolist()
    if array.dtype.kind == "O":  # BYTES: strings (the texts this server answers are UTF-8)
        return json.dumps([v.decode() if isinstance(v, bytes) else v for v in values], separators=(",", ":"))
    if array.dtype in (np.float32, np.float16) and values and np.isfinite(array).all():
        return "[" + ",".join(["%.9g"] * len(values)) % tuple(values) + "]"
    return json.dumps(values, separators=(",", ":"))


def requested_outputs(request: InferRequest, outputs: dict[str, np.ndarray]) -> list[tuple[str, bool]]:
    """(name, binary) of each output to return: those asked for, or all in the request's default form."""
    return request.outputs if request.outputs is not None else [(n, request.binary_outputs) for n in outputs]


def json_bytes(payload: dict[str, Any]) -> bytes:
    """Compact JSON with NumPy arrays as nested lists (a JSON worker runs this for large payloads)."""
    return json.dumps({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in payload.items()}, separators=(",", ":")).encode()


def parse_body(body: bytes, encoding: str | None, header_length: str | None, limit: int) -> InferRequest:
    """decompress, then parse_infer_request: the whole decoding of one infer body, as one picklable call."""
    return parse_infer_request(decompress(body, encoding, limit), header_length)


def kserve_datatype(dtype: np.dtype) -> str:
    """The KServe v2 datatype name of a NumPy dtype ("INT64" for int64)."""
    for name, np_type in DATATYPES.items():
        if np.dtype(np_type) == dtype:
            return name
    raise ProtocolError(f"dtype {dtype} has no KServe datatype; allowed: {', '.join(np.dtype(t).name for t in DATATYPES.values())}")


def tensor_metadata(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Manifest I/O specs -> KServe metadata (symbolic axes become -1)."""
    return [
        {"name": s["name"], "datatype": KSERVE_NAMES[s["dtype"]], "shape": [d if isinstance(d, int) else -1 for d in s["shape"]]}
        for s in specs
    ]
