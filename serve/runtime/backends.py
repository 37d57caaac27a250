"""One engine interface over torch eager, ONNX Runtime and TensorRT, and ``open_graphs`` to open it.

A ``GraphBackend`` (``graph_backend``) runs one graph: named arrays (NumPy or torch) in, named NumPy
arrays out, its inputs checked once against the graph's I/O contract from the export manifest.
``provider`` says what really ran (ONNX Runtime silently falls back to CPU when a GPU provider
cannot start, so it is read back from the session). The TensorRT backend lives here,
ONNX Runtime's in ``ort_backend``; the torch ones (``eager``, ``compiled``) and their device/precision helpers in ``torch_backends``.

``BackendGraphs`` puts three GraphBackends behind the ``InferenceGraphs`` methods, so the one
``LDLMPipeline`` (and the batching scheduler) runs on any backend. Torch and TensorRT backends also
take and give device tensors (``run_tensors``), so a GPU pipeline makes no host copy per denoiser call.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from ldlm.checkpoint import load_checkpoint
from ldlm.config import LDLMConfig
from ldlm.export.artifact import PLAN_SUFFIX, check_artifacts, check_engine_dir, read_manifest
from ldlm.export.graphs import GRAPH_NAMES
from ldlm.export.precision import lower_precision
from ldlm.serve.runtime.graph_backend import BackendError, GraphBackend
from ldlm.serve.runtime.ort_backend import OrtBackend
from ldlm.serve.runtime.tensorrt_engine import TensorRTEngine
from ldlm.serve.runtime.torch_backends import (
    CompiledBackend,
    EagerBackend,
    InductorBackend,
    check_precision,
    prepare_model,
    resolve_device,
)
from ldlm.tokenizer import TextTokenizer

BACKENDS: tuple[str, ...] = ("eager", "compiled", "inductor", "ort", "trt")
TORCH_BACKENDS: tuple[str, ...] = ("eager", "compiled", "inductor")  # open a checkpoint, run on --device
# --provider for ONNX Runtime: the providers asked for, in order (CPU as the fallback for ops a GPU
# provider lacks); the first one must really run.
ORT_PROVIDERS: dict[str, tuple[str, ...]] = {
    "cpu": ("CPUExecutionProvider",),
    "cuda": ("CUDAExecutionProvider", "CPUExecutionProvider"),
    "tensorrt": ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
}
ORT_PRECISIONS = ("fp32", "fp16", "int8")  # ONNX Runtime's CPU provider has no bf16 kernels; int8: an export's variants


class TensorRTBackend(GraphBackend):
    """A plan on the GPU. Batches larger than the engine's profiles run as several executions
    (``batch_limit`` is the largest one execution takes); sequences are capped by the profiles."""

    backend = "trt"

    def __init__(self, plan: Path, graph: str, max_seq_len: int, cuda_graphs: bool = False) -> None:
        self.engine = TensorRTEngine(plan, cuda_graphs=cuda_graphs)
        manifest = self.engine.manifest
        super().__init__(graph, manifest["inputs"], manifest["outputs"], min(max_seq_len, self.engine.max_seq or max_seq_len))
        self.batch_limit = self.engine.max_batch
        self.device = self.engine.device  # the pipeline samples here: no host copy per denoiser call
        self.provider = f"{manifest['flavor']} {manifest['trt_version']} ({manifest['precision']})"
        self.precision = manifest["precision"]

    def run_tensors(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Tensors in (any device; checked on their shapes alone), tensors out on the GPU, float outputs as FP32."""
        self.check_tensors(inputs)
        outputs = self.engine.run(dict(inputs))
        return {n: outputs[n].float() if outputs[n].is_floating_point() else outputs[n] for n in self.output_names}

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.engine.run({n: torch.from_numpy(a) for n, a in inputs.items()})
        # .cpu() waits for the caller's stream, which waits for the engine's
        return {
            n: outputs[n].float().cpu().numpy() if outputs[n].is_floating_point() else outputs[n].cpu().numpy() for n in self.output_names
        }

    def close(self) -> None:
        self.engine.close()


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
        raise BackendError(
            f"cuda_graphs applies to backend 'trt' only, not {backend!r}; "
            "the compiled backend captures CUDA graphs by itself on a CUDA device"
        )
    path = Path(path)
    if backend in TORCH_BACKENDS:
        return _open_checkpoint(backend, path, precision, device, with_logits)
    manifest = _check_artifact_dir(backend, path, precision, device)
    config = LDLMConfig.load(path / "config.json")
    tokenizer = TextTokenizer.from_directory(path) if (path / "tokenizer.json").is_file() else TextTokenizer.gpt2()
    if manifest is not None:
        return _open_export(path, manifest, config, precision, providers, threads, memory_arena), config, tokenizer
    graphs: dict[str, GraphBackend] = {
        g: TensorRTBackend(path / f"{g}{PLAN_SUFFIX}", g, config.max_seq_len, cuda_graphs) for g in GRAPH_NAMES
    }
    return graphs, config, tokenizer


