"""The OpenAI-compatible routes and the denoising-preview stream, against the real server on
127.0.0.1, through the official ``openai`` client and httpx. References are independent: the
eager pipeline, and a hand-written inpainting loop over the sampler's math."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
openai = pytest.importorskip("openai", reason="the OpenAI client under test (pip install -e .[test])")

from ldlm.pipeline import LDLMPipeline  # noqa: E402
from ldlm.sampling import NoiseStream, RequestLimits, sample_seeds  # noqa: E402
from ldlm.sampling.samplers import ddim_step  # noqa: E402
from ldlm.sampling.schedule import time_grid  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.graph_backend import BackendError  # noqa: E402
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler  # noqa: E402
from scripts.harness.traffic import sse_events  # noqa: E402
from tests.servers import RunningServer, free_port, openai_client  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def server(export_dir: Path):
    settings = ServerSettings(
        port=free_port(), max_batch=8, request_timeout_s=60, max_n=8, max_steps=2000, preview_budget=1.0
    )  # no throttling: these tests check what the previews say, not their pace
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer):
    with openai_client(server) as client:
        yield client


def complete(client, **kwargs):
    extra = {"steps": kwargs.pop("steps", STEPS), "sampler": kwargs.pop("sampler", "ddim")}
    return client.completions.create(model="ldlm", extra_body=extra, **kwargs)


def expected_choice(ids: list[int], eos: int, decode) -> tuple[str, str, int]:
    stop = eos in ids
    ids = ids[: ids.index(eos)] if stop else ids
    return decode(ids), "stop" if stop else "length", len(ids)


def test_models(client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["ldlm"] and models[0].object == "model"


def test_unconditional_completions_match_eager(client, pipeline: LDLMPipeline) -> None:
    result = complete(client, prompt="", max_tokens=10, n=3, seed=5)
    expected = pipeline.generate(3, 10, STEPS, 5, "ddim")  # the same sampler run, eager, in one batch
    eos = pipeline.config.eos_token_id
    assert [c.index for c in result.choices] == [0, 1, 2]
    used = 0
    for choice, ids in zip(result.choices, expected.token_ids.tolist()):
        text, reason, n = expected_choice(ids, eos, pipeline.tokenizer.decode)
        assert (choice.text, choice.finish_reason) == (text, reason)
        used += n
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (0, used, used)
    assert result.object == "text_completion" and result.model == "ldlm" and result.id.startswith("cmpl-")


def test_a_prior_temperature_in_extra_body_reaches_the_sampler(client, pipeline: LDLMPipeline) -> None:
    result = client.completions.create(
        model="ldlm", prompt="", max_tokens=10, n=2, seed=5, extra_body={"steps": STEPS, "sampler": "ddim", "prior_temperature": 0.5}
    )
    expected = pipeline.generate(2, 10, STEPS, 5, "ddim", prior_temperature=0.5)
    eos = pipeline.config.eos_token_id
    assert [c.text for c in result.choices] == [
        expected_choice(ids, eos, pipeline.tokenizer.decode)[0] for ids in expected.token_ids.tolist()
    ]
    assert expected.ids() != pipeline.generate(2, 10, STEPS, 5, "ddim").ids()


def test_seed_reproducible_with_ddim(client) -> None:
    first = [c.text for c in complete(client, prompt="", max_tokens=12, n=2, seed=11).choices]
    again = [c.text for c in complete(client, prompt="", max_tokens=12, n=2, seed=11).choices]
    other = [c.text for c in complete(client, prompt="", max_tokens=12, n=2, seed=12).choices]
    assert first == again and first != other


def inpainted_latents(pipeline: LDLMPipeline, prompt: str, max_tokens: int, seed: int, steps: int) -> torch.Tensor:
    """Prefix inpainting written out: at every step the prompt's positions are set to its latents
    forward-noised to that step's time, x_t = alpha_t z + sigma_t eps; then one DDIM step. The final
    latents (1, P + max_tokens, D)."""
    model, schedule = pipeline.graphs, pipeline.schedule
    prompt_ids = pipeline.tokenizer.encode([prompt])[0]
    p, length, d = len(prompt_ids), len(prompt_ids) + max_tokens, pipeline.config.d_model
    with torch.no_grad():
        z = model.encode_latents(torch.tensor([prompt_ids]), torch.ones(1, p, dtype=torch.bool))[0]
        sample_seed = sample_seeds(seed, 1)[0]
        x = NoiseStream(sample_seed, (length, d)).draw()
        prefix_noise = NoiseStream(sample_seed ^ 1, (p, d))
        x0 = torch.zeros_like(x)
        grid = time_grid(steps, pipeline.config.t_min)
        mask = torch.ones(1, length, dtype=torch.bool)
        for i in range(steps):
            t, t_next = grid[i].float(), grid[i + 1].float()
            x[:p] = schedule.alpha(t) * z + schedule.sigma(t) * prefix_noise.draw()
            x0 = model.denoise(x[None], t[None], x0[None], mask)[0]
            x = ddim_step(schedule, x[None], x0[None], t[None], t_next[None])[0]
        x[:p] = z
        return x[None]


def inpainted_reference(pipeline: LDLMPipeline, prompt: str, max_tokens: int, seed: int, steps: int) -> list[int]:
    latents = inpainted_latents(pipeline, prompt, max_tokens, seed, steps)
    with torch.no_grad():
        return pipeline.graphs.decode_tokens(latents, torch.ones(latents.shape[:2], dtype=torch.bool))[0].tolist()


def test_prompt_conditions_by_inpainting(client, pipeline: LDLMPipeline) -> None:
    prompt = "The weather today is"
    result = complete(client, prompt=prompt, max_tokens=9, seed=3, steps=6)
    ids = inpainted_reference(pipeline, prompt, 9, 3, 6)
    p = len(pipeline.tokenizer.encode([prompt])[0])
    text, reason, n = expected_choice(ids[p:], pipeline.config.eos_token_id, pipeline.tokenizer.decode)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (text, reason)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (p, n)


def test_streaming_chunks_match_plain(client) -> None:
    plain = complete(client, prompt="", max_tokens=8, n=2, seed=21)
    chunks = list(complete(client, prompt="", max_tokens=8, n=2, seed=21, stream=True, stream_options={"include_usage": True}))
    texts = {c.index: c.text for chunk in chunks for c in chunk.choices}
    assert texts == {c.index: c.text for c in plain.choices}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_errors_in_openai_shape(client, server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as error:  # 120 prompt tokens + 20 > 128
        complete(client, prompt="word " * 120, max_tokens=20)
    assert "allowed: up to 128 (the model's max_seq_len)" in error.value.message
    with pytest.raises(openai.NotFoundError, match="available: ldlm"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="n: 0 is out of range; allowed: 1..8"):
        complete(client, prompt="", n=0)
    raw = httpx.post(f"{server.url}/v1/completions", json={"model": "ldlm", "max_tokens": 500})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert raw.json()["error"]["message"] == "max_tokens: 500 is out of range; allowed: 1..128"


def test_a_chat_route_is_404_in_openai_shape_naming_completions(client) -> None:
    """A chat client pointed at this base model learns, in the shape it parses, which route to use."""
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="ldlm", messages=[{"role": "user", "content": "hi"}])
    assert error.value.status_code == 404 and error.value.body["type"] == "not_found_error"  # type: ignore[index]
    assert "not a chat model; use POST /v1/completions" in error.value.message


def test_submits_run_off_the_event_loop(client, server: RunningServer, monkeypatch) -> None:
    """Submitting draws every sample's prior noise: that work must not hold the event loop."""
    scheduler = server.service.scheduler
    threads = []

    def recording_submit(*args, **kwargs):
        threads.append(threading.current_thread())
        return GenerationScheduler.submit(scheduler, *args, **kwargs)

    monkeypatch.setattr(scheduler, "submit", recording_submit)
    body = {"n": 1, "length": 6, "steps": 2, "seed": 1, "sampler": "ddim"}
    assert httpx.post(f"{server.url}/v1/generate", json=body, timeout=60).status_code == 200
    assert httpx.post(f"{server.url}/v1/generate", json={**body, "stream": True}, timeout=60).status_code == 200
    complete(client, prompt=["", "a"], max_tokens=4, n=1, seed=3)
    assert len(threads) == 4 and server.thread not in threads  # server.thread runs the event loop


