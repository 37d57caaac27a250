"""Step grids tuned for one checkpoint: ``schedules.json`` beside its weights (and in its exports).

A tuned grid is the steps + 1 times a sampler steps through, searched for the checkpoint it was
tuned on (``ldlm tune-schedule``, ldlm/training/grid_search.py). The file records, per sampler and step count, the
grid, how it was measured (seeds, lengths, the reference) and its errors beside DDIM@50's and the
default grid's, and per sampler the default step count: the fewest steps whose held-out error and
token agreement are at least DDIM@50's. A file tuned for other weights is refused, naming both
hashes, and so is one edited by hand into a grid the samplers cannot run (non-monotone times, a
time outside [t_min, 1], NaN, the wrong length).

    {"format": 1, "weights_sha256": "...", "t_min": 0.05, "prior_temperature": 1.0,
     "defaults": {"dpm3m-psc": 10},
     "grids": [{"sampler": "dpm3m-psc", "steps": 10, "times": [1.0, ..., 0.05], "measured": {...}}]}
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ldlm.files import command_writer, sha256_file, write_atomically
from ldlm.limits import PRIOR_TEMPERATURE, T_MIN
from ldlm.model.checkpoint import WEIGHTS_FILE

SCHEDULES_FILE = "schedules.json"
FORMAT = 1
SCHEDULES_WRITER = command_writer("tune-schedule")  # the one command that writes a schedules file


class ScheduleError(ValueError):
    """A schedules.json that cannot be used: another checkpoint's, or not a valid grid."""


