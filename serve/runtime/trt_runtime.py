"""TensorRT runtime: run a plan on torch CUDA tensors (TensorRT or TensorRT-RTX alike).

A plan runs only on a GPU, and only on the TensorRT (and, for NVIDIA TensorRT, the GPU) it was
built with; the manifest written next to it at build time is checked before deserializing, so a
mismatch fails with a message that says what to rebuild instead of a TensorRT crash.

``TensorRTEngine`` owns the plan, the runtime, a dedicated CUDA stream and (RTX) the runtime config
and cache: inputs are converted on its stream, ordered after the caller's stream, and the caller's
stream waits for the outputs, so any stream (torch's, or a raw ``cudaStream_t``) works. The
TensorRT calls themselves (profiles, chunks, checked binding, the lock, CUDA graphs) are
``tensorrt_executor.PlanExecutor``'s.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ldlm.export.artifact import PLAN_SUFFIX, PlanMismatchError, read_plan_manifest
from ldlm.export.trt_flavor import Flavor, GpuInfo, flavor_logger, gpu_info, load_flavor
from ldlm.files import write_atomically
from ldlm.serve.runtime.tensorrt_executor import PlanExecutor

log = logging.getLogger(__name__)

RUNTIME_CACHE_SUFFIX = ".runtime.cache"


def check_plan_manifest(manifest: dict[str, Any], flavor: Flavor, gpu: GpuInfo) -> None:
    """Fail unless the running TensorRT (and GPU, for NVIDIA TensorRT) is the one the plan was built for."""
    rebuild = (
        f"rebuild it on this machine: ldlm build-engine ONNX_DIR OUT --flavor {flavor.name} --precision {manifest.get('precision', 'fp32')}"
    )
    built = f"{manifest.get('flavor')} {manifest.get('trt_version')}"
    plan = manifest.get("plan", "the plan")
    if manifest.get("flavor") != flavor.name or manifest.get("trt_version") != flavor.version:
        raise PlanMismatchError(f"{plan} was built by {built}, but this process runs {flavor.name} {flavor.version}; {rebuild}")
    built_cc = manifest.get("build_host", {}).get("compute_capability")
    # NVIDIA TensorRT plans are specific to the GPU they were built on; TensorRT-RTX plans are
    # AOT-compiled and finished for the GPU at run time.
    if not flavor.is_rtx and built_cc is not None and built_cc != gpu.compute_capability:
        running = gpu.description if gpu.name else "no GPU"
        raise PlanMismatchError(
            f"{plan} was built for compute capability {built_cc} ({manifest['build_host'].get('gpu')}), "
            f"but this process runs on {running}; {rebuild}"
        )


def as_stream(stream: torch.cuda.Stream | int | None, device: torch.device) -> torch.cuda.Stream:
    """torch's current stream for None, a torch stream as given, a raw ``cudaStream_t`` wrapped."""
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, int):
        return torch.cuda.ExternalStream(stream, device=device)
    return stream


def runtime_cache_path(plan: Path) -> Path:
    """One cache per plan (``denoiser.plan`` -> ``denoiser.runtime.cache``): kernels compiled for one
    plan are no use to another, and one shared file would keep only the last plan saved."""
    return plan.with_name(plan.name.removesuffix(PLAN_SUFFIX) + RUNTIME_CACHE_SUFFIX)


