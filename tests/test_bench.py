"""`ldlm bench` end to end on the tiny model, briefly (the numbers themselves come from real runs
of scripts and `ldlm bench`, never from timed unit tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ldlm.cli import main

pytest.importorskip("onnxruntime", reason="ONNX Runtime is one of the benchmarked backends (pip install -e .[cpu])")


def test_bench_writes_json_and_png(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench"
    code = main(["bench", str(tiny_checkpoint), "--onnx-dir", str(export_dir), "--runs", "2", "--batches", "1,2", "--length", "16",
                 "--gen-n", "1", "--gen-steps", "2", "--workload-requests", "6", "--workload-rate", "200", "--max-batch", "4",
                 "--quiet", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert set(report["graphs"]) == {f"{g}/b{b}/L16" for g in ("encoder", "denoiser", "decoder") for b in (1, 2)}
    for entry in report["graphs"].values():
        assert entry["eager"]["p50_ms"] > 0 and entry["ort"]["p50_ms"] > 0 and entry["ort"]["speedup_vs_eager"] > 0
        assert entry["ort"]["provider"] == "CPUExecutionProvider"
    assert report["generation"]["ort"]["tokens_per_s"] > 0
    for policy in ("static", "continuous"):
        assert report["batching"][policy]["requests"] == 6 and report["batching"][policy]["errors"] == 0
    assert (out / "bench.png").stat().st_size > 1000
    assert "mixed arrivals: continuous" in capsys.readouterr().out
