"""A batcher's worker runs its graph inside the graph's ``worker_context``: on CUDA a stream of its own, so a
preview's decode overlaps the scheduler's denoiser steps instead of queuing behind them on the default stream.
A compiled backend's static buffers stay one user's at a time across streams, on the GPU as on the host."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ldlm.model.ldlm import LDLM
from ldlm.serve.runtime.batcher import DynamicBatcher
from ldlm.serve.runtime.torch_backends import CompiledBackend, EagerBackend, prepare_model

TIMEOUT_S = 60
NO_CUDA = "no CUDA device here"


def feed(length: int, d: int, seed: int = 0) -> dict[str, np.ndarray]:
    latents = np.random.default_rng(seed).standard_normal((1, length, d)).astype(np.float32)
    return {"latents": latents, "attention_mask": np.ones((1, length), np.int64)}


def test_the_worker_runs_every_batch_inside_the_graphs_worker_context(tiny_model: LDLM) -> None:
    backend = EagerBackend(tiny_model, "decoder")
    inside = threading.local()
    entered: list[str] = []
    runs: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def worker_context() -> Iterator[None]:
        entered.append(threading.current_thread().name)
        inside.on = True
        yield

    run = backend._run

    def recorded(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        runs.append((threading.current_thread().name, getattr(inside, "on", False)))
        return run(inputs)

    backend.worker_context = worker_context  # type: ignore[method-assign]
    backend._run = recorded  # type: ignore[method-assign]
    batcher = DynamicBatcher(backend, max_batch=2, max_delay_ms=1)
    try:
        for length in (5, 9):
            assert batcher.submit(feed(length, tiny_model.config.d_model)).result(timeout=TIMEOUT_S)["token_ids"].shape == (1, length)
    finally:
        batcher.close(timeout_s=30)
    assert len(entered) == 1 and entered[0] != threading.current_thread().name  # once, on the worker's thread
    assert runs == [(entered[0], True)] * 2


def test_a_cpu_graph_needs_no_stream(tiny_model: LDLM) -> None:
    with EagerBackend(tiny_model, "decoder").worker_context() as held:
        assert held is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{NO_CUDA}: a batcher's CUDA stream of its own was not exercised")
def test_a_batchers_graph_runs_on_a_stream_of_its_own_on_cuda(tiny_model: LDLM) -> None:
    backend = EagerBackend(prepare_model(copy.deepcopy(tiny_model), torch.device("cuda"), "fp32"), "decoder")
    streams: list[Any] = []
    run_tensors = backend.run_tensors

    def recorded(inputs: Any) -> dict[str, torch.Tensor]:
        streams.append(torch.cuda.current_stream())
        return run_tensors(inputs)

    backend.run_tensors = recorded  # type: ignore[method-assign]
    x = feed(9, tiny_model.config.d_model)
    expected = backend.run(x)["token_ids"]
    batcher = DynamicBatcher(backend, max_batch=2, max_delay_ms=1)
    try:
        np.testing.assert_array_equal(batcher.submit(x).result(timeout=TIMEOUT_S)["token_ids"], expected)
    finally:
        batcher.close(timeout_s=30)
    assert streams[0] == torch.cuda.default_stream() and streams[1] != torch.cuda.default_stream()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason=f"{NO_CUDA}: replays of one CUDA graph from two streams at once were not exercised"
)
def test_two_streams_share_a_compiled_graphs_buffers_in_turn(tiny_model: LDLM) -> None:
    """Two threads, each on a stream of its own, call one compiled decoder (CUDA graphs, shared static buffers)
    with their own inputs, many times at once: every answer is its own input's, as a call alone gives it."""
    backend = CompiledBackend(prepare_model(copy.deepcopy(tiny_model), torch.device("cuda"), "fp32"), "decoder", True)
    d = tiny_model.config.d_model
    feeds = [feed(64, d, seed) for seed in (1, 2)]
    expected = [backend.run(f)["logits"] for f in feeds]
    wrong: list[int] = []

    def calls(k: int) -> None:
        with backend.worker_context():
            for _ in range(50):
                if not np.array_equal(backend.run(feeds[k])["logits"], expected[k]):
                    wrong.append(k)

    threads = [threading.Thread(target=calls, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert wrong == []
