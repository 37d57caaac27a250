"""scripts/gpu_check.py's targets table, and a quick run of its setup and report writing.

The measurements themselves run on the GPU (docs/gpu-run.md); here the verdicts are checked on a
hand-written report, and the script runs with the tiny config and two stages that are cheap on CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from gpu_targets import target_rows, targets_markdown  # noqa: E402


def report(**overrides: object) -> dict:
    stages = {
        "long_sample": {"length": 1024, "steps": 50, "compiled-bf16/ddim": {"p50_ms": 80.0}, "compiled-bf16/sde": {"p50_ms": 90.0}},
        "throughput": {"length": 128, "steps": 50, "best": {"batch": 256, "tokens_per_s": 19999.0}},
        "latency": {"graphs": {"denoiser/b1/L128": {"eager": {"p50_ms": 9.0}, "compiled-bf16": {"p50_ms": 3.0, "speedup_vs_eager": 3.0}}}},
        "batching": {"throughput_ratio": 1.4, "p99_ratio": 1.05, "requests": 100, "rate_per_s": 50, "max_batch": 16},
        "http": {"overhead": {"overhead_p50_ms": 1.5, "http_p50_ms": 3.0, "runner_p50_ms": 1.5, "graph": "encoder"}},
        "parity": {"eager-bf16": {"token_agreement": 0.995, "outputs": {"denoiser/x0_hat": {"cosine_min": 0.9991}}},
                   "compiled-bf16": {"token_agreement": 0.99, "outputs": {"denoiser/x0_hat": {"cosine_min": 0.999}}}},
    }
    stages.update(overrides)  # type: ignore[arg-type]
    return {"stages": stages}


def verdicts(r: dict) -> list[str]:
    return [row["verdict"] for row in target_rows(r)]


def test_each_target_is_judged_at_its_boundary() -> None:
    # 80 ms met; 19,999 tokens/s missed; x3.0 met; p99 x1.05 is worse, so missed; 1.5 ms met; 99% met.
    assert verdicts(report()) == ["met", "MISSED", "met", "MISSED", "met", "met"]
    rows = target_rows(report())
    assert rows[1]["measured"] == "19,999" and rows[3]["measured"] == "x1.40, p99 x1.05"
    assert "denoiser/x0_hat 0.99900" in rows[5]["note"]


def test_missing_or_failed_stages_are_not_measured_with_the_reason() -> None:
    r = report(http={"error": "RuntimeError: ldlm serve exited with 1"}, throughput={"skipped": "time budget"})
    del r["stages"]["long_sample"]
    rows = target_rows(r)
    assert [row["verdict"] for row in rows] == ["not measured", "not measured", "met", "MISSED", "not measured", "met"]
    assert "stage long_sample did not run" in rows[0]["note"]
    assert "time budget" in rows[1]["note"] and "ldlm serve exited with 1" in rows[4]["note"]
    assert targets_markdown(rows).count("\n") == len(rows) + 1


def test_tiny_dry_run_writes_the_json_and_the_summary(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--tiny", "--device", "cpu", "--out", str(tmp_path),
                           "--stages", "device_loop,probe_eps"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["config"] == "tiny" and data["device"] == "cpu"
    assert data["stages"]["device_loop"]["skipped"].startswith("not on CUDA")
    assert data["stages"]["parity"] == {"skipped": "not selected (--stages)"}
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "| 1024-token sample, 50 steps, batch 1, noise to token ids | <= 100 ms | - | not measured |" in summary
    assert not list(tmp_path.glob(".*.tmp"))


def test_unknown_stage_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--tiny", "--out", str(tmp_path), "--stages", "warp"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "names unknown stages; allowed: parity" in done.stderr
