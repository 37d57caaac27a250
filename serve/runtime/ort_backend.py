"""ONNX Runtime as a GraphBackend: one inference session per graph file, and ``open_backend``, which opens
an ``ldlm export`` directory on the providers of its registry entry (``ort``: the --provider asked for;
``ort-cuda``: the CUDA provider)."""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from ldlm.export.artifact import check_artifacts, describe_io, read_manifest
from ldlm.export.graphs import GRAPH_NAMES
from ldlm.export.precision import lower_precision
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TextTokenizer
from ldlm.serve.runtime.graph_backend import BackendError, GraphBackend
from ldlm.serve.runtime.registry import CPU_PROVIDER, ORT

if TYPE_CHECKING:
    from ldlm.serve.runtime.registry import BackendInfo, OpenOptions

# --provider of the ort backend: the providers asked for, in order (CPU as the fallback for ops a GPU
# provider lacks); the first one must really run.
ORT_PROVIDERS: dict[str, tuple[str, ...]] = {
    "cpu": (CPU_PROVIDER,),
    "cuda": ("CUDAExecutionProvider", CPU_PROVIDER),
    "tensorrt": ("TensorrtExecutionProvider", "CUDAExecutionProvider", CPU_PROVIDER),
}


class OrtBackend(GraphBackend):
    backend = ORT

    def __init__(
        self,
        path: Path,
        graph: str,
        max_seq_len: int,
        providers: tuple[str, ...] = (CPU_PROVIDER,),
        threads: int | None = None,
        memory_arena: bool = True,
        precision: str = "fp32",
    ) -> None:
        """``precision``: what the file at ``path`` is (fp32, an fp16 cast, an int8 variant), as reported."""
        ort = _import("onnxruntime", "pip install -e .[cpu] (or .[gpu] for the CUDA and TensorRT providers)")
        available = ort.get_available_providers()
        unknown = [p for p in providers if p not in available]
        if unknown:
            hint = (
                "; the CUDA and TensorRT providers need onnxruntime-gpu in place of onnxruntime (pip install -e .[gpu])"
                if CPU_PROVIDER in available
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


def _import(module: str, install: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise BackendError(f"ONNX Runtime is not installed ({error}); install it with {install}") from error


def providers_for(info: BackendInfo, provider: str = "cpu") -> tuple[str, ...]:
    """The providers ``info`` runs on: its own (ort-cuda), or for ort those of ``--provider``."""
    if info.providers:
        if provider != "cpu":
            raise BackendError(f"provider={provider!r} applies to backend {ORT!r} only; backend {info.name!r} runs {info.providers[0]}")
        return info.providers
    if provider not in ORT_PROVIDERS:
        raise BackendError(f"provider={provider!r} is unknown; allowed: {', '.join(ORT_PROVIDERS)}")
    return ORT_PROVIDERS[provider]


def open_backend(info: BackendInfo, path: Path, options: OpenOptions) -> tuple[dict[str, GraphBackend], LDLMConfig, TextTokenizer]:
    """An export's graphs, once every file its manifest names matches its record (the tokenizer included):
    int8 runs each graph's INT8 variant where the export has one (fp32 elsewhere), fp16 casts the graphs first."""
    manifest = read_manifest(path)
    check_artifacts(path, manifest)
    config = LDLMConfig.load(path / "config.json")
    tokenizer = TextTokenizer.from_directory(path) if (path / "tokenizer.json").is_file() else TextTokenizer.gpt2()
    providers = options.providers or providers_for(info)

    def session(file: Path, graph: str, precision: str = "fp32") -> OrtBackend:
        backend = OrtBackend(file, graph, config.max_seq_len, providers, options.threads, options.memory_arena, precision)
        backend.backend = info.name  # ort or ort-cuda, as metrics and reports name it
        return backend

    files = {g: path / manifest["graphs"][g]["file"] for g in GRAPH_NAMES}
    if options.precision == "int8":
        variants = {g: manifest["graphs"][g].get("variants", {}).get("int8") for g in GRAPH_NAMES}
        if not any(variants.values()):
            raise BackendError(
                f"{path} has no int8 variants (exported without --quantize); re-export with `ldlm export CKPT OUT --quantize int8`"
            )
        return {g: session(path / v["file"], g, "int8") if v else session(files[g], g) for g, v in variants.items()}, config, tokenizer
    if options.precision != "fp16":
        return {g: session(f, g) for g, f in files.items()}, config, tokenizer
    # The same cast pass the engines use, into a scratch directory that goes once the sessions hold
    # the graphs (ONNX Runtime reads a model and its external data whole when a session is made).
    with tempfile.TemporaryDirectory(prefix="ldlm-fp16-") as work:
        lowered = {g: Path(work) / f"{g}.fp16.onnx" for g in files}
        for g, source in files.items():
            lower_precision(source, lowered[g], "fp16")
        return {g: session(f, g, "fp16") for g, f in lowered.items()}, config, tokenizer
