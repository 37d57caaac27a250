"""One engine interface over torch eager, ONNX Runtime and TensorRT.

A ``GraphBackend`` runs one graph: named arrays (NumPy or torch) in, named NumPy arrays out.
Inputs are checked once here, against the graph's I/O contract from the export manifest; then a
backend-specific ``_run`` does the work. ``provider`` says what really ran (ONNX Runtime silently
falls back to CPU when a GPU provider cannot start, so it is read back from the session).

``BackendGraphs`` puts three GraphBackends behind the ``InferenceGraphs`` methods, so the one
``LDLMPipeline`` (and the batching scheduler) runs on any backend. Torch and TensorRT backends also
take and give device tensors (``run_tensors``), so a GPU pipeline makes no host copy per denoiser call.
The torch device/precision helpers and the ``compiled`` backend live in ``torch_backends``.
"""

from __future__ import annotations

import dataclasses
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
from ldlm.export.artifact import PLAN_SUFFIX, check_artifacts, check_engine_dir, describe_io, read_manifest
from ldlm.export.graphs import GRAPH_NAMES, graph_io
from ldlm.model import LDLM
from ldlm.tokenizer import TextTokenizer

BACKENDS: tuple[str, ...] = ("eager", "compiled", "ort", "trt")
TORCH_BACKENDS: tuple[str, ...] = ("eager", "compiled")  # open a checkpoint, run on --device
# --provider for ONNX Runtime: the providers asked for, in order (CPU as the fallback for ops a GPU
# provider lacks); the first one must really run.
ORT_PROVIDERS: dict[str, tuple[str, ...]] = {
    "cpu": ("CPUExecutionProvider",),
    "cuda": ("CUDAExecutionProvider", "CPUExecutionProvider"),
    "tensorrt": ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
}
NUMPY_DTYPES = {"FLOAT": np.float32, "INT64": np.int64, "FLOAT16": np.float16, "INT32": np.int32, "BOOL": np.bool_}
ORT_PRECISIONS = ("fp32", "fp16")  # ONNX Runtime's CPU provider has no bf16 kernels


class BackendError(ValueError):
    """A backend that is not installed, a precision it cannot run, or inputs outside its contract."""


class GraphBackend(ABC):
    backend: str
    provider: str
    batch_limit: int | None = None  # the largest batch one execution takes (TensorRT profiles); None: any

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
            self._check_one(spec, array.dtype.kind, str(array.dtype), tuple(array.shape), sizes)
            arrays[name] = np.ascontiguousarray(array, dtype=dtype)
        self._check_sizes(sizes)
        return arrays

    def check_tensors(self, inputs: Mapping[str, Tensor]) -> None:
        """``check_inputs`` for torch tensors on any device: shapes and dtypes only, no copy to the host."""
        sizes: dict[str, int] = {}
        missing = [n for n in self.input_names if n not in inputs]
        if missing or len(inputs) != len(self.input_names):
            raise BackendError(f"{self.graph}: inputs {sorted(inputs)} do not match; allowed: exactly {self.input_names}")
        for spec in self.inputs:
            value = inputs[spec["name"]]
            kind = "f" if value.is_floating_point() else "b" if value.dtype == torch.bool else "i"
            self._check_one(spec, kind, str(value.dtype).removeprefix("torch."), tuple(value.shape), sizes)
        self._check_sizes(sizes)

    def _check_one(self, spec: dict[str, Any], kind: str, dtype: str, shape: tuple[int, ...], sizes: dict[str, int]) -> None:
        """One input's dtype kind and shape against its spec; symbolic sizes collected in ``sizes``."""
        name, want_kind = spec["name"], np.dtype(NUMPY_DTYPES[spec["dtype"]]).kind
        if kind != want_kind and not (kind == "b" and want_kind == "i"):
            raise BackendError(f"{self.graph}: input {name} has dtype {dtype}; allowed: {np.dtype(NUMPY_DTYPES[spec['dtype']]).name}")
        if len(shape) != len(spec["shape"]):
            raise BackendError(f"{self.graph}: input {name} has shape {shape}; allowed: {spec['shape']}")
        for axis, (size, want) in enumerate(zip(shape, spec["shape"])):
            if isinstance(want, str):
                if sizes.setdefault(want, size) != size:
                    raise BackendError(f"{self.graph}: input {name} axis {axis} ({want}) is {size}, other inputs have {sizes[want]}")
            elif size != want:
                raise BackendError(f"{self.graph}: input {name} axis {axis} is {size}; allowed: {want}")

    def _check_sizes(self, sizes: dict[str, int]) -> None:
        if sizes.get("batch", 1) < 1 or not 1 <= sizes.get("seq", 1) <= self.max_seq_len:
            raise BackendError(f"{self.graph}: batch {sizes.get('batch')} / seq {sizes.get('seq')} out of range; allowed: batch >= 1, 1 <= seq <= {self.max_seq_len}")

    @abstractmethod
    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None:
        """Release what the backend holds past its last call (TensorRT: save the runtime cache)."""


