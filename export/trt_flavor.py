"""Which TensorRT: NVIDIA TensorRT (``tensorrt``, datacenter GPUs) or TensorRT for RTX
(``tensorrt_rtx``, which also AOT-builds engines on machines without a GPU).

Both share the builder, parser, profile and runtime API this package uses, so everything else
takes the imported module and runs one code path. Imports are lazy: neither is a hard dependency.
The network creation flags every parse and build here uses (``network_flags``) live here too, and the checked
binding of torch tensors to an execution context (``bind``) that the runtime and the eps probes share.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

FLAVORS: tuple[str, ...] = ("tensorrt", "tensorrt_rtx")
INSTALL_HINT = "pip install -e .[rtx] (TensorRT-RTX), or NVIDIA TensorRT from NVIDIA's index or container"


class FlavorError(ValueError):
    """No usable TensorRT flavour, or not the one asked for."""


class EngineBuildError(RuntimeError):
    """Parsing or building failed; the message names the graph and TensorRT's own errors."""


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
    missing = f"TensorRT flavour {name!r} is not installed" if name else f"no TensorRT flavour ({', '.join(FLAVORS)}) is installed"
    raise FlavorError(f"{missing} ({'; '.join(errors)}); install {'it' if name else 'one'} with {INSTALL_HINT}")


# --- network definitions: the same flags for every network this package builds ----------------------


def network_flags(trt: Any) -> int:
    """Strongly typed where the flag exists: the ONNX carries the precision (TensorRT 11 and RTX
    build nothing else; TensorRT 10 accepts it)."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def is_strongly_typed(trt: Any, network: Any) -> bool:
    """Read back from the network itself: TensorRT-RTX networks are strongly typed whatever the
    creation flags say, and a TensorRT without the flag builds weakly typed networks."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return flag is not None and bool(network.get_flag(flag))


# TensorRT prints this when a LayerNorm arrived decomposed and runs in FP16; it is a build failure.
LAYERNORM_OVERFLOW = re.compile(r"layer\s*norm.*fp16.*overflow", re.IGNORECASE)
LOG_HISTORY = 256  # messages a long-running process keeps; older ones are dropped
CAPTURE_LIMIT = 1000  # messages one capture() keeps (a build's warnings, a deserialize's errors)

_loggers: dict[str, Any] = {}
_loggers_lock = threading.Lock()


def layernorm_overflow_warnings(messages: Iterable[tuple[str, str]]) -> list[str]:
    return [m for _, m in messages if LAYERNORM_OVERFLOW.search(m)]


def flavor_logger(flavor: Flavor) -> Any:
    """This process's one TensorRT ILogger for ``flavor``, shared by every builder and runtime.

    TensorRT registers the first logger it is given and warns "logger ... differs from one already
    registered" for each later one, so a logger per engine or per build is wrong. Messages at or
    above WARNING are kept in ``.messages``, the last ``LOG_HISTORY`` of them, so a server that runs
    for weeks does not grow; ``with logger.capture() as messages:`` collects one step's messages
    (a build's errors) from every thread while the block runs.
    """
    with _loggers_lock:
        if flavor.name not in _loggers:
            _loggers[flavor.name] = _make_logger(flavor.trt)
        return _loggers[flavor.name]


def _make_logger(trt: ModuleType) -> Any:
    class RecordingLogger(trt.ILogger):  # type: ignore[name-defined, unused-ignore]  # trt is a module chosen at run time
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: deque[tuple[str, str]] = deque(maxlen=LOG_HISTORY)
            self.threshold = trt.ILogger.Severity.WARNING
            self._captures: list[list[tuple[str, str]]] = []
            self._lock = threading.Lock()  # TensorRT may log from its own threads

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) > int(self.threshold):  # lower value = more severe
                return
            entry = (str(severity).rsplit(".", 1)[-1], msg)
            with self._lock:
                self.messages.append(entry)
                for capture in self._captures:
                    if len(capture) < CAPTURE_LIMIT:
                        capture.append(entry)

        @contextmanager
        def capture(self) -> Iterator[list[tuple[str, str]]]:
            messages: list[tuple[str, str]] = []
            with self._lock:
                self._captures.append(messages)
            try:
                yield messages
            finally:
                with self._lock:  # by identity: two captures still empty are equal lists
                    self._captures = [c for c in self._captures if c is not messages]

    return RecordingLogger()


@dataclass(frozen=True)
class GpuInfo:
    name: str | None
    compute_capability: str | None  # "9.0"

    @property
    def description(self) -> str:
        return f"{self.name} (compute capability {self.compute_capability})" if self.name else "AOT, no GPU"


def gpu_info(device: Any = None) -> GpuInfo:
    """The GPU this process would run on (``device``, else torch's current one), through torch's
    CUDA runtime; no GPU gives (None, None)."""
    if not torch.cuda.is_available():
        return GpuInfo(None, None)
    major, minor = torch.cuda.get_device_capability(device)
    return GpuInfo(torch.cuda.get_device_name(device), f"{major}.{minor}")


def set_input_shape(context: Any, name: str, shape: tuple[int, ...]) -> None:
    if not context.set_input_shape(name, shape):
        raise RuntimeError(f"TensorRT rejected shape {shape} for input {name} (outside the context's profile?)")


def set_tensor_address(context: Any, name: str, tensor: Tensor) -> None:
    if not context.set_tensor_address(name, tensor.data_ptr()):
        raise RuntimeError(f"TensorRT rejected the address of tensor {name} (shape {tuple(tensor.shape)}, {tensor.dtype})")


def bind(
    context: Any, inputs: dict[str, Tensor], output_names: Sequence[str], dtypes: dict[str, torch.dtype], device: torch.device
) -> dict[str, Tensor]:
    """Set every input's shape and address, allocate each output at the shape TensorRT infers."""
    for name, tensor in inputs.items():
        set_input_shape(context, name, tuple(tensor.shape))
        set_tensor_address(context, name, tensor)
    outputs = {}
    for name in output_names:
        shape = tuple(context.get_tensor_shape(name))
        if any(size < 0 for size in shape):
            raise RuntimeError(f"TensorRT could not infer the shape of output {name} ({shape}); are all input shapes set?")
        outputs[name] = torch.empty(shape, dtype=dtypes[name], device=device)
        set_tensor_address(context, name, outputs[name])
    return outputs
