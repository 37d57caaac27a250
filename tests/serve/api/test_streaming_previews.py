"""Streamed previews, counted: on an otherwise idle server at a lone share of 1 a stream gets every
preview it asked for (steps k, 2k, ... below its last step, in order, then the result); within a
budget (beside other work, or alone at the default lone share) the previews keep within it, skipping
rather than slowing the generation. Real server on 127.0.0.1, real httpx streams; the preview texts
are checked against the plain answer's model, not the decoder."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.pipeline import TextResult  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.api.streaming import GenerationStream, PreviewDecoder  # noqa: E402
from ldlm.serve.runtime.scheduler import GenerateRequest  # noqa: E402
from tests.serve.api.routes.test_openai import read_events  # noqa: E402
from tests.serve.api.test_server_values import metric  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

BUDGET = 0.05  # the default share of wall time that previews may take while others wait
LONE_BUDGET = 1 / 3  # the default share while a stream's own generation is the only one


def serve(export_dir: Path, lone_budget: float) -> RunningServer:
    settings = ServerSettings(
        port=free_port(),
        max_batch=16,
        request_timeout_s=120,
        max_n=16,
        max_steps=1000,
        preview_budget=BUDGET,
        preview_lone_budget=lone_budget,
    )
    return RunningServer(LDLMService(str(export_dir), settings))


@pytest.fixture(scope="module")
def server(export_dir: Path):
    """Every preview asked for, while alone (a lone share of 1)."""
    running = serve(export_dir, 1.0)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def budget_server(export_dir: Path):
    """The default lone share."""
    running = serve(export_dir, LONE_BUDGET)
    yield running
    running.stop()


def stream(server: RunningServer, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{server.url}/v1/generate", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return read_events(response)


@pytest.mark.parametrize(
    "steps, every, expected",
    [
        (40, 5, [5, 10, 15, 20, 25, 30, 35]),  # the case: 7 previews then the result
        (10, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9]),  # every step but the last
        (10, None, [5]),  # the default preview_every, 5
        (5, 5, []),  # the only multiple of 5 is the last step: the result says it
    ],
)
def test_an_idle_server_sends_every_preview(server: RunningServer, steps: int, every: int | None, expected: list[int]) -> None:
    body = {"n": 1, "length": 16, "steps": steps, "seed": 2, "sampler": "ddim", **({"preview_every": every} if every else {})}
    for _ in range(3):  # not a lucky run: three in a row
        events = stream(server, body)
        assert [k for k, _ in events] == ["preview"] * len(expected) + ["result"]
        assert [[s["step"] for s in e["samples"]] for k, e in events[:-1]] == [[step] for step in expected]
        assert all(e["steps"] == steps for _, e in events[:-1])
    plain = httpx.post(f"{server.url}/v1/generate", json=body, timeout=120).json()
    assert events[-1][1] == plain


def test_previews_of_every_sample_of_a_stream(server: RunningServer) -> None:
    events = stream(server, {"n": 3, "length": 8, "steps": 12, "seed": 5, "sampler": "ddim", "preview_every": 4})
    # a preview event holds one step's samples, those decoded together (the decoder may catch a step
    # before all its samples are offered): each (sample, step) once, steps in order
    assert [k for k, _ in events[:-1]] == ["preview"] * (len(events) - 1)
    shown = [(s["index"], s["step"]) for _, e in events[:-1] for s in e["samples"]]
    assert all(len({s["step"] for s in e["samples"]}) == 1 for _, e in events[:-1])
    assert sorted(shown) == [(i, step) for i in range(3) for step in (4, 8)] and len(shown) == 6
    assert [step for _, step in shown] == sorted(step for _, step in shown)
    assert events[-1][0] == "result" and len(events[-1][1]["texts"]) == 3


def test_beside_other_work_previews_keep_within_the_budget(server: RunningServer) -> None:
    """A long plain request runs; a stream asking for a preview at every step of 300 gets some, and
    their decoding takes at most the budget's share of the stream's wall time (plus one decode)."""
    url = server.url
    before = httpx.get(f"{url}/metrics", timeout=30).text
    # the other work: 8 samples x 1000 steps, longer than the stream's 300, and leaving it 8 slots of 16
    other = server.service.submit_generation(GenerateRequest(8, 64, 1000, 0, "ddim"))
    try:
        started = time.monotonic()
        events = stream(server, {"n": 1, "length": 16, "steps": 300, "seed": 1, "sampler": "ddim", "preview_every": 1})
        wall = time.monotonic() - started
        assert not other.done(), "the other work ended before the stream: make it longer"
    finally:
        other.cancel()
    after = httpx.get(f"{url}/metrics", timeout=30).text
    previews = [e for k, e in events if k == "preview"]
    steps = [e["samples"][0]["step"] for e in previews]
    assert events[-1][0] == "result" and steps == sorted(set(steps))  # in order, none twice
    sent = metric(after, "ldlm_previews_sent_total") - metric(before, "ldlm_previews_sent_total")
    skipped = metric(after, "ldlm_previews_skipped_total") - metric(before, "ldlm_previews_skipped_total")
    seconds = metric(after, "ldlm_preview_decode_seconds_total") - metric(before, "ldlm_preview_decode_seconds_total")
    assert skipped > 0 and len(previews) < 299, (len(previews), skipped)  # the budget held some back
    assert len(previews) <= sent and sent + skipped <= 299
    one_decode = seconds / max(sent, 1)
    assert seconds <= BUDGET * wall * 1.2 + 2 * one_decode, f"previews took {seconds:.3f} s of {wall:.2f} s"


def test_alone_at_the_default_share_previews_keep_within_it(budget_server: RunningServer) -> None:
    """Idle server, default lone share: a stream asking for a preview at every step of 300 gets some,
    newest first, and their decoding takes at most that share of its wall time (plus one decode)."""
    url = budget_server.url
    body = {"n": 1, "length": 16, "steps": 300, "seed": 1, "sampler": "ddim", "preview_every": 1}
    before = httpx.get(f"{url}/metrics", timeout=30).text
    started = time.monotonic()
    events = stream(budget_server, body)
    wall = time.monotonic() - started
    after = httpx.get(f"{url}/metrics", timeout=30).text
    steps = [e["samples"][0]["step"] for k, e in events if k == "preview"]
    assert events[-1][0] == "result" and steps == sorted(set(steps)) and steps  # in order, none twice
    sent = metric(after, "ldlm_previews_sent_total") - metric(before, "ldlm_previews_sent_total")
    skipped = metric(after, "ldlm_previews_skipped_total") - metric(before, "ldlm_previews_skipped_total")
    seconds = metric(after, "ldlm_preview_decode_seconds_total") - metric(before, "ldlm_preview_decode_seconds_total")
    assert skipped > 0 and len(steps) < 299, (len(steps), skipped)  # the share held some back
    one_decode = seconds / max(sent, 1)
    assert seconds <= LONE_BUDGET * wall * 1.2 + 2 * one_decode, f"previews took {seconds:.3f} s of {wall:.2f} s"
    plain = httpx.post(f"{url}/v1/generate", json={k: v for k, v in body.items() if k != "preview_every"}, timeout=120).json()
    assert events[-1][1] == plain


class GatedDecodes:
    """The service's pipeline for previews, each decode held until ``gate`` opens (the previews stay owed)."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline, self.gate = pipeline, threading.Event()

    def decode(self, latents: Any, mask: Any) -> Any:
        self.gate.wait(60)
        return self.pipeline.decode(latents, mask)


