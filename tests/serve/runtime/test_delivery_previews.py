"""Previews from the scheduler: every due preview of a step, across requests and samples, in one decoder
call; each request's hook gets them in step order, before its answer; the texts are those of an
independent DDIM run's x0_hat; and a preview is dropped exactly where serve/runtime/delivery.py says."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.samplers import ddim_step
from ldlm.sampling import NoiseStream, sample_seeds
from ldlm.schedule import time_grid
from ldlm.serve.runtime import delivery as delivery_module
from ldlm.serve.runtime.delivery import PreviewDecodes, PreviewShares
from ldlm.serve.runtime.generation import Generation, Preview, Sample
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler


def ddim_previews(pipeline: LDLMPipeline, n: int, length: int, seed: int, steps: int, after: int) -> list[str]:
    """The texts of a DDIM run's x0_hat after ``after`` denoiser calls, sample by sample: what a preview shows."""
    model, grid = pipeline.graphs, time_grid(steps, pipeline.config.t_min)
    with torch.no_grad():
        x = torch.stack([NoiseStream(s, (length, pipeline.config.d_model)).draw() for s in sample_seeds(seed, n)])
        x0 = torch.zeros_like(x)
        mask = torch.ones(n, length, dtype=torch.bool)
        for i in range(after):
            t, t_next = grid[i].float().expand(n), grid[i + 1].float().expand(n)
            x0 = model.denoise(x, t, x0, mask)  # type: ignore[attr-defined]
            x = ddim_step(pipeline.schedule, x, x0, t, t_next)
    return pipeline.decode(x0).texts


class Recorder:
    """A preview hook that records what it got, and whether its request was answered by then."""

    def __init__(self) -> None:
        self.calls: list[list[Preview]] = []
        self.future: Future[Any] | None = None
        self.after_answer = False

    def __call__(self, previews: list[Preview]) -> None:
        self.after_answer |= self.future is not None and self.future.done()
        self.calls.append(previews)


def test_one_decoder_call_per_step_for_every_request_and_sample(pipeline: LDLMPipeline) -> None:
    """Two requests (so the busy share applies: 1 here, nothing dropped for time)."""
    scheduler = GenerationScheduler(pipeline, max_batch=8, start=False, previews=PreviewShares(busy=1.0))
    rows: list[int] = []
    decode = scheduler.delivery.preview_decodes._decode
    scheduler.delivery.preview_decodes._decode = lambda latents, mask: (rows.append(latents.shape[0]), decode(latents, mask))[1]  # type: ignore[method-assign]
    specs = [
        GenerateRequest(n=2, length=6, steps=7, seed=3, sampler="ddim"),
        GenerateRequest(n=1, length=9, steps=7, seed=4, sampler="ddim"),
    ]
    hooks = [Recorder(), Recorder()]
    try:
        futures = [scheduler.submit(spec, on_preview=hook, preview_every=3) for spec, hook in zip(specs, hooks)]
        for hook, future in zip(hooks, futures):
            hook.future = future
        scheduler.start()
        results = [f.result(timeout=60) for f in futures]
    finally:
        scheduler.close()
    assert rows == [3, 3]  # steps 3 and 6 (7 is the last): both requests' samples in each call
    for spec, hook, result in zip(specs, hooks, results):
        assert [[(p.index, p.step) for p in call] for call in hook.calls] == [
            [(i, 3) for i in range(spec.n)],
            [(i, 6) for i in range(spec.n)],
        ]
        for call in hook.calls:
            assert [p.text for p in call] == ddim_previews(pipeline, spec.n, spec.length, spec.seed, spec.steps, call[0].step)
        assert not hook.after_answer and result.token_ids.shape == (spec.n, spec.length)


class Clock:
    """perf_counter for delivery.py: advanced by the fake decoder only."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeDecoder:
    """The pipeline's decode: ``seconds`` on the clock per call; rows recorded."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        self.clock, self.seconds, self.calls = clock, seconds, []  # type: ignore[var-annotated]

    def decode(self, latents: torch.Tensor, mask: torch.Tensor) -> TextResult:
        self.clock.now += self.seconds
        self.calls.append(latents.shape[0])
        return TextResult(torch.zeros(latents.shape[:2], dtype=torch.long), ["x"] * latents.shape[0], [latents.shape[1]] * latents.shape[0])


def due_sample(step: int, hook: Any, every: int = 1) -> Sample:
    request = Generation(None, None, Future(), [None], 1, on_preview=hook, preview_every=every)  # type: ignore[arg-type]
    state = type("State", (), {"done": False, "step": step, "x0_hat": torch.zeros(4, 2)})()
    return Sample(request, 0, state)  # type: ignore[arg-type]


