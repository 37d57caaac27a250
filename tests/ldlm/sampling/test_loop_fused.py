"""``SlotTable.step_fused`` (the denoiser inside the step callable) against ``step`` (the denoiser called
first): the same persistent state, bit for bit, for every sampler; the rows it refuses (mixed samplers,
prompt guidance), naming why; and a slot freed mid-run (a cancelled sample) handing none of its noise on. The compiled backend's captured steps are checked in
tests/serve/runtime/test_torch_backends_fused.py."""

from __future__ import annotations

import pytest
import torch

from ldlm.model.config import SAMPLERS, preset
from ldlm.sampling import GenerateRequest, SamplingEngine, SamplingPlan, resolve
from ldlm.sampling.loop import fused_step
from ldlm.sampling.schedule import TangentSchedule

CONFIG = preset("tiny")
SCHEDULE = TangentSchedule()
WEIGHT = torch.randn(CONFIG.d_model, CONFIG.d_model, generator=torch.Generator().manual_seed(0)) / 8


def denoise(x_t, t, x0_prev, mask):  # position-wise, so padding cannot leak into real rows
    mask = torch.ones(x_t.shape[:2], dtype=torch.bool) if mask is None else mask  # None: no padding
    return torch.tanh(x_t @ WEIGHT + 0.5 * x0_prev + t[:, None, None]) * mask[..., None]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_step_fused_equals_step(sampler: str) -> None:
    engines = SamplingEngine(SCHEDULE), SamplingEngine(SCHEDULE)
    tables = [engine.table(16) for engine in engines]
    plans = [resolve(GenerateRequest(n=2, length=n, steps=5, seed=n, sampler=sampler), CONFIG) for n in (9, 6)]
    lives = [e.start(plans[0], CONFIG.d_model) for e in engines]
    for k in range(7):
        if k == 2:  # a second request joins: its samples have no past while the first's do
            for engine, live in zip(engines, lives):
                live += engine.start(plans[1], CONFIG.d_model)
        for table, live in zip(tables, lives):
            table.run([s for s in live if not s.done])
        tables[0].step(denoise)
        tables[1].step_fused(fused_step(denoise))
        for name, value in tables[0].state.items():  # every slot's every tensor: the same admission order, the same slots
            torch.testing.assert_close(value, tables[1].state[name], rtol=0, atol=0, equal_nan=True, msg=f"{sampler} {name} at step {k}")
        assert [s.step for s in lives[0]] == [s.step for s in lives[1]]
    assert all(s.done for live in lives for s in live)
    for a, b in zip(*lives):
        assert torch.equal(engines[0].latent(a), engines[1].latent(b))


def test_mixed_samplers_and_guided_prompts_are_not_fused() -> None:
    engine = SamplingEngine(SCHEDULE)
    ddim = engine.start(resolve(GenerateRequest(n=1, length=6, steps=3, sampler="ddim"), CONFIG), CONFIG.d_model)
    sde = engine.start(resolve(GenerateRequest(n=1, length=6, steps=3, sampler="sde"), CONFIG), CONFIG.d_model)
    table = engine.table(8)
    table.run(ddim + sde)
    assert not table.fusable()
    with pytest.raises(ValueError, match=r"one sampler and no prompt-guided rows; these rows have samplers \['ddim', 'sde'\] and 0 guided"):
        table.step_fused(fused_step(denoise))
    prompt = torch.zeros(2, CONFIG.d_model)
    guided = engine.start(
        resolve(GenerateRequest(n=1, length=6, steps=3, sampler="ddim", prompt_strength=2.0), CONFIG), CONFIG.d_model, prompt
    )
    table.run(guided)
    assert not table.fusable()
    table.run(ddim)
    assert table.fusable()


def test_a_failed_fused_step_changes_no_sample_not_even_its_noise() -> None:
    """A prompted sde sample whose fused step raised, then stepped unfused: the state of a run that never failed.
    Both its streams (the sde noise and the prompt's forward noise) give the failed step's draws to the retry."""
    prompt = torch.randn(3, CONFIG.d_model, generator=torch.Generator().manual_seed(4))
    plan = resolve(GenerateRequest(n=2, length=7, steps=4, seed=8, sampler="sde"), CONFIG)
    engines = SamplingEngine(SCHEDULE), SamplingEngine(SCHEDULE)
    tables, lives = [e.table(8) for e in engines], [e.start(plan, CONFIG.d_model, prompt) for e in engines]
    for table, live in zip(tables, lives):
        table.run(live)

    def failing(sampler, schedule, inputs):  # type: ignore[no-untyped-def]
        raise RuntimeError("capture refused")

    with pytest.raises(RuntimeError, match="capture refused"):
        tables[1].step_fused(failing)
    while tables[0].running:
        tables[0].step(denoise)
        tables[1].step(denoise)
    for a, b in zip(*lives):
        assert torch.equal(engines[0].latent(a), engines[1].latent(b))


def mixing(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
    """``denoise`` with every position seeing the mean of its row's real ones, as attention would: a prompt's forward
    noise then reaches the continuation, which a position-wise denoiser never lets it."""
    real = torch.ones(x_t.shape[:2], dtype=torch.bool) if mask is None else mask
    context = (x_t * real[..., None]).sum(1, keepdim=True) / real.sum(1)[:, None, None]
    return denoise(x_t + context, t, x0_prev, mask)


def alone(plan: SamplingPlan, prompt: torch.Tensor) -> torch.Tensor:
    """The latent of ``plan``'s one sample stepped in a table of its own."""
    engine = SamplingEngine(SCHEDULE)
    table, (sample,) = engine.table(8), engine.start(plan, CONFIG.d_model, prompt)
    table.run([sample])
    while table.running:
        table.step(mixing)
    return engine.latent(sample)


@pytest.mark.parametrize("failed", [False, True], ids=["after-a-step", "after-a-failed-fused-step"])
def test_a_slot_freed_by_a_cancelled_sample_gives_the_next_one_its_own_noise(failed: bool) -> None:
    """A prompted sde sample cancelled (released) while it runs; a new one admitted into its slot draws its own sde
    and prompt noise from its first step: the latent it gets alone. After a fused step that raised, the slot's held
    draws were the cancelled sample's: only the sample that stays takes its own back."""
    prompt = torch.randn(3, CONFIG.d_model, generator=torch.Generator().manual_seed(4))
    plans = [resolve(GenerateRequest(n=1, length=7, steps=4, seed=seed, sampler="sde"), CONFIG) for seed in (1, 2, 3)]
    engine = SamplingEngine(SCHEDULE)
    table = engine.table(8)
    stays, cancelled, late = (engine.start(plan, CONFIG.d_model, prompt)[0] for plan in plans)
    table.run([stays, cancelled])
    table.step(mixing)

    def failing(sampler, schedule, inputs):  # type: ignore[no-untyped-def]
        raise RuntimeError("capture refused")

    if failed:
        with pytest.raises(RuntimeError, match="capture refused"):
            table.step_fused(failing)
    freed = cancelled.slot
    table.release([cancelled])
    table.run([stays, late])
    assert late.slot == freed  # the freed slot is the one reused
    while table.running:
        table.step_fused(fused_step(mixing))
    assert torch.equal(engine.latent(late), alone(plans[2], prompt)), "the sample in the freed slot did not draw its own noise"
    assert torch.equal(engine.latent(stays), alone(plans[0], prompt)), "the sample that stayed did not get its own draws back"
