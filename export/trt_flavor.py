"""Which TensorRT: NVIDIA TensorRT (``tensorrt``, datacenter GPUs) or TensorRT for RTX
(``tensorrt_rtx``, which also AOT-builds engines on machines without a GPU).

Both share the builder, parser, profile and runtime API this package uses, so everything else
takes the imported module and runs one code path. Imports are lazy: neither is a hard dependency.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

FLAVORS: tuple[str, ...] = ("tensorrt", "tensorrt_rtx")
INSTALL_HINT = "pip install -e .[rtx] (TensorRT-RTX), or NVIDIA TensorRT from NVIDIA's index or container"


class FlavorError(ValueError):
    """No usable TensorRT flavour, or not the one asked for."""


@dataclass(frozen=True)
class Flavor:
    name: str  # "tensorrt" or "tensorrt_rtx"
    trt: ModuleType

    @property
    def version(self) -> str:
        return str(self.trt.__version__)

    @property
    def is_rtx(self) -> bool:
        return self.name == "tensorrt_rtx"


def load_flavor(name: str | None = None) -> Flavor:
    """Import ``name``, or the first installed of tensorrt, tensorrt_rtx when None."""
    if name is not None and name not in FLAVORS:
        raise FlavorError(f"flavor={name!r} is unknown; allowed: {', '.join(FLAVORS)}")
    errors = []
    for candidate in [name] if name else FLAVORS:
        try:
            return Flavor(candidate, importlib.import_module(candidate))
        except ImportError as error:
            errors.append(f"{candidate}: {error}")
    wanted = f"TensorRT flavour {name!r} is" if name else "no TensorRT flavour is"
    raise FlavorError(f"{wanted} not installed ({'; '.join(errors)}); install it with {INSTALL_HINT}")


# TensorRT prints this when a LayerNorm arrived decomposed and runs in FP16; it is a build failure.
LAYERNORM_OVERFLOW = re.compile(r"layer\s*norm.*fp16.*overflow", re.IGNORECASE)


def recording_logger(flavor: Flavor, min_severity: str = "WARNING") -> Any:
    """A TensorRT ILogger that keeps every message at or above ``min_severity`` in ``.messages``."""
    trt = flavor.trt

    class RecordingLogger(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: list[tuple[str, str]] = []
            self.threshold = getattr(trt.ILogger.Severity, min_severity)

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) <= int(self.threshold):  # lower value = more severe
                self.messages.append((str(severity).rsplit(".", 1)[-1], msg))

        def layernorm_overflow_warnings(self) -> list[str]:
            return [m for _, m in self.messages if LAYERNORM_OVERFLOW.search(m)]

    return RecordingLogger()


@dataclass(frozen=True)
class GpuInfo:
    name: str | None
    compute_capability: str | None  # "9.0"

    @property
    def description(self) -> str:
        return f"{self.name} (compute capability {self.compute_capability})" if self.name else "AOT, no GPU"


def gpu_info() -> GpuInfo:
    """The GPU this process would run on, through torch's CUDA runtime; no GPU gives (None, None)."""
    import torch

    if not torch.cuda.is_available():
        return GpuInfo(None, None)
    major, minor = torch.cuda.get_device_capability()
    return GpuInfo(torch.cuda.get_device_name(), f"{major}.{minor}")
