"""What ``import_checkpoint`` found: every source key and every parameter accounted for, in lines for
people and in JSON (``ldlm import-checkpoint --json``).

Problems (any one fails the import): a source key no rule matches, a rule target the model does not
have, two source keys for one parameter, a tensor of the wrong shape or dtype, a parameter nothing
provides (unless ``allow_missing`` covers it), and a failed parity round. The rest is information:
keys a rule drops on purpose, feature-model blocks after the feature layer (they never run), the
parameters that keep their random init, and entries of a state dict that are not tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ldlm.importing.config import Inferred
from ldlm.model.checkpoint import CheckpointError

SHOWN = 6  # names of an informational list printed for people; problems are always printed whole


class CheckOutcome(Protocol):
    """What the parity check run on an imported checkpoint gives back (a ParityReport, from the CLI)."""

    @property
    def passed(self) -> bool: ...

    def summary(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Mismatch:
    """A parameter whose source tensor has another shape (or a non-float dtype) than the model's."""

    target: str
    source: str
    expected: list[int]
    found: list[int]
    dtype: str

    def line(self) -> str:
        if self.expected != self.found:
            return f"{self.target} (from {self.source}): expected shape {tuple(self.expected)}, found {tuple(self.found)}"
        return f"{self.target} (from {self.source}): dtype {self.dtype}, expected a floating-point dtype"


@dataclass
class ImportReport:
    source: str
    mapping: str
    config: dict[str, Any]
    inferred: dict[str, Inferred]
    overrides: dict[str, Any]
    imported: list[str] = field(default_factory=list)  # our parameters that got a source tensor
    unmatched: list[str] = field(default_factory=list)  # source keys no rule matches
    unknown_targets: list[str] = field(default_factory=list)  # "source -> target" the model does not have
    duplicates: list[str] = field(default_factory=list)  # "target <- a, b"
    mismatches: list[Mismatch] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # our parameters nothing provides
    kept_init: list[str] = field(default_factory=list)  # missing, but allowed: the seeded random init stays
    dropped: list[str] = field(default_factory=list)  # source keys a rule drops on purpose
    skipped: list[str] = field(default_factory=list)  # feature-model blocks after the feature layer
    non_tensors: list[str] = field(default_factory=list)  # state-dict entries that hold no tensor
    parity: dict[str, Any] | None = None  # ParityReport.to_dict(); None when skipped or not reached
    parity_summary: str | None = None
    out: str | None = None  # set once the checkpoint is in place
    mapping_chosen: bool = False  # no mapping was named: chosen by the source's keys (ldlm.importing.convert.choose_mapping)
    ldlm_names: bool = False  # every source key already is one of ldlm's parameter names

    def problems(self) -> list[str]:
        """One line per problem; empty when the import may proceed."""
        lines = [
            f'source key {key} matches no mapping rule (add a rule for it, or one with "target": null to drop it)' for key in self.unmatched
        ]
        lines += [f"rule maps {pair}, a parameter the model does not have" for pair in self.unknown_targets]
        lines += [f"two source keys for one parameter: {item}" for item in self.duplicates]
        lines += [f"shape mismatch: {m.line()}" for m in self.mismatches]
        if self.missing:
            lines.append(
                f"{len(self.missing)} parameter(s) missing from the source: {', '.join(self.missing)} "
                "(map them, or keep their random init with --allow-missing PATTERN, e.g. 'denoiser\\.' for the whole denoiser)"
            )
        if self.parity is not None and not self.parity["passed"]:
            lines.append(f"parity round on the imported weights: {self.parity_summary}")
        if lines and self.ldlm_names and self.mapping != "ldlm":
            lines.append(
                f"the source's keys already are ldlm's parameter names, which mapping {self.mapping} does not expect: "
                "pass --mapping ldlm, or leave --mapping out to have it chosen"
            )
        return lines

    @property
    def passed(self) -> bool:
        return not self.problems()

    def lines(self) -> list[str]:
        """The report for people: what was read, what was done with it, then every problem."""
        inferred = ", ".join(f"{k}={v.value} ({v.evidence})" for k, v in self.inferred.items()) or "nothing"
        chosen = " (chosen by the source's keys; --mapping names another)" if self.mapping_chosen else ""
        lines = [
            f"source {self.source}, mapping {self.mapping}{chosen}: {len(self.imported)} parameter(s) imported",
            f"config inferred from the weights: {inferred}",
        ]
        if self.overrides:
            lines.append("config set by --set: " + ", ".join(f"{k}={v!r}" for k, v in self.overrides.items()))
        for name, keys in (
            ("dropped by the mapping", self.dropped),
            ("skipped (feature-model blocks after the feature layer never run)", self.skipped),
            ("kept their random init (--allow-missing)", self.kept_init),
            ("not tensors, ignored", self.non_tensors),
        ):
            if keys:  # information, not problems: the first few here, all of them in --json
                more = f" ... ({len(keys) - SHOWN} more)" if len(keys) > SHOWN else ""
                lines.append(f"{len(keys)} {name}: {', '.join(keys[:SHOWN])}{more}")
        if self.parity_summary:
            lines.append(self.parity_summary)
        lines += [f"problem: {line}" for line in self.problems()]
        return lines

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["inferred"] = {k: v.to_dict() for k, v in self.inferred.items()}
        data["passed"] = self.passed
        data["problems"] = self.problems()
        return data


class ImportCheckpointError(CheckpointError):
    """An import that found problems; ``report`` holds all of them, and nothing was written."""

    def __init__(self, report: ImportReport) -> None:
        self.report = report
        problems = report.problems()
        super().__init__(f"{report.source}: {len(problems)} problem(s); nothing written:\n  " + "\n  ".join(problems))
