"""TensorRT runtime: run a plan on torch CUDA tensors (TensorRT or TensorRT-RTX alike).

A plan runs only on a GPU, and only on the TensorRT (and, for NVIDIA TensorRT, the GPU) it was
built with; the manifest written next to it at build time is checked before deserializing, so a
mismatch fails with a message that says what to rebuild instead of a TensorRT crash.

Two layers:
- ``PlanExecutor`` does the TensorRT calls on tensors already on the device: pick the profile,
  split a batch larger than every profile into chunks that fit, set shapes and addresses (each
  call's result checked), ``execute_async_v3``. An execution context is not thread-safe and the
  server calls one engine from several threads (the scheduler's and each graph's batcher), so
  bind + enqueue run under one lock, with one context per optimization profile (a profile serves
  one context at a time in older TensorRT). With NVIDIA TensorRT it can capture one CUDA graph per
  (profile, shapes); TensorRT-RTX captures its own (``cuda_graph_strategy``), which also handles
  its lazily compiled shape-specialized kernels.
- ``TensorRTEngine`` owns the plan, the runtime, a dedicated CUDA stream and (RTX) the runtime
  config and cache: inputs are converted on its stream, ordered after the caller's stream, and the
  caller's stream waits for the outputs, so any stream (torch's, or a raw ``cudaStream_t``) works.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ldlm.export.engine import MANIFEST_SUFFIX, PLAN_SUFFIX
from ldlm.export.onnx_export import sha256_file
from ldlm.export.trt_flavor import Flavor, GpuInfo, flavor_logger, gpu_info, load_flavor

log = logging.getLogger(__name__)

RUNTIME_CACHE_SUFFIX = ".runtime.cache"


class PlanMismatchError(ValueError):
    """The plan was built for another TensorRT or GPU, or is corrupt; the message says what to rebuild."""


def read_plan_manifest(plan: str | Path) -> dict[str, Any]:
    plan = Path(plan)
    manifest = plan.with_name(plan.name.removesuffix(PLAN_SUFFIX) + MANIFEST_SUFFIX)
    if not plan.is_file():
        raise PlanMismatchError(f"plan {plan} does not exist; build it with `ldlm build-engine`")
    if not manifest.is_file():
        raise PlanMismatchError(f"plan {plan} has no manifest {manifest.name}; rebuild it with `ldlm build-engine`")
    return json.loads(manifest.read_text())


def check_plan_manifest(manifest: dict[str, Any], flavor: Flavor, gpu: GpuInfo) -> None:
    """Fail unless the running TensorRT (and GPU, for NVIDIA TensorRT) is the one the plan was built for."""
    rebuild = f"rebuild it on this machine: ldlm build-engine ONNX_DIR OUT --flavor {flavor.name} --precision {manifest.get('precision', 'fp32')}"
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


# TensorRT DataType name -> torch dtype. INT4, FP4 and E8M0 are packed or scale-only types with no
# torch tensor of their own; an engine with such an I/O tensor is refused by name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT64": torch.int64, "INT32": torch.int32,
    "INT8": torch.int8, "UINT8": torch.uint8, "BOOL": torch.bool, "FP8": torch.float8_e4m3fn,
}


def torch_dtype(trt_dtype: str, tensor: str) -> torch.dtype:
    if trt_dtype not in TORCH_DTYPES:
        raise PlanMismatchError(f"I/O tensor {tensor} has TensorRT dtype {trt_dtype}, which has no torch dtype; "
                                f"allowed: {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[trt_dtype]


def batch_chunks(batch: int, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Split ``batch`` samples into chunk sizes that each fall in one of the (min, max) batch ranges
    of the profiles: the whole batch when a profile holds it, else the largest chunks first."""
    if batch < 1:
        raise ValueError(f"batch={batch} is out of range; allowed: >= 1")
    chunks, left = [], batch
    while left:
        if any(low <= left <= high for low, high in ranges):
            chunks.append(left)
            break
        fitting = [high for _, high in ranges if high < left]  # a chunk that leaves something to run
        if not fitting:
            raise ValueError(f"batch {batch} cannot be split into the profiles' batch ranges {sorted(ranges)} "
                             f"({left} left over); rebuild the engines with a profile that holds it")
        chunks.append(max(fitting))
        left -= chunks[-1]
    return chunks


