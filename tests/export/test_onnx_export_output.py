"""What `export_graphs` hands back and what `ldlm export --quiet` prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ldlm.export.onnx_export import export_graphs


def test_export_result_points_at_the_final_files(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "onnx"
    result = export_graphs(tiny_checkpoint, out, graphs=("encoder", "decoder"))
    on_disk = sorted(str(p) for p in out.glob("*.onnx"))
    assert sorted(r.path for r in result.verification) == on_disk == [str(out / "decoder.onnx"), str(out / "encoder.onnx")]
    assert all(Path(r.path).is_file() for r in result.verification)
    assert repr(result) == f"ExportResult(out={str(out)!r}, graphs=['encoder', 'decoder'], opset=18, verified=2/2 passed)"


def test_quiet_export_prints_no_constant_folding_notice(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The decoder's query LayerNorm runs over constants; onnxscript logs that it does not fold it."""
    argv = [
        sys.executable,
        "-m",
        "ldlm.cli",
        "export",
        str(tiny_checkpoint),
        str(tmp_path / "onnx"),
        "--graphs",
        "decoder",
        "--with-logits",
        "--quiet",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "PASSED decoder" in done.stdout
    assert "constant folding" not in done.stderr, done.stderr
