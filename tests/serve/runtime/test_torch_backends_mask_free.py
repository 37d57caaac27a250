"""``mask=None`` on every backend: the sampling loop's ``denoise(x_t, t, x0_prev, None)`` (and the encoder's) for a
batch with no padding. On the torch backends no mask reaches SDPA, so its flash kernels are eligible on CUDA; a
padded batch, or one whose length is padded up to a compiled bucket, keeps a mask. Outputs equal the all-ones
mask's within fp32 tolerance on eager, compiled, inductor, fused steps, ONNX Runtime and (a stand-in engine)
TensorRT.

``sdpa`` records every ``scaled_dot_product_attention`` call's ``attn_mask`` (the model calls it through ``F``).
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ldlm.model.config import LDLMConfig
from ldlm.model.ldlm import LDLM
from ldlm.sampling import GenerateRequest, SamplingEngine, SlotTable, resolve
from ldlm.sampling.schedule import TangentSchedule
from ldlm.serve.runtime.backends import BackendGraphs, open_graphs
from ldlm.serve.runtime.graph_backend import MASK, BackendError, GraphBackend
from ldlm.serve.runtime.torch_backends import CompiledBackend, EagerBackend, FusedSteps, InductorBackend, prepare_model
from ldlm.serve.runtime.trt_backend import TensorRTBackend

TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32, same weights: only the kernels' order of summation differs


@pytest.fixture
def sdpa(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Each SDPA call's attn_mask (None or a tensor), the call itself unchanged."""
    masks: list[Any] = []
    original = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, **kwargs: Any) -> torch.Tensor:
        masks.append(attn_mask)
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    yield masks


def on_cpu(kind: type[EagerBackend], model: LDLM, graph: str) -> EagerBackend:
    return CompiledBackend(model, graph, cuda_graphs=False) if kind is CompiledBackend else kind(model, graph)


def denoiser_args(config: LDLMConfig, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 100 + length)
    x = torch.randn(batch, length, config.d_model, generator=gen)
    return x, torch.rand(batch, generator=gen), torch.randn(batch, length, config.d_model, generator=gen)


def ones(batch: int, length: int) -> torch.Tensor:
    return torch.ones(batch, length, dtype=torch.bool)


def no_mask_and_all_ones(graphs: BackendGraphs, config: LDLMConfig, batch: int, length: int, sdpa: list[Any]) -> list[Any]:
    """The denoiser with mask None and with an all-ones mask: equal outputs; returns the masks SDPA saw for None."""
    x, t, x0_prev = denoiser_args(config, batch, length)
    free = graphs.denoise(x, t, x0_prev, None)
    seen = list(sdpa)
    torch.testing.assert_close(free, graphs.denoise(x, t, x0_prev, ones(batch, length)), **TOL)
    return seen


@pytest.mark.parametrize("kind", [EagerBackend, CompiledBackend])
def test_denoiser_without_a_mask_runs_no_mask_and_matches_all_ones(tiny_model: LDLM, kind: type[EagerBackend], sdpa: list[Any]) -> None:
    backend = on_cpu(kind, tiny_model, "denoiser")
    graphs = BackendGraphs({"denoiser": backend})
    config = tiny_model.config
    # batch 3 -> bucket 4 (a padded row, full length), length 16 = its bucket: mask-free
    seen = no_mask_and_all_ones(graphs, config, 3, 16, sdpa)
    assert len(seen) == config.denoiser_layers and all(m is None for m in seen)
    sdpa.clear()
    # an explicit all-ones mask is a mask: the denoiser's masks are on the sampling device and never read
    x, t, x0_prev = denoiser_args(config, 3, 16)
    graphs.denoise(x, t, x0_prev, ones(3, 16))
    assert sdpa and all(isinstance(m, torch.Tensor) for m in sdpa)


@pytest.mark.parametrize("kind", [EagerBackend, CompiledBackend])
def test_a_padded_batch_keeps_its_mask(tiny_model: LDLM, kind: type[EagerBackend], sdpa: list[Any]) -> None:
    backend = on_cpu(kind, tiny_model, "denoiser")
    x, t, x0_prev = denoiser_args(tiny_model.config, 3, 16)
    mask = ones(3, 16)
    mask[2, 9:] = False
    out = BackendGraphs({"denoiser": backend}).denoise(x, t, x0_prev, mask)
    assert len(sdpa) == tiny_model.config.denoiser_layers and all(isinstance(m, torch.Tensor) for m in sdpa)
    with torch.no_grad():  # the padded row's real positions as that row alone, unpadded
        alone = tiny_model.denoise(x[2:, :9], t[2:], x0_prev[2:, :9], None)
    torch.testing.assert_close(out[2:, :9], alone, **TOL)


