"""Dynamic batching for one graph: requests run in batches of at most ``max_batch`` samples.

When a batch starts, as Triton's queue delay: a request that arrives to an idle batcher (nothing
queued, no batch running) runs at once, with whatever else is queued by the time the worker takes it.
One that arrives while others wait or a batch runs waits for company: up to ``max_delay_ms`` after
it arrived, or until ``max_batch`` samples are queued, whichever comes first.

A request whose future is cancelled before its batch runs (its client went away or its deadline
passed) leaves the queue without running: it takes no rows of any batch, and ``dropped_samples``
counts it.

Requests may have different sequence lengths: they are right-padded to the longest and the
padding is masked through the graph's ``attention_mask``, so each answer equals an unbatched
run; outputs are cut back to each request's own length. Every request gets exactly one answer:
its outputs or the exception of its batch. N requests in, N answers out.

A request of more than ``max_batch`` samples runs as chunks of ``max_batch`` (queued together,
answered together), so the memory one execution takes is bounded by ``max_batch`` whatever the
request size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.queueing import QueueFullError, QueueWorker, resolve_future
from ldlm.serve.runtime.tracing import BatchMarks

BatchObserver = Callable[[int, float, float], None]  # (batch size, queue seconds of the oldest, compute seconds)
DropObserver = Callable[[int], None]  # samples of a cancelled request dropped before they ran
TRIM_AFTER_BYTES = 1 << 22  # a batch whose inputs exceed this is followed by giving freed memory back


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim; None where the C library has none (musl, macOS) or cannot be found."""
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None


_malloc_trim = _find_malloc_trim()


def release_freed_memory() -> None:
    """Hand freed heap back to the OS (glibc keeps it per thread arena: after a large batch, the
    process would otherwise stay at its peak). The batcher calls this after each large batch, its
    one caller; a no-op where malloc_trim does not exist."""
    if _malloc_trim is not None:
        _malloc_trim(0)


@dataclass
class _Pending:
    inputs: dict[str, np.ndarray]
    batch: int
    length: int | None
    future: Future[dict[str, np.ndarray]] = field(default_factory=Future)
    queued_at: float = field(default_factory=time.perf_counter)
    alone: bool = False  # arrived to an idle batcher: runs without waiting for company
    trace: BatchMarks | None = None  # a traced request's marks (tracing.py; None: not traced)