def _open_checkpoint(
    backend: str, path: Path, precision: str, device: str, with_logits: bool
) -> tuple[dict[str, GraphBackend], LDLMConfig, TextTokenizer]:
    """The torch backends: the checkpoint's own modules on ``device`` in ``precision``."""
    check_precision(precision, backend)
    target = resolve_device(device)  # before loading: a missing device fails fast
    if not (path / "model.safetensors").is_file():
        raise BackendError(f"{path} is not a checkpoint (no model.safetensors); backend {backend!r} runs a checkpoint from `ldlm init`")
    model, tokenizer = load_checkpoint(path)
    model = prepare_model(model, target, precision)
    kind = {"eager": EagerBackend, "compiled": CompiledBackend, "inductor": InductorBackend}[backend]
    return {g: kind(model, g, with_logits and g == "decoder") for g in GRAPH_NAMES}, model.config, tokenizer


def _check_artifact_dir(backend: str, path: Path, precision: str, device: str) -> dict[str, Any] | None:
    """An export (ort) or engine (trt) directory checked before any of it is read: the export's
    manifest (None for engines), once every file it names matches its record."""
    if device != "cpu":
        raise BackendError(
            f"backend {backend!r} does not take device={device!r}; ort picks its device with providers "
            "(--provider cuda|tensorrt), trt runs on the GPU its engines were built for"
        )
    if not (path / "config.json").is_file():
        raise BackendError(
            f"{path} has no config.json; backend {backend!r} needs a directory written by "
            f"{'`ldlm export`' if backend == 'ort' else '`ldlm build-engine`'}"
        )
    # Every file is checked against its record before any is read, the tokenizer included.
    if backend == "ort":
        if precision not in ORT_PRECISIONS:
            raise BackendError(f"backend 'ort' cannot run precision={precision!r}; allowed: {', '.join(ORT_PRECISIONS)}")
        manifest = read_manifest(path)
        check_artifacts(path, manifest)
        return manifest
    # the plans themselves are hashed as TensorRTEngine reads them
    built = {m.get("precision") for m in check_engine_dir(path, GRAPH_NAMES, plans=False).values()}
    if built != {precision}:
        raise BackendError(
            f"engines in {path} are {sorted(map(str, built))}; asked for precision={precision!r}; rebuild with --precision {precision}"
        )
    return None


def _open_export(
    path: Path,
    manifest: dict[str, Any],
    config: LDLMConfig,
    precision: str,
    providers: tuple[str, ...],
    threads: int | None,
    memory_arena: bool,
) -> dict[str, GraphBackend]:
    """An export's graphs on ONNX Runtime: int8 runs each graph's INT8 variant where the export has one
    (fp32 elsewhere), fp16 casts the graphs first."""
    files = {g: path / manifest["graphs"][g]["file"] for g in GRAPH_NAMES}
    if precision == "int8":
        variants = {g: manifest["graphs"][g].get("variants", {}).get("int8") for g in GRAPH_NAMES}
        if not any(variants.values()):
            raise BackendError(
                f"{path} has no int8 variants (exported without --quantize); re-export with `ldlm export CKPT OUT --quantize int8`"
            )
        return {
            g: OrtBackend(
                path / v["file"] if v else files[g], g, config.max_seq_len, providers, threads, memory_arena, "int8" if v else "fp32"
            )
            for g, v in variants.items()
        }
    if precision != "fp16":
        return {g: OrtBackend(f, g, config.max_seq_len, providers, threads, memory_arena) for g, f in files.items()}
    # The same cast pass the engines use, into a scratch directory that goes once the sessions hold
    # the graphs (ONNX Runtime reads a model and its external data whole when a session is made).
    with tempfile.TemporaryDirectory(prefix="ldlm-fp16-") as work:
        lowered = {g: Path(work) / f"{g}.fp16.onnx" for g in files}
        for g, source in files.items():
            lower_precision(source, lowered[g], "fp16")
        return {g: OrtBackend(f, g, config.max_seq_len, providers, threads, memory_arena, "fp16") for g, f in lowered.items()}


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

    @property
    def has_logits(self) -> bool:
        """Whether the decoder outputs ``logits`` (a GraphBackend's output names, or those behind a DynamicBatcher)."""
        runner: Any = self.graphs["decoder"]
        return "logits" in (getattr(runner, "output_names", None) or getattr(getattr(runner, "backend", None), "output_names", []))

    def decode_logits(self, latents: Tensor, mask: Tensor) -> Tensor:
        """latents (B, L, D) -> the decoder's logits (B, L, V), FP32; a BackendError where it has none."""
        if not self.has_logits:
            raise BackendError("the decoder has no logits output; export it with `ldlm export --with-logits`")
        return self._run("decoder", {"latents": latents.float(), "attention_mask": mask.long()}, "logits", latents)