class RuntimeCacheFile:
    """TensorRT-RTX's runtime cache for one plan, kept in a file: the kernels it compiled for this
    GPU at run time (the counterpart of NVIDIA TensorRT's build-time timing cache)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.loaded = False
        self._config: Any = None
        self._cache: Any = None  # TensorRT keeps a reference, not ownership: it lives as long as we do

    def attach(self, config: Any) -> None:
        """Give ``config`` (an IRuntimeConfig) a cache, filled from the file when it still fits."""
        cache = config.create_runtime_cache()
        if self.path.is_file():
            # False: written by another TensorRT-RTX, driver or GPU; an empty cache is rebuilt, not an error.
            self.loaded = bool(cache.deserialize(self.path.read_bytes()))
            if not self.loaded:
                log.warning("%s does not match this TensorRT-RTX, driver or GPU; starting an empty runtime cache", self.path)
        if not config.set_runtime_cache(cache):
            raise RuntimeError(f"TensorRT-RTX refused the runtime cache for {self.path.name}")
        self._config, self._cache = config, cache

    def save(self) -> Path | None:
        """Write the cache (atomically) for the next process; None when never attached."""
        if self._config is None:
            return None
        write_atomically(self.path, bytes(self._config.get_runtime_cache().serialize()))
        return self.path


class TensorRTEngine:
    """One deserialized plan. ``run`` takes named tensors (any device) and returns named CUDA tensors."""

    def __init__(
        self,
        plan: str | Path,
        flavor: str | None = None,
        device: str = "cuda",
        cuda_graphs: bool = False,
        runtime_cache: str | Path | None = None,
    ) -> None:
        self.plan = Path(plan)
        self.manifest = read_plan_manifest(self.plan)
        self.flavor = load_flavor(flavor or self.manifest.get("flavor"))
        self.device = torch.device(device)
        gpu = gpu_info(self.device)
        if gpu.name is None:
            raise RuntimeError(f"running {self.plan} needs a CUDA GPU; torch.cuda.is_available() is False")
        check_plan_manifest(self.manifest, self.flavor, gpu)
        data = self.plan.read_bytes()  # read once: the bytes checked are the bytes loaded
        if hashlib.sha256(data).hexdigest() != self.manifest["plan_sha256"]:
            raise PlanMismatchError(f"{self.plan} does not match the sha256 in its manifest (corrupt or replaced); rebuild it")
        trt = self.flavor.trt
        self.logger = flavor_logger(self.flavor)
        self.runtime = trt.Runtime(self.logger)
        with self.logger.capture() as messages, torch.cuda.device(self.device):
            try:
                self.engine = self.runtime.deserialize_cuda_engine(data)
            except Exception as error:  # e.g. no CUDA driver: TensorRT raises instead of returning None
                raise PlanMismatchError(f"TensorRT could not load {self.plan}: {str(error).splitlines()[0][:300]}") from error
        if self.engine is None:
            raise PlanMismatchError(f"TensorRT could not deserialize {self.plan}: {'; '.join(m for _, m in messages) or 'no details'}")
        self.stream = torch.cuda.Stream(self.device)  # this engine's own: never the default stream
        self.runtime_cache = RuntimeCacheFile(Path(runtime_cache) if runtime_cache else runtime_cache_path(self.plan))
        context_args: tuple[Any, ...] = ()
        if self.flavor.is_rtx:
            context_args = (self._rtx_runtime_config(cuda_graphs),)
        axes = {
            spec["name"]: {d: i for i, d in enumerate(spec["shape"]) if isinstance(d, str)}
            for spec in self.manifest["inputs"] + self.manifest["outputs"]
        }
        # RTX captures graphs itself (runtime config); NVIDIA TensorRT through torch's stream capture.
        self.executor = PlanExecutor(
            self.engine,
            trt,
            self.plan.name,
            axes,
            self.device,
            capture_graphs=cuda_graphs and not self.flavor.is_rtx,
            context_args=context_args,
        )
        self.input_names, self.output_names, self.dtypes = self.executor.input_names, self.executor.output_names, self.executor.dtypes
        self._closed = False

    def _rtx_runtime_config(self, cuda_graphs: bool) -> Any:
        """TensorRT-RTX's per-context settings: its own CUDA graphs (captured after its shape-specialized
        kernels are compiled, which a capture from outside could not know) and the runtime cache."""
        config = self.engine.create_runtime_config()
        if cuda_graphs:
            config.cuda_graph_strategy = self.flavor.trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
        self.runtime_cache.attach(config)  # the cache file and the executor's contexts keep the config alive
        return config

    @property
    def max_batch(self) -> int:
        return self.executor.max_batch

    @property
    def max_seq(self) -> int | None:
        return self.executor.max_seq

    def run(self, inputs: dict[str, Any], stream: torch.cuda.Stream | int | None = None) -> dict[str, Tensor]:
        """Outputs on this engine's device. ``stream`` (torch's current one by default, or a raw
        handle) is the caller's: the work is ordered after what it has queued, and it waits for
        the outputs before its next kernel."""
        caller = as_stream(stream, self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            tensors = {}
            for name in self.input_names:
                if name in inputs:  # a missing one is named by the executor
                    tensors[name] = torch.as_tensor(inputs[name]).to(self.device, self.dtypes[name], non_blocking=True).contiguous()
                    tensors[name].record_stream(self.stream)  # a caller's tensor is in use here until this stream is done
            outputs = self.executor.execute(tensors, self.stream.cuda_stream)
        caller.wait_stream(self.stream)
        for tensor in outputs.values():
            tensor.record_stream(caller)  # allocated on this engine's stream, used on the caller's
        return outputs

    def save_runtime_cache(self) -> Path | None:
        """Write TensorRT-RTX's runtime cache next to the plan (atomically), for the next process."""
        return self.runtime_cache.save()

    def close(self) -> None:
        """Keep the runtime cache (a read-only plan folder is logged, not raised), free the contexts."""
        if self._closed:
            return
        self._closed = True
        try:
            self.save_runtime_cache()
        except OSError as error:
            log.warning("could not save the TensorRT-RTX runtime cache %s: %s", self.runtime_cache.path, error)
        self.stream.synchronize()
        self.executor.release()
