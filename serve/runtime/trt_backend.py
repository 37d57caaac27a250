"""TensorRT as a GraphBackend: one engine (plan) per graph, built ahead of time by ``ldlm build-engine``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ldlm.export.artifact import PLAN_SUFFIX, check_engine_dir
from ldlm.export.graphs import GRAPH_NAMES
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TextTokenizer
from ldlm.serve.runtime.graph_backend import MASK, BackendError, GraphBackend
from ldlm.serve.runtime.registry import TRT, default_precision
from ldlm.serve.runtime.trt_runtime import TensorRTEngine

if TYPE_CHECKING:
    from ldlm.serve.runtime.registry import BackendInfo, OpenOptions


class TensorRTBackend(GraphBackend):
    """A plan on the GPU. Batches larger than the engine's profiles run as several executions
    (``batch_limit`` is the largest one execution takes); sequences are capped by the profiles."""

    backend = TRT

    def __init__(self, plan: Path, graph: str, max_seq_len: int, cuda_graphs: bool = False) -> None:
        self.engine = TensorRTEngine(plan, cuda_graphs=cuda_graphs)
        manifest = self.engine.manifest
        super().__init__(graph, manifest["inputs"], manifest["outputs"], min(max_seq_len, self.engine.max_seq or max_seq_len))
        self.batch_limit = self.engine.max_batch
        self.device = self.engine.device  # the pipeline samples here: no host copy per denoiser call
        self.provider = f"{manifest['flavor']} {manifest['trt_version']} ({manifest['precision']})"
        self.precision = manifest["precision"]

    def run_tensors(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Tensors in (any device; checked on their shapes alone), tensors out on the GPU, float outputs as FP32.
        A left-out ``attention_mask`` (every position real) is all ones, made on the GPU: an engine has the mask
        input whatever its values, and a mask made on the host would cost a copy per call."""
        self.check_tensors(inputs)
        feed = dict(inputs)
        if MASK in self.input_names and MASK not in feed:
            feed[MASK] = torch.ones(self.mask_shape(feed), dtype=torch.int64, device=self.device)
        outputs = self.engine.run(feed)
        return {n: outputs[n].float() if outputs[n].is_floating_point() else outputs[n] for n in self.output_names}

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.engine.run({n: torch.from_numpy(a) for n, a in inputs.items()})
        # .cpu() waits for the caller's stream, which waits for the engine's
        return {
            n: outputs[n].float().cpu().numpy() if outputs[n].is_floating_point() else outputs[n].cpu().numpy() for n in self.output_names
        }

    def close(self) -> None:
        self.engine.close()


def precision_mismatch(path: Path, built: set[str | None], asked: str, default: str) -> str:
    """Why engines built in ``built`` do not run at ``asked`` (``default``: what a command runs without
    --precision), and the two ways out: run them as built, or build them again at what was asked."""
    rebuild = f"`ldlm build-engine EXPORT {path} --precision {asked} --force` (EXPORT: the `ldlm export` directory they came from)"
    said = f"engines in {path} are {sorted(map(str, built))}; asked for precision={asked!r} (--precision; {default} when not given)"
    (only,) = built if len(built) == 1 else (None,)
    if only is None:  # mixed, or plans from before manifests recorded their precision
        return f"{said}; their graphs were not built in one known precision: rebuild them with {rebuild}"
    return f"{said}. They run as built with --precision {only}; or rebuild them in {asked} with {rebuild}"


def open_backend(info: BackendInfo, path: Path, options: OpenOptions) -> tuple[dict[str, GraphBackend], LDLMConfig, TextTokenizer]:
    """An ``ldlm build-engine`` directory's plans, once their manifests say they were built in the precision
    asked for (the plans themselves are hashed as TensorRTEngine reads them); ``options.cuda_graphs``
    replays CUDA graphs (TensorRT-RTX's own capture, or torch's for NVIDIA TensorRT)."""
    built = {m.get("precision") for m in check_engine_dir(path, GRAPH_NAMES, plans=False).values()}
    if built != {options.precision}:
        raise BackendError(precision_mismatch(path, built, options.precision, default_precision(info.name, options.device)))
    config = LDLMConfig.load(path / "config.json")
    tokenizer = TextTokenizer.from_directory(path) if (path / "tokenizer.json").is_file() else TextTokenizer.gpt2()
    graphs: dict[str, GraphBackend] = {
        g: TensorRTBackend(path / f"{g}{PLAN_SUFFIX}", g, config.max_seq_len, options.cuda_graphs) for g in GRAPH_NAMES
    }
    return graphs, config, tokenizer