def set_input_shape(context: Any, name: str, shape: tuple[int, ...]) -> None:
    if not context.set_input_shape(name, shape):
        raise RuntimeError(f"TensorRT rejected shape {shape} for input {name} (outside the context's profile?)")


def set_tensor_address(context: Any, name: str, tensor: Tensor) -> None:
    if not context.set_tensor_address(name, tensor.data_ptr()):
        raise RuntimeError(f"TensorRT rejected the address of tensor {name} (shape {tuple(tensor.shape)}, {tensor.dtype})")


def bind(context: Any, inputs: dict[str, Tensor], output_names: Sequence[str], dtypes: dict[str, torch.dtype],
         device: torch.device) -> dict[str, Tensor]:
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


@dataclass
class _GraphCapture:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, Tensor]  # static buffers the graph reads
    outputs: dict[str, Tensor]  # static buffers the graph writes


class PlanExecutor:
    """Runs an ICudaEngine on device tensors: one context per profile, bind + enqueue under one
    lock, batches split to fit the profiles, optional CUDA graphs (NVIDIA TensorRT's stream capture).

    ``axes`` gives each input's and output's symbolic axes, ``{"x_t": {"batch": 0, "seq": 1}}``
    (from the export manifest); ``context_args`` go to ``create_execution_context`` (TensorRT-RTX:
    the runtime config).
    """

    def __init__(self, engine: Any, trt: Any, name: str, axes: dict[str, dict[str, int]], device: torch.device,
                 capture_graphs: bool = False, context_args: tuple[Any, ...] = ()) -> None:
        self.engine, self.trt, self.name, self.device = engine, trt, name, device
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.input_names = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if n not in self.input_names]
        self.dtypes = {n: torch_dtype(engine.get_tensor_dtype(n).name, n) for n in names}
        self.batch_axes = {n: a["batch"] for n, a in axes.items() if "batch" in a}
        self.seq_axes = {n: a["seq"] for n, a in axes.items() if "seq" in a and n in self.input_names}
        self.ranges = [
            {n: tuple(engine.get_tensor_profile_shape(n, i)[::2]) for n in self.input_names}  # name -> (min, max)
            for i in range(engine.num_optimization_profiles)
        ]
        self.capture_graphs = capture_graphs
        self.context_args = context_args
        self._lock = threading.Lock()
        self._contexts: dict[int, Any] = {}
        self._captures: dict[tuple[Any, ...], _GraphCapture] = {}

    @property
    def max_batch(self) -> int:
        """The largest batch one execution takes (larger ones run as several)."""
        return max(self._batch_range(r)[1] for r in self.ranges)

    @property
    def max_seq(self) -> int | None:
        """The longest sequence any profile takes; None for a graph without a sequence axis."""
        if not self.seq_axes:
            return None
        return max(min(r[n][1][axis] for n, axis in self.seq_axes.items()) for r in self.ranges)

    def _batch_range(self, ranges: dict[str, tuple[Any, Any]]) -> tuple[int, int]:
        """The batch sizes a profile takes: the tightest (min, max) over the inputs with a batch axis."""
        low = max(r[0][self.batch_axes[n]] for n, r in ranges.items() if n in self.batch_axes)
        high = min(r[1][self.batch_axes[n]] for n, r in ranges.items() if n in self.batch_axes)
        return low, high

    def profile_for(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """The first optimization profile whose min..max range holds every input shape."""
        for index, ranges in enumerate(self.ranges):
            if all(len(shape) == len(ranges[n][0]) and all(a <= s <= b for a, s, b in zip(ranges[n][0], shape, ranges[n][1]))
                   for n, shape in shapes.items()):
                return index
        allowed = {n: [r[n] for r in self.ranges] for n in shapes}
        raise ValueError(f"input shapes {shapes} are outside every profile of {self.name}; allowed (min, max): {allowed}")

    def execute(self, inputs: dict[str, Tensor], stream: int) -> dict[str, Tensor]:
        """Outputs of the engine on ``inputs`` (device tensors of the engine's dtypes), enqueued on
        ``stream``; batches larger than every profile run as chunks, concatenated."""
        missing = sorted(set(self.input_names) - set(inputs))
        if missing:
            raise ValueError(f"missing inputs {missing}; {self.name} takes {self.input_names}")
        batched = [n for n in self.input_names if n in self.batch_axes]
        batch = inputs[batched[0]].shape[self.batch_axes[batched[0]]] if batched else 1
        chunks = batch_chunks(batch, [self._batch_range(r) for r in self.ranges]) if batched else [batch]
        if len(chunks) == 1:
            return self._execute_one(inputs, stream)
        parts, start = [], 0
        for size in chunks:
            part = {n: t.narrow(self.batch_axes[n], start, size) if n in self.batch_axes else t for n, t in inputs.items()}
            parts.append(self._execute_one({n: t.contiguous() for n, t in part.items()}, stream))
            start += size
        unbatched = [n for n in self.output_names if n not in self.batch_axes]
        if unbatched:
            raise ValueError(f"{self.name}: outputs {unbatched} have no batch axis, so batch {batch} cannot run in chunks {chunks}")
        return {n: torch.cat([p[n] for p in parts], self.batch_axes[n]) for n in self.output_names}

    def _execute_one(self, inputs: dict[str, Tensor], stream: int) -> dict[str, Tensor]:
        shapes = {n: tuple(inputs[n].shape) for n in self.input_names}
        profile = self.profile_for(shapes)
        with self._lock:  # the context's shapes and addresses belong to one call until it is enqueued
            context = self._context(profile, stream)
            if self.capture_graphs:
                return self._replay(context, profile, inputs, shapes, stream)
            outputs = bind(context, {n: inputs[n] for n in self.input_names}, self.output_names, self.dtypes, self.device)
            if not context.execute_async_v3(stream):
                raise RuntimeError(f"execute_async_v3 failed for {self.name} (shapes {shapes})")
            return outputs

    def _context(self, profile: int, stream: int) -> Any:
        if profile not in self._contexts:
            context = self.engine.create_execution_context(*self.context_args)
            if context is None:
                raise RuntimeError(f"TensorRT could not create an execution context for {self.name} (out of GPU memory?)")
            if not context.set_optimization_profile_async(profile, stream):
                raise RuntimeError(f"TensorRT could not select optimization profile {profile} of {self.name}")
            self._contexts[profile] = context
        return self._contexts[profile]

    def _replay(self, context: Any, profile: int, inputs: dict[str, Tensor], shapes: dict[str, Any], stream: int) -> dict[str, Tensor]:
        """Replay the CUDA graph captured for (profile, shapes), capturing it on first use. The
        caller holds the lock and has made ``stream`` torch's current stream."""
        key = (profile, tuple(sorted(shapes.items())))
        capture = self._captures.get(key)
        if capture is None:
            capture = self._capture(context, inputs, stream)
            if capture is None:  # not capturable: run plainly from now on
                self.capture_graphs = False
                outputs = bind(context, {n: inputs[n] for n in self.input_names}, self.output_names, self.dtypes, self.device)
                if not context.execute_async_v3(stream):
                    raise RuntimeError(f"execute_async_v3 failed for {self.name} (shapes {shapes})")
                return outputs
            self._captures[key] = capture
        else:
            # Another capture of this context may have bound other shapes since: the context's own
            # state (shapes, addresses) is put back to the graph's before it replays.
            bind_static(context, capture)
        for name in self.input_names:
            capture.inputs[name].copy_(inputs[name], non_blocking=True)
        capture.graph.replay()  # on torch's current stream: ``stream``
        return {n: t.clone() for n, t in capture.outputs.items()}  # the static buffers are overwritten next replay

    def _capture(self, context: Any, inputs: dict[str, Tensor], stream: int) -> _GraphCapture | None:
        static = {n: inputs[n].clone() for n in self.input_names}
        outputs = bind(context, static, self.output_names, self.dtypes, self.device)
        capturable = getattr(context, "is_stream_capturable", None)
        if capturable is not None and not capturable(stream):
            log.warning("%s: TensorRT says this context cannot be stream-captured; running without CUDA graphs", self.name)
            return None
        # Warm-up outside the capture: TensorRT does its lazy set-up (allocations, kernel loading) here.
        if not context.execute_async_v3(stream):
            raise RuntimeError(f"execute_async_v3 failed for {self.name} during the CUDA graph warm-up")
        torch.cuda.current_stream(self.device).synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads (other engines, the sampler) keep running CUDA work meanwhile.
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(self.device), capture_error_mode="thread_local"):
            if not context.execute_async_v3(stream):
                raise RuntimeError(f"execute_async_v3 failed for {self.name} during CUDA graph capture")
        return _GraphCapture(graph, static, outputs)

    def release(self) -> None:
        """Drop the contexts and graphs (their device memory); the next call makes new ones."""
        with self._lock:
            self._captures.clear()
            self._contexts.clear()


