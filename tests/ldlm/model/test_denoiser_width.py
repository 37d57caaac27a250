"""A denoiser whose residual stream is wider than the latents (config.denoiser_width)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.graphs import graph_io
from export.onnx_export import export_graph
from ldlm.importing.config import infer_fields
from ldlm.model.checkpoint import init_model
from ldlm.model.config import LDLMConfig, preset
from ldlm.model.denoiser import Denoiser

TINY = preset("tiny")
WIDE = dataclasses.replace(TINY, denoiser_width=96)


def inputs(config: LDLMConfig, batch: int = 2, length: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x_t = torch.randn(batch, length, config.d_model, generator=gen)
    x0_prev = torch.randn(batch, length, config.d_model, generator=gen)
    return x_t, torch.rand(batch, generator=gen), x0_prev


def test_unset_width_keeps_the_spec_denoiser_and_the_saved_configs_hash() -> None:
    names = set(Denoiser(TINY).state_dict())
    assert not any(name.startswith(("in_proj", "out_proj")) for name in names)
    assert "denoiser_width" not in json.loads(TINY.to_json())  # configs saved before the field hash as they did
    saved = json.loads(TINY.to_json())
    assert LDLMConfig.from_dict(saved).config_hash() == TINY.config_hash()
    assert LDLMConfig.from_json(WIDE.to_json()) == WIDE and WIDE.config_hash() != TINY.config_hash()


@pytest.mark.parametrize(
    ("width", "allowed"),
    [(100, "a multiple of 2 * n_heads = 8"), (1, "unset (null) or an integer in 2..16384"), (True, "unset (null) or an integer")],
)
def test_a_bad_width_is_named(width: object, allowed: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"config field denoiser_width={width!r} is invalid; allowed: {allowed}")):
        dataclasses.replace(TINY, denoiser_width=width)


def test_identity_projections_reproduce_the_spec_denoiser() -> None:
    """At denoiser_width = D with identity projections, every block sees what the unset denoiser's sees."""
    torch.manual_seed(0)
    plain = Denoiser(TINY).eval()
    projected = Denoiser(dataclasses.replace(TINY, denoiser_width=TINY.d_model)).eval()
    eye = torch.eye(TINY.d_model)
    missing = projected.load_state_dict(plain.state_dict() | {"in_proj.weight": eye, "out_proj.weight": eye}, strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    with torch.no_grad():
        torch.testing.assert_close(projected(*inputs(TINY)), plain(*inputs(TINY)), rtol=0, atol=1e-6)


def test_a_wide_denoiser_is_the_spec_denoiser_at_its_width_between_the_projections() -> None:
    """Reference: the unset denoiser of a D = 96 config, fed in_proj(x_t) and x0_prev zero-padded to 96 (its
    self-conditioning weights padded with zero columns), its output norm's gain 1; then out_proj and the wide
    model's output norm. The norms' eps is 1e-12, so normalizing twice is normalizing once."""
    config = dataclasses.replace(WIDE, rms_norm_eps=1e-12)
    torch.manual_seed(0)
    wide = Denoiser(config).eval()
    plain = Denoiser(dataclasses.replace(config, d_model=96, denoiser_width=None)).eval()
    state = {name: t for name, t in wide.state_dict().items() if not name.startswith(("in_proj", "out_proj", "out_norm"))}
    for name in [n for n in state if n.endswith("self_cond_proj.weight")]:
        state[name] = torch.cat([state[name], torch.zeros(96, 32)], dim=1)
    plain.load_state_dict(state | {"out_norm.weight": torch.ones(96)}, strict=True)
    x_t, t, x0_prev = inputs(config)
    with torch.no_grad():
        stream = plain(wide.in_proj(x_t), t, torch.cat([x0_prev, torch.zeros(2, 12, 32)], dim=-1))
        want = wide.out_norm(wide.out_proj(stream))
        torch.testing.assert_close(wide(x_t, t, x0_prev), want, rtol=0, atol=1e-5)
    assert wide.in_proj.weight.shape == (96, 64) and wide.out_proj.weight.shape == (64, 96)
    w, d, h, n = 96, 64, config.swiglu_hidden, config.denoiser_layers
    block = (w * w + w) + (d * w + w) + 2 * w + 4 * w * w + 3 * w * h
    assert sum(p.numel() for p in wide.parameters()) == 2 * d * w + (w * 2 * w + 2 * w) + (2 * w * w + w) + n * block + d


def test_the_weights_tell_the_width() -> None:
    shapes = {name: tuple(t.shape) for name, t in Denoiser(WIDE).state_dict().items()}
    found = infer_fields({f"denoiser.{name}": shape for name, shape in shapes.items()})
    assert found["denoiser_width"].value == 96 and found["d_model"].value == 64
    plain = {f"denoiser.{name}": tuple(t.shape) for name, t in Denoiser(TINY).state_dict().items()}
    assert "denoiser_width" not in infer_fields(plain)


def test_a_wide_denoiser_exports_and_runs_on_onnx_runtime(tmp_path: Path) -> None:
    model = init_model(WIDE, seed=0)
    io = graph_io(model, "denoiser")
    path = tmp_path / "denoiser.onnx"
    export_graph(io, path, opset=18, max_seq_len=WIDE.max_seq_len, metadata={})
    x_t, t, x0_prev = inputs(WIDE, batch=3, length=20, seed=1)
    mask = torch.ones(3, 20, dtype=torch.int64)
    mask[1, 15:] = 0
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"x_t": x_t.numpy(), "t": t.numpy(), "x0_prev": x0_prev.numpy(), "attention_mask": mask.numpy()}
    (got,) = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
    with torch.no_grad():
        want = model.denoise(x_t, t, x0_prev, mask).numpy()
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    np.testing.assert_allclose(got[1, :15], want[1, :15], atol=1e-5)
