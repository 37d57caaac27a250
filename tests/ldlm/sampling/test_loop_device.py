"""The sampler on the device: today's tokens on CPU, and the device path against the host path.

tests/data/sampler_golden_cpu.json was written by the code before the device path existed (commit
5f890ca, torch 2.13.0 CPU): the tiny preset, init seed 0, for the seeds, samplers and shapes named
in its keys; it holds the token ids and the sampled float32 latents. tests/data/make_sampler_golden.py
rewrites the latents from that commit's code (its docstring says how) and checks the token ids.

Token ids must match exactly; latents within LATENT_TOL, because float32 sums differ in the last
bits with the CPU's vector ISA (AVX-512 against AVX2: up to ~2e-6 here), which a hash of the bytes
would turn into a failure on a CI machine without AVX-512.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from ldlm.model.checkpoint import init_model
from ldlm.model.config import preset
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import NoiseStream
from ldlm.serve.runtime.backends import BackendGraphs
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler
from ldlm.serve.runtime.torch_backends import EagerBackend
from tests import REPO

GOLDEN = json.loads((REPO / "tests" / "data" / "sampler_golden_cpu.json").read_text())
CASES = [k for k in GOLDEN if k != "scheduler"]
LATENT_TOL = 1e-4  # abs and rel; any change to the seeds, noise order or maths moves latents by O(1)


@pytest.fixture(scope="module")
def golden_model() -> LDLM:
    return init_model(preset("tiny"), seed=0)


def parse(case: str) -> tuple[int, str, int, int, int]:
    seed, sampler, shape, steps = case.split("-")
    n, length = shape.split("x")
    return int(seed), sampler, int(n), int(length), int(steps)


@pytest.mark.parametrize("case", CASES)
def test_cpu_tokens_are_todays_and_latents_match_to_float32_rounding(golden_model: LDLM, case: str) -> None:
    seed, sampler, n, length, steps = parse(case)
    pipe = LDLMPipeline(golden_model, TextTokenizer.gpt2())
    latents = pipe.sample_latents(n, length, steps, seed, sampler)
    expected = torch.tensor(GOLDEN[case]["latents"], dtype=torch.float32)
    assert latents.dtype == torch.float32 and latents.shape == (n, length, golden_model.config.d_model)
    torch.testing.assert_close(latents.cpu(), expected, atol=LATENT_TOL, rtol=LATENT_TOL)
    assert pipe.decode(latents).token_ids.tolist() == GOLDEN[case]["tokens"]


def test_scheduler_tokens_are_bitwise_todays(golden_model: LDLM) -> None:
    pipe = LDLMPipeline(golden_model, TextTokenizer.gpt2(), buckets=[16, 32])
    scheduler = GenerationScheduler(pipe, max_batch=4, policy="continuous", start=False)
    specs = [(12, 6, 0, "sde"), (9, 4, 5, "ddim"), (20, 5, 2, "sde")]
    try:
        futures = [scheduler.submit(GenerateRequest(n=1, length=n, steps=s, seed=seed, sampler=sm)) for n, s, seed, sm in specs]
        scheduler.start()
        assert [f.result(60).token_ids.tolist() for f in futures] == GOLDEN["scheduler"]
    finally:
        scheduler.close()


def test_noise_stream_on_cpu_is_the_seeded_cpu_generator() -> None:
    # The independent reference: torch's CPU generator, drawn the way the host code drew it.
    reference = torch.Generator().manual_seed(123)
    stream = NoiseStream(123, (3, 4), "cpu")
    for _ in range(3):
        assert torch.equal(stream.draw(), torch.randn((3, 4), generator=reference))


class HostOnly:
    """A graph runner with only ``run`` (NumPy in and out): the host path, a copy per call."""

    def __init__(self, backend: EagerBackend) -> None:
        self.backend = backend

    def run(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        return self.backend.run(inputs)


@pytest.mark.parametrize("sampler", ["sde", "ddim"])
def test_device_path_equals_host_path_on_cpu(golden_model: LDLM, sampler: str) -> None:
    tokenizer = TextTokenizer.gpt2()
    backends = {g: EagerBackend(golden_model, g) for g in ("encoder", "denoiser", "decoder")}
    device_path = LDLMPipeline(BackendGraphs(backends), tokenizer, config=golden_model.config)  # tensors, no NumPy
    host_path = LDLMPipeline(BackendGraphs({g: HostOnly(b) for g, b in backends.items()}), tokenizer, config=golden_model.config)
    a = device_path.sample_latents(2, 10, 5, 4, sampler)
    b = host_path.sample_latents(2, 10, 5, 4, sampler)
    assert torch.equal(a, b)
    assert torch.equal(device_path.decode(a).token_ids, host_path.decode(b).token_ids)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the CUDA step loop (no host sync, device noise) "
    "was not exercised here; scripts/research/gpu_check.py runs it on the GPU",
)
def test_cuda_step_loop_makes_no_host_sync(golden_model: LDLM) -> None:
    model = init_model(preset("tiny"), seed=0).cuda()
    pipe = LDLMPipeline(model, TextTokenizer.gpt2(), device="cuda")
    pipe.sample_latents(1, 8, 2, 0, "sde")  # warm-up (lazy CUDA init may sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        latents = pipe.sample_latents(2, 16, 5, 0, "sde")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_noise = LDLMPipeline(model, TextTokenizer.gpt2(), device="cuda", noise_device="cpu")
    host = LDLMPipeline(golden_model, TextTokenizer.gpt2())
    torch.testing.assert_close(
        cpu_noise.sample_latents(2, 16, 5, 0, "ddim").cpu(), host.sample_latents(2, 16, 5, 0, "ddim"), atol=1e-3, rtol=1e-3
    )
    assert latents.is_cuda and torch.isfinite(latents).all()
