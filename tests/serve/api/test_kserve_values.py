"""The KServe v2 codec against hand-built bodies: every binary tensor read from its own offset,
compressed bodies capped at the limit to the byte, responses that decode back to the arrays."""

from __future__ import annotations

import gzip
import json
import zlib

import numpy as np
import pytest

from ldlm.serve.api.kserve import HEADER_LENGTH, InferRequest, decompress, encode_infer_response, parse_infer_request
from ldlm.serve.api.kserve_tensors import ProtocolError


def binary_body(arrays: dict[str, tuple[str, np.ndarray]], json_inputs: dict[str, tuple[str, list]] | None = None) -> tuple[bytes, str]:
    """A tritonclient-style body: JSON header, then the raw tensors in input order."""
    inputs, blobs = [], []
    for name, (datatype, array) in arrays.items():
        raw = np.ascontiguousarray(array).tobytes()
        inputs.append({"name": name, "shape": list(array.shape), "datatype": datatype, "parameters": {"binary_data_size": len(raw)}})
        blobs.append(raw)
    for name, (datatype, data) in (json_inputs or {}).items():
        inputs.append({"name": name, "shape": [len(data)], "datatype": datatype, "data": data})
    head = json.dumps({"inputs": inputs}).encode()
    return head + b"".join(blobs), str(len(head))


def test_each_binary_input_is_read_from_its_own_offset() -> None:
    ids = np.arange(6, dtype=np.int64).reshape(2, 3) + 100
    mask = np.array([[1, 1, 0], [1, 0, 0]], dtype=np.int64)  # same size as ids, other values
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 2, 2)
    body, header = binary_body(
        {"input_ids": ("INT64", ids), "attention_mask": ("INT64", mask), "x": ("FP32", x)}, {"t": ("FP32", [0.25, 0.75])}
    )
    parsed = parse_infer_request(body, header)
    np.testing.assert_array_equal(parsed.inputs["input_ids"], ids)
    np.testing.assert_array_equal(parsed.inputs["attention_mask"], mask)
    np.testing.assert_array_equal(parsed.inputs["x"], x)
    np.testing.assert_array_equal(parsed.inputs["t"], np.array([0.25, 0.75], np.float32))
    assert parsed.inputs["x"].dtype == np.float32 and parsed.inputs["input_ids"].dtype == np.int64
    with pytest.raises(ProtocolError, match="4 trailing bytes"):
        parse_infer_request(body + b"abcd", header)
    with pytest.raises(ProtocolError, match="shorter than its binary_data_size"):
        parse_infer_request(body[:-1], header)


def test_json_inputs_keep_shape_and_dtype() -> None:
    body = json.dumps(
        {
            "id": "r1",
            "inputs": [{"name": "a", "shape": [2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}, {"name": "z"}],
        }
    ).encode()
    parsed = parse_infer_request(body, None)
    assert parsed.id == "r1" and parsed.outputs == [("y", True), ("z", False)] and parsed.binary_outputs is False
    np.testing.assert_array_equal(parsed.inputs["a"], np.array([[1, 2], [3, 4]], np.int32))
    assert parsed.inputs["a"].dtype == np.int32


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_bodies_and_the_exact_limit(encoding: str) -> None:
    raw = bytes(range(256)) * 8  # 2048 bytes
    packed = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    assert decompress(packed, encoding, limit=2048) == raw  # exactly at the limit: accepted
    with pytest.raises(ProtocolError, match="exceeds the 2047-byte limit"):
        decompress(packed, encoding, limit=2047)  # one byte over: refused
    bomb = gzip.compress(b"\0" * (1 << 20)) if encoding == "gzip" else zlib.compress(b"\0" * (1 << 20))
    with pytest.raises(ProtocolError, match="exceeds the 4096-byte limit"):
        decompress(bomb, encoding, limit=4096)
    with pytest.raises(ProtocolError, match=f"not valid {encoding}"):
        decompress(b"plain text", encoding, limit=4096)
    assert decompress(b"as is", None, 10) == b"as is" and decompress(b"as is", "identity", 10) == b"as is"
    with pytest.raises(ProtocolError, match="'br' is unsupported"):
        decompress(b"x", "br", 10)


def test_response_binary_and_json_outputs_decode_back() -> None:
    y = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    z = np.array([[3, 1]], dtype=np.int64)
    request = InferRequest("abc", {}, [("y", True), ("z", False)], False)
    content, headers = encode_infer_response("decoder", "1", request, {"y": y, "z": z})
    size = int(headers[HEADER_LENGTH])
    head = json.loads(content[:size])
    assert head["id"] == "abc" and head["model_name"] == "decoder" and head["model_version"] == "1"
    y_entry, z_entry = head["outputs"]
    assert y_entry == {"name": "y", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}}
    np.testing.assert_array_equal(np.frombuffer(content[size:], np.float32).reshape(2, 3), y)
    assert z_entry == {"name": "z", "datatype": "INT64", "shape": [1, 2], "data": [3, 1]}
    # nothing requested: every output, in JSON unless binary_data_output
    content, headers = encode_infer_response("decoder", "1", InferRequest(None, {}, None, False), {"z": z})
    assert headers == {"Content-Type": "application/json"} and json.loads(content)["outputs"][0]["data"] == [3, 1]


def test_kserve_datatype_names_each_numpy_dtype() -> None:
    from ldlm.serve.api.kserve import kserve_datatype

    assert [kserve_datatype(np.dtype(t)) for t in ("float32", "float16", "float64", "int64", "int32", "bool")] == [
        "FP32",
        "FP16",
        "FP64",
        "INT64",
        "INT32",
        "BOOL",
    ]
    with pytest.raises(ProtocolError, match="dtype uint8 has no KServe datatype; allowed: float32, float16"):
        kserve_datatype(np.dtype("uint8"))


def test_json_float_outputs_decode_back_exactly() -> None:
    """FP32 and FP16 data in JSON give back every value bit for bit as its own type (9 digits for float32),
    FP64 keeps float64's, and a non-finite value is written as json.dumps writes it."""
    rng = np.random.default_rng(7)
    outputs = {
        "f32": np.concatenate([rng.standard_normal(500), [1e-38, 3.4e38, -0.0, 1 / 3]]).astype(np.float32).reshape(2, -1),
        "f16": rng.standard_normal(64).astype(np.float16),
        "f64": rng.standard_normal(64),
        "nan": np.array([np.nan, np.inf, 1.0], dtype=np.float32),
    }
    content, _ = encode_infer_response("decoder", "1", InferRequest("q", {}, None, False), outputs)
    decoded = {entry["name"]: entry for entry in json.loads(content)["outputs"]}
    for name, array in outputs.items():
        got = np.array(decoded[name]["data"], dtype=array.dtype).reshape(decoded[name]["shape"])
        np.testing.assert_array_equal(got, array)
    assert '"data":[NaN,Infinity,1.0]' in content.decode()
