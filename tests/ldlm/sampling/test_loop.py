"""The sampling engine against independent references: closed forms of a one-step run, each sample
advanced alone against a batch that mixes samplers, steps and lengths, and the request resolution's
defaults and refusals written out by hand."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from ldlm.model.config import SAMPLERS, preset
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest, NoiseStream, RequestLimits, SamplingEngine, resolve, run_lockstep
from ldlm.sampling.samplers import get_sampler
from ldlm.sampling.schedule import TangentSchedule, time_grid

SCHEDULE = TangentSchedule(3.0, 0.95)
CONFIG = preset("tiny")


def constant_denoiser(value: torch.Tensor):
    """A denoiser whose x0_hat is ``value`` (L, D) for every sample at every step."""

    def denoise(x_t, t, x0_prev, mask):
        return value.expand(x_t.shape[0], -1, -1)[:, : x_t.shape[1]].clone()

    return denoise


@pytest.mark.parametrize("final", ["mean", "x0"])
def test_one_ddim_step_from_t1_decodes_the_closed_form(final: str) -> None:
    """At t = 1, alpha = 0 and sigma = 1, so eps_hat is the prior itself and one DDIM step to t_min gives
    alpha(t_min) D + sigma(t_min) x_1; decode_final="x0" gives the denoiser's D instead."""
    length, d, t_min = 5, 4, 0.3
    value = torch.randn(length, d, generator=torch.Generator().manual_seed(1))
    engine = SamplingEngine(SCHEDULE, final)  # type: ignore[arg-type]
    stream = NoiseStream(7, (length, d))
    prior = NoiseStream(7, (length, d)).draw()
    state = engine.state(get_sampler("ddim"), time_grid(1, t_min), stream, stream.draw())
    latent = run_lockstep(engine, [state], constant_denoiser(value))[0]
    alpha = 1 / math.sqrt(1 + 9 * math.tan(math.pi * t_min / 2) ** 2)
    expected = value if final == "x0" else alpha * value + math.sqrt(1 - alpha**2) * prior
    torch.testing.assert_close(latent, expected, rtol=1e-5, atol=1e-6)


def test_a_mixed_batch_advances_each_sample_as_it_would_alone() -> None:
    """Samplers, grids, step positions and lengths mixed in one advance: every sample's numbers are those of
    its own run (the reference: the same sample stepped alone), and each finishes at its own step."""
    d = 4
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(d, d, generator=gen, dtype=torch.float64) / 3

    def denoise(x_t, t, x0_prev, mask):  # position-wise, so padding cannot leak into real rows
        mask = torch.ones(x_t.shape[:2], dtype=torch.bool) if mask is None else mask  # None: no padding
        return torch.tanh(x_t @ weight + 0.5 * x0_prev + t[:, None, None]) * mask[..., None]

    # two of each multistep sampler, at other steps and lengths: each row's past is its own
    specs = [("sde", 3, 6), ("ddim", 5, 3), ("dpm2m", 4, 7), ("dpm3m", 6, 5), ("dpm3m-psc", 5, 4), ("dpm3m", 3, 2), ("dpm3m-psc", 7, 6)]
    specs += [("dpm3m-psc-unic", 6, 3), ("dpm3m-psc-unic", 4, 5)]
    assert {name for name, _, _ in specs} == set(SAMPLERS)

    def states(engine: SamplingEngine) -> list:
        out = []
        for seed, (name, steps, length) in enumerate(specs):
            stream = NoiseStream(seed, (length, d))
            grid = time_grid(steps, 0.05, get_sampler(name).grid, SCHEDULE)
            out.append(engine.state(get_sampler(name), grid, stream, stream.draw().double()))
        return out

    engine = SamplingEngine(SCHEDULE)
    alone = [run_lockstep(engine, [state], denoise)[0] for state in states(engine)]
    mixed = states(engine)
    table = engine.table(max(length for _, _, length in specs))
    table.run(mixed)
    finished_at: dict[int, int] = {}
    step = 0
    while table.running:
        for state in table.step(denoise):
            finished_at[mixed.index(state)] = step + 1
        step += 1
    assert finished_at == {i: steps for i, (_, steps, _) in enumerate(specs)}
    for i, state in enumerate(mixed):
        torch.testing.assert_close(engine.latent(state), alone[i], rtol=0, atol=0, msg=specs[i][0])


