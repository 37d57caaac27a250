"""Fused steps (the denoiser call and the sampler's update as one callable per bucket and sampler) against
today's unfused path: the compiled backend's denoiser call, then the sampler's update, each in a persistent
batch (``SlotTable.step`` against ``SlotTable.step_fused``).

The reference is the path every server step takes now (``BackendGraphs.denoise`` on the compiled backend,
which pads to the same buckets, then the sampler's update); the fused path must give bit-identical
states (every slot's every tensor) for every sampler, with samples joining and leaving, tables shorter than the
length bucket and batches that share a bucket at other sizes (stale static buffers would show). On CPU the
fused step runs uncaptured on its static buffers; the CUDA graph capture of it runs only on a GPU (skipped here).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from ldlm.model.config import SAMPLERS, LDLMConfig
from ldlm.model.ldlm import LDLM
from ldlm.sampling import GenerateRequest, SampleState, SamplingEngine, resolve
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.slots import SlotTable
from ldlm.serve.runtime.backends import BackendGraphs, open_graphs
from ldlm.serve.runtime.graph_backend import BackendError
from ldlm.serve.runtime.registry import COMPILED
from ldlm.serve.runtime.torch_backends import CompiledBackend, FusedSteps, prepare_model

SCHEDULE = TangentSchedule()
# (n, length, steps, joins at step): 4 samples fill bucket 4, 5 rows take bucket 8, then 3 rows reuse
# bucket 4's buffers; lengths 12 and 7 sit below the 16 bucket, and the joiners have no past yet.
Groups = tuple[tuple[int, int, int, int], ...]
GROUPS: Groups = ((4, 12, 3, 0), (1, 16, 6, 1), (2, 7, 3, 3))


def start(engine: SamplingEngine, config: LDLMConfig, sampler: str, k: int, groups: Groups = GROUPS) -> list[SampleState]:
    states = []
    for g, (n, length, steps, joins) in enumerate(groups):
        if joins == k:
            request = GenerateRequest(n=n, length=length, steps=steps, seed=10 + g, sampler=sampler)
            states += engine.start(resolve(request, config), config.d_model)
    return states


def assert_tables_equal(a: SlotTable, b: SlotTable, exact: bool, message: str) -> None:
    """Every slot's every tensor (the same admission order gives the same slots); NaN where a step is missing. Not
    the scratch slot past the capacity: a fused step's padded rows write there."""
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-5}
    assert a.capacity == b.capacity
    for name, value in a.state.items():
        torch.testing.assert_close(value[: a.capacity], b.state[name][: b.capacity], equal_nan=True, msg=f"{message}: {name}", **tolerance)


def run_both(backend: CompiledBackend, config: LDLMConfig, sampler: str, length: int, groups: Groups = GROUPS) -> None:
    """Both paths side by side in tables of ``length`` positions, step by step, every state compared after every step."""
    unfused, fused = SamplingEngine(SCHEDULE), SamplingEngine(SCHEDULE)
    denoise, steps = BackendGraphs({"denoiser": backend}).denoise, FusedSteps(backend)
    tables = unfused.table(length), fused.table(length)
    live_u: list[SampleState] = []
    live_f: list[SampleState] = []
    for k in range(7):
        live_u += start(unfused, config, sampler, k, groups)
        live_f += start(fused, config, sampler, k, groups)
        if not live_f:
            break
        tables[0].run(live_u)
        tables[1].run(live_f)
        assert tables[1].fusable()
        tables[0].step(denoise)
        tables[1].step_fused(steps)
        assert_tables_equal(*tables, exact=True, message=f"{sampler}: step {k}")
        assert [s.step for s in live_u] == [s.step for s in live_f]
        live_u, live_f = [s for s in live_u if not s.done], [s for s in live_f if not s.done]
    assert not live_u and not live_f


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint: Path) -> tuple[CompiledBackend, LDLMConfig]:
    graphs, config, _ = open_graphs(COMPILED, tiny_checkpoint)
    return graphs["denoiser"], config  # type: ignore[return-value]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_fused_steps_equal_the_unfused_path(compiled: tuple[CompiledBackend, LDLMConfig], sampler: str) -> None:
    backend, config = compiled
    run_both(backend, config, sampler, length=16)  # as the server's tables are: a length bucket


