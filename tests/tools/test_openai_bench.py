"""scripts/research/openai_bench.py, so it cannot rot: a few seconds of AIPerf against `ldlm serve` on the reference
checkpoint (streamed, concurrency 1, four requests), the summary's shape checked against what the
model card says the checkpoint runs (dpm3m-psc at 12 steps on its tuned grid) and against the request count and
token budget the run was given; and the parsing of each tool's report on hand-written reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import REPO, import_script

SCRIPT = REPO / "scripts" / "research" / "openai_bench.py"
MAX_TOKENS, REQUESTS = 16, 4


def load_script() -> ModuleType:
    return import_script(SCRIPT)


def test_agreement_counts_equal_tokens_over_every_position() -> None:
    bench = load_script()
    # a completion cut at end-of-text after 2 tokens: 1 equal of 4 positions
    assert bench.agreement([" a", " b", " c", " d"], [" a", " x"], 4) == 0.25
    assert bench.agreement([" a", " b"], [" a", " b"], 2) == 1.0


def test_aiperf_report_read_as_written(tmp_path: Path) -> None:
    stats = {"unit": "ms", "avg": 150.0, "p50": 120.0, "p99": 300.0, "count": 4}
    report = {
        "request_latency": stats,
        "time_to_first_token": {**stats, "p50": 110.0},
        "inter_token_latency": {**stats, "p50": 0.0, "p99": 0.0},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 210.5},
        "request_count": {"unit": "requests", "avg": 4.0},
    }
    (tmp_path / "profile_export_aiperf.json").write_text(json.dumps(report))
    figures = load_script().aiperf_figures(tmp_path)
    assert figures["request_latency_ms"] == {"p50": 120.0, "p99": 300.0}
    assert figures["ttft_ms"] == {"p50": 110.0, "p99": 300.0}
    assert figures["output_tokens_per_s"] == 210.5 and figures["requests"] == 4.0 and figures["errors"] == 0


def guidellm_stats(p50: float, p99: float, count: int = 4) -> dict[str, Any]:
    return {"successful": {"mean": p50, "count": count, "percentiles": {"p50": p50, "p99": p99}}}


def test_guidellm_report_latency_in_seconds_is_read_as_ms(tmp_path: Path) -> None:
    metrics = {
        "request_totals": {"successful": 4, "errored": 0, "incomplete": 0, "total": 4},
        "request_latency": guidellm_stats(0.125, 0.5),  # GuideLLM writes request latency in seconds
        "time_to_first_token_ms": guidellm_stats(0.0, 0.0, count=0),
        "inter_token_latency_ms": guidellm_stats(2.0, 3.0),
        "output_tokens_per_second": guidellm_stats(256.0, 300.0),
    }
    (tmp_path / "benchmarks.json").write_text(json.dumps({"benchmarks": [{"metrics": metrics, "requests": {"errored": []}}]}))
    figures = load_script().guidellm_figures(tmp_path)
    assert figures["request_latency_ms"] == {"p50": 125.0, "p99": 500.0}
    assert figures["ttft_ms"] is None and figures["itl_ms"] == {"p50": 2.0, "p99": 3.0}
    assert figures["output_tokens_per_s"] == 256.0 and figures["requests"] == 4


def installed_aiperf() -> Path:
    bench = load_script()
    try:
        return bench.tool_env("aiperf")
    except bench.ToolUnavailable as error:  # no network, no package index
        pytest.skip(f"AIPerf cannot be installed here, so the benchmark cannot run: {error}")


@pytest.mark.slow
def test_aiperf_run_names_the_plan_and_positive_figures(tmp_path: Path) -> None:
    installed_aiperf()  # on first use: a virtualenv under .cache/bench-env (minutes, once)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--tools", "aiperf", "--concurrency", "1"]
        + [
            "--modes",
            "stream",
            "--requests",
            str(REQUESTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--seeds",
            "1",
            "--serve-flags",
            "--backend eager",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    report = json.loads((tmp_path / "openai_bench.json").read_text())
    # the model card: a generation that names no steps runs dpm3m-psc at 12 steps on its tuned grid
    assert {k: report["plan"][k] for k in ("sampler", "steps", "grid")} == {"sampler": "dpm3m-psc", "steps": 12, "grid": "tuned"}
    quality = report["quality"]
    assert {k: quality["per_seed"][0]["reference_plan"][k] for k in ("sampler", "steps")} == {"sampler": "ddim", "steps": 200}
    assert 0 < quality["token_agreement_vs_ddim200"] <= 1
    assert round(quality["held_out"]["generated_words_in_corpus"], 3) == 0.898  # the model card's held-out table
    [row] = report["rows"]
    assert row["tool"] == "aiperf" and row["mode"] == "stream" and report["tools"][0]["version"] == "0.13.0"
    assert row["plan"] == report["plan"] and row["token_agreement_vs_ddim200"] == quality["token_agreement_vs_ddim200"]
    assert row["requests"] == REQUESTS and row["concurrency"] == 1
    latency, rate = row["request_latency_ms"], row["output_tokens_per_s"]
    assert 0 < latency["p50"] <= latency["p99"] and rate > 0
    # one request at a time of at most MAX_TOKENS tokens: about MAX_TOKENS per request latency, never twice that
    assert rate <= 2 * MAX_TOKENS / (latency["p50"] / 1000), (rate, latency)
    # one chunk per completion: the first token comes with the whole text
    assert 0 < row["ttft_ms"]["p50"] <= latency["p99"] and row["itl_ms"]["p50"] >= 0
