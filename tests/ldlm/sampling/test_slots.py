"""The persistent batch's promise: a step is a fixed number of tensor operations whatever the batch holds. Counted
at the dispatcher (a TorchDispatchMode sees every aten op a step runs, views included), so the counts do not
depend on the machine's load: a step of 1 sample and of 48 run the same operations, unfused and fused, for DDIM
and the default sampler. The denoiser here is a single op, so the count is the step's own host work."""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from ldlm.model.config import preset
from ldlm.sampling import GenerateRequest, SamplingEngine, resolve
from ldlm.sampling.loop import fused_step
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


def step_ops(sampler: str, batch: int, fused: bool) -> Counter[str]:
    """The ops of the third step of ``batch`` samples of 2 lengths in one table (the past filled by then)."""
    engine = SamplingEngine(TangentSchedule())
    table = engine.table(16)
    states = []
    for length, n in ((16, (batch + 1) // 2), (11, batch // 2)):
        if n:
            states += engine.start(resolve(GenerateRequest(n, length, 20, length, sampler), CONFIG), 8)
    table.run(states)
    run = (lambda: table.step_fused(fused_step(denoise))) if fused else (lambda: table.step(denoise))
    for _ in range(2):
        run()
    with Ops() as counted:
        run()
    return counted.ops


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("sampler", ["ddim", CONFIG.default_sampler])
def test_a_step_runs_the_same_ops_at_batch_1_and_48(sampler: str, fused: bool) -> None:
    one, many = step_ops(sampler, 1, fused), step_ops(sampler, 48, fused)
    assert one == many, f"ops that grow with the batch: {(many - one) + (one - many)}"