def weights_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a weights file, the identity a tuned grid is bound to."""
    return sha256_file(path)


@dataclass(frozen=True)
class TunedGrid:
    sampler: str
    steps: int
    times: tuple[float, ...]  # steps + 1, from 1 down to t_min
    measured: dict[str, Any] = field(default_factory=dict, compare=False)  # seeds, lengths, errors, tokens


@dataclass(frozen=True)
class TunedSchedules:
    weights_sha256: str
    t_min: float
    grids: tuple[TunedGrid, ...]
    defaults: dict[str, int] = field(default_factory=dict)  # sampler -> steps that match DDIM@50
    prior_temperature: float = 1.0  # the prior the grids were tuned from (files without it: 1)

    def tuned_for(self, t_min: float, prior_temperature: float) -> bool:
        """Whether these grids were tuned for runs that end at ``t_min`` and start at ``prior_temperature``."""
        return t_min == self.t_min and prior_temperature == self.prior_temperature

    def grid(self, sampler: str, steps: int) -> TunedGrid | None:
        return next((g for g in self.grids if g.sampler == sampler and g.steps == steps), None)

    def steps_tuned(self, sampler: str) -> list[int]:
        return sorted(g.steps for g in self.grids if g.sampler == sampler)

    def to_json(self) -> str:
        grids = [{"sampler": g.sampler, "steps": g.steps, "times": list(g.times), "measured": g.measured} for g in self.grids]
        body = {
            "format": FORMAT,
            "weights_sha256": self.weights_sha256,
            "t_min": self.t_min,
            "prior_temperature": self.prior_temperature,
            "defaults": self.defaults,
            "grids": grids,
        }
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = SCHEDULES_FILE) -> TunedSchedules:
        try:
            data = json.loads(text)
            grids = tuple(
                TunedGrid(str(g["sampler"]), int(g["steps"]), tuple(float(t) for t in g["times"]), dict(g.get("measured", {})))
                for g in data["grids"]
            )
            defaults = {str(k): int(v) for k, v in data["defaults"].items()}
            tau = float(data.get("prior_temperature", 1.0))
            schedules = cls(str(data["weights_sha256"]), float(data["t_min"]), grids, defaults, tau)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ScheduleError(f"{where} is not a schedules file ({type(error).__name__}: {error}); re-run `ldlm tune-schedule`") from None
        if data.get("format") != FORMAT:
            raise ScheduleError(f"{where} has format {data.get('format')!r}; allowed: {FORMAT}")
        schedules.check(where)
        return schedules

    def check(self, where: str = SCHEDULES_FILE) -> None:
        """Every grid is one the samplers can run, and every default names a tuned grid."""
        if self.t_min not in T_MIN:
            raise ScheduleError(f"{where}: t_min={self.t_min!r} is invalid; allowed: {T_MIN}")
        if self.prior_temperature not in PRIOR_TEMPERATURE:
            raise ScheduleError(f"{where}: prior_temperature={self.prior_temperature!r} is invalid; allowed: {PRIOR_TEMPERATURE}")
        for g in self.grids:
            check_times(g.times, g.steps, self.t_min, f"{where}: the {g.sampler} grid of {g.steps} steps")
        for sampler, steps in self.defaults.items():
            if self.grid(sampler, steps) is None:
                raise ScheduleError(
                    f"{where}: the default of {sampler} is {steps} steps, but no such grid is tuned; tuned: {self.steps_tuned(sampler)}"
                )

    def save(self, path: str | os.PathLike[str]) -> Path:
        return write_atomically(path, self.to_json())


def written_by(path: Path) -> str | None:
    """``SCHEDULES_WRITER`` for a file that reads as a schedules file (a JSON object of this format with its
    weights' hash and grids, valid or not), None for any other: the format names its writer, in the shipped
    checkpoints' files as in new ones."""
    try:
        data = json.loads(path.read_bytes()[: 1 << 24])
    except (OSError, ValueError):
        return None
    schedules = isinstance(data, dict) and data.get("format") == FORMAT and "weights_sha256" in data and isinstance(data.get("grids"), list)
    return SCHEDULES_WRITER if schedules else None


def check_times(times: tuple[float, ...], steps: int, t_min: float, what: str) -> None:
    """steps + 1 finite times, 1 first and t_min last, strictly decreasing."""
    if len(times) != steps + 1:
        raise ScheduleError(f"{what} has {len(times)} times; allowed: steps + 1 = {steps + 1}")
    bad = [t for t in times if not (math.isfinite(t) and t_min <= t <= 1.0)]
    if bad:
        raise ScheduleError(f"{what} has the time {bad[0]!r}; allowed: finite times in [t_min={t_min}, 1]")
    if times[0] != 1.0 or times[-1] != t_min:
        raise ScheduleError(f"{what} runs from {times[0]} to {times[-1]}; allowed: from 1 to t_min={t_min}")
    drops = [i for i in range(steps) if not times[i + 1] < times[i]]
    if drops:
        i = drops[0]
        raise ScheduleError(f"{what} is not strictly decreasing: times[{i}]={times[i]}, times[{i + 1}]={times[i + 1]}")


def load_schedules(
    directory: str | os.PathLike[str], weights: str | os.PathLike[str] | None = None, sha256: str | None = None
) -> TunedSchedules | None:
    """``directory``'s schedules.json, or None when it has none. Refused when it was tuned for other
    weights: ``weights`` (a file, hashed here) or ``sha256`` (already known, e.g. from an export's manifest)."""
    path = Path(directory) / SCHEDULES_FILE
    if not path.is_file():
        return None
    schedules = TunedSchedules.from_json(path.read_text(), str(path))
    expected = sha256 if sha256 is not None else weights_sha256(weights) if weights is not None else None
    if expected is not None and schedules.weights_sha256 != expected:
        raise ScheduleError(_other_weights(path, schedules.weights_sha256, expected, weights))
    return schedules


def _other_weights(path: Path, tuned: str, found: str, weights: str | os.PathLike[str] | None) -> str:
    """Weights and grids that do not belong together. The grids record the weights they were tuned on, so
    without a SHA256SUMS it is the grids that catch damaged weights: the weights are the suspect, and
    removing the grids would only hide it."""
    which = f"the weights {weights}" if weights is not None else "the weights they are used with"
    retune = (
        f"`ldlm tune-schedule {path.parent} --force`"
        if weights is not None
        else "`ldlm tune-schedule CHECKPOINT --force` on their checkpoint, then export it again"
    )
    return (
        f"{which} do not match the weights {path} was tuned on (sha256 {found}; tuned on {tuned}): the weights may be "
        "corrupt, truncated or replaced. Restore the checkpoint's own weights (a fresh copy from where you got it; its "
        f"SHA256SUMS, where it has one, names the right hash), or, if they are new weights on purpose, tune their grids "
        f"with {retune}. Removing {path.name} would only hide the mismatch"
    )


def checkpoint_schedules(directory: str | os.PathLike[str]) -> TunedSchedules | None:
    """A checkpoint's tuned step grids (schedules.json), refused when tuned for other weights than its own; None: not tuned."""
    return load_schedules(directory, weights=Path(directory) / WEIGHTS_FILE)