class EagerBackend(GraphBackend):
    """The reference: the graph's torch module, run as exported (same wrapper, same names), on the
    model's device and in its precision (see ``torch_backends.prepare_model``). Float outputs come
    back as FP32."""

    backend = "eager"

    def __init__(self, model: LDLM, graph: str, with_logits: bool = False) -> None:
        io = graph_io(model, graph, with_logits)
        specs = [{"name": n, "dtype": "INT64" if t.dtype == torch.int64 else "FLOAT", "shape": list(s)}
                 for n, t, s in zip(io.input_names, io.example_inputs, io.input_shapes)]
        outs = [{"name": n, "dtype": "INT64" if n == "token_ids" else "FLOAT", "shape": list(s)} for n, s in zip(io.output_names, io.output_shapes)]
        super().__init__(graph, specs, outs, model.config.max_seq_len)
        self.module = io.module.eval()
        self.device = next(model.parameters()).device
        # The compute dtype: the latent bank is cast with the model and never on the FP32 list.
        self.dtype = model.latent_encoder.latent_bank.dtype
        self.precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        self.seq_names = {s["name"] for s in specs if "seq" in s["shape"]}
        self.seq_outputs = {o["name"] for o in outs if "seq" in o["shape"]}
        self.provider = f"torch {torch.__version__} eager on {self.device}" + ("" if self.precision == "fp32" else f" ({self.precision})")

    @torch.inference_mode()
    def run_tensors(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Tensors in (any device; checked on their shapes alone, no copy to the host), tensors
        out on this backend's device."""
        self.check_tensors(inputs)
        return self._forward({s["name"]: inputs[s["name"]].to(self.device, self.input_dtype(s), non_blocking=True) for s in self.inputs})

    def input_dtype(self, spec: dict[str, Any]) -> torch.dtype:
        """int64 stays; per-position activations take the compute dtype; the per-sample time t
        stays FP32 (its sinusoidal embedding is computed in FP32)."""
        if spec["dtype"] == "INT64":
            return torch.int64
        return self.dtype if spec["name"] in self.seq_names else torch.float32

    def _batch_and_length(self, tensors: Mapping[str, Tensor]) -> tuple[int, int]:
        mask = tensors["attention_mask"]
        return mask.shape[0], mask.shape[1]

    def _forward(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        result = self.module(*(tensors[n] for n in self.input_names))
        values = result if isinstance(result, tuple) else (result,)
        return {n: v.float() if v.is_floating_point() else v for n, v in zip(self.output_names, values)}

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.run_tensors({n: torch.from_numpy(a) for n, a in inputs.items()})
        return {n: v.cpu().numpy() for n, v in outputs.items()}


class OrtBackend(GraphBackend):
    backend = "ort"

    def __init__(self, path: Path, graph: str, max_seq_len: int, providers: tuple[str, ...] = ("CPUExecutionProvider",),
                 threads: int | None = None, memory_arena: bool = True) -> None:
        ort = _import("onnxruntime", "ort", ".[cpu] (or .[gpu] for CUDA/TensorRT providers)")
        available = ort.get_available_providers()
        unknown = [p for p in providers if p not in available]
        if unknown:
            hint = "; the CUDA and TensorRT providers need onnxruntime-gpu (pip install -e .[gpu])" if "CPUExecutionProvider" in available else ""
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
        if self.provider != providers[0]:  # onnxruntime-gpu falls back to CPU silently (no GPU, no CUDA libraries)
            raise BackendError(f"ONNX Runtime could not start {providers[0]} for {graph} (it fell back to {self.provider}); "
                               "check that a GPU is visible and that the CUDA/cuDNN (and TensorRT) libraries onnxruntime-gpu needs are installed")

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.session.run(self.output_names, inputs)
        return dict(zip(self.output_names, values))


class TensorRTBackend(GraphBackend):
    """A plan on the GPU. Batches larger than the engine's profiles run as several executions
    (``batch_limit`` is the largest one execution takes); sequences are capped by the profiles."""

    backend = "trt"

    def __init__(self, plan: Path, graph: str, max_seq_len: int, cuda_graphs: bool = False) -> None:
        from ldlm.serve.runtime.tensorrt_engine import TensorRTEngine

        self.engine = TensorRTEngine(plan, cuda_graphs=cuda_graphs)
        manifest = self.engine.manifest
        super().__init__(graph, manifest["inputs"], manifest["outputs"], min(max_seq_len, self.engine.max_seq or max_seq_len))
        self.batch_limit = self.engine.max_batch
        self.device = self.engine.device  # the pipeline samples here: no host copy per denoiser call
        self.provider = f"{manifest['flavor']} {manifest['trt_version']} ({manifest['precision']})"

    def run_tensors(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Tensors in (any device; checked on their shapes alone), tensors out on the GPU, float outputs as FP32."""
        self.check_tensors(inputs)
        outputs = self.engine.run(dict(inputs))
        return {n: outputs[n].float() if outputs[n].is_floating_point() else outputs[n] for n in self.output_names}

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.engine.run({n: torch.from_numpy(a) for n, a in inputs.items()})
        # .cpu() waits for the caller's stream, which waits for the engine's
        return {n: outputs[n].float().cpu().numpy() if outputs[n].is_floating_point() else outputs[n].cpu().numpy() for n in self.output_names}

    def close(self) -> None:
        self.engine.close()


def _import(module: str, backend: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise BackendError(f"backend {backend!r} is not installed ({error}); install it with pip install -e {extra}") from error


def ort_providers(name: str) -> tuple[str, ...]:
    """The ONNX Runtime provider list for ``--provider NAME``."""
    if name not in ORT_PROVIDERS:
        raise BackendError(f"provider={name!r} is unknown; allowed: {', '.join(ORT_PROVIDERS)}")
    return ORT_PROVIDERS[name]


def open_graphs(
    backend: str,
    path: str | Path,
    precision: str = "fp32",
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    threads: int | None = None,
    device: str = "cpu",
    with_logits: bool = False,
    memory_arena: bool = True,
    cuda_graphs: bool = False,
) -> tuple[dict[str, GraphBackend], LDLMConfig, TextTokenizer]:
    """Open every graph of ``path`` on ``backend``: a checkpoint (eager, compiled: on ``device``),
    an ``ldlm export`` directory (ort: on ``providers``), or an ``ldlm build-engine`` directory (trt;
    ``cuda_graphs`` replays CUDA graphs: TensorRT-RTX's own capture, or torch's for NVIDIA TensorRT).
    Every file an export manifest names is checked first (inside the directory, sha256 as written),
    so serve, parity and bench never run an edited artifact."""
    if backend not in BACKENDS:
        raise BackendError(f"backend={backend!r} is unknown; allowed: {', '.join(BACKENDS)}")
    if cuda_graphs and backend != "trt":
        raise BackendError(f"cuda_graphs applies to backend 'trt' only, not {backend!r}; "
                           "the compiled backend captures CUDA graphs by itself on a CUDA device")
    path = Path(path)
    if backend in TORCH_BACKENDS:
        from ldlm.serve.runtime.torch_backends import CompiledBackend, check_precision, prepare_model, resolve_device

        check_precision(precision, backend)
        target = resolve_device(device)  # before loading: a missing device fails fast
        if not (path / "model.safetensors").is_file():
            raise BackendError(f"{path} is not a checkpoint (no model.safetensors); backend {backend!r} runs a checkpoint from `ldlm init`")
        model, tokenizer = load_checkpoint(path)
        model = prepare_model(model, target, precision)
        kind = EagerBackend if backend == "eager" else CompiledBackend
        return {g: kind(model, g, with_logits and g == "decoder") for g in GRAPH_NAMES}, model.config, tokenizer
    if device != "cpu":
        raise BackendError(f"backend {backend!r} does not take device={device!r}; ort picks its device with providers "
                           "(--provider cuda|tensorrt), trt runs on the GPU its engines were built for")
    if not (path / "config.json").is_file():
        raise BackendError(f"{path} has no config.json; backend {backend!r} needs a directory written by "
                           f"{'`ldlm export`' if backend == 'ort' else '`ldlm build-engine`'}")
    # Every file is checked against its record before any is read, the tokenizer included.
    if backend == "ort":
        if precision not in ORT_PRECISIONS:
            raise BackendError(f"backend 'ort' cannot run precision={precision!r}; allowed: {', '.join(ORT_PRECISIONS)}")
        manifest = read_manifest(path)
        check_artifacts(path, manifest)
    else:  # the plans themselves are hashed as TensorRTEngine reads them
        built = {m.get("precision") for m in check_engine_dir(path, GRAPH_NAMES, plans=False).values()}
        if built != {precision}:
            raise BackendError(f"engines in {path} are {sorted(map(str, built))}; asked for precision={precision!r}; "
                               f"rebuild with --precision {precision}")
    config = LDLMConfig.load(path / "config.json")
    tokenizer = TextTokenizer.from_directory(path) if (path / "tokenizer.json").is_file() else TextTokenizer.gpt2()
    if backend == "ort":
        files = {g: path / manifest["graphs"][g]["file"] for g in GRAPH_NAMES}
        if precision != "fp16":
            return {g: OrtBackend(f, g, config.max_seq_len, providers, threads, memory_arena) for g, f in files.items()}, config, tokenizer
        from ldlm.export.precision import lower_precision

        # The same cast pass the engines use, into a scratch directory that goes once the sessions hold
        # the graphs (ONNX Runtime reads a model and its external data whole when a session is made).
        with tempfile.TemporaryDirectory(prefix="ldlm-fp16-") as work:
            lowered = {g: Path(work) / f"{g}.fp16.onnx" for g in files}
            for g, source in files.items():
                lower_precision(source, lowered[g], "fp16")
            return {g: OrtBackend(f, g, config.max_seq_len, providers, threads, memory_arena) for g, f in lowered.items()}, config, tokenizer
    graphs: dict[str, GraphBackend] = {g: TensorRTBackend(path / f"{g}{PLAN_SUFFIX}", g, config.max_seq_len, cuda_graphs) for g in GRAPH_NAMES}
    return graphs, config, tokenizer


def serving_limits(graphs: Mapping[str, GraphBackend], config: LDLMConfig, max_batch: int) -> tuple[LDLMConfig, int]:
    """What a service built on ``graphs`` may accept: ``config`` with ``max_seq_len`` capped at the
    shortest sequence every graph takes (TensorRT profiles may stop short of the model's), and
    samples per execution capped at the smallest batch one execution of any graph takes."""
    seq = min(g.max_seq_len for g in graphs.values())
    capped = config if seq >= config.max_seq_len else dataclasses.replace(config, max_seq_len=seq)
    limits = [g.batch_limit for g in graphs.values() if g.batch_limit is not None]
    return capped, min([max_batch, *limits])


class GraphRunner(Protocol):
    """Runs one graph: named arrays or tensors in (checked by the runner), named arrays out."""

    def run(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]: ...


class BackendGraphs:
    """The ``InferenceGraphs`` methods on top of anything that runs a graph by name: GraphBackends,
    or the server's DynamicBatchers in front of them (torch tensors in and out)."""

    def __init__(self, graphs: Mapping[str, GraphRunner]) -> None:
        self.graphs = dict(graphs)

    def _run(self, graph: str, feed: dict[str, Tensor], output: str, like: Tensor) -> Tensor:
        """One output of ``graph``, on ``like``'s device: through device tensors where the runner
        takes them (torch backends), else through NumPy (ONNX Runtime, TensorRT, batchers)."""
        runner = self.graphs[graph]
        if hasattr(runner, "run_tensors"):
            return runner.run_tensors(feed)[output].to(like.device)
        return torch.from_numpy(runner.run(feed)[output]).to(like.device)

    def encode_latents(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self._run("encoder", {"input_ids": input_ids, "attention_mask": attention_mask.long()}, "latents", input_ids)

    def denoise(self, x_t: Tensor, t: Tensor, x0_prev: Tensor, mask: Tensor) -> Tensor:
        feed = {"x_t": x_t.float(), "t": t.float(), "x0_prev": x0_prev.float(), "attention_mask": mask.long()}
        return self._run("denoiser", feed, "x0_hat", x_t).to(x_t.dtype)

    def decode_tokens(self, latents: Tensor, mask: Tensor) -> Tensor:
        return self._run("decoder", {"latents": latents.float(), "attention_mask": mask.long()}, "token_ids", latents)