def test_within_a_share_previews_due_during_the_rest_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a share of 1/4 a call of 2 s is followed by 6 s in which due previews are dropped and counted;
    alone at the default share every one is decoded."""
    clock = Clock()
    monkeypatch.setattr(delivery_module.time, "perf_counter", clock)
    decoder = FakeDecoder(clock, 2.0)
    seen: list[tuple[int, int, float]] = []
    decodes = PreviewDecodes(decoder, PreviewShares(busy=0.25), lambda *counts: seen.append(counts))  # type: ignore[arg-type]
    got: list[int] = []
    hook = lambda previews: got.extend(p.step for p in previews)  # noqa: E731
    try:
        for step, at in ((1, 0.0), (2, 1.0), (3, 5.9), (4, 0.2), (5, 0.0)):  # clock moves between steps (plus 2 s per call)
            clock.now += at
            decodes.step([due_sample(step, hook)], alone=False)
        decodes.collect()
        assert got == [1, 4] and decoder.calls == [1, 1]  # 2 and 3 within 6 s of call 1's end; 5 within call 4's rest
        assert sum(dropped for _, dropped, _ in seen) == 3 and sum(sent for sent, _, _ in seen) == 2
        for step in range(6, 10):  # alone, at the default share of 1: every preview, none dropped for time
            decodes.step([due_sample(step, hook)], alone=True)
        decodes.collect()
        assert got == [1, 4, 6, 7, 8, 9]
    finally:
        decodes.close()


def test_previews_of_an_answered_request_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled before its preview is due: not decoded. Cancelled while its call runs: not handed on. Both counted."""
    clock = Clock()
    decoder = FakeDecoder(clock, 0.0)
    seen: list[tuple[int, int, float]] = []
    decodes = PreviewDecodes(decoder, observer=lambda *counts: seen.append(counts))  # type: ignore[arg-type]
    got: list[int] = []
    hook = lambda previews: got.extend(p.step for p in previews)  # noqa: E731
    try:
        gone = due_sample(1, hook)
        gone.request.future.cancel()
        decodes.step([gone], alone=True)
        assert decoder.calls == []  # nothing due: no call
        leaving, staying = due_sample(2, hook), due_sample(2, hook)
        decodes.step([leaving, staying], alone=False)
        leaving.request.future.cancel()  # its client leaves while the call runs
        decodes.collect()
        assert decoder.calls == [2] and got == [2]  # one row each; only the staying request's is handed on
        assert seen[-1][:2] == (1, 1)
    finally:
        decodes.close()


def test_a_failed_call_drops_its_previews_and_the_request_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    class Failing:
        def decode(self, latents: torch.Tensor, mask: torch.Tensor) -> TextResult:
            raise RuntimeError("decoder lost")

    seen: list[tuple[int, int, float]] = []
    decodes = PreviewDecodes(Failing(), observer=lambda *counts: seen.append(counts))  # type: ignore[arg-type]
    sample = due_sample(1, lambda previews: pytest.fail("no preview was decoded"))
    try:
        decodes.step([sample], alone=True)
        decodes.collect()
    finally:
        decodes.close()
    assert seen == [(0, 1, 0.0)] and not sample.request.future.done()
    assert "decoding previews failed" in caplog.text


@pytest.mark.parametrize("field", ["busy", "alone"])
def test_preview_shares_are_in_zero_one(field: str) -> None:
    name = {"busy": "preview_budget", "alone": "preview_lone_budget"}[field]
    for bad in (0, -0.5, 1.0001):
        with pytest.raises(ValueError, match=rf"{name}={bad} is out of range; allowed: a number in \(0, 1\]"):
            PreviewShares(**{field: bad})
    assert PreviewShares(**{field: 1.0})  # the edge itself is allowed


def test_the_hook_runs_on_the_schedulers_thread_after_the_step(pipeline: LDLMPipeline) -> None:
    """Hooks must only hand previews on: they run on the scheduler's thread, never the decoder's."""
    threads: list[str] = []
    scheduler = GenerationScheduler(pipeline, max_batch=2)
    try:
        future = scheduler.submit(
            GenerateRequest(n=1, length=4, steps=3, seed=1, sampler="ddim"),
            on_preview=lambda previews: threads.append(threading.current_thread().name),
            preview_every=1,
        )
        future.result(timeout=60)
    finally:
        scheduler.close()
    assert threads == ["ldlm-generation", "ldlm-generation"]
