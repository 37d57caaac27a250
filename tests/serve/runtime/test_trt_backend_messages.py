"""Engines built in one precision and asked to run in another: the refusal says what was built, what was asked
(and that fp32 is what runs when no --precision is given) and both ways out, from the plans' manifests alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from ldlm.serve.runtime import trt_backend
from ldlm.serve.runtime.graph_backend import BackendError
from ldlm.serve.runtime.registry import OpenOptions, backend_info


def refusal(monkeypatch: pytest.MonkeyPatch, built: list[str | None], asked: str) -> str:
    manifests = {graph: {"precision": p} for graph, p in zip(("encoder", "denoiser", "decoder"), built)}
    monkeypatch.setattr(trt_backend, "check_engine_dir", lambda *_, **__: manifests)
    with pytest.raises(BackendError) as refused:
        trt_backend.open_backend(backend_info("trt"), Path("runs/engines"), OpenOptions(precision=asked))
    return str(refused.value)


def test_fp16_engines_served_without_a_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's fp16 build, then `ldlm serve runs/engines --backend trt`: fp32 was asked by default."""
    said = refusal(monkeypatch, ["fp16"] * 3, "fp32")
    assert said.startswith("engines in runs/engines are ['fp16']; asked for precision='fp32' (--precision; fp32 when not given)")
    assert "They run as built with --precision fp16" in said
    assert "or rebuild them in fp32 with `ldlm build-engine EXPORT runs/engines --precision fp32 --force`" in said
    assert "rebuild with --precision fp32" not in said


def test_engines_of_mixed_precisions_can_only_be_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    said = refusal(monkeypatch, ["fp16", "fp16", "bf16"], "fp16")
    assert "are ['bf16', 'fp16']; asked for precision='fp16'" in said and "not built in one known precision" in said
    assert "run as built" not in said
