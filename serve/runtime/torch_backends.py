"""Torch on a chosen device: the device and precision helpers, and the compiled backends.

``eager`` (``EagerBackend``) runs the graph's module as it is, on CPU or CUDA, in fp32, bf16 or fp16. Reduced precision
is mixed, as ``torch.autocast`` runs it: the Linear layers' weights are cast once, their matmuls and attention run in
the low precision, and everything else (the residual stream, every LayerNorm and RMSNorm, softmax, the time and
position embeddings) stays FP32. The vocabulary head runs wholly in FP32, so logits and the argmax are FP32's. On the
trained reference this keeps 99.7% of fp32's tokens in fp16 and 97.9% in bf16, on the CPU
(docs/measurements/precision-tokens-reference-cpu-2026-12-06.json).

``compiled`` (``CompiledBackend``) serves static shapes: inputs are padded up to a (batch bucket,
length bucket), the padding masked through ``attention_mask``, and on CUDA one CUDA graph is
captured per (graph, batch bucket, length bucket, masked or not) on first use, so a denoiser call is one graph
replay plus the copies into its static input buffers. With ``cuda_graphs=False`` (the default on
CPU) the same buckets and padding run the module directly, which is how CPU tests check them.

``FusedSteps`` goes one further for the denoiser: the gather of a step's rows from the persistent batch, its call,
the sampler's update (self-conditioning and the corrector included) and the scatter back as one step per (bucket,
sampler), on CUDA one captured graph each, driven by ``SlotTable.step_fused``.

Without padding the encoder and the denoiser run attention with no mask at all (``MaskFree``), so on CUDA SDPA may
take its flash or memory-efficient kernels: when the caller leaves ``attention_mask`` out (``BackendGraphs`` with a
mask of None), or for the encoder, when its mask is on the host and all ones. ``compiled`` keeps such a batch
mask-free where its length is its bucket's, and captures it apart from the masked one.

``inductor`` (``InductorBackend``) is ``compiled`` with torch.compile's kernels, one static compile per bucket (about
15 s for the base denoiser on an H200): 1.46-2.04x faster there (docs/measurements/gpu-profile-h200-2026-12-04.json).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ldlm.buckets import bucket_for
from ldlm.device import DeviceError
from ldlm.device import resolve_device as core_resolve_device
from ldlm.export.graphs import GRAPH_NAMES, graph_io
from ldlm.model.checkpoint import WEIGHTS_FILE, load_checkpoint
from ldlm.model.config import LDLMConfig
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer
from ldlm.sampling.samplers import Sampler
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.step import SlotStep, StepInputs, StepOutputs, gather_inputs, gather_past, sampler_update, scatter_outputs
from ldlm.serve.runtime.graph_backend import MASK, BackendError, GraphBackend
from ldlm.serve.runtime.registry import COMPILED, EAGER, INDUCTOR, TORCH_PRECISIONS

if TYPE_CHECKING:
    from ldlm.serve.runtime.registry import BackendInfo, OpenOptions

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LENGTH_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here, or a BackendError naming what is missing."""
    try:
        return core_resolve_device(device)
    except DeviceError as error:
        raise BackendError(str(error)) from None


def check_precision(precision: str, backend: str) -> torch.dtype:
    if precision not in TORCH_DTYPES:
        raise BackendError(f"backend {backend!r} cannot run precision={precision!r}; allowed: {', '.join(TORCH_PRECISIONS)}")
    return TORCH_DTYPES[precision]


def prepare_model(model: LDLM, device: torch.device, precision: str) -> LDLM:
    """Move ``model`` to ``device`` and, for bf16 or fp16, cast its Linear layers' weights (not the vocabulary
    head's), which the backends run under ``LowPrecision``. In place (the model is the backend's own copy).
    TF32 stays off for FP32 matmuls, as for parity."""
    dtype = check_precision(precision, EAGER)
    model = model.to(device).eval()
    if dtype == torch.float32:
        return model
    head = model.token_decoder.head
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not head:
            module.to(dtype)
    # Logits stay FP32, computed from FP32 weights: the argmax is fp32's wherever its input is. A bound method,
    # so a deep copy of the model binds it to the copy's head.
    head.forward = types.MethodType(_fp32_forward, head)  # type: ignore[method-assign]
    return model