def test_fused_steps_pad_lengths_below_the_bucket(compiled: tuple[CompiledBackend, LDLMConfig]) -> None:
    backend, config = compiled
    run_both(backend, config, "dpm3m-psc-unic", length=12, groups=((4, 12, 3, 0), (2, 7, 3, 3)))  # rows of 12: padded to 16 inside
    # one sample in a table of 16 positions, then one in a table of 12 through the same fused steps and (1, 16) bucket:
    # its buffers' last 4 positions must not keep the first's
    steps = FusedSteps(backend)
    for length in (16, 12):
        engines = SamplingEngine(SCHEDULE), SamplingEngine(SCHEDULE)
        tables = engines[0].table(length), engines[1].table(length)
        lives = [
            e.start(resolve(GenerateRequest(n=1, length=length, steps=3, seed=length, sampler="dpm2m"), config), config.d_model)
            for e in engines
        ]
        for k in range(3):
            for table, live in zip(tables, lives):
                table.run([s for s in live if not s.done])
            tables[0].step(BackendGraphs({"denoiser": backend}).denoise)
            tables[1].step_fused(steps)
            assert_tables_equal(*tables, exact=True, message=f"table {length}, step {k}")
    assert {key[:2] for key in steps.prepared} == {(1, 16)}  # one bucket (prepared with its mask, and without for the full table)


def test_a_table_that_grows_is_stepped_on_its_new_storage(compiled: tuple[CompiledBackend, LDLMConfig]) -> None:
    """6 samples, then 5 more: the table doubles past its first 8 slots and reallocates its tensors, so the steps
    prepared on the old ones (on CUDA, graphs holding their addresses) must not run again."""
    backend, config = compiled
    run_both(backend, config, "dpm2m", length=16, groups=((6, 16, 2, 0), (5, 16, 4, 1)))  # 6 rows, 11, then 5 again


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fused_steps_in_reduced_precision(tiny_model: LDLM, tiny_config: LDLMConfig, precision: str) -> None:
    """The compute dtype in, FP32 out, as BackendGraphs.denoise feeds the backend."""
    model = prepare_model(copy.deepcopy(tiny_model), torch.device("cpu"), precision)
    run_both(CompiledBackend(model, "denoiser"), tiny_config, "dpm3m-psc", length=16)


def test_batches_above_the_largest_bucket_run_in_chunks(tiny_model: LDLM, tiny_config: LDLMConfig) -> None:
    backend = CompiledBackend(copy.deepcopy(tiny_model), "denoiser", batch_buckets=(1, 2))
    run_both(backend, tiny_config, "sde", length=16)


def test_only_the_denoiser_fuses(compiled: tuple[CompiledBackend, LDLMConfig], tiny_model: LDLM) -> None:
    with pytest.raises(BackendError, match="fused steps run the denoiser graph, not 'decoder'"):
        FusedSteps(CompiledBackend(copy.deepcopy(tiny_model), "decoder"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA graph capture of fused steps was not exercised")
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_captured_steps_equal_the_uncaptured_ones(tiny_model: LDLM, tiny_config: LDLMConfig, sampler: str) -> None:
    """On CUDA: one graph per bucket and sampler, replayed, against the same step uncaptured on the same device
    (the unfused path runs the denoiser's own per-bucket graph: other kernels' order, so compared closely, not bitwise)."""
    model = prepare_model(copy.deepcopy(tiny_model), torch.device("cuda"), "fp32")
    captured = CompiledBackend(model, "denoiser")
    plain = CompiledBackend(model, "denoiser", cuda_graphs=False)
    engines = SamplingEngine(SCHEDULE, device="cuda", noise_device="cpu"), SamplingEngine(SCHEDULE, device="cuda", noise_device="cpu")
    tables = engines[0].table(16), engines[1].table(16)
    steps = FusedSteps(captured), FusedSteps(plain)
    lives: tuple[list[SampleState], list[SampleState]] = ([], [])
    for k in range(7):
        for engine, table, live, step in zip(engines, tables, lives, steps):
            live += start(engine, tiny_config, sampler, k)
            if live:
                table.run(live)
                table.step_fused(step)
        assert_tables_equal(*tables, exact=False, message=f"{sampler}: step {k}")
        for live in lives:
            live[:] = [s for s in live if not s.done]
    assert all(key[2].name == sampler for key in steps[0].prepared) and all(p.graph is not None for p in steps[0].prepared.values())
