"""Delivery's edges: rows gathered across persistent batches come back in the callers' order; a preview carries
its own token ids; every preview dropped and every second of a call is counted; closing waits for what was
queued; a request is decoded by argmax or from logits as its settings say, after its previews, and a failed
decode answers that request with its error."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ldlm.pipeline import TextResult
from ldlm.sampling import NoiseStream, SamplingEngine
from ldlm.sampling.samplers import get_sampler
from ldlm.sampling.schedule import TangentSchedule, time_grid
from ldlm.sampling.tokens import TokenSampling
from ldlm.serve.runtime import delivery as delivery_module
from ldlm.serve.runtime.delivery import Delivery, PreviewDecodes, PreviewShares, ragged_batch, slot_rows
from ldlm.serve.runtime.generation import Generation, Preview, Sample
from ldlm.serve.runtime.tracing import GenerationMarks
from tests.serve.runtime.test_delivery_previews import Clock, FakeDecoder, due_sample

D = 3  # latent width of the hand-made states


def test_rows_from_two_tables_come_back_in_the_callers_order() -> None:
    """States of two lengths (two tables), interleaved: each row is its own state's x0_hat, padded to the longest."""
    engine = SamplingEngine(TangentSchedule())
    states = [
        engine.state(get_sampler("ddim"), time_grid(3, 0.1), NoiseStream(i, (length, D)), torch.zeros(length, D))
        for i, length in enumerate((4, 6, 4, 6))
    ]
    engine.table(4).run(states[0::2])
    engine.table(6).run(states[1::2])
    for i, state in enumerate(states):
        state.table.state["x0_hat"][state.slot] = 10.0 * (i + 1)  # type: ignore[union-attr]
    order = [states[1], states[0], states[3], states[2]]  # a table's own order differs from this one
    rows, mask = slot_rows(order, "x0_hat")
    assert rows.shape == (4, 6, D)
    for row, state, length in zip(rows, order, (6, 4, 6, 4)):
        value = 10.0 * (states.index(state) + 1)
        assert torch.equal(row[:length], torch.full((length, D), value)) and not row[length:].any()
    assert mask.tolist() == [[True] * 6, [True] * 4 + [False] * 2, [True] * 6, [True] * 4 + [False] * 2]


class IdsDecoder:
    """Decodes row r to token ids 100 r + position, cut to ``lengths``; ``seconds`` on the clock per call."""

    def __init__(self, clock: Clock, seconds: float, lengths: list[int]) -> None:
        self.clock, self.seconds, self.lengths = clock, seconds, lengths
        self.gate = threading.Event()
        self.gate.set()

    def decode(self, latents: torch.Tensor, mask: torch.Tensor) -> TextResult:
        assert self.gate.wait(60)
        self.clock.now += self.seconds
        rows, width = latents.shape[:2]
        ids = 100 * torch.arange(rows)[:, None] + torch.arange(width)[None]
        return TextResult(ids, [f"text {r}" for r in range(rows)], self.lengths[:rows])


