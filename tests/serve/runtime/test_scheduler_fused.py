"""The scheduler's fused steps (``FusedSteps`` of a compiled denoiser): every batch of one sampler takes them, a
batch that mixes samplers takes the denoiser call and ``advance``, and the tokens are the unfused scheduler's. A
fused step that fails changes no sample: the scheduler goes on unfused and says why. On CPU the fused step runs
uncaptured on its static buffers; its CUDA graph capture is a gpu test of tests/serve/runtime/test_torch_backends_fused.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import Tensor

from ldlm.model.ldlm import LDLM
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest
from ldlm.sampling.loop import FusedStepFn, StepOutputs
from ldlm.serve.api.service import LDLMService, ServerSettings
from ldlm.serve.runtime.backends import BackendGraphs
from ldlm.serve.runtime.scheduler import GenerationScheduler
from ldlm.serve.runtime.torch_backends import CompiledBackend, EagerBackend, FusedSteps, fused_steps

# ddim for 3 steps beside dpm3m-psc for 6 at the same length: three mixed steps (unfused), then three of dpm3m-psc
# alone (fused); sde at another length, alone (fused).
REQUESTS = (
    GenerateRequest(n=2, length=12, steps=3, seed=1, sampler="ddim"),
    GenerateRequest(n=2, length=12, steps=6, seed=2, sampler="dpm3m-psc"),
    GenerateRequest(n=1, length=7, steps=4, seed=3, sampler="sde"),
)


def run(pipeline: LDLMPipeline, backend: CompiledBackend, fused: FusedStepFn | None) -> tuple[list[list[list[int]]], GenerationScheduler]:
    scheduler = GenerationScheduler(
        pipeline,
        max_batch=8,
        start=False,
        denoise=BackendGraphs({"denoiser": backend}).denoise,
        fused=fused,
    )
    try:
        futures = [scheduler.submit(r) for r in REQUESTS]  # all queued before the first step: one batch
        scheduler.start()
        results = [f.result(timeout=120).token_ids.tolist() for f in futures]
    finally:
        scheduler.close()
    return results, scheduler


def test_fused_steps_give_the_unfused_tokens_and_take_every_one_sampler_batch(tiny_model: LDLM, pipeline: LDLMPipeline) -> None:
    backend = CompiledBackend(tiny_model, "denoiser")
    expected, unfused = run(pipeline, backend, None)
    got, fused = run(pipeline, backend, FusedSteps(backend))
    assert got == expected
    assert unfused.executor.fused_steps == 0
    calls, taken = fused.executor.denoiser_calls, fused.executor.fused_steps
    assert calls == unfused.executor.denoiser_calls and 0 < taken < calls, (taken, calls)  # both paths ran


def test_a_failing_fused_step_falls_back_to_unfused_steps(
    tiny_model: LDLM, pipeline: LDLMPipeline, caplog: pytest.LogCaptureFixture
) -> None:
    backend = CompiledBackend(tiny_model, "denoiser")
    expected, _ = run(pipeline, backend, None)

    def refused(*args: object) -> StepOutputs:
        raise RuntimeError("operation not permitted when stream is capturing")

    with caplog.at_level(logging.ERROR, logger="ldlm.serve"):
        got, scheduler = run(pipeline, backend, refused)
    assert got == expected
    assert scheduler.executor.fused is None and scheduler.executor.fused_steps == 0
    assert "the fused denoiser step failed; steps run unfused from now on" in caplog.text
    assert "operation not permitted when stream is capturing" in caplog.text


def test_only_a_compiled_denoiser_has_fused_steps(tiny_model: LDLM) -> None:
    assert isinstance(fused_steps(CompiledBackend(tiny_model, "denoiser")), FusedSteps)
    assert fused_steps(CompiledBackend(tiny_model, "decoder")) is None
    assert fused_steps(EagerBackend(tiny_model, "denoiser")) is None


@pytest.mark.parametrize(("backend", "fused"), [("compiled", True), ("eager", False)])
def test_the_server_steps_a_compiled_denoiser_fused(tiny_checkpoint: Path, backend: str, fused: bool) -> None:
    service = LDLMService(str(tiny_checkpoint), ServerSettings(backend=backend, max_batch=4))
    try:
        assert isinstance(service.scheduler.executor.fused, FusedSteps) is fused
        result = service.scheduler.submit(GenerateRequest(n=1, length=8, steps=3, seed=4, sampler="ddim")).result(timeout=120)
        assert result.token_ids.shape == (1, 8)
        assert service.scheduler.executor.fused_steps == (3 if fused else 0)
    finally:
        service.close()


def test_slots_freed_by_a_failed_step_give_the_next_request_its_own_noise(pipeline: LDLMPipeline) -> None:
    """The fused step raised (its draws held for the step that runs it instead), then that unfused step raised too: the
    request is answered with the error and its slots are freed. The next request's sde samples, admitted into those
    slots, draw their own noise from their first step: the tokens the pipeline gives them alone."""
    calls = []

    def fails_once(*args: Tensor) -> Tensor:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return pipeline.graphs.denoise(*args)

    def refused(*args: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    later = GenerateRequest(n=2, length=8, steps=3, seed=6, sampler="sde")
    scheduler = GenerationScheduler(pipeline, max_batch=8, start=False, denoise=fails_once, fused=refused)
    try:
        failed = scheduler.submit(GenerateRequest(n=2, length=8, steps=3, seed=5, sampler="sde"))
        scheduler.start()
        with pytest.raises(RuntimeError, match="device lost"):
            failed.result(timeout=120)
        got = scheduler.submit(later).result(timeout=120)
    finally:
        scheduler.close()
    expected = pipeline.generate(later.n, later.length, later.steps, later.seed, later.sampler)
    assert torch.equal(got.token_ids, expected.token_ids)
