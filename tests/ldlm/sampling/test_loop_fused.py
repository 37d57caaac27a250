"""``SamplingEngine.advance_fused`` (the denoiser inside the step callable) against ``advance`` (the
denoiser called first): the same states, bit for bit, for every sampler; and the batches it refuses
(mixed samplers, prompt guidance), naming why. The compiled backend's captured steps are checked in
tests/serve/runtime/test_torch_backends_fused.py."""

from __future__ import annotations

import pytest
import torch

from ldlm.model.config import SAMPLERS, preset
from ldlm.sampling import GenerateRequest, SamplingEngine, resolve
from ldlm.sampling.loop import fused_step
from ldlm.sampling.schedule import TangentSchedule

CONFIG = preset("tiny")
SCHEDULE = TangentSchedule()
WEIGHT = torch.randn(CONFIG.d_model, CONFIG.d_model, generator=torch.Generator().manual_seed(0)) / 8


def denoise(x_t, t, x0_prev, mask):  # position-wise, so padding cannot leak into real rows
    return torch.tanh(x_t @ WEIGHT + 0.5 * x0_prev + t[:, None, None]) * mask[..., None]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_advance_fused_equals_advance(sampler: str) -> None:
    engines = SamplingEngine(SCHEDULE), SamplingEngine(SCHEDULE)
    plans = [resolve(GenerateRequest(n=2, length=n, steps=5, seed=n, sampler=sampler), CONFIG) for n in (9, 6)]
    lives = [[s for p in plans[:1] for s in e.start(p, CONFIG.d_model)] for e in engines]
    for k in range(7):
        if k == 2:  # a second request joins: its samples have no past while the first's do
            for engine, live in zip(engines, lives):
                live += engine.start(plans[1], CONFIG.d_model)
        plain, fused = engines[0].batch(lives[0]), engines[1].batch(lives[1])
        engines[0].advance(plain, denoise(plain.x, plain.t, plain.x0_prev, plain.mask))
        engines[1].advance_fused(fused, fused_step(denoise))
        for a, b in zip(*lives):
            assert a.step == b.step
            for x, y in zip(
                [a.x, a.x_mean, a.x0_hat, a.x0_prev, *(t for e in a.past for t in e)],
                [b.x, b.x_mean, b.x0_hat, b.x0_prev, *(t for e in b.past for t in e)],
                strict=True,
            ):
                assert torch.equal(x, y), f"{sampler} at step {k}"
            assert (a.x_prev is None) == (b.x_prev is None) and (a.x_prev is None or torch.equal(a.x_prev, b.x_prev))
        lives = [[s for s in live if not s.done] for live in lives]
    assert lives == [[], []]


def test_mixed_samplers_and_guided_prompts_are_not_fused() -> None:
    engine = SamplingEngine(SCHEDULE)
    ddim = engine.start(resolve(GenerateRequest(n=1, length=6, steps=3, sampler="ddim"), CONFIG), CONFIG.d_model)
    sde = engine.start(resolve(GenerateRequest(n=1, length=6, steps=3, sampler="sde"), CONFIG), CONFIG.d_model)
    mixed = engine.batch(ddim + sde)
    assert not engine.fusable(mixed)
    with pytest.raises(ValueError, match=r"one sampler and no prompt-guided rows; this batch has samplers \['ddim', 'sde'\] and 0 blind"):
        engine.advance_fused(mixed, fused_step(denoise))
    prompt = torch.zeros(2, CONFIG.d_model)
    guided = engine.start(
        resolve(GenerateRequest(n=1, length=6, steps=3, sampler="ddim", prompt_strength=2.0), CONFIG), CONFIG.d_model, prompt
    )
    assert not engine.fusable(engine.batch(guided)) and engine.fusable(engine.batch(ddim))