def test_a_preview_carries_its_rows_token_ids_cut_to_its_length(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(delivery_module.time, "perf_counter", clock)
    seen: list[tuple[int, int, float]] = []
    decodes = PreviewDecodes(IdsDecoder(clock, 1.5, [2, 3]), observer=lambda *counts: seen.append(counts))  # type: ignore[arg-type]
    got: list[Preview] = []
    try:
        decodes.step([due_sample(1, got.extend), due_sample(1, got.extend)], alone=True)
        decodes.wait()
    finally:
        decodes.close()
    assert [(p.token_ids, p.text) for p in got] == [([0, 1], "text 0"), ([100, 101, 102], "text 1")]
    assert seen == [(2, 0, 1.5)]  # the call's own seconds, from the clock it read


def test_every_request_answered_during_a_call_counts_its_previews_dropped() -> None:
    seen: list[tuple[int, int, float]] = []
    decoder = FakeDecoder(Clock(), 0.0)
    decodes = PreviewDecodes(decoder, observer=lambda *counts: seen.append(counts))  # type: ignore[arg-type]
    got: list[int] = []
    try:
        samples = [due_sample(2, lambda previews: got.extend(p.step for p in previews)) for _ in range(3)]
        decoder.gate.clear()
        decodes.step(samples, alone=True)
        samples[0].request.future.cancel()
        samples[2].request.future.cancel()
        decoder.gate.set()
        decodes.wait()
    finally:
        decodes.close()
    assert got == [2] and [counts[:2] for counts in seen] == [(1, 2)]


def test_closing_the_previews_waits_for_the_call_under_way() -> None:
    decoder = FakeDecoder(Clock(), 0.0)
    decodes = PreviewDecodes(decoder)  # type: ignore[arg-type]
    got: list[int] = []
    decoder.gate.clear()
    decodes.step([due_sample(4, lambda previews: got.extend(p.step for p in previews))], alone=True)
    threading.Timer(0.3, decoder.gate.set).start()
    decodes.close()
    assert got == [4]


class FakeEngine:
    """The engine's latent of a state: the state itself stands for its latent here."""

    def latent(self, state: Any) -> Any:
        return state


class FakePipeline:
    """``decode``: argmax calls (a mask given) and sampled ones (``sampling`` given) recorded; a row's first id
    is the latent's first value; held while ``gate`` is clear; fails for latents whose value is negative."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def decode(self, latents: torch.Tensor, mask: torch.Tensor | None = None, sampling: TokenSampling | None = None) -> TextResult:
        assert self.gate.wait(60)
        if (latents < 0).any():
            raise RuntimeError("no logits output")
        self.calls.append("sampled" if sampling is not None else "argmax")
        ids = latents[..., 0].long()
        return TextResult(ids, ["t"] * latents.shape[0], [latents.shape[1]] * latents.shape[0])


def generation(value: float, decoding: TokenSampling | None, n: int = 1, length: int = 2) -> Generation:
    plan = SimpleNamespace(n=n, length=length)
    return Generation(None, plan, Future(), [None] * n, n, decoding=decoding)  # type: ignore[arg-type]


def finished(request: Generation, value: float) -> list[Sample]:
    return [Sample(request, i, torch.full((request.plan.length, D), value)) for i in range(request.plan.n)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("decoding", "how"),
    [
        (None, "argmax"),
        (TokenSampling(), "argmax"),
        (TokenSampling(top_logprobs=2), "sampled"),
        (TokenSampling(temperature=0.7), "sampled"),
    ],
)
def test_a_request_is_decoded_the_way_its_settings_need(decoding: TokenSampling | None, how: str) -> None:
    pipeline = FakePipeline()
    delivery = Delivery(FakeEngine(), pipeline)  # type: ignore[arg-type]
    request = generation(7.0, decoding, n=2)
    try:
        delivery.finish(finished(request, 7.0))
        result = request.future.result(timeout=10)
    finally:
        delivery.close()
    assert pipeline.calls == [how] and result.token_ids.tolist() == [[7, 7], [7, 7]]


def test_closing_delivery_answers_what_finished_first() -> None:
    pipeline = FakePipeline()
    delivery = Delivery(FakeEngine(), pipeline)  # type: ignore[arg-type]
    argmax, sampled = generation(3.0, None), generation(4.0, TokenSampling(temperature=0.5))
    pipeline.gate.clear()
    delivery.finish(finished(argmax, 3.0) + finished(sampled, 4.0))
    threading.Timer(0.3, pipeline.gate.set).start()
    delivery.close()
    assert argmax.future.done() and sampled.future.done()


def test_an_argmax_decode_that_fails_answers_its_requests_with_the_error() -> None:
    pipeline = FakePipeline()
    delivery = Delivery(FakeEngine(), pipeline)  # type: ignore[arg-type]
    requests = [generation(-1.0, None), generation(2.0, TokenSampling())]  # decoded together: one call fails both
    try:
        delivery.finish(finished(requests[0], -1.0) + finished(requests[1], 2.0))
        for request in requests:
            with pytest.raises(RuntimeError, match="no logits output"):
                request.future.result(timeout=10)
    finally:
        delivery.close()


def test_a_sampled_request_whose_decode_fails_gets_the_error_and_the_others_their_answers() -> None:
    pipeline = FakePipeline()
    delivery = Delivery(FakeEngine(), pipeline)  # type: ignore[arg-type]
    broken, fine = generation(-1.0, TokenSampling(temperature=0.5)), generation(5.0, TokenSampling(temperature=0.5))
    try:
        delivery.finish(finished(broken, -1.0) + finished(fine, 5.0))
        with pytest.raises(RuntimeError, match="no logits output"):
            broken.future.result(timeout=10)
        assert fine.future.result(timeout=10).token_ids.tolist() == [[5, 5]]
    finally:
        delivery.close()


def test_a_sampled_answer_comes_after_its_previews() -> None:
    """Its previews' call still runs when it finishes: the answer waits for them, on the previews' thread."""
    decoder = FakeDecoder(Clock(), 0.0)
    decodes = PreviewDecodes(decoder)  # type: ignore[arg-type]
    delivery = Delivery(FakeEngine(), FakePipeline(), decodes)  # type: ignore[arg-type]
    order: list[str] = []
    sample = due_sample(2, lambda previews: order.append("preview"))
    request = sample.request
    request.decoding, request.plan = TokenSampling(temperature=0.5), SimpleNamespace(n=1, length=2)  # type: ignore[assignment]
    request.future.add_done_callback(lambda _: order.append("answer"))
    try:
        decoder.gate.clear()
        delivery.previews([sample], alone=True)
        delivery.finish([Sample(request, 0, torch.full((2, D), 1.0))])  # type: ignore[arg-type]
        threading.Timer(0.3, decoder.gate.set).start()
        request.future.result(timeout=10)
    finally:
        decoder.gate.set()
        delivery.close()
    assert order == ["preview", "answer"]


def test_ragged_latents_are_padded_to_the_longest_with_a_boolean_mask() -> None:
    batch, mask = ragged_batch([torch.ones(3, 5), 2 * torch.ones(2, 5)])
    assert batch.shape == (2, 3, 5) and torch.equal(batch[1, 2], torch.zeros(5)) and torch.equal(batch[1, :2], 2 * torch.ones(2, 5))
    assert mask.dtype == torch.bool and mask.tolist() == [[True] * 3, [True, True, False]]


@pytest.mark.parametrize("decoding", [None, TokenSampling(temperature=0.5)])
def test_a_traced_request_is_marked_with_its_decode_and_its_plan_answered(decoding: TokenSampling | None) -> None:
    delivery = Delivery(FakeEngine(), FakePipeline())  # type: ignore[arg-type]
    request = generation(6.0, decoding)
    request.trace = GenerationMarks()
    try:
        before = time.perf_counter()
        delivery.finish(finished(request, 6.0))
        result = request.future.result(timeout=10)
        after = time.perf_counter()
    finally:
        delivery.close()
    assert before <= request.trace.decoding <= request.trace.decoded <= after
    assert result.plan is request.plan


def test_previews_without_a_share_named_are_those_of_a_request_alone() -> None:
    """``Delivery.previews`` defaults to the alone share (1 here): a preview due while a call runs is not dropped."""
    decoder = FakeDecoder(Clock(), 0.0)
    decodes = PreviewDecodes(decoder, PreviewShares(busy=0.5, alone=1.0))  # type: ignore[arg-type]
    delivery = Delivery(FakeEngine(), FakePipeline(), decodes)  # type: ignore[arg-type]
    got: list[int] = []
    try:
        decoder.gate.clear()
        delivery.previews([due_sample(1, lambda previews: got.extend(p.step for p in previews))])
        delivery.previews([due_sample(2, lambda previews: got.extend(p.step for p in previews))])  # the first call still runs
        decoder.gate.set()
        decodes.wait()
    finally:
        decoder.gate.set()
        delivery.close()
    assert got == [1, 2]
