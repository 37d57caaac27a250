"""`ldlm bench` end to end on the tiny model, briefly (the numbers themselves come from real runs
of scripts and `ldlm bench`, never from timed unit tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.serve.checks.bench_latency import available_cpus

pytest.importorskip("onnxruntime", reason="ONNX Runtime is one of the benchmarked backends (pip install -e .[cpu])")


def test_bench_writes_json_and_png(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine: the figures are reliable, ratios kept
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            str(tiny_checkpoint),
            "--onnx-dir",
            str(export_dir),
            "--runs",
            "2",
            "--batches",
            "1,2",
            "--length",
            "16",
            "--gen-n",
            "1",
            "--gen-steps",
            "2",
            "--workload-requests",
            "6",
            "--workload-rate",
            "200",
            "--max-batch",
            "4",
            "--workload-lengths",
            "16,4096",
            "--solvers",
            "ddim@30,ddim@3,dpm3m-psc@3",
            "--solver-reference-steps",
            "30",
            "--prior-temperature",
            "0.5",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["reliable"] is True and report["threads"] == available_cpus() and "unreliable_reason" not in report
    assert set(report["graphs"]) == {f"{g}/b{b}/L16" for g in ("encoder", "denoiser", "decoder") for b in (1, 2)}
    for entry in report["graphs"].values():
        assert entry["eager"]["p50_ms"] > 0 and entry["ort"]["p50_ms"] > 0 and entry["ort"]["speedup_vs_eager"] > 0
        assert entry["ort"]["provider"] == "CPUExecutionProvider"
    assert report["generation"]["ort"]["tokens_per_s"] > 0
    for policy in ("static", "continuous"):
        assert report["batching"][policy]["requests"] == 6 and report["batching"][policy]["errors"] == 0
    assert report["batching"]["lengths"] == [16]  # the lengths used: 4096 is above the tiny config's max_seq_len (128)
    # The derived figures follow from the measured ones (the arithmetic itself: tests/serve/checks/test_bench_values.py).
    for key, entry in report["graphs"].items():
        batch = int(key.split("/")[1][1:])
        assert entry["ort"]["speedup_vs_eager"] == pytest.approx(entry["eager"]["p50_ms"] / entry["ort"]["p50_ms"], rel=1e-2, abs=2e-3)
        assert entry["ort"]["samples_per_s"] == pytest.approx(1000 * batch / entry["ort"]["p50_ms"], rel=1e-2)
    generation = report["generation"]["ort"]
    assert generation["tokens_per_s"] == pytest.approx(generation["n"] * generation["length"] / generation["p50_s"], rel=1e-2)
    batching = report["batching"]
    assert batching["throughput_ratio"] == pytest.approx(
        batching["continuous"]["tokens_per_s"] / batching["static"]["tokens_per_s"], rel=1e-2
    )
    assert batching["p99_ratio"] == pytest.approx(batching["continuous"]["latency_p99_s"] / batching["static"]["latency_p99_s"], rel=1e-2)
    assert batching["continuous_mixed_solvers"]["errors"] == 0 and batching["continuous_mixed_solvers"]["requests"] == 6
    solvers = report["solvers"]["entries"]
    assert report["solvers"]["reference"] == "ddim@30"
    # the reference itself: the same run only where both start from the prior at tau = 0.5
    assert solvers["ddim@30"]["token_agreement"] == 1.0 and solvers["ddim@30"]["latent_rel_error"] == 0.0
    assert report["solvers"]["prior_temperature"] == 0.5 and generation["prior_temperature"] == 0.5
    assert solvers["ddim@3"]["latent_rel_error"] > 0 and solvers["dpm3m-psc@3"]["latent_rel_error"] < solvers["ddim@3"]["latent_rel_error"]
    for entry in solvers.values():
        assert entry["ms_per_sample"] == pytest.approx(1000 * entry["p50_s"] / report["solvers"]["n"], rel=1e-2)
    assert (out / "bench.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "mixed arrivals: continuous" in printed and "dpm3m-psc@3" in printed


def test_a_bench_on_a_busy_machine_takes_fewer_threads_and_writes_no_speedups(
    tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Load average 6 on the CPUs this process may use: the default is 1 thread, and bench.json records the
    load, reliable: false with the reason, and no speed-up ratio, while the timings stay."""
    cpus = available_cpus()
    monkeypatch.setattr(os, "getloadavg", lambda: (cpus + 4.0, cpus + 4.0, cpus + 4.0))
    out = tmp_path / "bench"
    args = ["bench", str(tiny_checkpoint), "--onnx-dir", str(export_dir), "--runs", "1", "--batches", "1", "--length", "8"]
    args += ["--gen-n", "1", "--gen-steps", "1", "--workload-requests", "2", "--workload-rate", "200", "--solvers", "", "--quiet"]
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["threads"] == 1 and report["load_average_1m"] == cpus + 4.0 and report["load_average_1m_end"] == cpus + 4.0
    assert report["reliable"] is False
    assert (
        report["unreliable_reason"]
        == f"at the start, 1-minute load average {cpus + 4.0:.1f} on {cpus} CPUs, and the bench adds 1 thread: the CPUs are oversubscribed"
    )
    assert all("speedup_vs_eager" not in cell for entry in report["graphs"].values() for cell in entry.values())
    assert all(entry["eager"]["p50_ms"] > 0 and entry["ort"]["p50_ms"] > 0 for entry in report["graphs"].values())
    assert "precision_speedups" not in report and "throughput_ratio" not in report["batching"]
    assert "encoder/b1/L8:ort:speedup_vs_eager" in report["ratios_left_out"] and "batching:throughput_ratio" in report["ratios_left_out"]
    captured = capsys.readouterr()
    assert "UNRELIABLE figures: at the start" in captured.out and " (x" not in captured.out
    assert "ldlm bench: warning: the figures are unreliable" in captured.err