def test_samples_that_join_late_pause_and_reuse_slots_keep_their_numbers() -> None:
    """The persistent batch changed between steps: samples admitted while others run, a sample left out of some
    steps (its slot kept, it resumes where it stopped), and a newcomer in a finished sample's freed slot. Every
    latent is its run alone, bit for bit; the table never grew past what was live at once."""
    d, length = 4, 6
    weight = torch.randn(d, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64) / 3

    def denoise(x_t, t, x0_prev, mask):
        mask = torch.ones(x_t.shape[:2], dtype=torch.bool) if mask is None else mask  # None: no padding
        return torch.tanh(x_t @ weight + 0.5 * x0_prev + t[:, None, None]) * mask[..., None]

    def state(engine: SamplingEngine, seed: int, name: str, steps: int, n: int):
        stream = NoiseStream(seed, (n, d))
        return engine.state(get_sampler(name), time_grid(steps, 0.05, get_sampler(name).grid, SCHEDULE), stream, stream.draw().double())

    specs = [(0, "dpm3m-psc", 5, 6), (1, "dpm3m-psc-unic", 6, 4), (2, "sde", 4, 5), (3, "dpm2m", 5, 3), (4, "ddim", 3, 6)]
    engine = SamplingEngine(SCHEDULE)
    alone = [run_lockstep(engine, [state(engine, *spec)], denoise)[0] for spec in specs]
    samples = [state(engine, *spec) for spec in specs]
    table = engine.table(length)
    plan = {0: [0, 1], 1: [0, 1, 2], 2: [1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 3]}  # sample 0 sits out step 2
    for k in range(12):
        chosen = [samples[i] for i in plan.get(k, range(len(samples))) if not samples[i].done and (k < 5 or i != 2)]
        chosen += [samples[4]] if k >= 5 and not samples[4].done and samples[4] not in chosen else []
        if not chosen:
            break
        table.run(chosen)
        table.step(denoise)
    assert all(s.done for s in samples) and table.capacity == 8
    for i, s in enumerate(samples):
        torch.testing.assert_close(engine.latent(s), alone[i], rtol=0, atol=0, msg=specs[i][1])


def test_a_prompt_is_held_at_its_positions_and_noised_to_each_steps_time() -> None:
    """The denoiser sees the prompt's positions at alpha(t) P + sigma(t) eps (eps ~ N(0, 1): within 6
    sigma of alpha(t) P for a prompt far from zero), and the final latent holds P exactly there."""
    length, d, p = 6, 4, 2
    prefix = torch.full((p, d), 50.0)
    seen: list[tuple[float, torch.Tensor]] = []

    def denoise(x_t, t, x0_prev, mask):
        seen.append((float(t[0]), x_t[0, :p].clone()))
        return torch.zeros_like(x_t)

    engine = SamplingEngine(SCHEDULE)
    plan = resolve(GenerateRequest(1, length, 4, 3, "ddim", 0.2), CONFIG)
    states = engine.start(plan, d, prefix)
    latent = run_lockstep(engine, states, denoise)[0]
    assert torch.equal(latent[:p], prefix) and not torch.equal(latent[p:], torch.zeros(length - p, d))
    for t, x in seen[1:]:  # at t = 1 alpha is 0: the prompt is pure noise there
        alpha = SCHEDULE.alpha(torch.tensor(t)).item()
        sigma = math.sqrt(1 - alpha**2)
        assert (x - alpha * prefix).abs().max().item() <= 6 * sigma, t
    with pytest.raises(ValueError, match=re.escape(f"prefix has shape (6, {d}); allowed: (P, {d}) with P < length=6")):
        engine.start(plan, d, torch.zeros(6, d))


def test_resolve_fills_the_configs_defaults_and_the_samplers_grid() -> None:
    config = replace(CONFIG, default_steps=7, default_sampler="dpm2m", t_min=0.1)
    plan = resolve(GenerateRequest(2, 9), config)
    assert (plan.n, plan.length, plan.steps, plan.seed, plan.sampler.name, plan.t_min, plan.grid) == (2, 9, 7, 0, "dpm2m", 0.1, "power")
    torch.testing.assert_close(plan.times(SCHEDULE), time_grid(7, 0.1, "power"), rtol=0, atol=0)
    plan = resolve(GenerateRequest(1, 3, 2, 5, "ddim", 0.3, "logsnr"), config)
    assert (plan.steps, plan.seed, plan.sampler.name, plan.t_min, plan.grid) == (2, 5, "ddim", 0.3, "logsnr")