def test_a_stream_whose_result_is_in_does_not_hold_it_for_previews_beside_other_work(server: RunningServer) -> None:
    """Once its result is in, a stream no longer counts itself in flight: one other generation running
    is other work, so the stream owes no previews (it sends its result); alone, it owes them."""
    service = server.service
    previews, real = service.previews, service.previews.pipeline
    other = service.submit_generation(GenerateRequest(8, 64, 1000, 0, "ddim"))
    loop = asyncio.new_event_loop()  # never run: the stream is checked, not read
    gated = GatedDecodes(real)
    previews.pipeline = gated
    try:
        stream = GenerationStream(service.submit_generation, previews, GenerateRequest(1, 8, 4, 3, "ddim"), 1, loop=loop)
        stream.future.result(60)  # 4 steps beside the other's 1000: its previews of steps 1..3 are offered, none decoded
        assert not other.done(), "the other work ended before the stream: make it longer"
        assert stream._offered == 3 and stream._settled == 0
        assert not stream._previews_owed()  # the other generation waits: the result goes out now
        other.cancel()
        assert stream._previews_owed()  # nothing else in flight: its previews are worth waiting for
    finally:
        other.cancel()
        gated.gate.set()
        previews.pipeline = real
        previews.forget(stream)
        loop.close()


