"""BYTES tensors in the KServe codec, against tritonclient's own serializer (the form Triton's clients and servers
write): JSON strings and binary elements (each after its 4-byte length) decode to the same bytes, a binary section
that is not whole elements is refused naming the form, outputs encode back to what tritonclient deserializes, and a
gRPC request's bytes_contents and raw_input_contents read alike."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient's serializer is the reference (pip install -e .[test])")

from tritonclient.grpc import service_pb2  # noqa: E402
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor  # noqa: E402

from ldlm.serve.api.grpc_tensors import infer_payload, infer_response  # noqa: E402
from ldlm.serve.api.kserve import HEADER_LENGTH, InferRequest, encode_infer_response, infer_request_of, parse_infer_request  # noqa: E402
from ldlm.serve.api.kserve_tensors import ProtocolError, object_array  # noqa: E402

TEXTS = ["It is a truth", "", "caf\u00e9 \u2014 \U0001f600"]


def binary_body(values: list[bytes], size: int | None = None) -> tuple[bytes, str]:
    raw = serialize_byte_tensor(np.array(values, dtype=np.object_)).item()
    spec = {"name": "PROMPT", "datatype": "BYTES", "shape": [len(values)], "parameters": {"binary_data_size": size or len(raw)}}
    header = json.dumps({"inputs": [spec]}).encode()
    return header + raw, str(len(header))


def test_json_strings_and_binary_elements_read_alike() -> None:
    encoded = [t.encode() for t in TEXTS]
    body, length = binary_body(encoded)
    from_binary = parse_infer_request(body, length).inputs["PROMPT"]
    from_json = parse_infer_request(
        json.dumps({"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [3], "data": TEXTS}]}).encode(), None
    )
    assert from_binary.dtype == np.object_ and from_binary.tolist() == encoded
    assert from_json.inputs["PROMPT"].tolist() == encoded


@pytest.mark.parametrize(
    "cut",
    [
        lambda raw: raw[:-1],  # the last element shorter than its length says
        lambda raw: raw + b"\x00",  # a byte after the last element
        lambda raw: raw[:2],  # a length cut in half
    ],
    ids=["short", "trailing", "half-length"],
)
def test_binary_that_is_not_whole_elements_is_refused(cut) -> None:
    raw = serialize_byte_tensor(np.array([b"ab", b"cde"], dtype=np.object_)).item()
    bad = cut(raw)
    header = json.dumps(
        {"inputs": [{"name": "P", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(bad)}}]}
    ).encode()
    with pytest.raises(ProtocolError, match=r"inputs\[0\] \(P\): BYTES binary data is not 2 elements; allowed: each element's 4-byte"):
        parse_infer_request(header + bad, str(len(header)))


def test_json_bytes_data_must_be_strings() -> None:
    body = json.dumps({"inputs": [{"name": "P", "datatype": "BYTES", "shape": [2], "data": ["a", 3]}]}).encode()
    with pytest.raises(ProtocolError, match=r"BYTES data holds int values; allowed: strings"):
        parse_infer_request(body, None)


def test_outputs_encode_to_what_tritonclient_reads() -> None:
    outputs = {"TEXTS": object_array([t.encode() for t in TEXTS]), "IDS": np.arange(6, dtype=np.int64).reshape(2, 3)}
    binary, headers = encode_infer_response("m", "1", InferRequest(None, {}, None, True), outputs)
    head = json.loads(binary[: int(headers[HEADER_LENGTH])])
    texts = head["outputs"][0]
    assert texts["datatype"] == "BYTES" and texts["shape"] == [3]
    start = int(headers[HEADER_LENGTH])
    raw = binary[start : start + texts["parameters"]["binary_data_size"]]
    assert deserialize_bytes_tensor(raw).tolist() == [t.encode() for t in TEXTS]
    as_json, _ = encode_infer_response("m", "1", InferRequest(None, {}, None, False), outputs)
    assert json.loads(as_json)["outputs"][0]["data"] == TEXTS
    grpc_answer = infer_response("m", "1", InferRequest(None, {}, None, True), outputs)
    assert deserialize_bytes_tensor(grpc_answer.raw_output_contents[0]).tolist() == [t.encode() for t in TEXTS]


def test_grpc_bytes_contents_and_raw_read_alike() -> None:
    encoded = [t.encode() for t in TEXTS]
    typed = service_pb2.ModelInferRequest(model_name="ldlm_generate")
    typed.inputs.add(name="PROMPT", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(encoded)
    raw = service_pb2.ModelInferRequest(model_name="ldlm_generate")
    raw.inputs.add(name="PROMPT", datatype="BYTES", shape=[3])
    raw.raw_input_contents.append(serialize_byte_tensor(np.array(encoded, dtype=np.object_)).item())
    for request in (typed, raw):
        payload, binary, _ = infer_payload(request)
        assert infer_request_of(payload, memoryview(binary)).inputs["PROMPT"].tolist() == encoded
