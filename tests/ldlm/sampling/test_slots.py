"""The persistent batch's promise: a step is a fixed number of tensor operations whatever the batch holds. Counted
at the dispatcher (a TorchDispatchMode sees every aten op a step runs, views included), so the counts do not
depend on the machine's load: a step of 1 sample and of 48 run the same operations, unfused and fused, for DDIM
and the default sampler. The denoiser here is a single op, so the count is the step's own host work."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ldlm.model.config import SAMPLERS, preset
from ldlm.sampling import GenerateRequest, SamplingEngine, resolve
from ldlm.sampling.loop import fused_step
from ldlm.sampling.samplers import Sampler, get_sampler
from ldlm.sampling.schedule import TangentSchedule

CONFIG = preset("tiny")


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def denoise(x_t, t, x0_prev, mask):  # one op: the step's own work is what is counted
    return x0_prev.neg()


def step_ops(sampler: str, batch: int, fused: bool, length: int) -> Counter[str]:
    """The ops of the third step of ``batch`` samples of ``length`` positions in a table of 16 (the past filled by then)."""
    engine = SamplingEngine(TangentSchedule())
    table = engine.table(16)
    table.run(engine.start(resolve(GenerateRequest(batch, length, 20, 3, sampler), CONFIG), 8))
    run = (lambda: table.step_fused(fused_step(denoise))) if fused else (lambda: table.step(denoise))
    for _ in range(2):
        run()
    with Ops() as counted:
        run()
    return counted.ops


@pytest.mark.parametrize("length", [16, 11], ids=["unpadded", "padded"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("sampler", ["ddim", CONFIG.default_sampler])
def test_a_step_runs_the_same_ops_at_batch_1_and_48(sampler: str, fused: bool, length: int) -> None:
    one, many = step_ops(sampler, 1, fused, length), step_ops(sampler, 48, fused, length)
    assert one == many, f"ops that grow with the batch: {(many - one) + (one - many)}"


def test_an_unpadded_step_passes_no_mask_so_attention_may_take_flash_kernels() -> None:
    """None where every running row fills the table's length; a mask as soon as one row is shorter, or guided."""
    engine, masks = SamplingEngine(TangentSchedule()), []

    def recording(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
        masks.append(mask)
        return x0_prev

    full = engine.start(resolve(GenerateRequest(2, 16, 9, 1, "ddim"), CONFIG), 8)
    short = engine.start(resolve(GenerateRequest(1, 12, 9, 2, "ddim"), CONFIG), 8)
    guided = engine.start(resolve(GenerateRequest(1, 16, 9, 3, "ddim", prompt_strength=2.0), CONFIG), 8, torch.zeros(3, 8))
    table = engine.table(16)
    for running in (full, full + short, full, full + guided):
        table.run(running)
        table.step(recording)
    assert masks[0] is None and masks[2] is None
    assert masks[1].tolist() == [[True] * 16] * 2 + [[True] * 12 + [False] * 4]
    assert masks[3].shape == (4, 16) and not masks[3][3, :3].any()  # the guided row's blind copy: the prompt out


@dataclass(frozen=True)
class OnTheSpot(Sampler):
    """A sampler that computes its coefficients at every step (it redefines ``step``): the reference of the table."""

    def step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().step(*args, **kwargs)

    def correct(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().correct(*args, **kwargs)


def test_coefficients_tabulated_at_admission_are_the_ones_a_step_computes() -> None:
    """Every sampler, in one mixed batch with samples joining late: the persistent batch's looked-up coefficients
    give exactly the states of samplers that compute theirs at every step (the past's lambdas gathered, the
    schedule evaluated), bit for bit."""
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(5)) / 3

    def denoise(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
        return torch.tanh(x_t @ weight + 0.5 * x0_prev + t[:, None, None])

    specs = [(name, steps, length) for steps, name in zip((3, 6, 5, 7, 4, 6), SAMPLERS) for length in (16, 9)]
    latents = []
    for tabulated in (True, False):
        engine = SamplingEngine(TangentSchedule())
        table, states = engine.table(16), []
        for seed, (name, steps, length) in enumerate(specs):
            sampler = get_sampler(name) if tabulated else OnTheSpot(**vars(get_sampler(name)))
            assert sampler.tabulated == tabulated
            plan = resolve(GenerateRequest(1, length, steps, seed, name), CONFIG)
            states += [replace(s, sampler=sampler) for s in engine.start(plan, 8)]
        for k in range(8):
            table.run([s for s in states[: 4 + 2 * k] if not s.done])  # two more join at every step
            table.step(denoise)
        while table.running:
            table.step(denoise)
        latents.append([engine.latent(s) for s in states])
    for name_steps_length, a, b in zip(specs, *latents):
        assert torch.equal(a, b), name_steps_length