@pytest.mark.parametrize(
    ("request_", "limits", "message"),
    [
        (GenerateRequest(0, 4), RequestLimits(), "n=0 is out of range; allowed: an integer >= 1"),
        (GenerateRequest(5, 4), RequestLimits(max_n=4), "n=5 is out of range; allowed: 1..4"),
        (GenerateRequest(True, 4), RequestLimits(), "n=True is out of range"),  # type: ignore[arg-type]
        (GenerateRequest(1, 0), RequestLimits(), "length=0 is out of range; allowed: 1..128 (config max_seq_len)"),
        (GenerateRequest(1, 129), RequestLimits(), "length=129 is out of range; allowed: 1..128 (config max_seq_len)"),
        (GenerateRequest(1, 4, 0), RequestLimits(), "steps=0 is invalid; allowed: an integer >= 1"),
        (GenerateRequest(1, 4, 11), RequestLimits(max_steps=10), "steps=11 is out of range; allowed: 1..10"),
        (GenerateRequest(1, 4, sampler="euler"), RequestLimits(), f"sampler='euler' is unknown; allowed: {', '.join(SAMPLERS)}"),
        (GenerateRequest(1, 4, t_min=1.0), RequestLimits(), "t_min=1.0 is out of range; allowed: a number in (0, 1), both ends excluded"),
        (
            GenerateRequest(1, 4, t_min=float("nan")),
            RequestLimits(),
            "t_min=nan is out of range; allowed: a number in (0, 1), both ends excluded",
        ),
        (GenerateRequest(1, 4, grid="cosine"), RequestLimits(), "grid='cosine' is unknown; allowed: uniform, power, logsnr, tuned"),
        (GenerateRequest(1, 4, seed=-1), RequestLimits(), "seed=-1 is out of range; allowed: 0..9223372036854775807"),
        (GenerateRequest(1, 4, seed=2**63), RequestLimits(), "seed=9223372036854775808 is out of range; allowed: 0..9223372036854775807"),
    ],
)
def test_resolve_refuses_each_bad_setting_naming_it(request_: GenerateRequest, limits: RequestLimits, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        resolve(request_, CONFIG, limits)


def test_resolve_names_fields_as_the_caller_does() -> None:
    names = {"n": "N", "steps": "STEPS"}
    with pytest.raises(ValueError, match=re.escape("N=9 is out of range; allowed: 1..8")):
        resolve(GenerateRequest(9, 4), CONFIG, RequestLimits(max_n=8), names)
    assert resolve(GenerateRequest(8, 4, 10), CONFIG, RequestLimits(max_n=8, max_steps=10), names).n == 8  # the caps themselves pass


def test_generate_with_a_prompt_keeps_the_prompts_latents(pipeline: LDLMPipeline) -> None:
    """``LDLMPipeline.generate(prompt=...)``: the prompt's own latents sit at its positions of every sample,
    and the continuation is conditioned on them (it differs from an unprompted run of the same seed); the
    answer starts with the prompt's own tokens, as given, not with what the decoder makes of their latents."""
    prompt = pipeline.tokenizer.encode(["Once upon a time"])[0]
    prefix = pipeline.encode([prompt]).latents[0]
    prompted = pipeline.sample_latents(2, 12, 3, 4, "ddim", prefix=prefix)
    plain = pipeline.sample_latents(2, 12, 3, 4, "ddim")
    assert torch.equal(prompted[:, : len(prompt)], prefix.expand(2, -1, -1))
    assert not torch.allclose(prompted[:, len(prompt) :], plain[:, len(prompt) :])
    result = pipeline.generate(2, 12, 3, 4, "ddim", prompt="Once upon a time")
    decoded = pipeline.decode(prompted).token_ids
    assert torch.equal(result.token_ids[:, len(prompt) :], decoded[:, len(prompt) :])  # the continuation, as decoded
    assert result.token_ids[:, : len(prompt)].tolist() == [prompt, prompt] and decoded[:, : len(prompt)].tolist() != [prompt, prompt]
    assert all(text.startswith("Once upon a time") for text in result.texts), result.texts
    with pytest.raises(ValueError, match=re.escape(f"the prompt is {len(prompt)} tokens long; allowed: 1..3 tokens (fewer than length=4)")):
        pipeline.generate(1, 4, 2, prompt=prompt)
