"""The persistent batch at the scale the service runs (up to 256 samples): a sample's tokens do not depend on how many
others share its table, at 1 sample and at and just past each of the table's growths (its first 8 slots, doubled as
often as needed: 8, 9, 16, 17, 32, 33 samples), while it grows and after it shrinks, on the unfused step and on the
fused step whose padded batch buckets write their extra rows to the table's spare row. The reference is each sample
run alone from the same seed."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from ldlm.model.config import LDLMConfig
from ldlm.model.ldlm import LDLM
from ldlm.sampling import GenerateRequest, SampleState, SamplingEngine, resolve
from ldlm.sampling.schedule import TangentSchedule
from ldlm.serve.runtime.backends import BackendGraphs
from ldlm.serve.runtime.torch_backends import CompiledBackend, FusedSteps

SCHEDULE = TangentSchedule()
LENGTH, STEPS = 8, 8  # every sample is still running when the last one arrives (at step 6), so all 33 share the table
# Running samples after each arrival: 1, then each growth's edge (the table full) and one past it. One arrives alone
# at a full table, as a request of one sample does between steps: no admission of several at once hides the edge.
RUNNING = (1, 8, 9, 16, 17, 32, 33)
SAMPLER = "dpm3m-psc"  # the default: a past and a corrector's state in every slot, all of it copied when the table grows
CAPACITY = {1: 8, 8: 8, 9: 16, 16: 16, 17: 32, 32: 32, 33: 64}  # the growth points these counts sit at and just past


def state(engine: SamplingEngine, config: LDLMConfig, seed: int) -> SampleState:
    request = GenerateRequest(n=1, length=LENGTH, steps=STEPS, seed=seed, sampler=SAMPLER)
    return engine.start(resolve(request, config), config.d_model)[0]


@pytest.fixture(scope="module")
def backend(tiny_model: LDLM) -> CompiledBackend:
    return CompiledBackend(tiny_model, "denoiser")  # static batch buckets 1, 2, 4, 8, 16, 32, 64: most steps padded


@pytest.fixture(scope="module")
def alone(backend: CompiledBackend, tiny_config: LDLMConfig) -> Tensor:
    """(33, L, D) each sample's latent run alone (a table of its own, batch 1), by seed: shared by both paths."""
    denoise, latents = BackendGraphs({"denoiser": backend}).denoise, []
    for seed in range(RUNNING[-1]):
        engine = SamplingEngine(SCHEDULE)
        table, sample = engine.table(LENGTH), state(engine, tiny_config, seed)
        table.run([sample])
        while table.running:
            table.step(denoise)
        latents.append(engine.latent(sample))
    return torch.stack(latents)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_every_sample_gets_its_alone_tokens_across_the_tables_growths(
    backend: CompiledBackend, tiny_model: LDLM, tiny_config: LDLMConfig, alone: Tensor, fused: bool
) -> None:
    """Samples arrive between steps until 33 run (the table grows 8 -> 16 -> 32 -> 64 slots), then leave in the order
    they came, so the running set shrinks back through padded buckets (25, 17, ...) while the table keeps its slots."""
    engine, step = SamplingEngine(SCHEDULE), FusedSteps(backend) if fused else None
    denoise, table = BackendGraphs({"denoiser": backend}).denoise, engine.table(LENGTH)
    samples: list[SampleState] = []
    seen = []  # (running, capacity) at each arrival
    for k in itertools.count():
        if k < len(RUNNING):
            samples += [state(engine, tiny_config, seed) for seed in range(len(samples), RUNNING[k])]
        running = [s for s in samples if not s.done]
        if not running:
            break
        table.run(running)
        if k < len(RUNNING):
            seen.append((table.running, table.capacity))
        if step is not None:
            table.step_fused(step)
        else:
            table.step(denoise)
    got = torch.stack([engine.latent(s) for s in samples])
    mask = torch.ones(got.shape[:2], dtype=torch.bool)
    with torch.inference_mode():
        tokens, tokens_alone = tiny_model.decode_tokens(got, mask), tiny_model.decode_tokens(alone, mask)
    differ = [seed for seed in range(len(samples)) if not torch.allclose(got[seed], alone[seed], rtol=1e-5, atol=1e-5)]
    assert not differ, f"samples whose latents are not their alone ones (seed = arrival order): {differ}"
    assert torch.equal(tokens, tokens_alone)
    assert seen == [(n, CAPACITY[n]) for n in RUNNING], "the counts no longer sit at the table's growth points"
