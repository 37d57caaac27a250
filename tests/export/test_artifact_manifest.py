"""A damaged manifest.json is refused naming the file, what is wrong and the fix, by every command that opens an
export (here ``ldlm parity --onnx-dir``): exit code 2, not a bare JSON parse error."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.export.artifact import ArtifactError, read_manifest


def test_a_garbled_manifest_is_named_with_the_fix(
    tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "onnx"
    shutil.copytree(export_dir, export)  # a whole export, all but its manifest sound
    (export / "manifest.json").write_text('{"ldlm_version": "0.1", "graphs": {"encoder": ')  # cut off
    expected = f"{export / 'manifest.json'} is not valid JSON (Expecting value: line 1 column 47 (char 46)): the export is damaged"
    with pytest.raises(ArtifactError, match=re.escape(expected)):
        read_manifest(export)
    assert main(["parity", str(tiny_checkpoint), "--onnx-dir", str(export), "--out", str(tmp_path / "report"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"ldlm parity: error: {export / 'manifest.json'} is not valid JSON" in err
    assert "export the checkpoint again (`ldlm export`)" in err and "Traceback" not in err
    (export / "manifest.json").write_bytes(b"\xff\xfe\x00garbage")  # not even text
    with pytest.raises(ArtifactError, match="manifest.json is not valid JSON"):
        read_manifest(export)
