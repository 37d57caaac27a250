"""What a command says of a checkpoint directory short of a file, missing altogether, or with an edited
config.json: the same words from ``ldlm generate``'s loader and ``ldlm serve``'s (ONNX Runtime) opening, and an
edited field named with its allowed values rather than called a damaged copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ldlm.model.checkpoint import load_checkpoint
from ldlm.serve.runtime.backends import open_graphs
from tests import REPO

REFERENCE = REPO / "models" / "ldlm-austen-tiny"  # ships SHA256SUMS over its files


def reference_without_weights(tmp_path: Path) -> Path:
    """The reference checkpoint's small files (config, tokenizer, SHA256SUMS, ...), its weights left out."""
    out = tmp_path / "ckpt"
    shutil.copytree(REFERENCE, out, ignore=shutil.ignore_patterns("model.safetensors"))
    return out


def refusal(call, *args) -> str:
    with pytest.raises(ValueError) as refused:
        call(*args)
    return str(refused.value)


def test_serve_names_missing_weights_as_generate_does(tmp_path: Path) -> None:
    ckpt = reference_without_weights(tmp_path)
    expected = f"checkpoint {ckpt}: model.safetensors is listed in SHA256SUMS but missing"  # the words by hand
    assert refusal(load_checkpoint, ckpt) == expected
    assert refusal(open_graphs, "ort", ckpt) == expected
    (ckpt / "SHA256SUMS").unlink()
    assert refusal(load_checkpoint, ckpt) == refusal(open_graphs, "ort", ckpt) == f"checkpoint {ckpt} has no model.safetensors"


def test_a_directory_that_does_not_exist_is_called_so(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    assert "does not exist" in refusal(load_checkpoint, missing) and "no config.json" not in refusal(load_checkpoint, missing)
    assert refusal(open_graphs, "ort", missing) == f"{missing} does not exist; backend 'ort' needs a directory written by `ldlm export`"
    assert refusal(open_graphs, "trt", missing).startswith(f"{missing} does not exist; backend 'trt' needs")


def edit_config(ckpt: Path, **fields: object) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"default_sampler": "euler"},
            "config field default_sampler='euler' is invalid; allowed: sde, ddim, dpm2m, dpm3m, dpm3m-psc, dpm3m-psc-unic",
        ),
        ({"d_model": "big"}, "config field d_model='big' is invalid; allowed: an integer in 2..16384"),
        ({"wingspan": 3}, "unknown config field(s) ['wingspan']; known fields are"),
    ],
)
def test_an_edited_config_names_its_field_not_a_damaged_copy(tmp_path: Path, fields: dict, named: str) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(REFERENCE, ckpt)  # with SHA256SUMS, whose config.json line the edit breaks
    edit_config(ckpt, **fields)
    said = refusal(load_checkpoint, ckpt)
    assert named in said and "corrupted" not in said


def test_a_valid_edit_is_called_an_edit_and_unreadable_json_a_damaged_copy(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(REFERENCE, ckpt)
    edit_config(ckpt, default_steps=20)  # a valid config, still: only the checksum tells
    said = refusal(load_checkpoint, ckpt)
    assert "config.json has sha256" in said and "it was edited (it is still valid JSON)" in said and "corrupted" not in said
    (ckpt / "config.json").write_text('{"d_model": 12')  # cut short
    assert "the file is truncated or corrupted" in refusal(load_checkpoint, ckpt)
    (ckpt / "SHA256SUMS").unlink()  # without the checksums, the JSON itself is found unreadable
    assert f"{ckpt / 'config.json'} is not readable JSON" in refusal(load_checkpoint, ckpt)


def test_a_damaged_weights_file_is_still_called_so(tmp_path: Path) -> None:
    ckpt = reference_without_weights(tmp_path)
    (ckpt / "model.safetensors").write_bytes(b"\0" * 16)
    assert "model.safetensors has sha256" in refusal(load_checkpoint, ckpt) and "truncated or corrupted" in refusal(load_checkpoint, ckpt)
