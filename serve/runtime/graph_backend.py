"""The interface every backend implements: ``GraphBackend`` runs one graph, checking its inputs
against the graph's I/O contract (names, dtypes, shapes from the export manifest) before a
backend-specific ``_run`` does the work. The backends themselves live in ``backends`` (ONNX Runtime,
TensorRT) and ``torch_backends`` (eager, compiled, inductor).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

NUMPY_DTYPES = {"FLOAT": np.float32, "INT64": np.int64, "FLOAT16": np.float16, "INT32": np.int32, "BOOL": np.bool_}
# The one input a caller of ``run_tensors`` (the sampling loop's denoiser, through BackendGraphs) may leave out: no
# attention_mask means every position of every row is real. The torch backends then run attention with no mask at
# all, so SDPA may take its flash kernels; TensorRT's builds an all-ones one on its GPU. ``run`` (the arrays a client
# sends, KServe's infer) takes every input the graph declares, as its metadata says.
MASK = "attention_mask"


class BackendError(ValueError):
    """A backend that is not installed, a precision it cannot run, or inputs outside its contract."""


class GraphBackend(ABC):
    backend: str
    provider: str
    precision: str = "fp32"  # what runs: fp32, fp16, bf16 or int8 (an export's quantized variant)
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

    def worker_context(self) -> contextlib.AbstractContextManager[Any]:
        """What a thread that runs this graph alone (a batcher's worker) holds while it lives: nothing here; a
        torch graph on CUDA gives it a CUDA stream of its own (``EagerBackend.worker_context``)."""
        return contextlib.nullcontext()

    def check_inputs(self, inputs: Mapping[str, np.ndarray | Tensor]) -> dict[str, np.ndarray]:
        """Names, dtypes and shapes against the contract (every input the graph declares); a consistent batch and
        sequence length."""
        self._check_names(inputs, mask_optional=False)
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
        """``check_inputs`` for torch tensors on any device: shapes and dtypes only, no copy to the host. The
        mask may be left out; the caller decides what that means (``MASK``)."""
        self._check_names(inputs, mask_optional=True)
        sizes: dict[str, int] = {}
        for spec in self.inputs:
            if spec["name"] not in inputs:  # the mask, left out
                continue
            value = inputs[spec["name"]]
            kind = "f" if value.is_floating_point() else "b" if value.dtype == torch.bool else "i"
            self._check_one(spec, kind, str(value.dtype).removeprefix("torch."), tuple(value.shape), sizes)
        self._check_sizes(sizes)

    def _check_names(self, inputs: Mapping[str, Any], mask_optional: bool) -> None:
        """Exactly the graph's inputs, where with ``mask_optional`` ``attention_mask`` may be left out (``MASK``)."""
        missing = [n for n in self.input_names if n not in inputs and not (mask_optional and n == MASK)]
        unknown = [n for n in inputs if n not in self.input_names]
        if missing or unknown:
            optional = mask_optional and MASK in self.input_names
            raise BackendError(
                f"{self.graph}: inputs {sorted(inputs)} do not match; allowed: exactly {self.input_names}"
                + (f" ({MASK} may be left out: every position real)" if optional else "")
            )

    def mask_shape(self, inputs: Mapping[str, Any]) -> tuple[int, int]:
        """(batch, seq) of these inputs, read off the first one with both axes other than the mask: the shape of the
        all-ones mask a left-out one stands for."""
        spec = next(s for s in self.inputs if s["name"] != MASK and {"batch", "seq"} <= set(s["shape"]) and s["name"] in inputs)
        shape, axes = inputs[spec["name"]].shape, list(spec["shape"])
        return int(shape[axes.index("batch")]), int(shape[axes.index("seq")])

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
            raise BackendError(
                f"{self.graph}: batch {sizes.get('batch')} / seq {sizes.get('seq')} out of range; allowed: batch >= 1, 1 <= seq <= {self.max_seq_len}"
            )

    @abstractmethod
    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None:  # noqa: B027 (a hook with nothing to do for most backends, not abstract)
        """Release what the backend holds past its last call (TensorRT: save the runtime cache)."""