def _fp32_forward(head: nn.Linear, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(head.weight.device.type, enabled=False):
        return type(head).forward(head, *args, **kwargs)


def compute_dtype(model: LDLM) -> torch.dtype:
    """The precision ``prepare_model`` gave the model's matmuls: its Linear layers' weights' dtype."""
    return next(m.weight.dtype for m in model.denoiser.modules() if isinstance(m, nn.Linear))


class LowPrecision(nn.Module):
    """A graph's module under ``torch.autocast``: matmuls and attention in ``dtype``, the rest FP32. Autocast's cast
    cache is off, as CUDA graph capture requires; the weights are already in ``dtype``, so their casts are no-ops."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.module, self.dtype, self.device_type = module, dtype, device.type

    def forward(self, *args: Tensor) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False):
            return self.module(*args)


# The graphs that have a mask-free module: the decoder runs once per request, always with its mask.
MASK_FREE_GRAPHS: tuple[str, ...] = ("encoder", "denoiser")


class MaskFree(nn.Module):
    """A graph's computation for a batch with no padding, without its ``attention_mask`` input: the LDLM method the
    exported graph calls (``ldlm.export.graphs``), with a mask of None. No mask tensor reaches attention (the
    model makes no bias from None; GPT-2's causality is SDPA's ``is_causal``), so SDPA may take the flash or
    memory-efficient kernels on CUDA. An all-ones mask gives the same numbers as an additive bias of zeros,
    which rules the flash kernel out."""

    def __init__(self, model: LDLM, graph: str) -> None:
        super().__init__()
        if graph not in MASK_FREE_GRAPHS:
            raise BackendError(f"graph {graph!r} has no mask-free module; allowed: {', '.join(MASK_FREE_GRAPHS)}")
        self.model, self.graph = model, graph

    def forward(self, *inputs: Tensor) -> Tensor:
        if self.graph == "denoiser":
            x_t, t, x0_prev = inputs
            return self.model.denoise(x_t, t, x0_prev, None)
        (input_ids,) = inputs
        return self.model.encode_latents(input_ids, None)


class EagerBackend(GraphBackend):
    """The reference: the graph's torch module, run as exported (same wrapper, same names), on the
    model's device and in its precision (see ``prepare_model``). Float outputs come
    back as FP32."""

    backend = EAGER

    def __init__(self, model: LDLM, graph: str, with_logits: bool = False) -> None:
        io = graph_io(model, graph, with_logits)
        specs = [
            {"name": n, "dtype": "INT64" if t.dtype == torch.int64 else "FLOAT", "shape": list(s)}
            for n, t, s in zip(io.input_names, io.example_inputs, io.input_shapes)
        ]
        outs = [
            {"name": n, "dtype": "INT64" if n == "token_ids" else "FLOAT", "shape": list(s)}
            for n, s in zip(io.output_names, io.output_shapes)
        ]
        super().__init__(graph, specs, outs, model.config.max_seq_len)
        self.model = model  # the prepared LDLM this graph is part of
        self.device = next(model.parameters()).device
        self.dtype = compute_dtype(model)
        self.precision = next(name for name, dtype in TORCH_DTYPES.items() if dtype == self.dtype)
        self.module = self._wrapped(io.module.eval())
        # What runs a batch with no padding, without the mask input (``MaskFree``); None: the graph always takes one.
        self.free_module = self._wrapped(MaskFree(model, graph).eval()) if graph in MASK_FREE_GRAPHS else None
        self.seq_names: set[str] = {str(s["name"]) for s in specs if "seq" in s["shape"]}
        self.seq_outputs = {o["name"] for o in outs if "seq" in o["shape"]}
        self.provider = f"torch {torch.__version__} eager on {self.device}" + ("" if self.precision == "fp32" else f" ({self.precision})")

    def _wrapped(self, module: nn.Module) -> nn.Module:
        return module if self.dtype == torch.float32 else LowPrecision(module, self.dtype, self.device)

    def worker_context(self) -> contextlib.AbstractContextManager[Any]:
        """On CUDA, a stream of this thread's own. On the default stream a batcher's graph (a preview's decode)
        would queue behind the scheduler's denoiser steps, and each of its copies to the host would wait for
        them; on its own stream it overlaps them."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.Stream(self.device))

    @torch.inference_mode()
    def run_tensors(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Tensors in (any device; checked on their shapes alone, no copy to the host), tensors
        out on this backend's device. ``attention_mask`` may be left out: every position is real. A batch that
        ``mask_free`` finds so runs ``free_module`` with no mask; a graph without one gets ones on the device."""
        self.check_tensors(inputs)
        free = self.mask_free(inputs)
        tensors = {
            s["name"]: inputs[s["name"]].to(self.device, self.input_dtype(s), non_blocking=True)
            for s in self.inputs
            if s["name"] in inputs and not (free and s["name"] == MASK)
        }
        if not free and MASK in self.input_names and MASK not in tensors:
            tensors[MASK] = torch.ones(self.mask_shape(tensors), dtype=torch.int64, device=self.device)
        return self._forward(tensors)

    def mask_free(self, inputs: Mapping[str, Tensor]) -> bool:
        """Whether these inputs run without a mask: a graph with a mask-free module, called without a mask, or
        the encoder, with a mask on the host that is all ones (the tokenizer's, for prompts without padding).

        Only a CPU mask is read. ``bool(mask.all())`` on a CUDA tensor copies the answer to the host, which
        waits for every kernel queued before it: the host would stall at each call instead of queuing the next
        work (what keeps the GPU busy), and inside a CUDA graph capture it fails. So the denoiser, whose masks
        live on the sampling device, is told by its caller: no mask means no padding."""
        if self.free_module is None:
            return False
        mask = inputs.get(MASK)
        if mask is None:
            return True
        return self.graph == "encoder" and mask.device.type == "cpu" and bool(mask.all())

    def input_dtype(self, spec: dict[str, Any]) -> torch.dtype:
        """int64 stays; every float input is FP32, as the residual stream is (autocast casts for the matmuls)."""
        return torch.int64 if spec["dtype"] == "INT64" else torch.float32

    def _forward(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        values = self._module_outputs(tensors)
        return {n: v.float() if v.is_floating_point() else v for n, v in zip(self.output_names, values)}

    def _module_outputs(self, tensors: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        """The graph's module on ``tensors``; ``free_module`` where they hold no mask (``run_tensors`` sees to it that
        only a graph with one gets none)."""
        if MASK in tensors or self.free_module is None:
            result = self.module(*(tensors[n] for n in self.input_names))
        else:
            result = self.free_module(*(tensors[n] for n in self.input_names if n != MASK))
        return result if isinstance(result, tuple) else (result,)

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.run_tensors({n: torch.from_numpy(a) for n, a in inputs.items()})
        return {n: v.cpu().numpy() for n, v in outputs.items()}


def length_buckets(max_seq_len: int, buckets: Sequence[int] = LENGTH_BUCKETS) -> tuple[int, ...]:
    return tuple(sorted({b for b in buckets if b <= max_seq_len} | {max_seq_len}))


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, Tensor]  # static input buffers, filled before each replay
    outputs: tuple[Tensor, ...]  # static output buffers, overwritten by each replay


class CompiledBackend(EagerBackend):
    """Static shape buckets and, on CUDA, one captured CUDA graph per (batch bucket, length bucket, masked): a batch
    with no mask whose length is its bucket's runs ``free_module`` (no mask in attention); one whose length is
    padded up to its bucket needs a mask for the padding, so it takes the masked path."""

    backend = COMPILED
    compiler = ""  # who compiled the module's kernels, for the provider string ("": eager kernels)

    def __init__(
        self,
        model: LDLM,
        graph: str,
        with_logits: bool = False,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        seq_buckets: Sequence[int] | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        super().__init__(model, graph, with_logits)
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.seq_buckets = length_buckets(self.max_seq_len, seq_buckets or LENGTH_BUCKETS)
        if not self.batch_buckets or self.batch_buckets[0] < 1:
            raise BackendError(f"batch_buckets={list(batch_buckets)} is invalid; allowed: integers >= 1")
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise BackendError(f"CUDA graphs need a CUDA device; this backend runs on {self.device}")
        self.captured: dict[tuple[int, int, bool], _Captured] = {}  # by (batch bucket, length bucket, masked)
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None  # one pool per graph
        self._lock = threading.Lock()  # static buffers are shared: one replay at a time (``exclusive``)
        self._last_use: Any = None  # torch.cuda.Event after the last user's work, on its stream
        self.module = self.compile(self.module)
        self.free_module = None if self.free_module is None else self.compile(self.free_module)
        mode = "CUDA graphs" if self.cuda_graphs else "static buckets, no CUDA graphs"
        self.provider = f"torch {torch.__version__} compiled{self.compiler} ({mode}) on {self.device} ({self.precision})"

    def compile(self, module: nn.Module) -> nn.Module:
        """The module the buckets run: this one as it is."""
        return module

    def bucket(self, batch: int, length: int) -> tuple[int, int]:
        return bucket_for(batch, self.batch_buckets), bucket_for(length, self.seq_buckets)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The module, its pool and the static buffers, for one user at a time: in the host's order under the lock
        and, on CUDA, in the GPU's too: threads on streams of their own (``worker_context``) would otherwise
        fill the buffers while another stream's replay still reads them. The caller's stream waits for the last
        user's work first."""
        with self._lock:
            if self._last_use is not None:
                torch.cuda.current_stream(self.device).wait_event(self._last_use)
            try:
                yield
            finally:
                if self.device.type == "cuda":
                    self._last_use = torch.cuda.Event()
                    self._last_use.record(torch.cuda.current_stream(self.device))

    def _forward(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        # Batches above the largest bucket run in chunks of the largest bucket.
        batch, length = self.mask_shape(tensors)
        top = self.batch_buckets[-1]
        if batch > top:
            parts = [self._forward({n: t[i : i + top] for n, t in tensors.items()}) for i in range(0, batch, top)]
            return {n: torch.cat([p[n] for p in parts]) for n in self.output_names}
        batch_bucket, length_bucket = self.bucket(batch, length)
        if MASK not in tensors and length_bucket != length:  # the padded positions must be masked out: the masked path
            tensors = {**tensors, MASK: torch.ones(batch, length, dtype=torch.int64, device=self.device)}
        key = (batch_bucket, length_bucket, MASK in tensors)
        with self.exclusive():
            if self.cuda_graphs:
                captured = self.captured.get(key) or self._capture(key)
                fill_padded(captured.inputs, tensors, self.seq_names)
                captured.graph.replay()
                outputs = captured.outputs
            else:
                buffers = self._blank_inputs(*key)
                fill_padded(buffers, tensors, self.seq_names)
                outputs = self._module_outputs(buffers)
            # Cut back to the request's shape, float outputs as FP32; always a copy, since the next
            # replay overwrites the buffers.
            return {
                n: _cut(o, batch, length, n in self.seq_outputs).to(torch.float32 if o.is_floating_point() else o.dtype, copy=True)
                for n, o in zip(self.output_names, outputs)
            }

    def warm_up(self, batches: Sequence[int], lengths: Sequence[int]) -> None:
        """Capture (and for inductor, compile) the buckets of these shapes now rather than on the first request:
        masked and, where the graph has one, mask-free."""
        for batch in batches:
            for length in lengths:
                inputs = self.example_inputs(batch, length)
                self.run_tensors(inputs)
                if self.free_module is not None:
                    self.run_tensors({n: t for n, t in inputs.items() if n != MASK})

    def example_inputs(self, batch: int, length: int) -> dict[str, Tensor]:
        """Zeros of the contract's shapes (ones for the mask), on this backend's device."""
        return {
            n: (torch.ones if n == "attention_mask" else torch.zeros)(shape, dtype=dtype, device=self.device)
            for n, (shape, dtype) in self._shapes(batch, length).items()
        }

    def _shapes(self, batch: int, length: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        sizes = {"batch": batch, "seq": length}
        return {
            spec["name"]: (tuple(sizes[s] if isinstance(s, str) else s for s in spec["shape"]), self.input_dtype(spec))
            for spec in self.inputs
        }

    def _blank_inputs(self, batch: int, length: int, masked: bool = True) -> dict[str, Tensor]:
        """Zeros of the bucket's shapes; without the mask where the bucket runs mask-free."""
        shapes = self._shapes(batch, length)
        return {n: torch.zeros(shape, dtype=dtype, device=self.device) for n, (shape, dtype) in shapes.items() if masked or n != MASK}

    def _capture(self, key: tuple[int, int, bool]) -> _Captured:
        static = self._blank_inputs(*key)
        if MASK in static:
            static[MASK].fill_(1)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up off the capture: cuBLAS handles, kernel choice, allocator
            for _ in range(2):
                self._module_outputs(static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may run CUDA work while this one captures.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self._module_outputs(static)
        self.captured[key] = _Captured(graph, static, outputs)
        return self.captured[key]


class InductorBackend(CompiledBackend):
    """``CompiledBackend`` with the module compiled by torch.compile (Inductor), inside each bucket's CUDA graph."""

    backend = INDUCTOR
    compiler = " by Inductor"

    def compile(self, module: nn.Module) -> nn.Module:
        # Static shapes, as measured. Past recompile_limit shapes Dynamo runs eagerly, silently: every bucket gets one.
        import torch._dynamo

        # Two per bucket: the masked module and the mask-free one (``MaskFree``) may share a code object (LowPrecision's).
        buckets = 2 * len(self.batch_buckets) * len(self.seq_buckets)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets)
        return cast(nn.Module, torch.compile(module, dynamic=False))  # an OptimizedModule, itself a Module


@dataclass
class _PreparedStep:
    """One (batch bucket, length bucket, sampler, ...) step over one table's storage."""

    graph: Any  # torch.cuda.CUDAGraph; None without CUDA graphs (the step runs uncaptured on the buffers)
    state: Mapping[str, Tensor]  # the table's tensors the graph reads and writes (kept: the graph holds their addresses)
    gather: Tensor  # (Bb,) the rows' slots; padded rows repeat the first row's (ordinary, finite steps)
    scatter: Tensor  # (Bb,) where the rows' results go; padded rows' go to the scratch slot
    sent: Tensor  # (3 + C, Bb) the rows' times and coefficients, copied in before each replay
    noise: Tensor | None  # (Bb, L, D) the stochastic sampler's draws, copied in likewise
    slots_host: np.ndarray | None = None  # the running set the indices were last filled from


class FusedSteps:
    """A compiled denoiser's fused steps (``SlotTable.step_fused``'s ``fused``): the gather of the running rows
    from the persistent batch, the denoiser call, the sampler's update (corrector and self-conditioning included)
    and the scatter back, as one callable per (batch bucket, length bucket, sampler, schedule, table storage). On
    CUDA each is captured once as one CUDA graph whose static inputs are the rows' slot index, their times and
    coefficients and the sde sampler's noise, so a step is one small copy and one replay whatever the batch
    holds: the index is copied again only when the running set changes. Without CUDA graphs (CPU) the same
    buckets, padding and math run uncaptured on the same buffers, which is how CPU tests check them.

    A batch bucket larger than the batch repeats the first row's slot and writes the extra rows' results to the
    table's scratch slot; a length bucket longer than the table pads inside the step (zeros, masked out). What
    is not fused: a batch mixing samplers, and prompt guidance (``SlotTable.fusable``); those take
    ``SlotTable.step``. A table that grows reallocates its tensors, so its steps are captured again.

    ``SlotStep.full``: no row has padding. Where the length is its bucket's the step then runs the mask-free
    denoiser (no mask in attention), prepared apart from the masked step of the same bucket.
    """

    def __init__(self, backend: CompiledBackend) -> None:
        if backend.graph != "denoiser":
            raise BackendError(f"fused steps run the denoiser graph, not {backend.graph!r}")
        self.backend = backend
        self.prepared: dict[tuple[Any, ...], _PreparedStep] = {}
        self.output = backend.output_names.index("x0_hat")

    def __call__(self, sampler: Sampler, schedule: TangentSchedule, rows: SlotStep) -> None:
        backend = self.backend
        top = backend.batch_buckets[-1]
        chunks = [rows.rows(i, i + top) for i in range(0, len(rows.slots_host), top)]  # as the backend's own calls
        with backend.exclusive():  # the module, its pool and the static buffers are shared: one step at a time
            # Every chunk's step prepared before any runs: a capture that fails then changes no row.
            steps = [self._prepared(sampler, schedule, chunk) for chunk in chunks]
            for (key, prepared), chunk in zip(steps, chunks):
                self._fill(prepared, chunk)
                if prepared.graph is not None:
                    prepared.graph.replay()
                else:  # the same static buffers, uncaptured: what CPU tests check
                    self.run(sampler, schedule, prepared, key[1], key[5])

    def run(self, sampler: Sampler, schedule: TangentSchedule, prepared: _PreparedStep, length_bucket: int, masked: bool) -> None:
        """One step at the buffers' (bucket) shape, in place: gather, the denoiser as ``BackendGraphs.denoise``
        feeds it (FP32 in and out), the sampler's update, scatter; what a CUDA graph captures."""
        state, length = prepared.state, prepared.state["x"].shape[1]
        rows = gather_inputs(state, prepared.gather, prepared.sent, full=not masked)
        inputs, past = gather_past(state, sampler, prepared.gather, rows, prepared.noise)
        if length_bucket != length:
            inputs = _padded(inputs, length_bucket)
        backend = self.backend
        feed = {"x_t": inputs.x, "t": inputs.t, "x0_prev": inputs.x0_prev}
        if inputs.mask is not None:
            feed[MASK] = inputs.mask.long()
        tensors = {
            spec["name"]: feed[spec["name"]].to(backend.device, backend.input_dtype(spec))
            for spec in backend.inputs
            if spec["name"] in feed
        }
        x0_hat = backend._module_outputs(tensors)[self.output].float().to(inputs.x.dtype)
        out = sampler_update(sampler, schedule, inputs, x0_hat)
        if length_bucket != length:
            x, x_mean, x0_hat, x0_prev, x_start = (o[:, :length] for o in (out.x, out.x_mean, out.x0_hat, out.x0_prev, out.x_start))
            out = StepOutputs(x, x_mean, x0_hat, x0_prev, x_start, out.lam)
        scatter_outputs(state, sampler, prepared.scatter, out, past)

    def _prepared(self, sampler: Sampler, schedule: TangentSchedule, rows: SlotStep) -> tuple[tuple[Any, ...], _PreparedStep]:
        batch, length = len(rows.slots_host), rows.state["x"].shape[1]
        batch_bucket, length_bucket = self.backend.bucket(batch, length)
        masked = not rows.full or length_bucket != length  # the bucket's padding must be masked out
        key = (batch_bucket, length_bucket, sampler, schedule, rows.state["x"].dtype, masked, rows.storage)
        prepared = self.prepared.get(key)
        if prepared is None:
            self._forget(rows.storage)
            prepared = self.prepared[key] = self._prepare(key, sampler, schedule, rows)
        return key, prepared

    def _forget(self, storage: tuple[int, int]) -> None:
        """Drop the steps of the same table's older storage (it grew: their graphs hold freed addresses)."""
        for key in [k for k in self.prepared if k[6][0] == storage[0] and k[6] != storage]:
            del self.prepared[key]

    def _prepare(self, key: tuple[Any, ...], sampler: Sampler, schedule: TangentSchedule, rows: SlotStep) -> _PreparedStep:
        """The bucket's static buffers and, with CUDA graphs, the step captured on them."""
        batch_bucket, device = key[0], rows.slots.device
        index = torch.full((batch_bucket,), rows.scratch, dtype=torch.int64, device=device)
        noise = None if rows.noise is None else torch.zeros((batch_bucket, *rows.noise.shape[1:]), dtype=rows.noise.dtype, device=device)
        sent = torch.from_numpy(np.repeat(rows.sent[:, :1], batch_bucket, 1)).to(device)  # finite times for the warm-up
        prepared = _PreparedStep(None, dict(rows.state), index, index.clone(), sent, noise)
        if not self.backend.cuda_graphs:
            return prepared
        # The warm-up runs, so it must not touch a sample: every row reads and writes the scratch slot.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up off the capture: cuBLAS handles, kernel choice, allocator
            for _ in range(2):
                self.run(sampler, schedule, prepared, key[1], key[5])
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may run CUDA work while this one captures.
        with torch.cuda.graph(graph, pool=self.backend.pool, capture_error_mode="thread_local"):
            self.run(sampler, schedule, prepared, key[1], key[5])
        prepared.graph = graph
        return prepared

    def _fill(self, prepared: _PreparedStep, rows: SlotStep) -> None:
        """This step's values into the static buffers: the times always (one copy), the slot index only when the
        running set changed since this step last ran, the noise where the sampler draws. Padded rows repeat
        the first row (ordinary, finite steps: zeros would put them at t = 0, where sigma is 0)."""
        batch, bucket = len(rows.slots_host), prepared.gather.shape[0]
        sent = rows.sent if batch == bucket else np.concatenate([rows.sent, np.repeat(rows.sent[:, :1], bucket - batch, 1)], 1)
        prepared.sent.copy_(torch.from_numpy(sent), non_blocking=True)
        if prepared.slots_host is not rows.slots_host:
            slots, extra = rows.slots_host, bucket - batch
            prepared.gather.copy_(torch.from_numpy(np.concatenate([slots, np.full(extra, slots[0])])), non_blocking=True)
            prepared.scatter.copy_(torch.from_numpy(np.concatenate([slots, np.full(extra, rows.scratch)])), non_blocking=True)
            prepared.slots_host = slots
        if rows.noise is not None:
            prepared.noise[:batch].copy_(rows.noise)  # type: ignore[index]
            if batch < bucket:
                prepared.noise[batch:] = prepared.noise[:1]  # type: ignore[index]


def _padded(inputs: StepInputs, length: int) -> StepInputs:
    """``inputs`` padded to ``length`` positions: zeros, masked out (a mask of the real positions where there was none)."""
    batch, real = inputs.x.shape[:2]

    def pad(value: Tensor) -> Tensor:
        return F.pad(value, (0, 0, 0, length - real))

    mask = torch.ones(batch, real, dtype=torch.bool, device=inputs.x.device) if inputs.mask is None else inputs.mask
    return replace(
        inputs,
        x=pad(inputs.x),
        x0_prev=pad(inputs.x0_prev),
        mask=F.pad(mask, (0, length - real)),
        past_x0=tuple(pad(p) for p in inputs.past_x0),
        noise=None if inputs.noise is None else pad(inputs.noise),
        x_prev=None if inputs.x_prev is None else pad(inputs.x_prev),
    )


def fused_steps(graph: GraphBackend) -> FusedSteps | None:
    """The fused steps a server's scheduler takes for this denoiser: a compiled one's (``compiled``, ``inductor``),
    none for the others, which run the denoiser and the sampler's update apart."""
    return FusedSteps(graph) if isinstance(graph, CompiledBackend) and graph.graph == "denoiser" else None


def fill_padded(buffers: Mapping[str, Tensor], tensors: Mapping[str, Tensor], seq_names: set[str]) -> None:
    """Copy ``tensors`` into the top-left corner of the bucket-shaped ``buffers``.

    Padded positions of real rows get attention_mask 0 (they are masked out of every attention,
    so they cannot change real positions); padded rows get zeros with a full mask (their outputs
    are dropped; a full mask keeps them ordinary, finite inputs).
    """
    batch = next(iter(tensors.values())).shape[0]
    for name, buffer in buffers.items():
        value = tensors[name]
        if buffer.shape == value.shape:
            buffer.copy_(value)
            continue
        if name == "attention_mask":
            buffer.zero_()
            buffer[batch:] = 1
        else:
            buffer.zero_()
        region = (slice(0, batch), slice(0, value.shape[1])) if name in seq_names else (slice(0, batch),)
        buffer[region].copy_(value)


def _cut(output: Tensor, batch: int, length: int, has_seq: bool) -> Tensor:
    return output[:batch, :length] if has_seq else output[:batch]


TORCH_KINDS: dict[str, type[EagerBackend]] = {kind.backend: kind for kind in (EagerBackend, CompiledBackend, InductorBackend)}


def open_backend(info: BackendInfo, path: Path, options: OpenOptions) -> tuple[dict[str, GraphBackend], LDLMConfig, TextTokenizer]:
    """A checkpoint's own modules on ``options.device`` in ``options.precision`` (its FP32 list kept in FP32)."""
    check_precision(options.precision, info.name)
    target = resolve_device(options.device)  # before loading: a missing device fails fast
    if not (path / WEIGHTS_FILE).is_file():
        raise BackendError(f"{path} is not a checkpoint (no {WEIGHTS_FILE}); backend {info.name!r} runs a checkpoint from `ldlm init`")
    model, tokenizer = load_checkpoint(path)
    model = prepare_model(model, target, options.precision)
    kind = TORCH_KINDS[info.name]
    return {g: kind(model, g, options.with_logits and g == "decoder") for g in GRAPH_NAMES}, model.config, tokenizer
