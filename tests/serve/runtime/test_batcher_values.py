"""The dynamic batcher's promise, checked value by value: a request batched with others of other
lengths gets exactly what its own unbatched run gives (padding masked), cut to its own length."""

from __future__ import annotations

import numpy as np
import pytest

from ldlm.model.ldlm import LDLM
from ldlm.serve.runtime.batcher import DynamicBatcher
from ldlm.serve.runtime.torch_backends import EagerBackend


def feeds(graph: str, lengths: list[int], d: int) -> list[dict[str, np.ndarray]]:
    gen = np.random.default_rng(7)
    out = []
    for n in lengths:
        mask = np.ones((1, n), dtype=np.int64)
        if graph == "encoder":
            out.append({"input_ids": gen.integers(0, 50257, (1, n)), "attention_mask": mask})
        elif graph == "denoiser":
            x = gen.standard_normal((1, n, d)).astype(np.float32)
            out.append({"x_t": x, "t": np.array([0.4], np.float32), "x0_prev": 0.5 * x, "attention_mask": mask})
        else:
            out.append({"latents": gen.standard_normal((1, n, d)).astype(np.float32), "attention_mask": mask})
    return out


def run_batched(backend: EagerBackend, inputs: list[dict[str, np.ndarray]]) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """Submit every request before the worker can look at the queue (its lock held), so they arrive
    together and run as one batch; the observer records the batch sizes."""
    sizes: list[int] = []
    batcher = DynamicBatcher(
        backend, max_batch=len(inputs), max_delay_ms=60_000, observer=lambda batch, queued, compute: sizes.append(batch)
    )
    try:
        with batcher._cond:
            futures = [batcher.submit(feed) for feed in inputs]
        results = [f.result(timeout=60) for f in futures]
    finally:
        batcher.close(timeout_s=30)
    return results, sizes


@pytest.mark.parametrize("graph", ["encoder", "denoiser", "decoder"])
def test_mixed_lengths_batched_equal_single_runs(tiny_model: LDLM, graph: str) -> None:
    backend = EagerBackend(tiny_model, graph, with_logits=graph == "decoder")
    inputs = feeds(graph, [3, 12, 7], tiny_model.config.d_model)
    results, sizes = run_batched(backend, inputs)
    assert sizes == [3]  # one batch of three: the shorter ones were padded
    for feed, got in zip(inputs, results):
        alone = backend.run(feed)
        length = feed["attention_mask"].shape[1]
        assert set(got) == set(alone)
        for name, value in alone.items():
            assert got[name].shape == value.shape, name  # cut back to the request's own length
            if value.dtype.kind == "f":
                np.testing.assert_allclose(got[name], value, atol=2e-5, rtol=1e-4, err_msg=f"{graph}/{name}/L{length}")
            else:
                np.testing.assert_array_equal(got[name], value)


def test_errors_reach_every_request_and_the_worker_lives_on(tiny_model: LDLM) -> None:
    backend = EagerBackend(tiny_model, "decoder")
    calls = {"n": 0}
    real_run = backend._run

    def flaky(inputs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real_run(inputs)

    backend._run = flaky  # type: ignore[method-assign]
    inputs = feeds("decoder", [4, 6], tiny_model.config.d_model)
    batcher = DynamicBatcher(backend, max_batch=2, max_delay_ms=60_000)
    try:
        with batcher._cond:  # both arrive before the worker looks: one batch, which fails
            first = [batcher.submit(feed) for feed in inputs]
        for future in first:
            with pytest.raises(RuntimeError, match="device lost"):
                future.result(timeout=60)
        second = [batcher.submit(feed) for feed in inputs]
        for feed, future in zip(inputs, second):
            assert future.result(timeout=60)["token_ids"].shape == feed["attention_mask"].shape
    finally:
        batcher.close(timeout_s=30)


def test_n_requests_in_n_answers_out_across_batches(tiny_model: LDLM) -> None:
    """Seven requests of 1..3 samples each through max_batch 4: every sample's row comes back to
    its own request, in order (checked against single runs)."""
    backend = EagerBackend(tiny_model, "decoder")
    gen = np.random.default_rng(3)
    inputs = []
    for i in range(7):
        rows, n = 1 + i % 3, 2 + i
        inputs.append({"latents": gen.standard_normal((rows, n, 64)).astype(np.float32), "attention_mask": np.ones((rows, n), np.int64)})
    sizes: list[int] = []
    batcher = DynamicBatcher(backend, max_batch=4, max_delay_ms=0, observer=lambda b, q, c: sizes.append(b))
    try:
        futures = [batcher.submit(feed) for feed in inputs]
        results = [f.result(timeout=60) for f in futures]
    finally:
        batcher.close(timeout_s=30)
    assert sum(sizes) == sum(f["latents"].shape[0] for f in inputs) and max(sizes) <= 4
    for feed, got in zip(inputs, results):
        np.testing.assert_array_equal(got["token_ids"], backend.run(feed)["token_ids"])


def test_freed_memory_is_given_back_after_large_batches_only(tiny_model: LDLM, monkeypatch: pytest.MonkeyPatch) -> None:
    import platform

    from ldlm.serve.runtime import batcher as batcher_module

    if platform.libc_ver()[0] == "glibc":
        assert batcher_module._malloc_trim is not None, "glibc has malloc_trim; release_freed_memory would do nothing"
    trims: list[int] = []
    monkeypatch.setattr(batcher_module, "release_freed_memory", lambda: trims.append(1))
    small, large = feeds("decoder", [4, 12], tiny_model.config.d_model)
    # between the two requests' input bytes: only the larger one is followed by a trim
    monkeypatch.setattr(
        batcher_module, "TRIM_AFTER_BYTES", (sum(a.nbytes for a in small.values()) + sum(a.nbytes for a in large.values())) // 2
    )
    backend = EagerBackend(tiny_model, "decoder")
    batcher = DynamicBatcher(backend, max_batch=1, max_delay_ms=0)
    try:
        batcher.submit(small).result(timeout=60)
        assert trims == []
        batcher.submit(large).result(timeout=60)
    finally:
        batcher.close(timeout_s=30)
    assert trims == [1]
