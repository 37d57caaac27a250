"""What a tensor may be in a KServe v2 request: the protocol's datatypes and their NumPy types, the
JSON value types each kind takes, and JSON tensor data decoded value by value (``json_tensor``).
``ProtocolError``, what every refusal of the codec raises, is here so that this module and the codec
(``kserve``) raise the one type."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

DATATYPES: dict[str, Any] = {
    "FP32": np.float32,
    "FP16": np.float16,
    "FP64": np.float64,
    "INT64": np.int64,
    "INT32": np.int32,
    "BOOL": np.bool_,
    "BYTES": np.object_,  # each element bytes: text as UTF-8 (JSON: a string); only ldlm_generate takes and answers it
}


class ProtocolError(ValueError):
    """A request that does not follow the protocol; answered with 400 and this message."""


# The JSON value types each kind of datatype takes (JSON true/false are Python bools, never integers here).
JSON_TYPES: dict[str, set[type]] = {"b": {bool}, "i": {int}, "f": {int, float}, "O": {str, bytes}}  # bytes: gRPC's bytes_contents
LENGTH = struct.Struct("<I")  # a BYTES element's length before it, in the binary form (as tritonclient writes it)


def json_tensor(data: Any, datatype: str, dtype: np.dtype, where: str) -> np.ndarray:
    """JSON ``data`` (flat, or nested as the shape) -> an array of ``dtype``, refusing any value
    whose JSON type does not match the datatype or whose value does not fit it."""
    flat = _flatten(data, where)
    kinds = set(map(type, flat))
    allowed = JSON_TYPES[dtype.kind]
    if not kinds <= allowed:
        names = {bool: "true/false", int: "integers", float: "numbers", str: "strings"}
        wrong = sorted(k.__name__ for k in kinds - allowed)
        raise ProtocolError(
            f"{where}: {datatype} data holds {', '.join(wrong)} values; allowed: {' or '.join(names[k] for k in names if k in allowed)}"
        )
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            bad = min(flat) if min(flat) < info.min else max(flat)
            shown = bad if abs(bad) < 10**30 else f"an integer of {len(str(abs(bad)))} digits"
            raise ProtocolError(f"{where}: {datatype} data holds {shown}; allowed: {info.min}..{info.max}")
        return np.array(flat, dtype=dtype)
    if dtype.kind == "f":
        try:
            wide = np.array(flat, dtype=np.float64)
        except OverflowError:  # an integer beyond float64's range
            raise ProtocolError(f"{where}: {datatype} data holds an integer beyond the float range") from None
        if not np.isfinite(wide).all():
            raise ProtocolError(f"{where}: data holds NaN or Infinity; allowed: finite numbers")
        limit = float(np.finfo(dtype).max)
        if wide.size and np.abs(wide).max() > limit:
            raise ProtocolError(f"{where}: {datatype} data holds {np.abs(wide).max():g}; allowed: magnitudes up to {limit:g}")
        return wide.astype(dtype)
    if dtype.kind == "O":
        return object_array([value.encode() if isinstance(value, str) else value for value in flat])
    return np.array(flat, dtype=dtype)


def object_array(values: list[bytes]) -> np.ndarray:
    """A 1-D BYTES tensor of ``values`` (np.array would make a fixed-width bytes array of them)."""
    array = np.empty(len(values), dtype=np.object_)
    array[:] = values
    return array


def bytes_tensor(data: memoryview, count: int, where: str) -> np.ndarray:
    """A BYTES input's binary data: ``count`` elements, each its 4-byte little-endian length then its bytes,
    filling ``data`` exactly."""
    values: list[bytes] = []
    offset = 0
    while offset < len(data) and len(values) < count:
        if offset + LENGTH.size > len(data):
            break
        (size,) = LENGTH.unpack_from(data, offset)
        offset += LENGTH.size
        if offset + size > len(data):
            break
        values.append(bytes(data[offset : offset + size]))
        offset += size
    if len(values) != count or offset != len(data):
        raise ProtocolError(
            f"{where}: BYTES binary data is not {count} elements; allowed: each element's 4-byte little-endian length, "
            "then its bytes, filling binary_data_size exactly"
        )
    return object_array(values)


def tensor_bytes(array: np.ndarray) -> bytes:
    """A tensor's binary form: its values' bytes in C order; a BYTES element's 4-byte length before each one."""
    if array.dtype.kind == "O":
        return b"".join(LENGTH.pack(len(value)) + value for value in (v.encode() if isinstance(v, str) else v for v in array.reshape(-1)))
    return np.ascontiguousarray(array).tobytes()


def _flatten(data: Any, where: str) -> list[Any]:
    if not isinstance(data, list):
        raise ProtocolError(f"{where}: 'data' must be a list, not {type(data).__name__}")
    flat: list[Any] = []
    stack = [(data, 0)]
    while stack:  # iterative: the depth is the client's choice
        items, depth = stack.pop()
        if depth >= 8:  # depth 0 is the outermost list: a rank-8 tensor's innermost lists are at depth 7
            raise ProtocolError(f"{where}: 'data' is nested {depth + 1} levels deep; allowed: at most 8 (the shape's rank)")
        if any(isinstance(x, list) for x in items):
            stack.extend((x, depth + 1) if isinstance(x, list) else ([x], depth + 1) for x in reversed(items))
        else:
            flat.extend(items)
    return flat