def test_alone_within_a_share_the_result_does_not_wait_for_previews(budget_server: RunningServer) -> None:
    """At a lone share below 1 a stream's result goes out as soon as it is in: what is not decoded by then
    is skipped (at a share of 1 it would wait for every one, as above)."""
    service = budget_server.service
    previews, real = service.previews, service.previews.pipeline
    loop = asyncio.new_event_loop()  # never run: the stream is checked, not read
    gated = GatedDecodes(real)
    previews.pipeline = gated
    try:
        stream = GenerationStream(service.submit_generation, previews, GenerateRequest(1, 8, 4, 3, "ddim"), 1, loop=loop)
        stream.future.result(60)  # alone: previews of steps 1..3 offered, none decoded (the decoder is held)
        assert stream._offered == 3 and stream._settled == 0
        assert not stream._previews_owed()
    finally:
        gated.gate.set()
        previews.pipeline = real
        previews.forget(stream)
        loop.close()


class CountingDecodes:
    """A pipeline stand-in that records the rows of each decode call, each held until ``gate`` opens."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def decode(self, latents: Any, mask: Any) -> TextResult:
        self.gate.wait(60)
        self.calls.append(latents.shape[0])
        return TextResult(torch.zeros(latents.shape[:2], dtype=torch.long), ["x"] * latents.shape[0], [latents.shape[1]] * latents.shape[0])


class FakeStream:
    """What the decoder needs of a GenerationStream: its request's future and a deliver that records the steps."""

    def __init__(self) -> None:
        self.future: Future[Any] = Future()
        self.steps: list[int] = []
        self.changed = threading.Condition()

    def deliver(self, previews: list[dict[str, Any]], skipped: int = 0) -> None:
        with self.changed:
            self.steps += [p["step"] for p in previews]
            self.changed.notify_all()

    def wait_for_previews(self, count: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.steps) >= count, 30)


def test_previews_offered_for_a_cancelled_request_are_not_decoded() -> None:
    """The step running as a client leaves still offers its previews: nobody reads them, so no decoder call."""
    pipeline = CountingDecodes()
    decoder = PreviewDecoder(pipeline, 1.0, lambda: 1)  # type: ignore[arg-type]
    try:
        gone, live = FakeStream(), FakeStream()
        gone.future.cancel()
        x0 = torch.zeros(4, 8)
        decoder.offer(gone, 0, 5, x0)  # type: ignore[arg-type]
        decoder.offer(live, 0, 5, x0)  # type: ignore[arg-type]
        assert live.wait_for_previews(1)  # offered after the gone one: any call that took the gone one is over
        assert sum(pipeline.calls) == 1 and gone.steps == []
    finally:
        decoder.close()


