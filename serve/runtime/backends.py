"""One engine interface over torch, ONNX Runtime and TensorRT, and ``open_graphs`` to open it.

A ``GraphBackend`` (``graph_backend``) runs one graph: named arrays (NumPy or torch) in, named NumPy
arrays out, its inputs checked once against the graph's I/O contract from the export manifest.
``provider`` says what really ran (ONNX Runtime silently falls back to CPU when a GPU provider
cannot start, so it is read back from the session). Which backends exist, and which module opens
each, is the registry's (``registry``); ``open_graphs`` checks what every artifact backend shares
(no torch device, the directory's config.json) and hands the rest to the backend's module.

``BackendGraphs`` puts three GraphBackends behind the ``InferenceGraphs`` methods, so the one
``LDLMPipeline`` (and the batching scheduler) runs on any backend. Torch and TensorRT backends also
take and give device tensors (``run_tensors``), so a GPU pipeline makes no host copy per denoiser call.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from ldlm.export.artifact import MANIFEST_FILE, built_plans, read_schedules
from ldlm.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, check_checkpoint_files
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling.tuned_grids import checkpoint_schedules
from ldlm.serve.runtime.graph_backend import MASK, BackendError, GraphBackend
from ldlm.serve.runtime.registry import (
    ARTIFACT_COMMANDS,
    DEFAULT_BACKEND,
    BackendInfo,
    OpenOptions,
    UnknownBackendError,
    backend_info,
    implementation,
    resolve_run,
)


def ort_providers(name: str, backend: str = DEFAULT_BACKEND) -> tuple[str, ...]:
    """The ONNX Runtime providers ``backend`` runs on with ``--provider NAME`` (ort-cuda: its own)."""
    from ldlm.serve.runtime.ort_backend import providers_for  # ONNX Runtime's module, on use

    return providers_for(info_of(backend), name)


def info_of(backend: str) -> BackendInfo:
    """The registry's entry of ``backend``, as a BackendError naming the allowed ones where there is none."""
    try:
        return backend_info(backend)
    except UnknownBackendError as error:
        raise BackendError(str(error)) from None


def open_graphs(
    backend: str,
    path: str | os.PathLike[str],
    precision: str = "fp32",
    providers: tuple[str, ...] = (),
    threads: int | None = None,
    device: str = "cpu",
    with_logits: bool = False,
    memory_arena: bool = True,
    cuda_graphs: bool = False,
) -> tuple[dict[str, GraphBackend], LDLMConfig, TextTokenizer]:
    """Open every graph of ``path`` on ``backend``: a checkpoint (torch backends: on ``device``), an
    ``ldlm export`` directory (ONNX Runtime: on ``providers``, else the backend's own), or an ``ldlm
    build-engine`` directory (TensorRT; ``cuda_graphs`` replays CUDA graphs). Every file an export
    manifest names is checked first (inside the directory, sha256 as written), so serve, parity and
    bench never run an edited artifact."""
    info = info_of(backend)
    if cuda_graphs and info.opens != "engines":
        raise BackendError(
            f"cuda_graphs applies to engine backends only, not {backend!r}; the compiled backend captures CUDA graphs by itself on a CUDA device"
        )
    if precision not in info.precisions:
        raise BackendError(f"backend {backend!r} cannot run precision={precision!r}; allowed: {', '.join(info.precisions)}")
    path = Path(path)
    if not info.runs_checkpoint:
        _check_artifact_dir(info, path, device)
    options = OpenOptions(precision, providers, threads, device, with_logits, memory_arena, cuda_graphs)
    module: Any = implementation(info)
    return module.open_backend(info, path, options)


