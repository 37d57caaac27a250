"""One engine interface over torch eager, ONNX Runtime and TensorRT.

A ``GraphBackend`` runs one graph: named arrays (NumPy or torch) in, named NumPy arrays out.
Inputs are checked once here, against the graph's I/O contract from the export manifest; then a
backend-specific ``_run`` does the work. ``provider`` says what really ran (ONNX Runtime silently
falls back to CPU when a GPU provider cannot start, so it is read back from the session).

``BackendGraphs`` puts three GraphBackends behind the ``InferenceGraphs`` methods, so the one
``LDLMPipeline`` (and the batching scheduler) runs on any backend.
"""

from __future__ import annotations

import importlib
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
import torch
from torch import Tensor

from ldlm.checkpoint import load_checkpoint
from ldlm.config import LDLMConfig
from ldlm.export.artifact import check_artifacts
from ldlm.export.graphs import GRAPH_NAMES, graph_io
from ldlm.export.onnx_export import describe_io, read_manifest
from ldlm.model import LDLM
from ldlm.tokenizer import TextTokenizer

BACKENDS: tuple[str, ...] = ("eager", "ort", "trt")
NUMPY_DTYPES = {"FLOAT": np.float32, "INT64": np.int64, "FLOAT16": np.float16, "INT32": np.int32, "BOOL": np.bool_}
ORT_PRECISIONS = ("fp32", "fp16")  # ONNX Runtime's CPU provider has no bf16 kernels


class BackendError(ValueError):
    """A backend that is not installed, a precision it cannot run, or inputs outside its contract."""


class GraphBackend(ABC):
    backend: str
    provider: str

    def __init__(self, graph: str, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]], max_seq_len: int) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.max_seq_len = max_seq_len
        self.input_names = [i["name"] for i in inputs]
        self.output_names = [o["name"] for o in outputs]

    def run(self, inputs: Mapping[str, np.ndarray | Tensor]) -> dict[str, np.ndarray]:
        return self._run(self.check_inputs(inputs))

    def check_inputs(self, inputs: Mapping[str, np.ndarray | Tensor]) -> dict[str, np.ndarray]:
        """Names, dtypes and shapes against the contract; a consistent batch and sequence length."""
        missing = [n for n in self.input_names if n not in inputs]
        unknown = [n for n in inputs if n not in self.input_names]
        if missing or unknown:
            raise BackendError(f"{self.graph}: inputs {sorted(inputs)} do not match; allowed: exactly {self.input_names}")
        arrays: dict[str, np.ndarray] = {}
        sizes: dict[str, int] = {}
        for spec in self.inputs:
            name = spec["name"]
            value = inputs[name]
            array = value.detach().cpu().numpy() if isinstance(value, Tensor) else np.asarray(value)
            dtype = NUMPY_DTYPES[spec["dtype"]]
            if array.dtype.kind != np.dtype(dtype).kind and not (array.dtype.kind == "b" and dtype == np.int64):
                raise BackendError(f"{self.graph}: input {name} has dtype {array.dtype}; allowed: {np.dtype(dtype).name}")
            if array.ndim != len(spec["shape"]):
                raise BackendError(f"{self.graph}: input {name} has shape {array.shape}; allowed: {spec['shape']}")
            for axis, (size, want) in enumerate(zip(array.shape, spec["shape"])):
                if isinstance(want, str):
                    if sizes.setdefault(want, size) != size:
                        raise BackendError(f"{self.graph}: input {name} axis {axis} ({want}) is {size}, other inputs have {sizes[want]}")
                elif size != want:
                    raise BackendError(f"{self.graph}: input {name} axis {axis} is {size}; allowed: {want}")
            arrays[name] = np.ascontiguousarray(array, dtype=dtype)
        if sizes.get("batch", 1) < 1 or not 1 <= sizes.get("seq", 1) <= self.max_seq_len:
            raise BackendError(f"{self.graph}: batch {sizes.get('batch')} / seq {sizes.get('seq')} out of range; allowed: batch >= 1, 1 <= seq <= {self.max_seq_len}")
        return arrays

    @abstractmethod
    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class EagerBackend(GraphBackend):
    """The reference: the graph's torch module, run as exported (same wrapper, same names)."""

    backend = "eager"

    def __init__(self, model: LDLM, graph: str, with_logits: bool = False) -> None:
        io = graph_io(model, graph, with_logits)
        specs = [{"name": n, "dtype": "INT64" if t.dtype == torch.int64 else "FLOAT", "shape": list(s)}
                 for n, t, s in zip(io.input_names, io.example_inputs, io.input_shapes)]
        outs = [{"name": n, "dtype": "INT64" if n == "token_ids" else "FLOAT", "shape": list(s)} for n, s in zip(io.output_names, io.output_shapes)]
        super().__init__(graph, specs, outs, model.config.max_seq_len)
        self.module = io.module.eval()
        self.device = next(model.parameters()).device
        self.provider = f"torch {torch.__version__} eager on {self.device}"

    @torch.inference_mode()
    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self.module(*(torch.from_numpy(inputs[n]).to(self.device) for n in self.input_names))
        values = result if isinstance(result, tuple) else (result,)
        return {n: v.cpu().numpy() for n, v in zip(self.output_names, values)}