def test_an_idle_backlog_is_decoded_a_step_at_a_time() -> None:
    """A lone stream whose previews come faster than they decode gets every one, in order, one decoder
    call per step (a call costs per row: one call for the whole backlog would hold every preview back
    until the slowest is done, and decode a cancelled stream's backlog to the end)."""
    pipeline = CountingDecodes()
    decoder = PreviewDecoder(pipeline, BUDGET, lambda: 1, lone_budget=1.0)  # type: ignore[arg-type]  # the stream's own request only
    try:
        stream = FakeStream()
        pipeline.gate.clear()
        x0 = torch.zeros(4, 8)
        for step in (1, 2, 3, 4):  # the first call is held: the others queue behind it
            decoder.offer(stream, 0, step, x0)  # type: ignore[arg-type]
        pipeline.gate.set()
        assert stream.wait_for_previews(4)
        assert stream.steps == [1, 2, 3, 4] and pipeline.calls == [1, 1, 1, 1]
    finally:
        decoder.close()


class TimedDecodes(CountingDecodes):
    """CountingDecodes that also records when each call started and ended, and signals the first start."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[float, float]] = []
        self.started = threading.Event()

    def decode(self, latents: Any, mask: Any) -> TextResult:
        start = time.monotonic()
        self.started.set()
        result = super().decode(latents, mask)
        self.spans.append((start, time.monotonic()))
        return result


class SkipCountingStream(FakeStream):
    def __init__(self) -> None:
        super().__init__()
        self.skipped = 0

    def deliver(self, previews: list[dict[str, Any]], skipped: int = 0) -> None:
        self.skipped += skipped
        super().deliver(previews, skipped)


def test_a_lone_stream_within_its_share_rests_then_gets_the_newest_preview() -> None:
    """Alone at a share of 1/3: after a call of B seconds the decoder rests 2B; what was offered meanwhile
    is replaced by the newest (skipped, and counted), and only the newest is decoded."""
    pipeline = TimedDecodes()
    decoder = PreviewDecoder(pipeline, BUDGET, lambda: 1, lone_budget=LONE_BUDGET)  # type: ignore[arg-type]  # its own request only
    try:
        stream = SkipCountingStream()
        pipeline.gate.clear()
        x0 = torch.zeros(4, 8)
        decoder.offer(stream, 0, 1, x0)  # type: ignore[arg-type]
        assert pipeline.started.wait(30)  # the first call holds step 1
        for step in (2, 3, 4):
            decoder.offer(stream, 0, step, x0)  # type: ignore[arg-type]
        time.sleep(0.05)  # the first call lasts at least this long
        pipeline.gate.set()
        assert stream.wait_for_previews(2)
        assert stream.steps == [1, 4] and stream.skipped == 2 and pipeline.calls == [1, 1]
        (start1, end1), (start2, _) = pipeline.spans
        assert start2 - end1 >= 0.99 * (end1 - start1) * (1 - LONE_BUDGET) / LONE_BUDGET
    finally:
        decoder.close()


def test_previews_a_finished_stream_leaves_pending_count_as_skipped() -> None:
    """A result that went out without its pending previews: the metrics count them as skipped, not as nothing."""
    pipeline = TimedDecodes()
    seen: list[tuple[int, int]] = []
    decoder = PreviewDecoder(pipeline, BUDGET, lambda: 2, lambda sent, skipped, s: seen.append((sent, skipped)))  # type: ignore[arg-type]
    try:
        stream = FakeStream()
        pipeline.gate.clear()
        x0 = torch.zeros(4, 8)
        decoder.offer(stream, 0, 1, x0)  # type: ignore[arg-type]  # taken by the first call, which is held
        assert pipeline.started.wait(30)
        decoder.offer(stream, 0, 2, x0)  # type: ignore[arg-type]
        decoder.offer(stream, 0, 3, x0)  # type: ignore[arg-type]  # beside others: replaces step 2 (skipped)
        decoder.forget(stream)  # its result went out: step 3 is dropped
        assert (0, 2) in seen
    finally:
        pipeline.gate.set()
        decoder.close()
