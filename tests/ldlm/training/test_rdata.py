"""R's lazy-load data, read back from bytes this test writes with its own XDR serializer."""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import pytest

from ldlm.training.rdata import RDataError, decompress, read_lazy_load, unserialize

HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10


# A minimal writer of R's XDR serialization (R Internals, "Serialization Formats"), independent of the reader.
def xdr_int(v: int) -> bytes:
    return struct.pack(">i", v)


def charsxp(text: str | None) -> bytes:
    if text is None:
        return xdr_int(9) + xdr_int(-1)
    data = text.encode()
    return xdr_int(9) + xdr_int(len(data)) + data


def strsxp(values: list[str | None], attrs: bytes = b"") -> bytes:
    return xdr_int(16 | (HAS_ATTR if attrs else 0)) + xdr_int(len(values)) + b"".join(charsxp(v) for v in values) + attrs


def symbol(name: str) -> bytes:
    return xdr_int(1) + charsxp(name)


def pairlist(items: list[tuple[str, bytes]]) -> bytes:
    out = b""
    for tag, value in items:
        out += xdr_int(2 | HAS_TAG) + symbol(tag) + value
    return out + xdr_int(254)


def intsxp(values: list[int]) -> bytes:
    return xdr_int(13) + xdr_int(len(values)) + b"".join(xdr_int(v) for v in values)


def named_list(items: dict[str, bytes]) -> bytes:
    names = pairlist([("names", strsxp(list(items)))])
    return xdr_int(19 | HAS_ATTR) + xdr_int(len(items)) + b"".join(items.values()) + names


def serialized(body: bytes, version: int = 3) -> bytes:
    head = b"X\n" + xdr_int(version) + xdr_int(0x040300) + xdr_int(0x030500)
    if version == 3:
        head += xdr_int(5) + b"UTF-8"
    return head + body


def chunk(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + zlib.compress(data)


def write_package(data_dir: Path, datasets: dict[str, bytes]) -> None:
    """Rdata.rdb: one compressed chunk per data set; Rdata.rdx: the gzip'd index of offsets."""
    data_dir.mkdir(parents=True)
    blob, offsets = b"", {}
    for name, body in datasets.items():
        c = chunk(serialized(body))
        offsets[name] = intsxp([len(blob), len(c)])
        blob += c
    (data_dir / "Rdata.rdb").write_bytes(blob)
    index = named_list(
        {"variables": named_list(offsets), "references": named_list({}), "compressed": xdr_int(10) + xdr_int(1) + xdr_int(1)}
    )
    (data_dir / "Rdata.rdx").write_bytes(gzip.compress(serialized(index)))


def test_unserialize_reads_vectors_named_lists_and_na() -> None:
    body = named_list({"text": strsxp(["Emma Woodhouse,", "", None, "handsome"]), "n": intsxp([3, -(2**31)])})
    assert unserialize(serialized(body)) == {"text": ["Emma Woodhouse,", "", None, "handsome"], "n": [3, None]}
    assert unserialize(serialized(strsxp(["a"]), version=2)) == ["a"]


def test_read_lazy_load_finds_every_data_set(tmp_path: Path) -> None:
    write_package(tmp_path / "data", {"emma": strsxp(["EMMA", "", "By Jane Austen"]), "other": strsxp(["x" * 5000])})
    assert read_lazy_load(tmp_path / "data") == {"emma": ["EMMA", "", "By Jane Austen"], "other": ["x" * 5000]}


def test_code_and_damaged_files_are_refused_by_name(tmp_path: Path) -> None:
    closure = xdr_int(3)  # CLOSXP: R code is never decoded, let alone run
    with pytest.raises(RDataError, match="R object type 3 is not data"):
        unserialize(serialized(closure))
    with pytest.raises(RDataError, match=r"<bytes>: truncated at byte \d+"):
        unserialize(serialized(strsxp(["abcdef"]))[:-3])
    with pytest.raises(RDataError, match="not R's XDR serialization"):
        unserialize(b"A\n" + b"\0" * 20)
    with pytest.raises(RDataError, match="decompressed to 3 bytes, its header says 9"):
        decompress(struct.pack(">I", 9) + zlib.compress(b"abc"), "x")
    write_package(tmp_path / "data", {"emma": strsxp(["EMMA"])})
    rdb = tmp_path / "data" / "Rdata.rdb"
    rdb.write_bytes(rdb.read_bytes()[:-4])
    with pytest.raises(RDataError, match=f"{rdb}:emma: cannot decompress"):
        read_lazy_load(tmp_path / "data")
    with pytest.raises(RDataError, match="has no Rdata.rdx: not an R package's lazy-load data directory"):
        read_lazy_load(tmp_path)
