"""A gRPC infer request as the binary-tensor body it stands for (``infer_payload``), read by the HTTP codec, and
the answer as tritonclient's gRPC result reads it back: raw and typed contents give the arrays written by
hand, and each malformed request is refused naming the input at fault."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient's gRPC package (pip install -e .[test])")

from tritonclient.grpc import service_pb2  # noqa: E402

from ldlm.serve.api.grpc_tensors import infer_payload, infer_response  # noqa: E402
from ldlm.serve.api.kserve import InferRequest, infer_request_of  # noqa: E402
from ldlm.serve.api.kserve_tensors import ProtocolError  # noqa: E402


def request_of(*tensors: tuple[str, str, list[int]], raw: list[bytes] | None = None, **fields) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m", **fields)
    for name, datatype, shape in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.extend(raw or [])
    return request


def decoded(request: service_pb2.ModelInferRequest) -> InferRequest:
    payload, binary, _ = infer_payload(request)
    return infer_request_of(payload, memoryview(binary))


def refused(message: str, request: service_pb2.ModelInferRequest) -> None:
    with pytest.raises(ProtocolError, match=re.escape(message)):
        decoded(request)


def test_raw_contents_are_the_inputs_in_order() -> None:
    ids = np.array([[5, 6, 7]], dtype=np.int32)
    x = np.array([[0.5, -1.0]], dtype=np.float16)
    request = request_of(("ids", "INT32", [1, 3]), ("x", "FP16", [1, 2]), raw=[ids.tobytes(), x.tobytes()], id="r7")
    request.outputs.add(name="y")
    parsed = decoded(request)
    assert parsed.id == "r7" and parsed.outputs == [("y", False)]
    assert parsed.inputs["ids"].dtype == np.int32 and parsed.inputs["ids"].tolist() == [[5, 6, 7]]
    assert parsed.inputs["x"].dtype == np.float16 and parsed.inputs["x"].tolist() == [[0.5, -1.0]]
    assert decoded(request_of(("ids", "INT64", [1]), raw=[np.array([3], np.int64).tobytes()])).outputs is None  # none named: all


def test_typed_contents_are_read_from_the_datatypes_field() -> None:
    request = request_of(("a", "INT64", [2]), ("b", "INT32", [1, 2]), ("c", "FP32", [2]), ("d", "BOOL", [2]), ("e", "FP64", [1]))
    request.inputs[0].contents.int64_contents.extend([2**40, -3])
    request.inputs[1].contents.int_contents.extend([7, 8])
    request.inputs[2].contents.fp32_contents.extend([0.25, -2.0])
    request.inputs[3].contents.bool_contents.extend([True, False])
    request.inputs[4].contents.fp64_contents.append(1e300)
    inputs = decoded(request).inputs
    assert inputs["a"].dtype == np.int64 and inputs["a"].tolist() == [2**40, -3]
    assert inputs["b"].dtype == np.int32 and inputs["b"].tolist() == [[7, 8]]
    assert inputs["c"].dtype == np.float32 and inputs["c"].tolist() == [0.25, -2.0]
    assert inputs["d"].dtype == np.bool_ and inputs["d"].tolist() == [True, False]
    assert inputs["e"].tolist() == [1e300]


def test_malformed_requests_are_refused_naming_the_input() -> None:
    two = np.zeros(2, np.int64).tobytes()
    refused(
        "raw_input_contents holds 1 tensors for 2 inputs; allowed: one per input, in input order",
        request_of(("a", "INT64", [2]), ("b", "INT64", [2]), raw=[two]),
    )
    refused("inputs[0] (a): binary_data_size 16 is invalid; allowed: 3 elements x 8 bytes = 24", request_of(("a", "INT64", [3]), raw=[two]))
    both = request_of(("a", "INT64", [2]), raw=[two])
    both.inputs[0].contents.int64_contents.extend([1, 2])
    refused("inputs[0] (a): has both contents and raw_input_contents; allowed: one of them for every input", both)
    half = request_of(("x", "FP16", [1]))
    half.inputs[0].contents.fp32_contents.append(1.0)
    refused("inputs[0] (x): FP16 data has no contents field; allowed: raw_input_contents", half)
    wrong = request_of(("a", "INT64", [1]))
    wrong.inputs[0].contents.fp32_contents.append(1.0)
    refused("inputs[0] (a): INT64 data is in contents.fp32_contents; allowed: contents.int64_contents", wrong)
    short = request_of(("a", "INT32", [3]))
    short.inputs[0].contents.int_contents.extend([1, 2])
    refused("inputs[0] (a): 2 data elements but shape [3] needs 3", short)  # the codec's words for JSON data
    for bad in (math.nan, math.inf):
        nan = request_of(("x", "FP32", [2]))
        nan.inputs[0].contents.fp32_contents.extend([1.0, bad])
        refused("inputs[0] (x): data holds NaN or Infinity; allowed: finite numbers", nan)
    refused("inputs[0] (x): has neither 'data' nor parameters.binary_data_size", request_of(("x", "FP32", [1])))
    refused("inputs[0] (u): datatype 'UINT8' is unsupported", request_of(("u", "UINT8", [1]), raw=[b"\x01"]))
    refused("field 'inputs' must be a non-empty list", request_of())


def test_the_answer_reads_back_through_tritonclient() -> None:
    outputs = {"latents": np.arange(6, dtype=np.float32).reshape(1, 2, 3) / 7, "token_ids": np.array([[4, 2]], dtype=np.int64)}
    every = infer_response("decoder", "1", InferRequest("q", {}, None, False), outputs)
    result = grpcclient.InferResult(every)
    np.testing.assert_array_equal(result.as_numpy("latents"), outputs["latents"])
    np.testing.assert_array_equal(result.as_numpy("token_ids"), outputs["token_ids"])
    assert (every.model_name, every.model_version, every.id) == ("decoder", "1", "q")
    asked = infer_response("decoder", "1", InferRequest(None, {}, [("token_ids", False)], False), outputs)
    assert [o.name for o in asked.outputs] == ["token_ids"] and [o.datatype for o in asked.outputs] == ["INT64"]
