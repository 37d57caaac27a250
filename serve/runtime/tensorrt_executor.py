"""The TensorRT calls on tensors already on the device, one plan at a time: pick the profile, split
a batch larger than every profile into chunks that fit, set shapes and addresses (each call's
result checked), ``execute_async_v3``.

An execution context is not thread-safe, and the server calls one engine from several threads (the
scheduler's and each graph's batcher), so bind + enqueue run under one lock, with one context per
optimization profile (a profile serves one context at a time in older TensorRT). With NVIDIA
TensorRT it can capture one CUDA graph per (profile, shapes); TensorRT-RTX captures its own
(``cuda_graph_strategy``, set by ``trt_runtime``), which also handles its lazily compiled
shape-specialized kernels. Streams, dtype conversion and the plan's files are ``trt_runtime``'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ldlm.export.artifact import PlanMismatchError
from ldlm.export.trt_flavor import bind, set_input_shape, set_tensor_address

log = logging.getLogger(__name__)


# TensorRT DataType name -> torch dtype. INT4, FP4 and E8M0 are packed or scale-only types with no
# torch tensor of their own; an engine with such an I/O tensor is refused by name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT64": torch.int64,
    "INT32": torch.int32,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "BOOL": torch.bool,
    "FP8": torch.float8_e4m3fn,
}


def torch_dtype(trt_dtype: str, tensor: str) -> torch.dtype:
    if trt_dtype not in TORCH_DTYPES:
        raise PlanMismatchError(
            f"I/O tensor {tensor} has TensorRT dtype {trt_dtype}, which has no torch dtype; allowed: {', '.join(TORCH_DTYPES)}"
        )
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
            raise ValueError(
                f"batch {batch} cannot be split into the profiles' batch ranges {sorted(ranges)} "
                f"({left} left over); rebuild the engines with a profile that holds it"
            )
        chunks.append(max(fitting))
        left -= chunks[-1]
    return chunks


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

    def __init__(
        self,
        engine: Any,
        trt: Any,
        name: str,
        axes: dict[str, dict[str, int]],
        device: torch.device,
        capture_graphs: bool = False,
        context_args: tuple[Any, ...] = (),
    ) -> None:
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
        self.batch_ranges = [self._batch_range(r) for r in self.ranges] if self.batch_axes else []
        # Outputs a chunked batch could not be put back together along (none in LDLM's graphs).
        self.unbatched_outputs = [n for n in self.output_names if n not in self.batch_axes]
        self.capture_graphs = capture_graphs
        self.context_args = context_args
        self._lock = threading.Lock()
        self._contexts: dict[int, Any] = {}
        self._captures: dict[tuple[Any, ...], _GraphCapture] = {}
        self._bound: dict[int, tuple[Any, ...] | None] = {}  # profile -> the capture its context is bound to

    @property
    def max_batch(self) -> int:
        """The largest batch one execution takes (larger ones run as several)."""
        return max(high for _, high in self.batch_ranges)

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
            if all(
                len(shape) == len(ranges[n][0]) and all(a <= s <= b for a, s, b in zip(ranges[n][0], shape, ranges[n][1]))
                for n, shape in shapes.items()
            ):
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
        chunks = batch_chunks(batch, self.batch_ranges) if batched else [batch]
        if len(chunks) == 1:
            return self._execute_one(inputs, stream)
        if self.unbatched_outputs:
            raise ValueError(
                f"{self.name}: outputs {self.unbatched_outputs} have no batch axis, so batch {batch} cannot run in chunks {chunks}"
            )
        parts, start = [], 0
        for size in chunks:
            part = {n: t.narrow(self.batch_axes[n], start, size) if n in self.batch_axes else t for n, t in inputs.items()}
            parts.append(self._execute_one({n: t.contiguous() for n, t in part.items()}, stream))
            start += size
        return {n: torch.cat([p[n] for p in parts], self.batch_axes[n]) for n in self.output_names}

    def _execute_one(self, inputs: dict[str, Tensor], stream: int) -> dict[str, Tensor]:
        shapes = {n: tuple(inputs[n].shape) for n in self.input_names}
        profile = self.profile_for(shapes)
        with self._lock:  # the context's shapes and addresses belong to one call until it is enqueued
            context = self._context(profile, stream)
            if self.capture_graphs:
                return self._replay(context, profile, inputs, shapes, stream)
            return self._execute_plain(context, profile, inputs, shapes, stream)

    def _execute_plain(
        self, context: Any, profile: int, inputs: dict[str, Tensor], shapes: dict[str, Any], stream: int
    ) -> dict[str, Tensor]:
        outputs = bind(context, {n: inputs[n] for n in self.input_names}, self.output_names, self.dtypes, self.device)
        self._bound[profile] = None
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
                return self._execute_plain(context, profile, inputs, shapes, stream)
            self._captures[key] = capture
        elif self._bound.get(profile) != key:
            # Another capture (or a plain run) bound other shapes on this context since: its own
            # state is put back to the graph's, so what TensorRT reports matches what replays.
            bind_static(context, capture)
        self._bound[profile] = key
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
