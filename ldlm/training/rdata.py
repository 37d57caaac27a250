"""R's lazy-load data files (``data/Rdata.rdx`` + ``Rdata.rdb``), read with the standard library.

An R package's data sets sit in two files. ``Rdata.rdx`` is one gzip-compressed, serialized R
list (an ``.rds`` file) whose ``variables`` entry maps each data set's name to an (offset, length) pair in ``Rdata.rdb``;
each such chunk of ``Rdata.rdb`` is one compressed, serialized R object. Compression: a 4-byte
big-endian length of the uncompressed data, then zlib (or, with a type byte after the length,
bzip2 or xz). Serialization: R's XDR format (big-endian), versions 2 and 3.

Only what text data sets use is decoded: character, integer, logical and double vectors, generic
vectors (lists, data frames) and pairlists (attributes). Anything else (closures, environments,
bytecode) is refused by its type code: nothing read here is ever evaluated.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path
from typing import Any

# R's SEXP type codes (src/include/Rinternals.h) and the serialization's special markers.
NILSXP, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 0, 1, 2, 9, 10, 13, 14, 16, 19
REFSXP, NILVALUE_SXP = 255, 254
NA_INTEGER = -(2**31)


class RDataError(ValueError):
    """A file that is not R lazy-load data this reader decodes; the message names the file and why."""


def decompress(blob: bytes, source: str) -> bytes:
    if len(blob) < 5:
        raise RDataError(f"{source}: a compressed chunk of {len(blob)} bytes is too short")
    (size,) = struct.unpack(">I", blob[:4])
    kind = blob[4:5]
    try:
        if kind == b"Z":  # R's type-3 chunks name their method; type 1 (zlib) has no byte
            data = lzma.decompress(blob[5:])
        elif kind == b"2":
            data = bz2.decompress(blob[5:])
        elif kind == b"0":
            data = blob[5:]
        else:
            data = zlib.decompress(blob[4:])
    except (zlib.error, lzma.LZMAError, OSError, ValueError) as error:
        raise RDataError(f"{source}: cannot decompress a chunk: {error}") from error
    if len(data) != size:
        raise RDataError(f"{source}: a chunk decompressed to {len(data)} bytes, its header says {size}")
    return data


class _Reader:
    """R's XDR serialization: one object, read depth-first."""

    def __init__(self, data: bytes, source: str) -> None:
        self.data, self.pos, self.source = data, 0, source
        self.refs: list[Any] = []

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise RDataError(f"{self.source}: truncated at byte {self.pos} (wanted {n} more)")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def read(self) -> Any:
        if self.take(2) != b"X\n":
            raise RDataError(f"{self.source}: not R's XDR serialization (only format 'X' is read)")
        version = self.int()
        self.take(8)  # the writer's R version, the minimal reader version
        if version == 3:
            self.take(self.int())  # the native encoding's name
        elif version != 2:
            raise RDataError(f"{self.source}: serialization version {version}; versions 2 and 3 are read")
        return self.item()

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (NILVALUE_SXP, NILSXP):
            return None
        if kind == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == LISTSXP:  # a pairlist: (tag, value) cells
            out: dict[str, Any] = {}
            while kind == LISTSXP:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else f"[{len(out)}]"
                out[str(tag)] = self.item()
                flags = self.int()
                kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
            if kind not in (NILVALUE_SXP, NILSXP):
                raise RDataError(f"{self.source}: a pairlist ends in type {kind}, not NULL")
            return out
        if kind == CHARSXP:
            n = self.int()
            return None if n == -1 else self.take(n).decode("utf-8", errors="replace")
        if kind in (LGLSXP, INTSXP):
            n = self.int()
            value: Any = [None if v == NA_INTEGER else v for v in struct.unpack(f">{n}i", self.take(4 * n))]
        elif kind == REALSXP:
            n = self.int()
            value = list(struct.unpack(f">{n}d", self.take(8 * n)))
        elif kind in (STRSXP, VECSXP):
            value = [self.item() for _ in range(self.int())]
        else:
            raise RDataError(f"{self.source}: R object type {kind} is not data (only vectors and lists are read)")
        if has_attr:
            attributes = self.item()
            names = attributes.get("names") if isinstance(attributes, dict) else None
            if kind == VECSXP and isinstance(names, list) and len(names) == len(value):
                return dict(zip(names, value))
        return value


def unserialize(data: bytes, source: str = "<bytes>") -> Any:
    """One R object from its XDR serialization: vectors as lists, named lists as dicts."""
    return _Reader(data, source).read()


def read_lazy_load(data_dir: str | Path) -> dict[str, Any]:
    """Every data set of an R package's ``data/`` directory, by name."""
    data_dir = Path(data_dir)
    rdx, rdb = data_dir / "Rdata.rdx", data_dir / "Rdata.rdb"
    for path in (rdx, rdb):
        if not path.is_file():
            raise RDataError(f"{data_dir} has no {path.name}: not an R package's lazy-load data directory")
    try:
        index = unserialize(gzip.decompress(rdx.read_bytes()), str(rdx))
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise RDataError(f"{rdx}: not a gzip-compressed R index: {error}") from error
    if not isinstance(index, dict) or not isinstance(index.get("variables"), dict):
        raise RDataError(f"{rdx}: its index has no 'variables' list")
    blob = rdb.read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        out[name] = unserialize(decompress(blob[offset : offset + length], f"{rdb}:{name}"), f"{rdb}:{name}")
    return out