class OrtBackend(GraphBackend):
    backend = "ort"

    def __init__(self, path: Path, graph: str, max_seq_len: int, providers: tuple[str, ...] = ("CPUExecutionProvider",),
                 threads: int | None = None, memory_arena: bool = True) -> None:
        ort = _import("onnxruntime", "ort", ".[cpu] (or .[gpu] for CUDA/TensorRT providers)")
        available = ort.get_available_providers()
        unknown = [p for p in providers if p not in available]
        if unknown:
            raise BackendError(f"ONNX Runtime providers {unknown} are not available here; allowed: {available}")
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

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.session.run(self.output_names, inputs)
        return dict(zip(self.output_names, values))


class TensorRTBackend(GraphBackend):
    backend = "trt"

    def __init__(self, plan: Path, graph: str, max_seq_len: int, cuda_graphs: bool = False) -> None:
        from ldlm.serve.tensorrt_engine import TensorRTEngine

        self.engine = TensorRTEngine(plan, cuda_graphs=cuda_graphs)
        manifest = self.engine.manifest
        super().__init__(graph, manifest["inputs"], manifest["outputs"], max_seq_len)
        self.provider = f"{manifest['flavor']} {manifest['trt_version']} ({manifest['precision']})"

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.engine.run({n: torch.from_numpy(a) for n, a in inputs.items()})
        torch.cuda.synchronize()
        return {n: outputs[n].float().cpu().numpy() if outputs[n].is_floating_point() else outputs[n].cpu().numpy() for n in self.output_names}


def _import(module: str, backend: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise BackendError(f"backend {backend!r} is not installed ({error}); install it with pip install -e {extra}") from error


def open_graphs(
    backend: str,
    path: str | Path,
    precision: str = "fp32",
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    threads: int | None = None,
    memory_arena: bool = True,
) -> tuple[dict[str, GraphBackend], LDLMConfig, TextTokenizer]:
    """Open every graph of ``path`` on ``backend``: a checkpoint (eager), an ``ldlm export``
    directory (ort), or an ``ldlm build-engine`` directory (trt). Every file an export manifest
    names is checked first (inside the directory, sha256 as written), so serve, parity and bench
    never run an edited artifact."""
    if backend not in BACKENDS:
        raise BackendError(f"backend={backend!r} is unknown; allowed: {', '.join(BACKENDS)}")
    path = Path(path)
    if backend == "eager":
        if precision != "fp32":
            raise BackendError(f"backend 'eager' cannot run precision={precision!r}; allowed: fp32")
        model, tokenizer = load_checkpoint(path)
        return {g: EagerBackend(model, g) for g in GRAPH_NAMES}, model.config, tokenizer
    if not (path / "config.json").is_file():
        raise BackendError(f"{path} has no config.json; backend {backend!r} needs a directory written by "
                           f"{'`ldlm export`' if backend == 'ort' else '`ldlm build-engine`'}")
    config = LDLMConfig.load(path / "config.json")
    has_tokenizer = (path / "tokenizer.json").is_file()
    tokenizer = TextTokenizer.from_directory(path) if has_tokenizer else TextTokenizer.gpt2()
    if backend == "ort":
        if precision not in ORT_PRECISIONS:
            raise BackendError(f"backend 'ort' cannot run precision={precision!r}; allowed: {', '.join(ORT_PRECISIONS)}")
        manifest = read_manifest(path)
        check_artifacts(path, manifest)
        files = {g: path / manifest["graphs"][g]["file"] for g in GRAPH_NAMES}
        if precision == "fp16":  # the same cast pass the engines use, into a scratch directory
            from ldlm.export.precision import lower_precision

            work = Path(tempfile.mkdtemp(prefix="ldlm-fp16-"))
            for g, source in list(files.items()):
                files[g] = work / f"{g}.fp16.onnx"
                lower_precision(source, files[g], "fp16")
        return {g: OrtBackend(f, g, config.max_seq_len, providers, threads, memory_arena) for g, f in files.items()}, config, tokenizer
    plans = {g: path / f"{g}.plan" for g in GRAPH_NAMES}
    graphs: dict[str, GraphBackend] = {g: TensorRTBackend(p, g, config.max_seq_len) for g, p in plans.items()}
    built = {g.engine.manifest["precision"] for g in graphs.values() if isinstance(g, TensorRTBackend)}
    if built != {precision}:
        raise BackendError(f"engines in {path} are {sorted(built)}; asked for precision={precision!r}; rebuild with --precision {precision}")
    return graphs, config, tokenizer


class GraphRunner(Protocol):
    """Runs one graph: named arrays or tensors in (checked by the runner), named arrays out."""

    def run(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]: ...


class BackendGraphs:
    """The ``InferenceGraphs`` methods on top of anything that runs a graph by name: GraphBackends,
    or the server's DynamicBatchers in front of them (torch tensors in and out)."""

    def __init__(self, graphs: Mapping[str, GraphRunner]) -> None:
        self.graphs = dict(graphs)

    def encode_latents(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.graphs["encoder"].run({"input_ids": input_ids, "attention_mask": attention_mask.long()})
        return torch.from_numpy(out["latents"])

    def denoise(self, x_t: Tensor, t: Tensor, x0_prev: Tensor, mask: Tensor) -> Tensor:
        feed = {"x_t": x_t.float(), "t": t.float(), "x0_prev": x0_prev.float(), "attention_mask": mask.long()}
        return torch.from_numpy(self.graphs["denoiser"].run(feed)["x0_hat"]).to(x_t.dtype)

    def decode_tokens(self, latents: Tensor, mask: Tensor) -> Tensor:
        out = self.graphs["decoder"].run({"latents": latents.float(), "attention_mask": mask.long()})
        return torch.from_numpy(out["token_ids"])
