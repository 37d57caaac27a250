"""The backends a graph runs on, one entry each: the only place a backend is named.

An entry says what the backend opens (a checkpoint, an ``ldlm export`` directory, an ``ldlm build-engine``
directory), the precisions it runs, the ONNX Runtime providers it asks for (where it is ONNX Runtime), and
the module that implements it. That module owns how the artifact is checked and opened
(``open_backend(info, path, options)``); the service, parity, the eps probes, bench and the CLI read this
table, never a backend's name. Adding a backend is one module with ``open_backend`` plus one entry below.

Only the standard library here: the CLI lists the backends before anything heavy loads.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

Artifact = Literal["checkpoint", "export", "engines"]
ARTIFACT_COMMANDS: dict[str, str] = {  # what writes each artifact, for messages
    "checkpoint": "`ldlm init` or `ldlm import-checkpoint`",
    "export": "`ldlm export`",
    "engines": "`ldlm build-engine`",
}
TORCH_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class BackendInfo:
    name: str
    opens: Artifact  # what it runs: a checkpoint's own modules, an export's ONNX graphs, or engines
    precisions: tuple[str, ...]
    module: str  # the module with its ``open_backend``
    summary: str  # one line for --help
    providers: tuple[str, ...] = ()  # ONNX Runtime's providers, in order; () for ort: from --provider

    @property
    def runs_checkpoint(self) -> bool:
        """A torch backend: the checkpoint's own modules on a torch device; no artifact, so no verifier or eps probes."""
        return self.opens == "checkpoint"


CPU_PROVIDER = "CPUExecutionProvider"
# The names other modules may need one of by role (the reference, the default, the probes' runtimes).
EAGER, COMPILED, INDUCTOR, ORT, ORT_CUDA, TRT = "eager", "compiled", "inductor", "ort", "ort-cuda", "trt"
REGISTRY: dict[str, BackendInfo] = {
    b.name: b
    for b in (
        BackendInfo(
            EAGER, "checkpoint", TORCH_PRECISIONS, "ldlm.serve.runtime.torch_backends", "the checkpoint's torch modules as they are"
        ),
        BackendInfo(
            COMPILED,
            "checkpoint",
            TORCH_PRECISIONS,
            "ldlm.serve.runtime.torch_backends",
            "static shape buckets, one CUDA graph per bucket on CUDA",
        ),
        BackendInfo(
            INDUCTOR,
            "checkpoint",
            TORCH_PRECISIONS,
            "ldlm.serve.runtime.torch_backends",
            "compiled, with torch.compile's kernels per bucket",
        ),
        BackendInfo(
            ORT,
            "export",
            ("fp32", "fp16", "int8"),  # the CPU provider has no bf16 kernels; int8: an export's variants
            "ldlm.serve.runtime.ort_backend",
            "ONNX Runtime on an export (--provider picks CPU, CUDA or TensorRT)",
        ),
        BackendInfo(
            ORT_CUDA,
            "export",
            ("fp32", "fp16", "int8"),
            "ldlm.serve.runtime.ort_backend",
            "ONNX Runtime's CUDA provider on an export",
            providers=("CUDAExecutionProvider", CPU_PROVIDER),
        ),
        BackendInfo(
            TRT,
            "engines",
            ("fp32", "fp16", "bf16", "int8", "fp8"),
            "ldlm.serve.runtime.trt_backend",
            "TensorRT engines built ahead of time",
        ),
    )
}
# What --precision may name at run time (serve, parity, bench): what the checkpoint and export backends run; an
# engine's precision is built into it.
RUN_PRECISIONS: tuple[str, ...] = tuple(dict.fromkeys(p for b in REGISTRY.values() if b.opens != "engines" for p in b.precisions))
DEFAULT_BACKEND = ORT  # serve, parity and bench: ONNX Runtime on the CPU runs everywhere
# What `ldlm serve --device cuda` runs when no backend is named: Inductor's kernels inside the per-bucket CUDA graphs,
# 1.46-2.04x the eager kernels' speed on an H200 (docs/measurements/gpu-profile-h200-2026-12-04.json); its parity
# against CPU fp32 eager is a stage of scripts/research/gpu_check.py.
CUDA_DEFAULT_BACKEND = INDUCTOR
# What the torch backends run on CUDA when no precision is named: fp16 matmuls with the residual stream, norms and
# logits in FP32 kept 99.7% of fp32's tokens on the trained reference, bf16 97.9%
# (docs/measurements/precision-tokens-reference-cpu-2026-12-06.json). Everything else runs fp32 unless told.
CUDA_DEFAULT_PRECISION = "fp16"
DEFAULT_PRECISION = "fp32"
REFERENCE_BACKEND = EAGER  # what parity and bench compare against: the checkpoint's own modules, fp32 on the CPU
PROBE_BACKENDS: dict[Artifact, str] = {"export": ORT, "engines": TRT}  # what runs each artifact's LayerNorms alone (eps probes)