def test_a_full_queue_cancels_the_prompts_already_queued(server: RunningServer, monkeypatch) -> None:
    """Prompt 2 of 2 finds the queue full: 503, and prompt 1's queued samples are cancelled, not run for nobody."""
    scheduler = server.service.scheduler
    monkeypatch.setattr(scheduler, "limits", RequestLimits())  # the blocker runs far past the server's max_steps, on purpose
    blocker = scheduler.submit(GenerateRequest(n=8, length=8, steps=100_000, seed=0, sampler="ddim"))  # fills max_batch=8
    futures = []

    def recording_submit(*args, **kwargs):
        futures.append(GenerationScheduler.submit(scheduler, *args, **kwargs))
        return futures[-1]

    try:
        deadline = time.time() + 10
        while scheduler.queued_samples and time.time() < deadline:  # the blocker's samples are all active
            time.sleep(0.01)
        monkeypatch.setattr(scheduler, "max_queue", 4)
        monkeypatch.setattr(scheduler, "submit", recording_submit)
        body = {"model": "ldlm", "prompt": ["", ""], "max_tokens": 4, "n": 4, "steps": 2}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "server_error" and "queue is full" in response.json()["error"]["message"]
        assert len(futures) == 1 and futures[0].cancelled()
    finally:
        blocker.cancel()