def _check_artifact_dir(info: BackendInfo, path: Path, device: str) -> None:
    """What an export or engine directory must be before any of it is read."""
    if device != "cpu":
        raise BackendError(
            f"backend {info.name!r} does not take device={device!r}; ONNX Runtime picks its device with its providers "
            "(--provider cuda|tensorrt, or backend ort-cuda), engines run on the GPU they were built for"
        )
    needs = f"backend {info.name!r} needs a directory written by {ARTIFACT_COMMANDS[info.opens]}"
    if not path.exists():
        raise BackendError(f"{path} does not exist; {needs}")
    if not (path / CONFIG_FILE).is_file():
        raise BackendError(f"{path} has no {CONFIG_FILE}; {needs}")
    if not (path / MANIFEST_FILE).is_file() and not built_plans(path):
        # neither an export nor engines, and a config: a checkpoint, which is served once it has its weights; a
        # checkpoint short of a file is named as every command that loads one names it
        check_checkpoint_files(path)


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
    or the server's DynamicBatchers in front of them (torch tensors in and out).

    Every method takes a mask of None: every position of every row is real (the sampling loop's ``denoise`` for a
    batch with no padding). On every backend the result is the all-ones mask's; on the torch backends the encoder
    and the denoiser then run attention with no mask at all (``torch_backends.MaskFree``)."""

    def __init__(self, graphs: Mapping[str, GraphRunner]) -> None:
        self.graphs = dict(graphs)

    def _run(self, graph: str, feed: dict[str, Tensor], output: str, like: Tensor) -> Tensor:
        """One output of ``graph``, on ``like``'s device: through device tensors where the runner
        takes them (torch backends), else through NumPy (ONNX Runtime, TensorRT, batchers)."""
        runner = self.graphs[graph]
        if hasattr(runner, "run_tensors"):
            return runner.run_tensors(feed)[output].to(like.device)
        return torch.from_numpy(runner.run(feed)[output]).to(like.device)

    def _with_mask(self, graph: str, feed: dict[str, Tensor], mask: Tensor | None, like: Tensor) -> dict[str, Tensor]:
        """``feed`` and its attention_mask. ``mask`` None (every position of every row real) leaves it out for a
        runner of device tensors (``run_tensors``, ``graph_backend.MASK``: a torch backend then runs attention with no
        mask, which SDPA's flash kernels need) and gives any other runner (ONNX Runtime, a batcher) ones on the host,
        as it takes every input its graph declares."""
        if mask is not None:
            return {**feed, MASK: mask.long()}
        if hasattr(self.graphs[graph], "run_tensors"):
            return feed
        return {**feed, MASK: torch.ones(like.shape[:2], dtype=torch.int64)}

    def encode_latents(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """``attention_mask`` None: no padding. A torch backend also runs a host mask of all ones without a mask."""
        return self._run("encoder", self._with_mask("encoder", {"input_ids": input_ids}, attention_mask, input_ids), "latents", input_ids)

    def denoise(self, x_t: Tensor, t: Tensor, x0_prev: Tensor, mask: Tensor | None) -> Tensor:
        """``mask`` None: no row has padding, so a torch backend's attention runs with no mask (flash-eligible)."""
        feed = self._with_mask("denoiser", {"x_t": x_t.float(), "t": t.float(), "x0_prev": x0_prev.float()}, mask, x_t)
        return self._run("denoiser", feed, "x0_hat", x_t).to(x_t.dtype)

    def decode_tokens(self, latents: Tensor, mask: Tensor | None) -> Tensor:
        return self._run("decoder", self._with_mask("decoder", {"latents": latents.float()}, mask, latents), "token_ids", latents)

    @property
    def has_logits(self) -> bool:
        """Whether the decoder outputs ``logits`` (a GraphBackend's output names, or those behind a DynamicBatcher)."""
        runner: Any = self.graphs["decoder"]
        return "logits" in (getattr(runner, "output_names", None) or getattr(getattr(runner, "backend", None), "output_names", []))

    def decode_logits(self, latents: Tensor, mask: Tensor | None) -> Tensor:
        """latents (B, L, D) -> the decoder's logits (B, L, V), FP32; a BackendError where it has none."""
        if not self.has_logits:
            raise BackendError("the decoder has no logits output; export it with `ldlm export --with-logits`")
        return self._run("decoder", self._with_mask("decoder", {"latents": latents.float()}, mask, latents), "logits", latents)


def open_pipeline(
    path: str | os.PathLike[str],
    backend: str | None = None,
    precision: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    buckets: Sequence[int] = (),
) -> LDLMPipeline:
    """The pipeline on another backend than eager PyTorch: ``path`` is an ``ldlm export`` directory
    (``backend="ort"``: ONNX Runtime on the CPU; ``precision="int8"`` runs its INT8 variants), an ``ldlm
    build-engine`` directory (``"trt"``), or a checkpoint (``"eager"``, ``"compiled"``, ``"inductor"``, on
    ``device`` in ``precision``). A backend or precision not named is ``ldlm serve``'s for ``device``
    (``registry.resolve_run``): ONNX Runtime in fp32 on the CPU, the torch fast path in fp16 on CUDA.
    Every file an export's manifest names is
    checked first; its tuned step grids, where it has them, are used as ``LDLMPipeline.from_checkpoint`` uses a
    checkpoint's. ``threads``: ONNX Runtime's intra-op threads (default: its own). Drawing tokens at
    a temperature needs the decoder's logits: an export made with ``ldlm export --with-logits``, or
    any torch backend."""
    backend, precision = resolve_run(device, backend, precision)
    graphs, config, tokenizer = open_graphs(backend, path, precision, threads=threads, device=device, with_logits=True)
    if (Path(path) / WEIGHTS_FILE).is_file():
        schedules = checkpoint_schedules(path)
    else:  # an export carries its checkpoint's grids in its manifest; an engine directory carries none
        schedules = read_schedules(path) if (Path(path) / MANIFEST_FILE).is_file() else None
    on = getattr(graphs["denoiser"], "device", "cpu")  # torch and TensorRT graphs: sample where they run
    return LDLMPipeline(BackendGraphs(graphs), tokenizer, on, config=config, buckets=buckets, schedules=schedules)