@dataclass(frozen=True)
class OpenOptions:
    """How a backend's module opens its graphs (each takes what applies to it)."""

    precision: str = "fp32"
    providers: tuple[str, ...] = ()  # ONNX Runtime's; (): the backend's own (ort: CPU)
    threads: int | None = None
    device: str = "cpu"  # torch backends
    with_logits: bool = False  # torch backends: the decoder's logits too
    memory_arena: bool = True  # ONNX Runtime's CPU arena
    cuda_graphs: bool = False  # TensorRT: replay CUDA graphs


def default_backend(device: str = "cpu") -> str:
    """The backend the service runs when none is named: the torch fast path on a CUDA device (``cuda``,
    ``cuda:N``; a machine without one is refused when the device is resolved, naming why), else
    ``DEFAULT_BACKEND``, which needs no GPU. The one place this choice is made."""
    return CUDA_DEFAULT_BACKEND if _on_cuda(device) else DEFAULT_BACKEND


def default_precision(backend: str, device: str = "cpu") -> str:
    """The precision a command runs ``backend`` in when none is named: ``CUDA_DEFAULT_PRECISION`` for a torch backend
    on a CUDA device, else ``DEFAULT_PRECISION`` (an export or engines run as written). The one place this is chosen."""
    return CUDA_DEFAULT_PRECISION if _on_cuda(device) and backend_info(backend).runs_checkpoint else DEFAULT_PRECISION


def resolve_run(device: str = "cpu", backend: str | None = None, precision: str | None = None) -> tuple[str, str]:
    """The backend and precision a command runs on ``device``, given what it names (None or "": not named):
    ``default_backend(device)`` and ``default_precision(backend, device)``. ``ldlm serve`` (``ServerSettings``),
    ``ldlm parity`` and ``ldlm bench`` all resolve here, so parity checks and bench times what serve runs."""
    backend = backend or default_backend(device)
    return backend, precision or default_precision(backend, device)


def _on_cuda(device: str) -> bool:
    return device.split(":", 1)[0] == "cuda"


class UnknownBackendError(ValueError):
    pass


def backend_info(name: str) -> BackendInfo:
    """The entry of backend ``name``, or an error naming the allowed ones."""
    if name not in REGISTRY:
        raise UnknownBackendError(f"backend={name!r} is unknown; allowed: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def backend_names(opens: Artifact | None = None) -> tuple[str, ...]:
    """Every backend's name (those that open ``opens``, where given), in the table's order."""
    return tuple(name for name, info in REGISTRY.items() if opens is None or info.opens == opens)


def backend_help() -> str:
    """The backends in one line each, for --help."""
    return "; ".join(f"{name}: {info.summary} ({', '.join(info.precisions)})" for name, info in REGISTRY.items())


def implementation(info: BackendInfo) -> object:
    """The module that implements ``info`` (imported on first use: torch, ONNX Runtime and TensorRT are heavy)."""
    return importlib.import_module(info.module)
