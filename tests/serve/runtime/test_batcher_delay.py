"""When a batch starts: a request that arrives to an idle batcher runs at once, however long the
window; requests that arrive together still run as one batch; one that arrives while a batch runs
waits for company (up to the window, or a full batch). A real batcher on the tiny decoder."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from ldlm.model.ldlm import LDLM
from ldlm.serve.runtime.batcher import DynamicBatcher
from ldlm.serve.runtime.torch_backends import EagerBackend

WINDOW_MS = 600_000  # ten minutes: a request held for it would outlast every test's timeout
TIMEOUT_S = 60


def feed(length: int, d: int) -> dict[str, np.ndarray]:
    latents = np.random.default_rng(length).standard_normal((1, length, d)).astype(np.float32)
    return {"latents": latents, "attention_mask": np.ones((1, length), np.int64)}


class Gated:
    """The decoder's run, held at ``gate`` while ``hold`` is set; ``entered`` is set when a held run starts."""

    def __init__(self, backend: EagerBackend) -> None:
        self.run, self.gate, self.entered, self.hold = backend._run, threading.Event(), threading.Event(), False
        backend._run = self  # type: ignore[method-assign]

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.hold:
            self.entered.set()
            assert self.gate.wait(TIMEOUT_S)
        return self.run(inputs)


@pytest.fixture
def batcher(tiny_model: LDLM) -> Iterator[tuple[DynamicBatcher, list[int], Gated]]:
    """A batcher of up to 2 samples with a ten-minute window; the sizes of its batches; its gate."""
    backend = EagerBackend(tiny_model, "decoder")
    gated = Gated(backend)
    sizes: list[int] = []
    running = DynamicBatcher(backend, max_batch=2, max_delay_ms=WINDOW_MS, observer=lambda batch, queued, compute: sizes.append(batch))
    yield running, sizes, gated
    gated.gate.set()
    running.close(timeout_s=30)


def test_a_request_alone_runs_at_once(batcher: tuple[DynamicBatcher, list[int], Gated], tiny_model: LDLM) -> None:
    running, sizes, _ = batcher
    d = tiny_model.config.d_model
    for length in (5, 9):  # twice: the batcher is idle again after each
        got = running.submit(feed(length, d)).result(timeout=TIMEOUT_S)  # not held for the window
        assert got["token_ids"].shape == (1, length)
    assert sizes == [1, 1]


def test_requests_that_arrive_together_run_as_one_batch(batcher: tuple[DynamicBatcher, list[int], Gated], tiny_model: LDLM) -> None:
    running, sizes, _ = batcher
    d = tiny_model.config.d_model
    with running._cond:  # both queued before the worker looks at the queue
        futures = [running.submit(feed(length, d)) for length in (4, 7)]
    assert [f.result(timeout=TIMEOUT_S)["token_ids"].shape for f in futures] == [(1, 4), (1, 7)]
    assert sizes == [2]


def test_a_request_that_arrives_during_a_batch_waits_for_company(
    batcher: tuple[DynamicBatcher, list[int], Gated], tiny_model: LDLM
) -> None:
    """The first runs alone and is held; the second arrives meanwhile and, once the first is done, waits
    (its window is ten minutes) until the third fills the batch."""
    running, sizes, gated = batcher
    d = tiny_model.config.d_model
    gated.hold = True
    first = running.submit(feed(3, d))
    assert gated.entered.wait(TIMEOUT_S)  # the first is running
    second = running.submit(feed(6, d))
    gated.hold = False
    gated.gate.set()
    first.result(timeout=TIMEOUT_S)
    assert not second.done()  # not run alone: it waits for company
    third = running.submit(feed(8, d))
    assert second.result(timeout=TIMEOUT_S)["token_ids"].shape == (1, 6)
    assert third.result(timeout=TIMEOUT_S)["token_ids"].shape == (1, 8)
    assert sizes == [1, 2]
