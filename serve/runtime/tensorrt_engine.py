"""TensorRT runtime: run a plan on torch CUDA tensors (TensorRT or TensorRT-RTX alike).

A plan runs only on a GPU, and only on the TensorRT (and, for NVIDIA TensorRT, the GPU) it was
built with; the manifest written next to it at build time is checked before deserializing, so a
mismatch fails with a message that says what to rebuild instead of a TensorRT crash.

Per call: pick the optimization profile whose range holds the input shapes, set_input_shape and
set_tensor_address for every tensor, execute_async_v3 on the caller's stream. One execution
context per CUDA stream; optionally one CUDA graph per (profile, input shapes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ldlm.export.engine import MANIFEST_SUFFIX, PLAN_SUFFIX
from ldlm.export.onnx_export import sha256_file
from ldlm.export.trt_flavor import Flavor, GpuInfo, gpu_info, load_flavor, recording_logger


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


TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32", "BOOL": "bool", "INT8": "int8"}


@dataclass
class _GraphCapture:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, Any]
    outputs: dict[str, Any]


class TensorRTEngine:
    """One deserialized plan. ``run`` takes and returns named torch CUDA tensors."""

    def __init__(
        self, plan: str | Path, flavor: str | None = None, device: str = "cuda", cuda_graphs: bool = False,
        runtime_cache: str | Path | None = None,
    ) -> None:
        import torch

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
        self.torch = torch
        self.device = torch.device(device)
        self.logger = recording_logger(self.flavor)
        self.runtime = trt.Runtime(self.logger)
        try:
            self.engine = self.runtime.deserialize_cuda_engine(self.plan.read_bytes())
        except Exception as error:  # e.g. no CUDA driver: TensorRT raises instead of returning None
            raise PlanMismatchError(f"TensorRT could not load {self.plan}: {str(error).splitlines()[0][:300]}") from error
        if self.engine is None:
            errors = "; ".join(m for _, m in self.logger.messages)
            raise PlanMismatchError(f"TensorRT could not deserialize {self.plan}: {errors}")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if n not in self.input_names]
        self.dtypes = {n: getattr(torch, TORCH_DTYPES[self.engine.get_tensor_dtype(n).name]) for n in names}
        self.cuda_graphs = cuda_graphs
        self._contexts: dict[tuple[int, int], Any] = {}
        # TensorRT-RTX compiles kernels for the GPU at run time; its runtime cache keeps them across
        # processes (the counterpart of NVIDIA TensorRT's build-time timing cache).
        self.runtime_cache_path = Path(runtime_cache) if runtime_cache else self.plan.with_name("runtime.cache")
        self._runtime_config = None
        if self.flavor.is_rtx and hasattr(self.engine, "create_runtime_config"):
            self._runtime_config = self.engine.create_runtime_config()
            cache = self._runtime_config.create_runtime_cache()
            if self.runtime_cache_path.is_file():
                cache.deserialize(self.runtime_cache_path.read_bytes())
            self._runtime_config.set_runtime_cache(cache)
        self._captures: dict[tuple[Any, ...], _GraphCapture] = {}

    def profile_for(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """The first optimization profile whose min..max range holds every input shape."""
        for index in range(self.engine.num_optimization_profiles):
            ok = True
            for name, shape in shapes.items():
                low, _, high = self.engine.get_tensor_profile_shape(name, index)
                ok &= len(shape) == len(low) and all(a <= s <= b for a, s, b in zip(low, shape, high))
            if ok:
                return index
        ranges = {n: [tuple(self.engine.get_tensor_profile_shape(n, i)[::2]) for i in range(self.engine.num_optimization_profiles)] for n in shapes}
        raise ValueError(f"input shapes {shapes} are outside every profile of {self.plan.name}; allowed (min, max): {ranges}")

    def _context(self, stream: Any, profile: int) -> Any:
        key = (stream.cuda_stream, profile)
        if key not in self._contexts:
            if self._runtime_config is not None:
                context = self.engine.create_execution_context(self._runtime_config)
            else:
                context = self.engine.create_execution_context()
            context.set_optimization_profile_async(profile, stream.cuda_stream)
            self._contexts[key] = context
        return self._contexts[key]

    def run(self, inputs: dict[str, Any], stream: Any = None) -> dict[str, Any]:
        torch = self.torch
        missing = sorted(set(self.input_names) - set(inputs))
        if missing:
            raise ValueError(f"missing inputs {missing}; {self.plan.name} takes {self.input_names}")
        stream = stream or torch.cuda.current_stream(self.device)
        tensors = {n: torch.as_tensor(inputs[n]).to(self.device, self.dtypes[n]).contiguous() for n in self.input_names}
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        profile = self.profile_for(shapes)
        context = self._context(stream, profile)
        if self.cuda_graphs:
            return self._run_graph(context, tensors, shapes, profile, stream)
        outputs = self._bind(context, tensors)
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"execute_async_v3 failed for {self.plan.name}")
        return outputs

    def save_runtime_cache(self) -> Path | None:
        """Write TensorRT-RTX's runtime cache next to the plan (atomically), for the next process."""
        if self._runtime_config is None:
            return None
        data = bytes(self._runtime_config.get_runtime_cache().serialize())
        tmp = self.runtime_cache_path.with_name(self.runtime_cache_path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(self.runtime_cache_path)
        return self.runtime_cache_path

    def _bind(self, context: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        for name, tensor in tensors.items():
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in self.output_names:
            shape = tuple(context.get_tensor_shape(name))
            outputs[name] = self.torch.empty(shape, dtype=self.dtypes[name], device=self.device)
            context.set_tensor_address(name, outputs[name].data_ptr())
        return outputs

    def _run_graph(self, context: Any, tensors: dict[str, Any], shapes: dict[str, Any], profile: int, stream: Any) -> dict[str, Any]:
        """Replay a CUDA graph captured once per (stream, profile, shapes); inputs are copied into
        its static buffers, outputs are returned as copies so callers never see them overwritten."""
        torch = self.torch
        key = (stream.cuda_stream, profile, tuple(sorted(shapes.items())))
        capture = self._captures.get(key)
        if capture is None:
            static_inputs = {n: t.clone() for n, t in tensors.items()}
            outputs = self._bind(context, static_inputs)
            context.execute_async_v3(stream.cuda_stream)  # warm-up: TensorRT finishes lazy setup outside capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # captures on torch's side stream, which is current inside
                context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
            capture = self._captures[key] = _GraphCapture(graph, static_inputs, outputs)
        for name, tensor in tensors.items():
            capture.inputs[name].copy_(tensor, non_blocking=True)
        capture.graph.replay()
        return {n: t.clone() for n, t in capture.outputs.items()}
