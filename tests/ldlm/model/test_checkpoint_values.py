"""Checkpoint loading refuses tensors of the wrong kind, naming them (safetensors files only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ldlm.model.checkpoint import CheckpointError, load_checkpoint


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8])
def test_non_float_tensor_is_named(tiny_checkpoint: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, copy)
    state = load_file(str(copy / "model.safetensors"))
    name = "latent_decoder.blocks.0.mlp.norm.weight"
    assert name in state
    state[name] = state[name].round().to(dtype)  # right name and shape, wrong kind
    save_file(state, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor {name} has dtype {dtype}, expected a floating-point dtype"):
        load_checkpoint(copy)


def test_float_tensors_of_another_precision_load_as_saved(tiny_checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, copy)
    state = load_file(str(copy / "model.safetensors"))
    name = "latent_decoder.blocks.0.mlp.norm.weight"
    original = state[name].clone()
    state[name] = original.to(torch.float64)
    save_file(state, str(copy / "model.safetensors"))
    model, _ = load_checkpoint(copy)
    assert torch.equal(model.get_parameter(name).float(), original)