def bind_static(context: Any, capture: _GraphCapture) -> None:
    for name, tensor in capture.inputs.items():
        set_input_shape(context, name, tuple(tensor.shape))
        set_tensor_address(context, name, tensor)
    for name, tensor in capture.outputs.items():
        set_tensor_address(context, name, tensor)


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


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary name unique to this process and thread, then rename: concurrent
    writers (several server processes on one plan) never leave a torn file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
        self, plan: str | Path, flavor: str | None = None, device: str = "cuda", cuda_graphs: bool = False,
        runtime_cache: str | Path | None = None,
    ) -> None:
        self.plan = Path(plan)
        self.manifest = read_plan_manifest(self.plan)
        self.flavor = load_flavor(flavor or self.manifest.get("flavor"))
        gpu = gpu_info()
        if gpu.name is None:
            raise RuntimeError(f"running {self.plan} needs a CUDA GPU; torch.cuda.is_available() is False")
        check_plan_manifest(self.manifest, self.flavor, gpu)
        if sha256_file(self.plan) != self.manifest["plan_sha256"]:
            raise PlanMismatchError(f"{self.plan} does not match the sha256 in its manifest (corrupt or replaced); rebuild it")
        trt = self.flavor.trt
        self.device = torch.device(device)
        self.logger = flavor_logger(self.flavor)
        self.runtime = trt.Runtime(self.logger)
        with self.logger.capture() as messages:
            try:
                self.engine = self.runtime.deserialize_cuda_engine(self.plan.read_bytes())
            except Exception as error:  # e.g. no CUDA driver: TensorRT raises instead of returning None
                raise PlanMismatchError(f"TensorRT could not load {self.plan}: {str(error).splitlines()[0][:300]}") from error
        if self.engine is None:
            raise PlanMismatchError(f"TensorRT could not deserialize {self.plan}: {'; '.join(m for _, m in messages) or 'no details'}")
        self.stream = torch.cuda.Stream(self.device)  # this engine's own: never the default stream
        self.runtime_cache = RuntimeCacheFile(Path(runtime_cache) if runtime_cache else runtime_cache_path(self.plan))
        context_args: tuple[Any, ...] = ()
        if self.flavor.is_rtx:
            context_args = (self._rtx_runtime_config(cuda_graphs),)
        axes = {spec["name"]: {d: i for i, d in enumerate(spec["shape"]) if isinstance(d, str)}
                for spec in self.manifest["inputs"] + self.manifest["outputs"]}
        # RTX captures graphs itself (runtime config); NVIDIA TensorRT through torch's stream capture.
        self.executor = PlanExecutor(self.engine, trt, self.plan.name, axes, self.device,
                                     capture_graphs=cuda_graphs and not self.flavor.is_rtx, context_args=context_args)
        self.input_names, self.output_names, self.dtypes = self.executor.input_names, self.executor.output_names, self.executor.dtypes
        self._closed = False

    def _rtx_runtime_config(self, cuda_graphs: bool) -> Any:
        """TensorRT-RTX's per-context settings: its own CUDA graphs (captured after its shape-specialized
        kernels are compiled, which a capture from outside could not know) and the runtime cache."""
        config = self.engine.create_runtime_config()
        if cuda_graphs:
            config.cuda_graph_strategy = self.flavor.trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
        self.runtime_cache.attach(config)
        self._runtime_config = config  # contexts refer to it
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
        with torch.cuda.stream(self.stream):
            tensors = {}
            for name in self.input_names:
                if name not in inputs:
                    raise ValueError(f"missing inputs {[n for n in self.input_names if n not in inputs]}; {self.plan.name} takes {self.input_names}")
                tensor = torch.as_tensor(inputs[name]).to(self.device, self.dtypes[name], non_blocking=True).contiguous()
                tensor.record_stream(self.stream)  # a caller's tensor is in use here until this stream is done
                tensors[name] = tensor
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
