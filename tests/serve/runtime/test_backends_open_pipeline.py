"""``ldlm.open_pipeline``: the public way to run the pipeline on ONNX Runtime, TensorRT or a torch
backend, without reaching into ldlm.serve. The eager pipeline (``from_checkpoint``) is the reference."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ldlm
from ldlm.export.onnx_export import export_graphs
from ldlm.model.checkpoint import WEIGHTS_FILE
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling.tokens import TokenSampling
from ldlm.sampling.tuned_grids import SCHEDULES_FILE, TunedGrid, TunedSchedules, weights_sha256
from ldlm.serve.runtime.backends import open_pipeline
from ldlm.serve.runtime.graph_backend import BackendError

SETTINGS = {"n": 2, "length": 16, "steps": 6, "seed": 3, "sampler": "ddim"}


def test_the_top_level_name_is_the_runtimes() -> None:
    assert ldlm.open_pipeline is open_pipeline


def test_an_export_on_onnx_runtime_writes_the_checkpoints_tokens(export_dir: Path, pipeline: LDLMPipeline) -> None:
    """fp32 ONNX Runtime against eager on the same seed: the graphs agree within float rounding, so the
    tokens are the same (the parity check's fp32 bar)."""
    pipe = open_pipeline(export_dir, backend="ort", threads=1)
    assert pipe.graphs.graphs["denoiser"].backend == "ort"  # type: ignore[attr-defined]
    ours, eager = pipe.generate(**SETTINGS), pipeline.generate(**SETTINGS)
    assert ours.token_ids.tolist() == eager.token_ids.tolist()
    assert ours.texts == eager.texts


def test_an_export_with_logits_draws_tokens_at_a_temperature(export_dir: Path) -> None:
    """``ldlm export --with-logits`` keeps the decoder's logits: decoding at a temperature works and
    depends on the seed."""
    pipe = open_pipeline(export_dir, threads=1)
    latents = pipe.encode(["The quick brown fox jumps over the lazy dog."]).latents
    first = pipe.decode(latents, sampling=TokenSampling(temperature=2.0, seed=0)).token_ids
    again = pipe.decode(latents, sampling=TokenSampling(temperature=2.0, seed=0)).token_ids
    other = pipe.decode(latents, sampling=TokenSampling(temperature=2.0, seed=1)).token_ids
    assert first.tolist() == again.tolist() and first.tolist() != other.tolist()


def test_a_checkpoint_on_a_torch_backend_keeps_the_decoders_logits(tiny_checkpoint: Path, pipeline: LDLMPipeline) -> None:
    pipe = open_pipeline(tiny_checkpoint, backend="eager")
    assert pipe.graphs.has_logits  # type: ignore[attr-defined]
    latents = pipe.encode(["Hi there"]).latents
    assert pipe.decode(latents, sampling=TokenSampling(temperature=1.0, seed=0)).token_ids.shape == (1, latents.shape[1])
    assert pipe.generate(**SETTINGS).token_ids.tolist() == pipeline.generate(**SETTINGS).token_ids.tolist()


def tuned_checkpoint(tiny_checkpoint: Path, out: Path) -> TunedSchedules:
    """A copy of the tiny checkpoint with a schedules.json: ddim tuned (here: chosen) at 4 steps, its default."""
    shutil.copytree(tiny_checkpoint, out)
    times = (1.0, 0.6, 0.3, 0.12, 0.05)
    schedules = TunedSchedules(weights_sha256(out / WEIGHTS_FILE), 0.05, (TunedGrid("ddim", 4, times),), {"ddim": 4})
    schedules.save(out / SCHEDULES_FILE)
    return schedules


def test_the_exports_tuned_grids_set_the_default_steps_and_grid(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The grids travel with the export (its manifest binds them to the weights): a request that names no
    steps runs the tuned default on the tuned grid, as the eager pipeline of the checkpoint does."""
    schedules = tuned_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    export_graphs(tmp_path / "ckpt", tmp_path / "onnx", progress=False)
    pipe = open_pipeline(tmp_path / "onnx", threads=1)
    assert pipe.schedules == schedules
    eager = LDLMPipeline.from_checkpoint(tmp_path / "ckpt")
    ours = pipe.sample_latents(1, 12, seed=5, sampler="ddim")
    torch.testing.assert_close(ours, eager.sample_latents(1, 12, seed=5, sampler="ddim"), atol=1e-4, rtol=1e-4)
    untuned = eager.sample_latents(1, 12, steps=4, seed=5, sampler="ddim", grid="uniform")
    assert (ours - untuned).abs().max() > 1e-2  # the tuned grid, not ddim's own, ran


def test_a_checkpoints_tuned_grids_come_with_a_torch_backend(tiny_checkpoint: Path, tmp_path: Path) -> None:
    schedules = tuned_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    assert open_pipeline(tmp_path / "ckpt", backend="eager").schedules == schedules


def test_an_unknown_backend_is_refused_naming_the_allowed_ones(export_dir: Path) -> None:
    with pytest.raises(BackendError, match=r"backend='onnx' is unknown; allowed: .*ort"):
        open_pipeline(export_dir, backend="onnx")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_what_is_not_named_is_what_serve_runs_on_the_device(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """No backend or precision named: the pipeline opens what ``ldlm serve`` runs on that device (one rule,
    registry.resolve_run), not ONNX Runtime whatever the device. The graphs are not opened (no GPU here): the
    call that would open them is what is checked."""
    from ldlm.serve.runtime import backends
    from ldlm.serve.runtime.registry import resolve_run

    opened: list[tuple[str, str, str]] = []

    def record(backend: str, path: object, precision: str, **options: object) -> None:
        opened.append((backend, precision, str(options["device"])))
        raise RuntimeError("recorded")

    monkeypatch.setattr(backends, "open_graphs", record)
    with pytest.raises(RuntimeError, match="recorded"):
        open_pipeline("somewhere", device=device)
    assert opened == [(*resolve_run(device), device)]
    assert opened[0][:2] == (("ort", "fp32") if device == "cpu" else ("inductor", "fp16"))