def test_compiled_masks_a_length_padded_up_to_its_bucket(tiny_model: LDLM, sdpa: list[Any]) -> None:
    """Length 10 runs in the 16 bucket: its 6 padded positions need a mask even when the caller gave none."""
    backend = CompiledBackend(tiny_model, "denoiser", cuda_graphs=False)
    assert backend.bucket(2, 10) == (2, 16)
    seen = no_mask_and_all_ones(BackendGraphs({"denoiser": backend}), tiny_model.config, 2, 10, sdpa)
    assert seen and all(isinstance(m, torch.Tensor) for m in seen)
    x, t, x0_prev = denoiser_args(tiny_model.config, 2, 10)
    with torch.no_grad():
        reference = tiny_model.denoise(x, t, x0_prev, None)  # unpadded, at its own length
    torch.testing.assert_close(BackendGraphs({"denoiser": backend}).denoise(x, t, x0_prev, None), reference, **TOL)


@pytest.mark.parametrize("kind", [EagerBackend, CompiledBackend])
def test_encoder_runs_a_host_mask_of_all_ones_without_a_mask(tiny_model: LDLM, kind: type[EagerBackend], sdpa: list[Any]) -> None:
    backend = on_cpu(kind, tiny_model, "encoder")
    graphs = BackendGraphs({"encoder": backend})
    ids = torch.randint(0, tiny_model.config.gpt2_vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = tiny_model.encode_latents(ids, ones(3, 16))  # the masked path
    for mask in (None, ones(3, 16)):  # a CPU mask of all ones (the tokenizer's) is read on the host: no mask
        sdpa.clear()
        torch.testing.assert_close(graphs.encode_latents(ids, mask), reference, **TOL)
        assert sdpa and all(m is None for m in sdpa), mask
    padded = ones(3, 16)
    padded[0, 12:] = False
    sdpa.clear()
    out = graphs.encode_latents(ids, padded)
    assert sdpa and all(isinstance(m, torch.Tensor) for m in sdpa)
    with torch.no_grad():
        alone = tiny_model.encode_latents(ids[:1, :12], None)
    torch.testing.assert_close(out[:1, :12], alone, **TOL)


def test_a_mask_off_the_host_is_never_read(tiny_model: LDLM) -> None:
    """Reading a CUDA mask would wait for the GPU; a meta tensor stands in for one here (reading it raises)."""
    backend = EagerBackend(tiny_model, "encoder")
    ids = torch.zeros(2, 4, dtype=torch.int64)
    assert not backend.mask_free({"input_ids": ids, MASK: torch.ones(2, 4, dtype=torch.int64, device="meta")})
    assert backend.mask_free({"input_ids": ids}) and backend.mask_free({"input_ids": ids, MASK: torch.ones(2, 4, dtype=torch.int64)})
    assert not backend.mask_free({"input_ids": ids, MASK: torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])})
    assert EagerBackend(tiny_model, "decoder").free_module is None  # the decoder always runs its mask


def test_decoder_without_a_mask_gets_all_ones(tiny_model: LDLM) -> None:
    backend = EagerBackend(tiny_model, "decoder", with_logits=True)
    latents = torch.randn(2, 8, tiny_model.config.d_model, generator=torch.Generator().manual_seed(2))
    graphs = BackendGraphs({"decoder": backend})
    assert torch.equal(graphs.decode_tokens(latents, None), graphs.decode_tokens(latents, ones(2, 8)))