def test_a_failed_generation_ends_the_stream_with_an_error_chunk_then_done(server: RunningServer, monkeypatch) -> None:
    """An error set on the request's future (after the 200 went out) is reported in-band, as generate_sse does."""
    for error, status_type in (
        (BackendError("decoder: engine lost"), "invalid_request_error"),
        (RuntimeError("engine lost"), "server_error"),
    ):

        def failing_submit(*args, error=error, **kwargs):
            future = Future()
            future.set_exception(error)
            return future

        monkeypatch.setattr(server.service.scheduler, "submit", failing_submit)
        body = {"model": "ldlm", "prompt": "", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and len(data) == 2, data
        assert json.loads(data[0]) == {"error": {"message": str(error), "type": status_type, "param": None, "code": None}}


# --- /v1/generate with stream: true: previews, then the result ----------------------------------


def x0_hat_reference(pipeline: LDLMPipeline, length: int, seed: int, steps: int, after: int) -> list[str]:
    """The x0_hat of a DDIM run after ``after`` denoiser calls, decoded: what a preview shows."""
    model, grid = pipeline.graphs, time_grid(steps, pipeline.config.t_min)
    with torch.no_grad():
        x = torch.stack([NoiseStream(s, (length, pipeline.config.d_model)).draw() for s in sample_seeds(seed, 2)])
        x0 = torch.zeros_like(x)
        mask = torch.ones(2, length, dtype=torch.bool)
        for i in range(after):
            t, t_next = grid[i].float().expand(2), grid[i + 1].float().expand(2)
            x0 = model.denoise(x, t, x0, mask)
            x = ddim_step(pipeline.schedule, x, x0, t, t_next)
    return pipeline.decode(x0).texts


def test_generate_stream_previews_then_result(server: RunningServer, pipeline: LDLMPipeline) -> None:
    # 41 steps: a preview decode (latent and token decoder, ~6 ms on the tiny model on CPU) runs beside
    # the denoiser steps, so a short run can end before its first preview is decoded; previews are
    # best effort and never hold the result back. 40 steps after the first preview leave it ample time.
    body = {"n": 2, "length": 12, "steps": 41, "seed": 4, "sampler": "ddim", "stream": True, "preview_every": 4}
    with httpx.stream("POST", f"{server.url}/v1/generate", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    kinds = [k for k, _ in events]
    assert kinds[-1] == "result" and set(kinds[:-1]) == {"preview"}
    shown = {(s["index"], s["step"]): s["text"] for k, e in events if k == "preview" for s in e["samples"]}
    # every 4 steps, not after the last (step 41); a preview the client has not been sent yet when a newer
    # one of its sample arrives is replaced by it (a slow reader never backs up the scheduler)
    assert shown and set(shown) <= {(i, step) for i in (0, 1) for step in range(4, 41, 4)}
    reference = {step: x0_hat_reference(pipeline, 12, 4, 41, step) for step in {step for _, step in shown}}
    assert all(text == reference[step][i] for (i, step), text in shown.items())
    plain = httpx.post(f"{server.url}/v1/generate", json={**body, "stream": False}, timeout=60).json()
    assert events[-1][1] == plain
    assert plain["token_ids"] == pipeline.generate(2, 12, 41, 4, "ddim").token_ids.tolist()


def test_disconnect_mid_stream_frees_the_slot(server: RunningServer) -> None:
    scheduler = server.service.scheduler
    body = {"n": 1, "length": 16, "steps": 2000, "seed": 0, "sampler": "ddim", "stream": True, "preview_every": 1}
    before = scheduler.samples_stepped
    with httpx.stream("POST", f"{server.url}/v1/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one preview seen: now walk away
    deadline = time.time() + 10
    while scheduler._active and time.time() < deadline:
        time.sleep(0.02)
    assert not scheduler._active, "the abandoned request still holds its slot"
    stepped = scheduler.samples_stepped - before
    time.sleep(0.3)
    assert scheduler.samples_stepped - before == stepped < 2000  # it stopped, long before its 2000 steps


# --- temperature, top_p and logprobs at the token decoder -------------------------------------------


def eager_logits(pipeline: LDLMPipeline, n: int, length: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """The eager run's latents and its decoder's logits (n, length, V): what the served request draws from."""
    latents = pipeline.sample_latents(n, length, STEPS, seed, "ddim")
    with torch.no_grad():
        return latents, pipeline.graphs.decode_logits(latents, torch.ones(n, length, dtype=torch.bool)).numpy()  # type: ignore[attr-defined]


def np_log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_nucleus(logits: np.ndarray, temperature: float, top_p: float) -> set[int]:
    """The tokens a draw may give at one position: the most likely ones of softmax(l / T) until top_p is reached."""
    p = np.exp(np_log_softmax(logits / temperature))
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    return {int(t) for t, b in zip(order, before) if b < top_p} | {int(order[0])}


def test_temperature_zero_or_omitted_is_todays_argmax_text(client) -> None:
    plain = [c.text for c in complete(client, prompt="", max_tokens=10, n=2, seed=5).choices]
    zero = [c.text for c in complete(client, prompt="", max_tokens=10, n=2, seed=5, temperature=0, top_p=0.5).choices]
    assert zero == plain


def test_logprobs_are_the_decoders_log_softmax_in_openais_shape(client, pipeline: LDLMPipeline) -> None:
    result = complete(client, prompt="", max_tokens=10, n=1, seed=5, logprobs=3)
    _, logits = eager_logits(pipeline, 1, 10, 5)
    reference = np_log_softmax(logits[0])  # (10, V)
    eos = pipeline.config.eos_token_id
    ids = np.argmax(logits[0], axis=-1).tolist()
    ids = ids[: ids.index(eos)] if eos in ids else ids
    choice = result.choices[0]
    lp = choice.logprobs  # parsed by the client into its Logprobs model
    assert isinstance(lp, openai.types.completion_choice.Logprobs)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.tokens == [pipeline.tokenizer.decode([i]) for i in ids]
    np.testing.assert_allclose(lp.token_logprobs, reference[np.arange(len(ids)), ids], atol=1e-3, rtol=0)
    for position, alternatives in enumerate(lp.top_logprobs):
        best = np.sort(reference[position])[::-1][:3]
        assert len(alternatives) <= 4 and sorted(alternatives.values(), reverse=True)[:3] == pytest.approx(best, abs=1e-3)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


def test_echo_with_logprobs_gives_the_prompts_tokens_their_log_probabilities(client, pipeline: LDLMPipeline) -> None:
    """With echo, the prompt's tokens come first in ``logprobs``, each with log_softmax of the decoder's
    logits at its position for the prompt's own token (not the token the decoder would pick there), then
    the completion's, with offsets into the echoed text."""
    prompt = "The weather today is"
    result = complete(client, prompt=prompt, max_tokens=6, seed=3, steps=6, echo=True, logprobs=2)
    latents = inpainted_latents(pipeline, prompt, 6, 3, 6)
    with torch.no_grad():
        logits = pipeline.graphs.decode_logits(latents, torch.ones(latents.shape[:2], dtype=torch.bool))[0].numpy()  # type: ignore[attr-defined]
    reference = np_log_softmax(logits)
    prompt_ids = pipeline.tokenizer.encode([prompt])[0]
    completion = np.argmax(logits, axis=-1).tolist()[len(prompt_ids) :]
    eos = pipeline.config.eos_token_id
    completion = completion[: completion.index(eos)] if eos in completion else completion
    ids = prompt_ids + completion
    lp, choice = result.choices[0].logprobs, result.choices[0]
    assert choice.text.startswith(prompt)
    assert lp.tokens == [pipeline.tokenizer.decode([i]) for i in ids]
    np.testing.assert_allclose(lp.token_logprobs, reference[np.arange(len(ids)), ids], atol=1e-3, rtol=0)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for position, alternatives in enumerate(lp.top_logprobs):
        assert sorted(alternatives.values(), reverse=True)[:2] == pytest.approx(np.sort(reference[position])[::-1][:2], abs=1e-3)
    # without echo: the completion's tokens only, the same values
    plain = complete(client, prompt=prompt, max_tokens=6, seed=3, steps=6, logprobs=2).choices[0].logprobs
    assert plain.tokens == lp.tokens[len(prompt_ids) :]
    np.testing.assert_allclose(plain.token_logprobs, lp.token_logprobs[len(prompt_ids) :], atol=1e-6, rtol=0)


def test_sampled_completions_draw_from_the_nucleus_seeded(client, pipeline: LDLMPipeline) -> None:
    """The served draw equals the eager one for the same seed, every drawn token lies in NumPy's nucleus of
    the eager logits, and its reported logprob is NumPy's log_softmax there."""
    from ldlm.sampling.tokens import TokenSampling

    args = {"prompt": "", "max_tokens": 10, "n": 2, "seed": 5, "temperature": 1.5, "top_p": 0.6}
    result = complete(client, **args, logprobs=1)
    latents, logits = eager_logits(pipeline, 2, 10, 5)
    drawn = pipeline.decode(latents, sampling=TokenSampling(1.5, 0.6, seed=5)).token_ids.tolist()
    argmax = np.argmax(logits, axis=-1).tolist()
    eos = pipeline.config.eos_token_id
    assert drawn != argmax  # a draw at T=1.5 from the tiny model's flat distribution is not its argmax
    for choice, ids, row, reference in zip(result.choices, drawn, logits, np_log_softmax(logits)):
        text, reason, n = expected_choice(ids, eos, pipeline.tokenizer.decode)
        assert (choice.text, choice.finish_reason) == (text, reason)
        assert all(ids[j] in np_nucleus(row[j], 1.5, 0.6) for j in range(len(ids)))
        np.testing.assert_allclose(choice.logprobs.token_logprobs, reference[np.arange(n), ids[:n]], atol=1e-3, rtol=0)
    again = complete(client, **args)
    other = complete(client, **{**args, "seed": 6})
    assert [c.text for c in again.choices] == [c.text for c in result.choices] != [c.text for c in other.choices]
    assert all(c.logprobs is None for c in again.choices)  # only asked for, never sent unasked


def test_argmax_and_sampled_requests_in_flight_together_each_get_their_own(client, pipeline: LDLMPipeline) -> None:
    """Argmax requests are decoded together, a sampled one alone: neither takes the other's settings."""
    plain = complete(client, prompt="", max_tokens=8, n=2, seed=7)
    sampled = complete(client, prompt="", max_tokens=8, n=2, seed=8, temperature=1.0)
    answers: dict[str, list[str]] = {}

    def run(name: str, **kwargs) -> None:
        answers[name] = [c.text for c in complete(client, prompt="", max_tokens=8, n=2, **kwargs).choices]

    threads = [
        threading.Thread(target=run, args=("plain",), kwargs={"seed": 7}),
        threading.Thread(target=run, args=("sampled",), kwargs={"seed": 8, "temperature": 1.0}),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == {"plain": [c.text for c in plain.choices], "sampled": [c.text for c in sampled.choices]}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": 6}, "logprobs"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_decoding_parameters_out_of_range_are_refused_in_openai_shape(client, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        complete(client, prompt="", max_tokens=4, **kwargs)
    assert raised.value.body["param"] == param and raised.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_an_export_without_logits_refuses_sampling_naming_the_fix(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from ldlm.export.onnx_export import export_graphs

    out = export_graphs(tiny_checkpoint, tmp_path / "onnx").out  # the decoder's token_ids only
    running = RunningServer(LDLMService(str(out), ServerSettings(port=free_port(), max_steps=100)))
    try:
        with openai_client(running) as client:
            assert complete(client, prompt="", max_tokens=4, seed=1, temperature=0).choices[0].finish_reason
            for kwargs, param in (({"temperature": 0.7}, "temperature"), ({"logprobs": 1}, "logprobs")):
                with pytest.raises(openai.BadRequestError, match="ldlm export --with-logits") as raised:
                    complete(client, prompt="", max_tokens=4, **kwargs)
                assert raised.value.body["param"] == param  # type: ignore[index]
    finally:
        running.stop()


def test_a_prompt_strength_in_extra_body_guides_the_completion(client, pipeline: LDLMPipeline) -> None:
    prompt = "The weather today is"
    ids = pipeline.tokenizer.encode([prompt])[0]
    extra = {"steps": STEPS, "sampler": "ddim", "prompt_strength": 2.0}
    result = client.completions.create(model="ldlm", prompt=prompt, max_tokens=9, seed=3, extra_body=extra)
    guided = pipeline.generate(1, len(ids) + 9, STEPS, 3, "ddim", prompt=ids, prompt_strength=2.0).token_ids[0, len(ids) :].tolist()
    text, reason, _ = expected_choice(guided, pipeline.config.eos_token_id, pipeline.tokenizer.decode)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (text, reason)
    assert result.model_extra["ldlm_plan"]["prompt_strength"] == 2.0
