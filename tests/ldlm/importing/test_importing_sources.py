"""What ``ldlm import-checkpoint`` reads as a source: the format from the file's first bytes, not its name, and
every file that is not weights refused with its name, what it is and the fix (exit code 2, no traceback, nothing
written): a text file such as /etc/passwd, a JSON file such as an export's manifest.json, random bytes named .pt,
a damaged torch.save archive."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ldlm.cli import main
from ldlm.importing.convert import file_format, read_source

ALLOWED = "allowed: a .safetensors file, a torch.save state dict (.pt, .bin), or a directory holding model.safetensors"


def sources(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each file that is not weights, with what the refusal must say of it."""
    folder = tmp_path / "in"
    folder.mkdir()
    passwd = folder / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")
    manifest = folder / "manifest.json"
    manifest.write_text('{"ldlm_version": "0.1", "graphs": {"encoder": ')  # garbled: cut off
    noise = folder / "weights.pt"
    noise.write_bytes(random.Random(5).randbytes(5000))
    torch.save({"wte.weight": torch.zeros(64, 64)}, folder / "whole.pt")
    damaged = folder / "damaged.pt"
    damaged.write_bytes((folder / "whole.pt").read_bytes()[:300])  # a download cut short
    return {
        "text": (
            passwd,
            f"{passwd} is a text file (it starts 'root:x:0:0:root:/root:/bin/bash'), not weights; {ALLOWED}. Pass the weights file itself",
        ),
        "json": (manifest, f"{manifest} is a JSON file, not weights; {ALLOWED}. Pass the weights file itself"),
        "noise": (noise, f"{noise} is binary data of neither format (its first bytes are "),
        "damaged": (damaged, f"{damaged} starts as a torch.save file but cannot be read ("),
    }


@pytest.mark.parametrize("kind", ["text", "json", "noise", "damaged"])
def test_a_source_that_is_not_weights_is_refused_by_name(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, message = sources(tmp_path)[kind]
    out = tmp_path / "out"
    assert main(["import-checkpoint", str(source), str(out), "--quiet", "--skip-parity"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ldlm import-checkpoint: error: {message}"), err
    assert "Traceback" not in err and "needs full pickle" not in err
    fix = "it is damaged or incomplete" if kind in ("noise", "damaged") else "Pass the weights file itself"
    assert fix in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # nothing at OUT, nor beside it


def test_the_format_is_read_from_the_first_bytes(tmp_path: Path) -> None:
    tensors = {"feature_model.wte.weight": torch.arange(6.0).reshape(2, 3)}
    save_file(tensors, str(tmp_path / "named-wrong.pt"))  # safetensors under a torch.save name
    assert file_format(tmp_path / "named-wrong.pt") == "safetensors"
    read, others = read_source(tmp_path / "named-wrong.pt")
    assert read.keys() == tensors.keys() and read["feature_model.wte.weight"].equal(tensors["feature_model.wte.weight"]) and others == []
    torch.save(tensors, tmp_path / "new.pt")
    torch.save(tensors, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert file_format(tmp_path / "new.pt") == file_format(tmp_path / "legacy.pt") == "torch.save"
    assert read_source(tmp_path / "legacy.pt")[0]["feature_model.wte.weight"].equal(tensors["feature_model.wte.weight"])
    (tmp_path / "empty.safetensors").write_bytes(b"")
    assert file_format(tmp_path / "empty.safetensors") == "an empty file"
    shutil.copy(tmp_path / "new.pt", tmp_path / "copy.bin")
    assert file_format(tmp_path / "copy.bin") == "torch.save"