def test_a_runner_that_is_no_graph_backend_gets_an_all_ones_mask_on_the_host(tiny_model: LDLM) -> None:
    """A batcher takes arrays with every input: it gets ones, not a missing mask."""
    fed: list[dict[str, Any]] = []

    class Runner:
        def run(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
            fed.append(inputs)
            return {"x0_hat": np.zeros((2, 5, 3), np.float32)}

    x = torch.zeros(2, 5, 3)
    BackendGraphs({"denoiser": Runner()}).denoise(x, torch.zeros(2), x, None)  # type: ignore[dict-item]
    mask = fed[0][MASK]
    assert mask.device.type == "cpu" and mask.dtype == torch.int64 and torch.equal(mask, torch.ones(2, 5, dtype=torch.int64))


# --- fused steps ------------------------------------------------------------------------------------


def table_after_a_step(
    config: LDLMConfig, table_length: int, length: int, step: Callable[[SlotTable], object], device: str = "cpu"
) -> SlotTable:
    """A table of ``table_length`` positions after the first step (no past) of 3 dpm2m samples of ``length``."""
    engine = SamplingEngine(TangentSchedule(), device=device, noise_device="cpu")
    table = engine.table(table_length)
    plan = resolve(GenerateRequest(n=3, length=length, steps=5, seed=length, sampler="dpm2m"), config)
    table.run(engine.start(plan, config.d_model))
    step(table)
    return table


def assert_tables_close(a: SlotTable, b: SlotTable, **tolerance: float) -> None:
    for name in ("x", "x_mean", "x0_hat", "x0_prev"):
        torch.testing.assert_close(a.state[name][: a.capacity], b.state[name][: b.capacity], **(tolerance or TOL))


def all_ones(backend: CompiledBackend) -> Callable[[SlotTable], object]:
    """One unfused step whose denoiser call gets an all-ones mask where the table passes none."""
    graphs = BackendGraphs({"denoiser": backend})
    return lambda table: table.step(lambda x, t, x0_prev, mask: graphs.denoise(x, t, x0_prev, ones(*x.shape[:2]).to(x.device)))


def test_fused_step_without_a_mask_runs_no_mask_and_matches_all_ones(tiny_model: LDLM, tiny_config: LDLMConfig, sdpa: list[Any]) -> None:
    backend = CompiledBackend(tiny_model, "denoiser", cuda_graphs=False)
    steps = FusedSteps(backend)
    free = table_after_a_step(tiny_config, 16, 16, lambda table: table.step_fused(steps))  # batch 3 -> bucket 4, length = bucket
    assert len(sdpa) == tiny_config.denoiser_layers and all(m is None for m in sdpa)
    sdpa.clear()
    masked = table_after_a_step(tiny_config, 16, 16, all_ones(backend))
    assert sdpa and all(isinstance(m, torch.Tensor) for m in sdpa)
    assert_tables_close(free, masked)
    assert [key[:2] + (key[5],) for key in steps.prepared] == [(4, 16, False)]  # the mask-free step of its bucket


def test_fused_step_without_a_mask_below_its_bucket_is_masked(tiny_model: LDLM, tiny_config: LDLMConfig, sdpa: list[Any]) -> None:
    steps = FusedSteps(CompiledBackend(tiny_model, "denoiser", cuda_graphs=False))
    free = table_after_a_step(tiny_config, 10, 10, lambda table: table.step_fused(steps))  # rows of 10 in the 16 bucket
    assert sdpa and all(isinstance(m, torch.Tensor) for m in sdpa)
    assert [key[5] for key in steps.prepared] == [True]
    reference = FusedSteps(CompiledBackend(tiny_model, "denoiser", batch_buckets=(3,), seq_buckets=(10,), cuda_graphs=False))
    assert_tables_close(free, table_after_a_step(tiny_config, 10, 10, lambda table: table.step_fused(reference)))  # unpadded, mask-free


def test_fused_step_without_a_mask_in_fp16(tiny_model: LDLM, tiny_config: LDLMConfig) -> None:
    """The served precision: the mask-free module runs under the same autocast as the masked one."""
    backend = CompiledBackend(prepare_model(copy.deepcopy(tiny_model), torch.device("cpu"), "fp16"), "denoiser", cuda_graphs=False)
    free = table_after_a_step(tiny_config, 16, 16, lambda table: table.step_fused(FusedSteps(backend)))
    assert_tables_close(free, table_after_a_step(tiny_config, 16, 16, all_ones(backend)), rtol=2e-2, atol=2e-2)


# --- inductor, ONNX Runtime, TensorRT -----------------------------------------------------------------


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler: Inductor could not build kernels")
def test_inductor_without_a_mask_matches_all_ones(tiny_model: LDLM) -> None:
    backend = InductorBackend(tiny_model, "denoiser", batch_buckets=(2,), seq_buckets=(16,), cuda_graphs=False)
    x, t, x0_prev = denoiser_args(tiny_model.config, 2, 16)
    graphs = BackendGraphs({"denoiser": backend})
    torch.testing.assert_close(graphs.denoise(x, t, x0_prev, None), graphs.denoise(x, t, x0_prev, ones(2, 16)), rtol=1e-4, atol=1e-4)


def test_onnx_runtime_without_a_mask_matches_all_ones(export_dir: Path) -> None:
    graphs, config, _ = open_graphs("ort", export_dir)
    bg = BackendGraphs(graphs)
    x, t, x0_prev = denoiser_args(config, 2, 9)
    torch.testing.assert_close(bg.denoise(x, t, x0_prev, None), bg.denoise(x, t, x0_prev, ones(2, 9)), rtol=0, atol=0)
    ids = torch.randint(0, config.gpt2_vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(bg.encode_latents(ids, None), bg.encode_latents(ids, ones(2, 9)), rtol=0, atol=0)


def test_tensorrt_without_a_mask_feeds_its_engine_all_ones_on_its_device(tiny_model: LDLM) -> None:
    """A stand-in engine (no GPU here) records what the backend hands it."""
    fed: list[dict[str, torch.Tensor]] = []

    class Engine:
        def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            fed.append(inputs)
            return {"x0_hat": inputs["x_t"].half()}

    eager = EagerBackend(tiny_model, "denoiser")
    backend = TensorRTBackend.__new__(TensorRTBackend)
    GraphBackend.__init__(backend, "denoiser", eager.inputs, eager.outputs, tiny_model.config.max_seq_len)
    backend.engine, backend.device = Engine(), torch.device("cpu")  # type: ignore[assignment]
    x, t, x0_prev = denoiser_args(tiny_model.config, 2, 6)
    out = BackendGraphs({"denoiser": backend}).denoise(x, t, x0_prev, None)
    assert torch.equal(fed[0][MASK], torch.ones(2, 6, dtype=torch.int64)) and out.dtype == torch.float32
    with pytest.raises(BackendError, match="do not match"):  # the host path (a client's arrays) takes every input declared
        backend.run({"x_t": x.numpy(), "t": t.numpy(), "x0_prev": x0_prev.numpy()})


# --- on CUDA ------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the mask-free CUDA graphs (and that no mask is read on the device) were not exercised",
)
def test_mask_free_batches_capture_graphs_of_their_own_on_cuda(tiny_model: LDLM) -> None:
    """fp16, as served: a mask-free bucket is its own captured graph (and fused step) beside the masked one, replays
    the same numbers, matches the all-ones mask closely, and no call syncs with the host (a CUDA mask is never read)."""
    model = prepare_model(copy.deepcopy(tiny_model), torch.device("cuda"), "fp16")
    backend = CompiledBackend(model, "denoiser")
    graphs = BackendGraphs({"denoiser": backend})
    x, t, x0_prev = (a.cuda() for a in denoiser_args(tiny_model.config, 3, 16))
    full = ones(3, 16).cuda()
    free, masked = graphs.denoise(x, t, x0_prev, None), graphs.denoise(x, t, x0_prev, full)  # capture both
    assert sorted(backend.captured) == [(4, 16, False), (4, 16, True)]
    torch.testing.assert_close(free, masked, rtol=2e-2, atol=2e-2)
    encoder = BackendGraphs({"encoder": CompiledBackend(model, "encoder")})
    ids = torch.zeros(3, 16, dtype=torch.int64, device="cuda")
    encoder.encode_latents(ids, full)  # capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = graphs.denoise(x, t, x0_prev, None)  # a replay
        encoder.encode_latents(ids, full)  # a CUDA mask of all ones: not read, so the masked path, and no sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, free)
    steps = FusedSteps(backend)
    step_free = table_after_a_step(tiny_model.config, 16, 16, lambda table: table.step_fused(steps), "cuda")
    step_masked = table_after_a_step(tiny_model.config, 16, 16, all_ones(backend), "cuda")
    assert [key[5] for key in steps.prepared] == [False] and all(p.graph is not None for p in steps.prepared.values())
    assert_tables_close(step_free, step_masked, rtol=2e-2, atol=2e-2)
