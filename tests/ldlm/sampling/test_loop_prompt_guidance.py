"""Prompt guidance (the plan's ``prompt_strength``, ldlm/sampling/loop.py) against references written out
here: the continuation's x0_hat at x0_blind + w (x0_prompted - x0_blind), the blind row masked exactly at
the prompt's positions, strength 1 adding no row, a guided sample leaving its batch neighbours as they are
alone, and ``resolve`` filling the default and refusing values outside the one range."""

from __future__ import annotations

import math
import re

import pytest
import torch

from ldlm.limits import PROMPT_STRENGTH
from ldlm.model.config import preset
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest, SamplingEngine, resolve, run_lockstep
from ldlm.sampling.schedule import TangentSchedule

SCHEDULE = TangentSchedule(3.0, 0.95)
CONFIG = preset("tiny")
LENGTH, D, P = 7, 4, 3


def prompted_or_blind(cond: float, blind: float):
    """A denoiser whose x0_hat is ``cond`` everywhere in a row that sees position 0, else ``blind``; it
    records each call's inputs."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def denoise(x_t, t, x0_prev, mask):
        mask = torch.ones(x_t.shape[:2], dtype=torch.bool) if mask is None else mask  # None: no padding
        calls.append((x_t.clone(), mask.clone()))
        value = torch.where(mask[:, :1, None], torch.tensor(cond), torch.tensor(blind))
        return value.expand(x_t.shape).clone()

    return denoise, calls


def mixing(x_t, t, x0_prev, mask):
    mask = torch.ones(x_t.shape[:2], dtype=torch.bool) if mask is None else mask  # None: no padding
    """A denoiser where every position reads the mean of the row's real positions (as attention does)."""
    weights = mask[..., None].to(x_t.dtype)
    mean = (x_t * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True)
    return torch.tanh(0.7 * x_t + 0.9 * mean + 0.3 * x0_prev + t[:, None, None]) * weights


@pytest.mark.parametrize("strength", [0.0, 0.5, 1.5, 3.0])
def test_a_guided_step_extrapolates_from_the_prompt_blind_prediction(strength: float) -> None:
    cond, blind = 2.0, -1.0
    denoise, calls = prompted_or_blind(cond, blind)
    engine = SamplingEngine(SCHEDULE, "x0")
    plan = resolve(GenerateRequest(1, LENGTH, 2, 5, "ddim", prompt_strength=strength), CONFIG)
    states = engine.start(plan, D, torch.ones(P, D))
    table = engine.table(LENGTH)
    table.run(states)
    table.step(denoise)
    x0_hat = table.rows("x0_hat", states)[0]
    ((x, mask),) = calls
    assert x.shape[0] == 2 and torch.equal(x[0], x[1])  # the sample's row, then its blind copy
    assert mask[0].tolist() == [True] * LENGTH and mask[1].tolist() == [False] * P + [True] * (LENGTH - P)
    expected = blind + strength * (cond - blind)  # written out: classifier-free guidance's extrapolation
    torch.testing.assert_close(x0_hat[P:], torch.full((LENGTH - P, D), expected))
    torch.testing.assert_close(x0_hat[:P], torch.full((P, D), cond))  # the prompt's own positions: unguided
    table.step(denoise)
    latent = engine.latent(states[0])
    torch.testing.assert_close(latent[P:], torch.full((LENGTH - P, D), expected))  # decode_final="x0": the last x0_hat
    assert torch.equal(latent[:P], torch.ones(P, D))


def test_the_guided_state_steps_from_the_guided_prediction() -> None:
    """decode_final="mean": one DDIM step from t = 1 (alpha 0) gives alpha(t_min) x0 + sigma(t_min) x_1 with the
    guided x0 at the continuation."""
    denoise, _ = prompted_or_blind(1.0, 0.0)
    engine = SamplingEngine(SCHEDULE)
    plan = resolve(GenerateRequest(1, LENGTH, 1, 5, "ddim", 0.3, prompt_strength=2.5), CONFIG)
    state = engine.start(plan, D, torch.ones(P, D))[0]
    prior = state.prior.clone()
    latent = run_lockstep(engine, [state], denoise)[0]
    alpha = 1 / math.sqrt(1 + 9 * math.tan(math.pi * 0.3 / 2) ** 2)
    torch.testing.assert_close(latent[P:], alpha * 2.5 + math.sqrt(1 - alpha**2) * prior[P:])


