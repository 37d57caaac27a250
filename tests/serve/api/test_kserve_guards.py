"""Every refusal of the KServe v2 codec (serve/api/kserve.py), each with the message a client sees,
and each bound at its edge: the last allowed value parses, the first refused one names itself.
Bodies are written by hand, JSON and binary; NaN and Infinity in every float datatype."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from ldlm.serve.api.kserve import (
    InferRequest,
    json_bytes,
    load_json,
    parse_body,
    parse_infer_request,
    requested_outputs,
    tensor_metadata,
)
from ldlm.serve.api.kserve_tensors import ProtocolError


def body_of(*inputs: dict, **fields) -> bytes:
    return json.dumps({"inputs": list(inputs), **fields}).encode()


def tensor(name: str = "x", datatype: str = "FP32", shape=(2,), data=(1.0, 2.0), **fields) -> dict:
    return {"name": name, "datatype": datatype, "shape": list(shape), "data": list(data), **fields}


def refused(message: str, body: bytes, header: str | None = None) -> None:
    with pytest.raises(ProtocolError, match=re.escape(message)):
        parse_infer_request(body, header)


def binary(name: str, array: np.ndarray, datatype: str) -> tuple[dict, bytes]:
    return {
        "name": name,
        "datatype": datatype,
        "shape": list(array.shape),
        "parameters": {"binary_data_size": array.nbytes},
    }, array.tobytes()


# --- NaN and Infinity ----------------------------------------------------------------------------------

FLOATS = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}


@pytest.mark.parametrize("datatype", list(FLOATS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_values_are_refused_in_json_and_binary(datatype: str, bad: float) -> None:
    good = tensor("ids", "INT64", (1,), (3,))
    message = "inputs[1] (x): data holds NaN or Infinity; allowed: finite numbers"
    refused(message, body_of(good, tensor("x", datatype, (3,), (0.5, bad, 1.0))))  # json.dumps writes NaN / Infinity
    refused(message, body_of(good, tensor("x", datatype, (1, 3), ([0.5, 1.0, bad],))))  # nested data
    array = np.array([0.5, bad, 1.0], dtype=FLOATS[datatype])
    spec, raw = binary("x", array, datatype)
    head = body_of(good, spec)
    refused(message, head + raw, str(len(head)))
    # the same bodies with a finite value in that place parse, to the value
    array[1] = -2.0
    spec, raw = binary("x", array, datatype)
    head = body_of(good, spec)
    parsed = parse_infer_request(head + raw, str(len(head)))
    np.testing.assert_array_equal(parsed.inputs["x"], array)
    assert parse_infer_request(body_of(good, tensor("x", datatype, (3,), (0.5, -2.0, 1.0))), None).inputs["x"][1] == -2.0


def test_float_magnitudes_up_to_the_datatype_limit() -> None:
    assert parse_infer_request(body_of(tensor("x", "FP16", (2,), (65504.0, -65504))), None).inputs["x"].tolist() == [65504.0, -65504.0]
    refused("inputs[0] (x): FP16 data holds 70000; allowed: magnitudes up to 65504", body_of(tensor("x", "FP16", (1,), (70000.0,))))
    refused("inputs[0] (x): FP32 data holds 1e+39; allowed: magnitudes up to 3.40282e+38", body_of(tensor("x", "FP32", (1,), (-1e39,))))
    refused("inputs[0] (x): FP64 data holds an integer beyond the float range", body_of(tensor("x", "FP64", (1,), (10**400,))))
    assert parse_infer_request(body_of(tensor("x", "FP32", (2,), (1, 2))), None).inputs["x"].dtype == np.float32  # ints are numbers


# --- integers and bools ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("datatype", "low", "high"), [("INT32", -(2**31), 2**31 - 1), ("INT64", -(2**63), 2**63 - 1)])
def test_integers_fit_their_datatype_to_the_edge(datatype: str, low: int, high: int) -> None:
    parsed = parse_infer_request(body_of(tensor("ids", datatype, (2,), (low, high))), None)
    assert parsed.inputs["ids"].tolist() == [low, high]
    refused(
        f"inputs[0] (ids): {datatype} data holds {high + 1}; allowed: {low}..{high}", body_of(tensor("ids", datatype, (2,), (0, high + 1)))
    )
    refused(
        f"inputs[0] (ids): {datatype} data holds {low - 1}; allowed: {low}..{high}", body_of(tensor("ids", datatype, (2,), (low - 1, 0)))
    )


def test_json_types_must_match_the_datatype() -> None:
    refused("inputs[0] (ids): INT64 data holds bool values; allowed: integers", body_of(tensor("ids", "INT64", (2,), (1, True))))
    refused("inputs[0] (ids): INT32 data holds float values; allowed: integers", body_of(tensor("ids", "INT32", (1,), (1.0,))))
    refused("inputs[0] (m): BOOL data holds int values; allowed: true/false", body_of(tensor("m", "BOOL", (2,), (True, 1))))
    for value, kind in ((False, "bool"), ("1", "str")):  # the names in one order, whatever the set's
        refused(f"inputs[0] (x): FP32 data holds {kind} values; allowed: integers or numbers", body_of(tensor("x", "FP32", (1,), (value,))))
    assert parse_infer_request(body_of(tensor("m", "BOOL", (2,), (True, False))), None).inputs["m"].tolist() == [True, False]


# --- the request's structure -------------------------------------------------------------------------------


def test_header_length_must_be_an_integer_within_the_body() -> None:
    body = body_of(tensor())
    assert parse_infer_request(body, str(len(body))).inputs["x"].tolist() == [1.0, 2.0]  # the whole body is JSON: allowed
    refused("Inference-Header-Content-Length='12x' is not an integer", body, "12x")
    refused(f"Inference-Header-Content-Length=0 is out of range; allowed: 1..{len(body)} (the body size)", body, "0")
    refused(f"Inference-Header-Content-Length={len(body) + 1} is out of range; allowed: 1..{len(body)}", body, str(len(body) + 1))


def test_the_request_and_its_inputs_must_be_objects() -> None:
    refused("the request must be a JSON object with an 'inputs' list", b"[1]")
    refused("field 'inputs' must be a non-empty list", b"{}")
    refused("field 'inputs' must be a non-empty list", b'{"inputs": []}')
    refused("field 'inputs' must be a non-empty list", b'{"inputs": {"name": "x"}}')
    refused("field 'id' must be a string, not int", body_of(tensor(), id=7))
    refused("inputs[1] must be an object with a string 'name'", body_of(tensor(), "x"))
    refused("inputs[0] must be an object with a string 'name'", body_of({"name": 3, "datatype": "FP32", "shape": [1], "data": [1.0]}))
    refused("inputs[1] (x): input 'x' is given twice", body_of(tensor(), tensor()))


def test_datatypes_and_shapes() -> None:
    refused(
        "inputs[0] (x): datatype 'UINT8' is unsupported; allowed: FP32, FP16, FP64, INT64, INT32, BOOL", body_of(tensor(datatype="UINT8"))
    )
    eight = parse_infer_request(body_of(tensor(shape=[1] * 8, data=[[[[[[[[2.5]]]]]]]])), None)  # rank 8, nested as the shape
    assert eight.inputs["x"].shape == (1,) * 8 and eight.inputs["x"].item() == 2.5
    shape_message = "is invalid; allowed: a list of at most 8 integers in 0..2**31-1"
    refused(f"inputs[0] (x): shape {[1] * 9} {shape_message}", body_of(tensor(shape=[1] * 9, data=[1.0])))
    refused(f"inputs[0] (x): shape [-1] {shape_message}", body_of(tensor(shape=[-1])))
    refused(f"inputs[0] (x): shape [2147483648] {shape_message}", body_of(tensor(shape=[2**31])))
    refused(f"inputs[0] (x): shape [2.0] {shape_message}", body_of(tensor(shape=[2.0])))
    refused(f"inputs[0] (x): shape '2' {shape_message}", body_of({**tensor(), "shape": "2"}))
    refused("inputs[0] (x): 3 data elements but shape [2] needs 2", body_of(tensor(data=(1.0, 2.0, 3.0))))
    refused("inputs[0] (x): has neither 'data' nor parameters.binary_data_size", body_of({"name": "x", "datatype": "FP32", "shape": [1]}))
    assert parse_infer_request(body_of(tensor(shape=[0, 3], data=[])), None).inputs["x"].shape == (0, 3)


def test_json_data_nesting_is_bounded() -> None:
    refused("inputs[0] (x): 'data' must be a list, not str", body_of({**tensor(), "data": "1,2"}))
    data: list = [1.0]
    for _ in range(8):
        data = [data]  # 9 lists, one inside the other: one more than a rank-8 shape has
    refused(
        "inputs[0] (x): 'data' is nested 9 levels deep; allowed: at most 8 (the shape's rank)", body_of({**tensor(shape=[1]), "data": data})
    )
    rank_8 = [1] * 8  # 8 levels, the most a shape allows, parse
    assert parse_infer_request(body_of({**tensor(shape=rank_8), "data": data[0]}), None).inputs["x"].shape == tuple(rank_8)


def test_binary_sizes_and_offsets() -> None:
    a, b = np.arange(3, dtype=np.float32), np.arange(2, dtype=np.int64)
    (sa, ra), (sb, rb) = binary("a", a, "FP32"), binary("b", b, "INT64")
    head = body_of(sa, sb)
    parsed = parse_infer_request(head + ra + rb, str(len(head)))
    assert parsed.inputs["a"].tolist() == [0.0, 1.0, 2.0] and parsed.inputs["b"].tolist() == [0, 1]
    wrong = body_of({**sa, "parameters": {"binary_data_size": 8}})
    refused("inputs[0] (a): binary_data_size 8 is invalid; allowed: 3 elements x 4 bytes = 12", wrong + ra, str(len(wrong)))
    flag = body_of({**sa, "parameters": {"binary_data_size": True}})
    refused("inputs[0] (a): binary_data_size True is invalid", flag + ra, str(len(flag)))
    refused("inputs[1] (b): binary data is shorter than its binary_data_size 16", head + ra + rb[:-1], str(len(head)))
    refused("1 trailing bytes after the binary inputs", head + ra + rb + b"\0", str(len(head)))


def test_parameters_and_outputs() -> None:
    refused("the request: 'parameters' must be an object, not list", body_of(tensor(), parameters=[1]))
    refused("inputs[0] (x): 'parameters' must be an object, not str", body_of({**tensor(), "parameters": "binary"}))
    refused(
        "the request: parameters.binary_data_output=1 is invalid; allowed: true or false",
        body_of(tensor(), parameters={"binary_data_output": 1}),
    )
    refused(
        "outputs[0]: parameters.binary_data='true' is invalid; allowed: true or false",
        body_of(tensor(), outputs=[{"name": "y", "parameters": {"binary_data": "true"}}]),
    )
    refused("field 'outputs' must be a list", body_of(tensor(), outputs={"name": "y"}))
    refused("outputs[1] must be an object with a string 'name'", body_of(tensor(), outputs=[{"name": "y"}, {"id": "z"}]))
    parsed = parse_infer_request(body_of(tensor(), parameters={"binary_data_output": True}), None)
    assert parsed.outputs is None and parsed.binary_outputs is True
    assert requested_outputs(parsed, {"y": np.zeros(1), "z": np.zeros(1)}) == [("y", True), ("z", True)]


def test_json_errors_say_where() -> None:
    with pytest.raises(ProtocolError, match=re.escape("the body is not valid JSON: Expecting value at line 2 column 3")):
        load_json(b'{"a":\n  }')
    with pytest.raises(ProtocolError, match=re.escape("the body is not valid UTF-8 JSON: invalid start byte at byte 1")):
        load_json(b'"\xff"')
    with pytest.raises(ProtocolError, match="nested too deeply"):
        load_json(b"[" * 100000 + b"]" * 100000)
    with pytest.raises(ProtocolError, match="'br' is unsupported"):
        parse_body(body_of(tensor()), "br", None, 1 << 20)


def test_metadata_and_json_bytes() -> None:
    specs = [
        {"name": "x_t", "dtype": "FLOAT", "shape": ["batch", "seq", 64]},
        {"name": "ids", "dtype": "INT64", "shape": ["batch", 3]},
        {"name": "h", "dtype": "FLOAT16", "shape": [2]},
    ]
    assert tensor_metadata(specs) == [
        {"name": "x_t", "datatype": "FP32", "shape": [-1, -1, 64]},
        {"name": "ids", "datatype": "INT64", "shape": [-1, 3]},
        {"name": "h", "datatype": "FP16", "shape": [2]},
    ]
    payload = {"texts": ["a"], "latents": np.array([[1.5, 2.0]], np.float32), "n": 1}
    assert json.loads(json_bytes(payload)) == {"texts": ["a"], "latents": [[1.5, 2.0]], "n": 1}
    assert requested_outputs(InferRequest(None, {}, [("z", False)], True), {"y": np.zeros(1), "z": np.zeros(1)}) == [("z", False)]


# --- misspelled protocol fields --------------------------------------------------------------------------


def test_a_misspelled_field_is_refused_at_every_level() -> None:
    """Each level's fields are the protocol's; a typo was silently ignored (the request ran without it)."""
    good = tensor("ids", "INT64", (1,), (3,))
    refused("the request: unknown field 'outptus'; allowed: id, parameters, inputs, outputs", body_of(good, outptus=[{"name": "latents"}]))
    refused(
        "inputs[0] (ids): unknown field 'paramters'; allowed: name, shape, datatype, parameters, data",
        body_of(tensor("ids", "INT64", (1,), (3,), paramters={})),
    )
    refused(
        "outputs[0] (latents): unknown field 'binary_data'; allowed: name, parameters",
        body_of(good, outputs=[{"name": "latents", "binary_data": True}]),
    )
    # every field of the protocol, spelled right, parses
    parsed = parse_infer_request(
        body_of(
            tensor("ids", "INT64", (1,), (3,), parameters={}),
            id="r1",
            parameters={},
            outputs=[{"name": "latents", "parameters": {"binary_data": True}}],
        ),
        None,
    )
    assert (parsed.id, parsed.outputs) == ("r1", [("latents", True)])
