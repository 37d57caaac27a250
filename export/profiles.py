"""Optimization profiles: min/opt/max batch and sequence length for every dynamic graph input.

Several profiles make batch buckets (e.g. 1-4 with opt 1 for latency, 4-32 with opt 16 for
throughput). The symbolic axes come from the export manifest: "batch" and "seq".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ldlm.model.config import LDLMConfig


@dataclass(frozen=True)
class ShapeRange:
    min: int
    opt: int
    max: int

    def check(self, axis: str, upper: int | None = None) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"{axis} profile {self.min}:{self.opt}:{self.max} is invalid; allowed: 1 <= min <= opt <= max")
        if upper is not None and self.max > upper:
            raise ValueError(f"{axis} profile max {self.max} is out of range; allowed: <= {upper} (config max_seq_len)")


@dataclass(frozen=True)
class EngineProfile:
    batch: ShapeRange
    seq: ShapeRange

    def check(self, max_seq_len: int) -> None:
        self.batch.check("batch")
        self.seq.check("seq", max_seq_len)

    def to_dict(self) -> dict[str, list[int]]:
        return {axis: [r.min, r.opt, r.max] for axis, r in (("batch", self.batch), ("seq", self.seq))}

    @classmethod
    def parse(cls, text: str) -> EngineProfile:
        """``batch=1:8:32,seq=1:128:1024`` -> EngineProfile."""
        match = re.fullmatch(r"\s*batch=(\d+):(\d+):(\d+)\s*,\s*seq=(\d+):(\d+):(\d+)\s*", text)
        if not match:
            raise ValueError(f"profile {text!r} is malformed; allowed: 'batch=MIN:OPT:MAX,seq=MIN:OPT:MAX'")
        b = ShapeRange(*map(int, match.groups()[:3]))
        s = ShapeRange(*map(int, match.groups()[3:]))
        profile = cls(b, s)
        profile.batch.check("batch")
        profile.seq.check("seq")
        return profile


def default_profiles(config: LDLMConfig) -> tuple[EngineProfile, ...]:
    """One profile: batch 1..32 (opt 8), sequence 1..max_seq_len (opt 128, LM1B's length)."""
    seq_opt = min(128, config.max_seq_len)
    return (EngineProfile(ShapeRange(1, 8, 32), ShapeRange(1, seq_opt, config.max_seq_len)),)


def profile_shapes(inputs: list[dict[str, Any]], profile: EngineProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shapes of each input, from the manifest's symbolic shapes."""
    ranges = {"batch": profile.batch, "seq": profile.seq}
    shapes = {}
    for value in inputs:
        dims = value["shape"]
        unknown = [d for d in dims if isinstance(d, str) and d not in ranges]
        if unknown:
            raise ValueError(f"input {value['name']} has symbolic axes {unknown}; profiles know batch and seq")
        shapes[value["name"]] = tuple(
            tuple(getattr(ranges[d], which) if isinstance(d, str) else int(d) for d in dims) for which in ("min", "opt", "max")
        )
    return shapes