def test_strength_one_is_inpainting_alone_with_no_second_row() -> None:
    denoise, calls = prompted_or_blind(1.0, 0.0)
    engine = SamplingEngine(SCHEDULE)
    for strength in (None, 1.0):
        plan = resolve(GenerateRequest(2, LENGTH, 3, 5, "dpm3m-psc", prompt_strength=strength), CONFIG)
        assert plan.prompt_strength == 1.0 and plan.summary()["prompt_strength"] == 1.0
        run_lockstep(engine, engine.start(plan, D, torch.ones(P, D)), denoise)
    assert {x.shape[0] for x, _ in calls} == {2}  # two samples, two rows: no blind copy


def test_a_guided_sample_leaves_its_batch_neighbours_as_they_are_alone() -> None:
    """An unprompted, a plainly prompted and a guided sample (other samplers, lengths and steps) stepped in one
    batch: each sample's latent is that of its own run, so guidance changes no other request's tokens."""
    engine = SamplingEngine(SCHEDULE)
    prefix = torch.randn(P, D, generator=torch.Generator().manual_seed(3))
    specs = [
        (None, None, "dpm3m-psc", 9, 4),
        (prefix, 1.0, "ddim", LENGTH, 4),
        (prefix, 2.0, "dpm3m-psc", LENGTH, 4),
        (prefix, 0.5, "sde", 5, 3),
    ]

    def start(spec):
        given, strength, sampler, length, steps = spec
        plan = resolve(GenerateRequest(1, length, steps, 11, sampler, prompt_strength=strength), CONFIG)
        return engine.start(plan, D, given)[0]

    alone = [run_lockstep(engine, [start(spec)], mixing)[0] for spec in specs]
    states = [start(spec) for spec in specs]
    table, rows = engine.table(9), []

    def counting(x_t, t, x0_prev, mask):
        rows.append(x_t.shape[0])
        return mixing(x_t, t, x0_prev, mask)

    table.run(states)
    while table.running:
        table.step(counting)
    assert rows == [6, 6, 6, 4]  # each guided row twice (a blind copy), until the 3-step sde one finishes
    for state, expected, spec in zip(states, alone, specs):
        torch.testing.assert_close(engine.latent(state), expected, rtol=0, atol=1e-6, msg=str(spec[1:]))


@pytest.mark.parametrize("bad", [-0.5, 4.5, math.nan, math.inf, True, "2"])
def test_resolve_refuses_a_strength_outside_the_range_naming_both(bad: object) -> None:
    message = f"prompt_strength={bad!r} is out of range; allowed: a number in [0, 4]"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolve(GenerateRequest(1, LENGTH, prompt_strength=bad), CONFIG)  # type: ignore[arg-type]
    assert str(PROMPT_STRENGTH) == "a number in [0, 4]"
    for end in (0, 4):
        assert resolve(GenerateRequest(1, LENGTH, prompt_strength=end), CONFIG).prompt_strength == float(end)


def test_generate_guides_a_prompt_and_leaves_unprompted_tokens_alone(pipeline: LDLMPipeline) -> None:
    plain = pipeline.generate(2, 12, 3, 4, "ddim")
    assert torch.equal(pipeline.generate(2, 12, 3, 4, "ddim", prompt_strength=3.0).token_ids, plain.token_ids)
    prompt = pipeline.tokenizer.encode(["Once upon a time"])[0]
    prefix = pipeline.encode([prompt]).latents[0]
    inpainted = pipeline.sample_latents(2, 12, 3, 4, "ddim", prefix=prefix)
    guided = pipeline.sample_latents(2, 12, 3, 4, "ddim", prefix=prefix, prompt_strength=2.0)
    assert torch.equal(guided[:, : len(prompt)], inpainted[:, : len(prompt)]) and not torch.allclose(guided, inpainted)
    result = pipeline.generate(2, 12, 3, 4, "ddim", prompt=prompt, prompt_strength=2.0)
    assert result.plan is not None and result.plan.prompt_strength == 2.0
    assert torch.equal(result.token_ids[:, len(prompt) :], pipeline.decode(guided).token_ids[:, len(prompt) :])