class DynamicBatcher(QueueWorker):
    def __init__(
        self,
        backend: GraphBackend,
        max_batch: int = 16,
        max_delay_ms: float = 2.0,
        max_queue: int = 256,
        observer: BatchObserver | None = None,
        on_drop: DropObserver | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} is out of range; allowed: >= 1")
        if max_delay_ms < 0:
            raise ValueError(f"max_delay_ms={max_delay_ms} is out of range; allowed: >= 0")
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} is out of range; allowed: >= 1")
        self.backend = backend
        self.max_batch = max_batch
        self.max_delay_s = max_delay_ms / 1000
        self.max_queue = max_queue
        self.observer = observer
        self.on_drop = on_drop
        self.dropped_samples = 0
        self._queue: deque[_Pending] = deque()
        self._running = False  # a batch is executing (under _cond)
        seq_axes = {s["name"]: s["shape"].index("seq") for s in backend.inputs if "seq" in s["shape"]}
        self._seq_axes = seq_axes
        self._out_seq_axes = {o["name"]: o["shape"].index("seq") for o in backend.outputs if "seq" in o["shape"]}
        super().__init__(f"ldlm-batcher-{backend.graph}")

    def submit(self, inputs: Mapping[str, Any], trace: BatchMarks | None = None) -> Future[dict[str, np.ndarray]]:
        """Check ``inputs`` against the graph's contract (raises at once) and queue them; ``trace``: marks to set as
        their batch leaves the queue, is assembled and runs (a chunked request's: its last chunk's)."""
        arrays = self.backend.check_inputs(inputs)
        first = arrays[self.backend.input_names[0]]
        lengths = {a.shape[self._seq_axes[n]] for n, a in arrays.items() if n in self._seq_axes}
        length = lengths.pop() if lengths else None
        batch = int(first.shape[0])
        chunks = [
            _Pending({n: a[i : i + self.max_batch] for n, a in arrays.items()}, min(self.max_batch, batch - i), length)
            for i in range(0, batch, self.max_batch)
        ]
        with self._cond:
            self._check_open(f"the {self.backend.graph} batcher")
            if len(self._queue) + len(chunks) > self.max_queue:
                raise QueueFullError(f"{self.backend.graph} queue is full ({len(self._queue)} requests waiting, max {self.max_queue})")
            alone = not self._queue and not self._running
            for chunk in chunks:
                chunk.alone, chunk.trace = alone, trace
            self._queue.extend(chunks)
            self._cond.notify()
        for chunk in chunks:  # a cancelled request wakes the worker, which drops it (and stops waiting for it)
            chunk.future.add_done_callback(self._on_done)
        return chunks[0].future if len(chunks) == 1 else _joined([c.future for c in chunks])

    def run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Submit and wait: the GraphBackend.run signature, so a batcher can stand in for its graph."""
        return self.submit(inputs).result()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _on_done(self, future: Future[dict[str, np.ndarray]]) -> None:
        if future.cancelled():
            with self._cond:
                self._cond.notify()

    def _loop(self) -> None:
        with self.backend.worker_context():  # e.g. a CUDA stream of its own (GraphBackend.worker_context)
            self._serve()

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._running = False
                self._drop_cancelled()
                while not self._queue and not self._stopping:
                    self._cond.wait()
                    self._drop_cancelled()
                if not self._queue and self._stopping:
                    return
                first = self._queue[0]
                deadline = first.queued_at + (0.0 if first.alone else self.max_delay_s)
                while not self._stopping and self._size() < self.max_batch and (left := deadline - time.perf_counter()) > 0:
                    self._cond.wait(left)
                    self._drop_cancelled()
                    if not self._queue:
                        break
                batch = self._take()
                self._running = bool(batch)
            if batch:
                self._run(batch)

    def _drop_cancelled(self) -> None:
        """Take every request whose future is already done (cancelled) out of the queue, unrun."""
        if not any(p.future.done() for p in self._queue):
            return
        dropped = [p for p in self._queue if p.future.done()]
        self._queue = deque(p for p in self._queue if not p.future.done())
        samples = sum(p.batch for p in dropped)
        self.dropped_samples += samples
        if self.on_drop is not None:
            self.on_drop(samples)

    def _size(self) -> int:
        return sum(p.batch for p in self._queue)

    def _take(self) -> list[_Pending]:
        self._drop_cancelled()  # one last look: a request cancelled while the batch filled takes no rows
        batch: list[_Pending] = []
        size = 0
        while self._queue and (not batch or size + self._queue[0].batch <= self.max_batch):
            pending = self._queue.popleft()
            batch.append(pending)
            size += pending.batch
        return batch

    def _run(self, batch: list[_Pending]) -> None:
        started = time.perf_counter()
        try:
            inputs = self._concatenate(batch)
            assembled = time.perf_counter()
            outputs = self.backend.run(inputs)
            computed = time.perf_counter() - started
            offset = 0
            for pending in batch:
                rows = slice(offset, offset + pending.batch)
                offset += pending.batch
                if pending.trace is not None:
                    pending.trace.ran(started, assembled, started + computed, sum(p.batch for p in batch))  # before its answer
                resolve_future(pending.future, {name: self._cut(name, value[rows], pending.length) for name, value in outputs.items()})
            if self.observer is not None:
                self.observer(offset, started - batch[0].queued_at, computed)
        except Exception as error:  # the batch's requests all get the error; the worker lives on
            for pending in batch:
                resolve_future(pending.future, error=error)
        if sum(a.nbytes for p in batch for a in p.inputs.values()) > TRIM_AFTER_BYTES:
            release_freed_memory()

    def _concatenate(self, batch: list[_Pending]) -> dict[str, np.ndarray]:
        if len(batch) == 1 and all(a.flags.writeable for a in batch[0].inputs.values()):
            # a batch of one needs no padding: its own arrays, uncopied. A read-only one (a view of a
            # request's bytes) is copied below: torch.from_numpy warns on it, and a graph may write its inputs.
            return batch[0].inputs
        longest = max((p.length or 0) for p in batch)
        merged = {}
        for name in self.backend.input_names:
            parts = []
            for pending in batch:
                array = pending.inputs[name]
                axis = self._seq_axes.get(name)
                if axis is not None and array.shape[axis] < longest:
                    widths = [(0, 0)] * array.ndim
                    widths[axis] = (0, longest - array.shape[axis])
                    array = np.pad(array, widths)  # zeros: masked padding (attention_mask 0, ids 0)
                parts.append(array)
            merged[name] = np.concatenate(parts, axis=0)
        return merged

    def _cut(self, name: str, value: np.ndarray, length: int | None) -> np.ndarray:
        axis = self._out_seq_axes.get(name)
        if axis is None or length is None:
            return value
        index = [slice(None)] * value.ndim
        index[axis] = slice(0, length)
        return value[tuple(index)]


def _joined(parts: list[Future[dict[str, np.ndarray]]]) -> Future[dict[str, np.ndarray]]:
    """One future for a chunked request: the chunks' outputs concatenated, or the first error."""
    joined: Future[dict[str, np.ndarray]] = Future()
    left = [len(parts)]
    lock = threading.Lock()

    def done(_: Future[dict[str, np.ndarray]]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            results = [part.result() for part in parts]
        except BaseException as error:  # noqa: BLE001 (a cancelled chunk, or its batch's error)
            resolve_future(joined, error=error if isinstance(error, Exception) else RuntimeError(str(error)))
            return
        resolve_future(joined, {name: np.concatenate([r[name] for r in results], axis=0) for name in results[0]})

    for part in parts:
        part.add_done_callback(done)
    joined.add_done_callback(lambda f: [part.cancel() for part in parts] if f.cancelled() else None)
    return joined
