"""The scheduler's promises, checked against hand-counted batch schedules and single runs.

Continuous batching must admit a new sample at the very next step after a slot frees up; static
batching must wait for the whole batch. Both schedules are small enough to write out by hand.
"""

from __future__ import annotations

import pytest
import torch

from ldlm.pipeline import LDLMPipeline
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler

# Three one-sample requests of one length (one bucket): A takes 4 steps, B one, C two.
A = GenerateRequest(n=1, length=6, steps=4, seed=11, sampler="ddim")
B = GenerateRequest(n=1, length=6, steps=1, seed=12, sampler="ddim")
C = GenerateRequest(n=1, length=6, steps=2, seed=13, sampler="sde")

# max_batch=2, all three queued before the first step:
#   continuous (least work left first): [B,C] (B done) -> [C,A] (C done, A joins at once) -> [A] -> [A] -> [A]
#   static (first come first served):   [A,B] (B done) -> [A] -> [A] -> [A] (batch done) -> [C] -> [C]
EXPECTED_BATCHES = {"continuous": [2, 2, 1, 1, 1], "static": [2, 1, 1, 1, 1, 1]}


def run_schedule(pipeline: LDLMPipeline, policy: str, requests: list[GenerateRequest], max_batch: int):
    sizes: list[int] = []
    scheduler = GenerationScheduler(
        pipeline,
        max_batch=max_batch,
        policy=policy,
        start=False,  # type: ignore[arg-type]
        observer=lambda batch, queued, compute: sizes.append(batch),
    )
    try:
        futures = [scheduler.submit(r) for r in requests]
        scheduler.start()
        results = [f.result(timeout=60) for f in futures]
    finally:
        scheduler.close(timeout_s=30)
    return results, sizes, scheduler


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_batch_schedule_matches_the_hand_count(pipeline: LDLMPipeline, policy: str) -> None:
    results, sizes, scheduler = run_schedule(pipeline, policy, [A, B, C], max_batch=2)
    assert sizes == EXPECTED_BATCHES[policy]
    assert scheduler.denoiser_calls == len(EXPECTED_BATCHES[policy])
    assert scheduler.samples_stepped == 4 + 1 + 2
    for request, result in zip([A, B, C], results):  # whatever the schedule, a single run's tokens
        alone = pipeline.generate(request.n, request.length, request.steps, request.seed, request.sampler)
        assert torch.equal(result.token_ids, alone.token_ids), request


def test_each_request_gets_its_own_answer_in_a_shared_batch(pipeline: LDLMPipeline) -> None:
    """Requests with different n, lengths, steps, t_min and decode paths share denoiser calls; each
    answer equals the request's single run (per-sample rows, not a neighbour's)."""
    requests = [
        GenerateRequest(n=2, length=5, steps=3, seed=21, sampler="sde"),
        GenerateRequest(n=1, length=11, steps=2, seed=22, sampler="ddim", t_min=0.3),
        GenerateRequest(n=3, length=5, steps=2, seed=23, sampler="ddim"),
        GenerateRequest(n=2, length=5, steps=3, seed=21, sampler="sde", prior_temperature=0.5),
    ]
    results, sizes, _ = run_schedule(pipeline, "continuous", requests, max_batch=8)
    assert max(sizes) > 1
    assert not torch.equal(results[0].token_ids, results[3].token_ids)  # the same seed, a cooler prior
    for request, result in zip(requests, results):
        alone = pipeline.generate(
            request.n,
            request.length,
            request.steps,
            request.seed,
            request.sampler,
            request.t_min,
            prior_temperature=request.prior_temperature,
        )
        assert result.token_ids.shape == (request.n, request.length)
        assert torch.equal(result.token_ids, alone.token_ids), request
        assert result.texts == alone.texts


def test_a_cancelled_request_frees_its_slot_at_the_next_step(pipeline: LDLMPipeline) -> None:
    """max_batch=2; A and B run 6 steps. During the first denoiser call B is cancelled and C (one step) arrives:
    [A,B] (B cancelled, C queued) -> [A,C] (B dropped before admission: C takes its slot at once) -> [A] x 4."""
    a = GenerateRequest(n=1, length=6, steps=6, seed=31, sampler="ddim")
    b = GenerateRequest(n=1, length=6, steps=6, seed=32, sampler="ddim")
    c = GenerateRequest(n=1, length=6, steps=1, seed=33, sampler="ddim")
    sizes: list[int] = []
    futures = []
    dropped: list[int] = []

    def observe(batch: int, queued: float, compute: float) -> None:
        sizes.append(batch)
        if len(sizes) == 1:
            assert futures[1].cancel()  # the caller gives up (a client timeout, a disconnect)
            futures.append(scheduler.submit(c))

    scheduler = GenerationScheduler(pipeline, max_batch=2, start=False, observer=observe, on_drop=dropped.append)
    try:
        futures.extend(scheduler.submit(r) for r in (a, b))
        scheduler.start()
        first, third = futures[0].result(timeout=60), futures[2].result(timeout=60)
    finally:
        scheduler.close(timeout_s=30)
    assert sizes == [2, 2, 1, 1, 1, 1]
    assert scheduler.samples_stepped == 6 + 1 + 1  # B ran its one step, no more
    assert dropped == [1] and scheduler.dropped_samples == 1
    assert torch.equal(first.token_ids, pipeline.generate(1, 6, 6, 31, "ddim").token_ids)
    assert torch.equal(third.token_ids, pipeline.generate(1, 6, 1, 33, "ddim").token_ids)


def test_decode_ragged_equals_each_latent_decoded_alone(pipeline: LDLMPipeline) -> None:
    """The one pad-and-mask decode that finished requests and previews share: every row as its own run."""
    from ldlm.serve.runtime.scheduler import decode_ragged

    gen = torch.Generator().manual_seed(3)
    latents = [torch.randn(n, pipeline.config.d_model, generator=gen) for n in (3, 11, 7)]
    together = decode_ragged(pipeline, latents)
    for i, z in enumerate(latents):
        alone = pipeline.decode(z[None])
        assert together.lengths[i] == z.shape[0]
        assert torch.equal(together.token_ids[i, : z.shape[0]], alone.token_ids[0]), i
        assert together.texts[i] == alone.texts[0]
