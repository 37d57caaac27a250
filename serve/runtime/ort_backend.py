"""ONNX Runtime as a GraphBackend: one inference session per graph file."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ldlm.export.artifact import describe_io
from ldlm.serve.runtime.graph_backend import BackendError, GraphBackend


class OrtBackend(GraphBackend):
    backend = "ort"

    def __init__(
        self,
        path: Path,
        graph: str,
        max_seq_len: int,
        providers: tuple[str, ...] = ("CPUExecutionProvider",),
        threads: int | None = None,
        memory_arena: bool = True,
        precision: str = "fp32",
    ) -> None:
        """``precision``: what the file at ``path`` is (fp32, an fp16 cast, an int8 variant), as reported."""
        ort = _import("onnxruntime", "ort", ".[cpu] (or .[gpu] for CUDA/TensorRT providers)")
        available = ort.get_available_providers()
        unknown = [p for p in providers if p not in available]
        if unknown:
            hint = (
                "; the CUDA and TensorRT providers need onnxruntime-gpu (pip install -e .[gpu])"
                if "CPUExecutionProvider" in available
                else ""
            )
            raise BackendError(f"ONNX Runtime providers {unknown} are not available here; allowed: {available}{hint}")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        # ONNX Runtime's workers spin after each run; on a small machine that starves the torch
        # sampler math between denoiser calls, so they sleep instead.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # The CPU arena keeps its peak for the life of the session: one large request would pin
        # gigabytes. A server turns it off (memory_arena=False) so a peak is given back.
        options.enable_cpu_mem_arena = memory_arena
        try:
            self.session = ort.InferenceSession(str(path), options, providers=list(providers))
        except Exception as error:  # ONNX Runtime raises its own types (Fail, InvalidGraph, ...)
            raise BackendError(f"ONNX Runtime cannot load {path}: {str(error).splitlines()[0][:300]}") from error
        graph_proto = onnx.load(str(path), load_external_data=False).graph
        super().__init__(graph, describe_io(graph_proto.input), describe_io(graph_proto.output), max_seq_len)
        self.provider = self.session.get_providers()[0]  # what really runs, not what was asked for
        self.precision = precision
        if self.provider != providers[0]:  # onnxruntime-gpu falls back to CPU silently (no GPU, no CUDA libraries)
            raise BackendError(
                f"ONNX Runtime could not start {providers[0]} for {graph} (it fell back to {self.provider}); "
                "check that a GPU is visible and that the CUDA/cuDNN (and TensorRT) libraries onnxruntime-gpu needs are installed"
            )

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.session.run(self.output_names, inputs)
        return dict(zip(self.output_names, values))


def _import(module: str, backend: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise BackendError(f"backend {backend!r} is not installed ({error}); install it with pip install -e {extra}") from error
