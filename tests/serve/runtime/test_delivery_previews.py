"""Previews from the scheduler: every due preview of a step, across requests and samples, in one decoder
call; each request's hook gets them in step order, before its answer; the texts are those of an
independent DDIM run's x0_hat; and a preview is dropped exactly where serve/runtime/delivery.py says."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.sampling import NoiseStream, SamplingEngine, sample_seeds
from ldlm.sampling.samplers import ddim_step, get_sampler
from ldlm.sampling.schedule import TangentSchedule, time_grid
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
    decodes = scheduler.delivery.preview_decodes
    decodes.pipeline = SimpleNamespace(decode=lambda latents, mask: (rows.append(latents.shape[0]), pipeline.decode(latents, mask))[1])  # type: ignore[assignment]
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
    """The pipeline's decode: ``seconds`` on the clock per call, held while ``gate`` is clear; rows recorded."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        self.clock, self.seconds, self.calls = clock, seconds, []  # type: ignore[var-annotated]
        self.gate = threading.Event()
        self.gate.set()

    def decode(self, latents: torch.Tensor, mask: torch.Tensor) -> TextResult:
        assert self.gate.wait(60)
        self.clock.now += self.seconds
        self.calls.append(latents.shape[0])
        return TextResult(torch.zeros(latents.shape[:2], dtype=torch.long), ["x"] * latents.shape[0], [latents.shape[1]] * latents.shape[0])


def due_sample(step: int, hook: Any, every: int = 1) -> Sample:
    """A sample of a real persistent batch, its step counter set to ``step`` (of ``step + 1``)."""
    request = Generation(None, None, Future(), [None], 1, on_preview=hook, preview_every=every)  # type: ignore[arg-type]
    engine = SamplingEngine(TangentSchedule())
    state = engine.state(get_sampler("ddim"), time_grid(step + 1, 0.1), NoiseStream(0, (4, 2)), torch.zeros(4, 2))
    engine.table(4).run([state])
    state.table.k[state.slot] = step  # type: ignore[union-attr]
    return Sample(request, 0, state)


def test_within_a_share_previews_due_during_the_rest_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a share of 1/4 a call of 2 s is followed by 6 s in which due previews are dropped and counted,
    as are those due while a call runs; alone at the default share every one is decoded, in order."""
    clock = Clock()
    monkeypatch.setattr(delivery_module.time, "perf_counter", clock)
    decoder = FakeDecoder(clock, 2.0)
    seen: list[tuple[int, int, float]] = []
    decodes = PreviewDecodes(decoder, PreviewShares(busy=0.25), lambda *counts: seen.append(counts))  # type: ignore[arg-type]
    got: list[int] = []
    hook = lambda previews: got.extend(p.step for p in previews)  # noqa: E731
    try:
        # clock moves between steps (plus 2 s per call): call 1 ends at 102, rest until 108
        for step, at in ((1, 0.0), (2, 1.0), (3, 4.5), (4, 0.5), (5, 0.0)):
            clock.now += at
            decodes.step([due_sample(step, hook)], alone=False)
            decodes.wait()
        assert got == [1, 4] and decoder.calls == [1, 1]  # 2 (103) and 3 (107.5) rest; 4 at 108; 5 rests after it
        assert sum(dropped for _, dropped, _ in seen) == 3 and sum(sent for sent, _, _ in seen) == 2
        clock.now += 100
        decoder.gate.clear()
        decodes.step([due_sample(6, hook)], alone=False)
        decodes.step([due_sample(7, hook)], alone=False)  # call 6 still runs: dropped
        decoder.gate.set()
        decodes.wait()
        assert got == [1, 4, 6]
        for step in range(8, 12):  # alone, at the default share of 1: every preview, none dropped for time
            decodes.step([due_sample(step, hook)], alone=True)
        decodes.wait()
        assert got == [1, 4, 6, 8, 9, 10, 11] and sum(dropped for _, dropped, _ in seen) == 4
    finally:
        decodes.close()


def test_previews_of_an_answered_request_are_dropped() -> None:
    """Cancelled before its preview is due: not decoded. Cancelled while its call runs: not handed on. Both counted."""
    decoder = FakeDecoder(Clock(), 0.0)
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
        decoder.gate.clear()
        decodes.step([leaving, staying], alone=True)
        leaving.request.future.cancel()  # its client leaves while the call runs
        decoder.gate.set()
        decodes.wait()
        assert decoder.calls == [2] and got == [2]  # one row each; only the staying request's is handed on
        assert [counts[:2] for counts in seen] == [(1, 1)]  # (handed on, dropped) of the one call
    finally:
        decodes.close()


def test_an_answer_waits_for_its_previews_and_only_for_them() -> None:
    """A request that finishes while its previews are decoded is answered right after they are handed on;
    one with none pending is answered at once."""
    decoder = FakeDecoder(Clock(), 0.0)
    decodes = PreviewDecodes(decoder)  # type: ignore[arg-type]
    order: list[str] = []
    try:
        streamed, plain = due_sample(3, lambda previews: order.append("preview")), due_sample(3, None)
        decoder.gate.clear()
        decodes.step([streamed, plain], alone=True)
        decodes.after_previews(decodes.pending(streamed.request), lambda: order.append("streamed answer"))
        decodes.after_previews(decodes.pending(plain.request), lambda: order.append("plain answer"))
        assert order == ["plain answer"]  # not behind the call: its request has no preview in it
        decoder.gate.set()
        decodes.wait()
        decodes.close()  # the queued answer runs before the thread stops
        assert order == ["plain answer", "preview", "streamed answer"]
    finally:
        decoder.gate.set()
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
        decodes.wait()
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


def test_hooks_run_on_the_previews_thread_not_the_schedulers(pipeline: LDLMPipeline) -> None:
    """The steps never wait for a preview: its call and its hook run on the previews' own thread."""
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
    assert len(threads) == 2 and all(name.startswith("ldlm-previews") for name in threads), threads
