"""Streamed previews, counted: on an otherwise idle server, at the default settings, a stream gets every
preview it asked for (steps k, 2k, ... below its last step, each step's samples in one event, in order,
then the result); within a budget (beside other work, or alone at a lone share below 1) the previews keep
within it, dropped rather than slowing the generation. Real server on 127.0.0.1, real httpx streams."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.scheduler import GenerateRequest  # noqa: E402
from scripts.harness.traffic import sse_events  # noqa: E402
from tests.serve.api.test_server_values import metric  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

BUDGET = 0.05  # the default share of wall time that previews may take while others wait
LONE_BUDGET = 1 / 3  # a lone share below 1 (the default is 1: every preview)


def serve(export_dir: Path, **previews: float) -> RunningServer:
    settings = ServerSettings(port=free_port(), max_batch=16, request_timeout_s=120, max_n=16, max_steps=1000, **previews)  # type: ignore[arg-type]
    return RunningServer(LDLMService(str(export_dir), settings))


@pytest.fixture(scope="module")
def server(export_dir: Path):
    """The default preview settings."""
    running = serve(export_dir)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def budget_server(export_dir: Path):
    """A lone share of a third."""
    running = serve(export_dir, preview_lone_budget=LONE_BUDGET)
    yield running
    running.stop()


def stream(server: RunningServer, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", f"{server.url}/v1/generate", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return sse_events(response.iter_lines())


@pytest.mark.parametrize(
    "steps, every, expected",
    [
        (40, 5, [5, 10, 15, 20, 25, 30, 35]),  # 7 previews, then the result
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
    """Each step's samples are decoded in one call and sent as one event, steps in order."""
    events = stream(server, {"n": 3, "length": 8, "steps": 12, "seed": 5, "sampler": "ddim", "preview_every": 4})
    assert [k for k, _ in events] == ["preview", "preview", "result"]
    shown = [[(s["index"], s["step"]) for s in e["samples"]] for _, e in events[:-1]]
    assert shown == [[(0, 4), (1, 4), (2, 4)], [(0, 8), (1, 8), (2, 8)]]
    assert len(events[-1][1]["texts"]) == 3


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


def test_alone_at_a_share_previews_keep_within_it(budget_server: RunningServer) -> None:
    """Idle server, a lone share of a third: a stream asking for a preview at every step of 300 gets some,
    in order, and their decoding takes at most that share of its wall time (plus one decode)."""
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
