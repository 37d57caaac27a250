from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ldlm.files import atomic_directory
from ldlm.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_round_trip_is_exact(tiny_model: LDLM, tiny_checkpoint: Path) -> None:
    loaded, tokenizer = load_checkpoint(tiny_checkpoint)
    assert loaded.config == tiny_model.config
    original = tiny_model.state_dict()
    restored = loaded.state_dict()
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    assert not loaded.training
    assert tokenizer.encode(["round trip"]) == TextTokenizer.gpt2().encode(["round trip"])


def test_wrong_shape_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    state = load_file(ckpt / "model.safetensors")
    state["denoiser.out_norm.weight"] = torch.ones(3)
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor denoiser\.out_norm\.weight has shape \(3,\), expected \(64,\)"):
        load_checkpoint(ckpt)


def test_missing_and_unexpected_tensors_are_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    state = load_file(ckpt / "model.safetensors")
    del state["token_decoder.norm.bias"]
    state["extra.weight"] = torch.zeros(2)
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors: token_decoder\.norm\.bias") as info:
        load_checkpoint(ckpt)
    assert "unexpected tensors: extra.weight" in str(info.value)


def test_foreign_file_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "model.safetensors").write_bytes(b"PK\x03\x04 this is a zip, not safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        load_checkpoint(ckpt)


def test_pickle_weights_are_refused_by_name(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin found: pickle files are never loaded"):
        load_checkpoint(ckpt)


def test_missing_directory_and_config_are_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(ckpt)


def test_existing_output_needs_overwrite(tiny_model: LDLM, tokenizer: TextTokenizer, tmp_path: Path) -> None:
    out = save_checkpoint(tiny_model, tokenizer, tmp_path / "out")
    with pytest.raises(FileExistsError, match="--force"):
        save_checkpoint(tiny_model, tokenizer, out)
    save_checkpoint(tiny_model, tokenizer, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old copies left


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="disk full"), atomic_directory(tmp_path / "out") as tmp:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_leftovers_of_other_targets_and_live_writers_are_kept(tmp_path: Path) -> None:
    """``.ckpt.v2.<pid>.<rand>.tmp`` is a writer of ``ckpt.v2``, not of ``ckpt``: writing ``ckpt`` must
    leave it alone even though ``v2`` is no PID; names with glob characters are matched literally."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    others = [
        tmp_path / f".ckpt.v2.{dead.pid}.abcd1234.tmp",
        tmp_path / f".ckpt.v2.{os.getpid()}.abcd1234.tmp",
        tmp_path / f".ckpt.12.{dead.pid}.abcd1234.tmp",
    ]
    for folder in others:
        folder.mkdir()
    bracketed = tmp_path / "ck[pt]"
    mine = tmp_path / f".ck[pt].{dead.pid}.abcd1234.tmp"  # a killed writer of `ck[pt]`
    mine.mkdir()
    with atomic_directory(tmp_path / "ckpt") as tmp:
        (tmp / "done").write_text("ok")
    with atomic_directory(bracketed) as tmp:
        (tmp / "done").write_text("ok")
    assert all(folder.is_dir() for folder in others) and not mine.exists()


def test_sha256sums_refuse_a_truncated_or_corrupted_copy(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import hashlib

    from ldlm.model.checkpoint import write_checksums

    good = copy_checkpoint(tiny_checkpoint, tmp_path / "good")
    write_checksums(good, ["config.json", "model.safetensors", "tokenizer.json"])
    lines = (good / "SHA256SUMS").read_text().splitlines()
    assert lines == [
        f"{hashlib.sha256((good / n).read_bytes()).hexdigest()}  {n}" for n in ("config.json", "model.safetensors", "tokenizer.json")
    ]
    load_checkpoint(good)  # matches: loads
    weights = good / "model.safetensors"
    recorded = lines[1].split()[0]

    corrupted = copy_checkpoint(good, tmp_path / "corrupted")
    data = bytearray((corrupted / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside a tensor: safetensors itself would load it
    (corrupted / "model.safetensors").write_bytes(bytes(data))
    found = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(
        CheckpointError, match=f"model.safetensors has sha256 {found}, SHA256SUMS says {recorded}: the file is truncated or corrupted"
    ):
        load_checkpoint(corrupted)

    truncated = copy_checkpoint(good, tmp_path / "truncated")
    (truncated / "model.safetensors").write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"SHA256SUMS says {recorded}"):
        load_checkpoint(truncated)

    missing = copy_checkpoint(good, tmp_path / "missing")
    (missing / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is listed in SHA256SUMS but missing"):
        load_checkpoint(missing)

    escaping = copy_checkpoint(good, tmp_path / "escaping")
    (escaping / "SHA256SUMS").write_text(f"{'0' * 64}  ../good/model.safetensors\n")
    with pytest.raises(CheckpointError, match="is not a 'SHA256  NAME' line of a file in the checkpoint"):
        load_checkpoint(escaping)
