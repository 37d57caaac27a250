"""scripts/research/openai_bench.py, so it cannot rot: a few seconds of AIPerf against `ldlm serve` on the reference
checkpoint (streamed, concurrency 1, four requests), the summary's shape checked against what the
model card says the checkpoint runs (dpm3m-psc at 12 steps on its tuned grid) and against the request count and
token budget the run was given; the parsing of each tool's report on hand-written reports; GuideLLM called with
its own defaults; and what a user watches during a run of minutes: each stage said on stderr as it starts, a tool
installed into its own env once (from a wheel built here, offline) and reused after, a line at least every
heartbeat while a child runs, and a summary on disk after every run, so a stopped run keeps what finished. The tools
there are stand-ins: small programs that write the report the real tool would."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import time
import zipfile
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


def test_guidellm_runs_with_its_own_synthetic_lengths_and_streaming_default(tmp_path: Path) -> None:
    bench = load_script()
    args = bench.parse_args(["--out", str(tmp_path)])
    argv = {mode: bench.guidellm_command(Path("guidellm"), "http://h", tmp_path, mode, 4, args, tmp_path) for mode in bench.MODES}
    backends = {mode: argv[mode][argv[mode].index("--backend") + 1] for mode in bench.MODES}
    assert "stream" not in backends["stream"]  # GuideLLM streams by default, as a user runs it
    assert backends["plain"].endswith(",stream=false") and "max_tokens" not in backends["plain"]
    for mode in bench.MODES:
        assert argv[mode][argv[mode].index("--data") + 1] == "kind=synthetic_text,prompt_tokens=16,output_tokens=32"


def test_a_child_that_runs_long_is_heard_from_every_heartbeat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script()
    child = "import time; print('warming up', flush=True); time.sleep(1.3); print('finished')"
    code, seconds = bench.run_watched([sys.executable, "-c", child], tmp_path / "child.log", "fake tool", 60, every_s=0.3)
    assert code == 0 and seconds >= 1.3
    beats = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fake tool: still running after")]
    assert len(beats) >= 3, beats  # 1.3 s at one line every 0.3 s
    assert "warming up" in beats[-1]  # the child's last words, as progress
    assert (tmp_path / "child.log").read_text() == "warming up\nfinished\n"


def test_a_child_past_its_limit_is_killed_and_says_so(tmp_path: Path) -> None:
    bench = load_script()
    started = time.perf_counter()
    code, _ = bench.run_watched([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "child.log", "slow", 0.5)
    assert code == -9 and time.perf_counter() - started < 10
    assert "killed after 0.5 s" in (tmp_path / "child.log").read_text()


def fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A wheel of ``name`` whose console script ``name`` prints its name: what pip installs, offline."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"fake_{name}.py": f"def main():\n    print({name!r})\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": f"[console_scripts]\n{name} = fake_{name}:main\n",
    }

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text.encode())}\n" for path, text in files.items()) + f"{info}/RECORD,,\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in {**files, f"{info}/RECORD": record}.items():
            archive.writestr(path, text)
    return wheel


def test_a_tool_is_installed_once_with_its_size_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_script()
    monkeypatch.setitem(bench.PINS, "aiperf", str(fake_wheel(tmp_path, "aiperf", "0.13.0")))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the wheel is all pip needs; nothing is fetched
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    root = tmp_path / "envs"
    exe = bench.tool_env("aiperf", root)
    assert subprocess.run([str(exe)], capture_output=True, text=True).stdout == "aiperf\n"
    assert bench.tool_version(exe, "aiperf") == "0.13.0"
    first = capsys.readouterr().err.splitlines()
    assert first[0].startswith("aiperf: installing ") and f"(first use: {bench.FIRST_INSTALL['aiperf']})" in first[0]
    size = bench.size_text(bench.dir_size(root / "aiperf"))
    assert first[-1].startswith("aiperf: installed ") and first[-1].endswith(f", {size} in {root / 'aiperf'}"), first
    assert size.endswith(" MB") and 1 <= float(size.split()[0]) < 1000  # a venv with pip: tens of MB
    created = (root / "aiperf" / "pyvenv.cfg").stat().st_mtime_ns
    assert bench.tool_env("aiperf", root) == exe
    assert capsys.readouterr().err == f"aiperf: already installed in {root / 'aiperf'} ({size}), reused\n"
    assert (root / "aiperf" / "pyvenv.cfg").stat().st_mtime_ns == created  # not made again


# A stand-in for `aiperf profile`: its report for --request-count requests, after it copies the summary on disk as
# the run starts into its artifact dir (what a run stopped now would leave).
FAKE_AIPERF = """#!{python}
import json, shutil, sys
from pathlib import Path
argv = sys.argv[1:]
out = Path(argv[argv.index("--artifact-dir") + 1])
summary = out.parents[1] / "openai_bench.json"
if summary.exists():
    shutil.copyfile(summary, out / "summary_at_start.json")
count = int(argv[argv.index("--request-count") + 1])
stats = {{"p50": 100.0, "p99": 120.0, "avg": 105.0}}
report = {{"request_count": {{"avg": count}}, "request_latency": stats, "output_token_throughput": {{"avg": 300.0}}}}
(out / "profile_export_aiperf.json").write_text(json.dumps(report))
print("fake aiperf done")
"""


def test_each_run_is_announced_and_saved_as_it_ends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script()
    exe = tmp_path / "envs" / "aiperf" / "bin" / "aiperf"
    exe.parent.mkdir(parents=True)
    exe.write_text(FAKE_AIPERF.format(python=sys.executable))
    exe.chmod(0o755)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--env-root", str(tmp_path / "envs"), "--tools", "aiperf", "--modes", "plain", "--concurrency", "1,4"]
    args = bench.parse_args([*argv, "--requests", "3"])
    plan = {"sampler": "dpm3m-psc", "steps": 12}
    report = {"complete": False, "plan": plan, "quality": {"token_agreement_vs_ddim200": 0.9}}
    summary = out / bench.OUT_FILE
    tokenizer = out / "hf" / "hub" / "models--ldlm--gpt2-bpe" / "snapshots" / "local"  # HF_HOME is out/hf
    bench.run_tools("http://127.0.0.1:9", tokenizer, args, report, lambda: bench.save_summary(summary, report))

    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("aiperf: already installed in ") and err[0].endswith(", reused")
    assert err[1] == "aiperf plain c1: 3 requests of 16 + 32 tokens ..."
    assert err[2].startswith("aiperf plain c1: done in ") and err[2].endswith(" s, 3 requests, 0 errors")
    assert err[3] == "aiperf plain c4: 3 requests of 16 + 32 tokens ..." and err[4].startswith("aiperf plain c4: done in ")
    # when the second run started, the first was on disk already, its row beside the plan
    at_start = json.loads((out / "aiperf" / "plain-c4" / "summary_at_start.json").read_text())
    assert [run["concurrency"] for run in at_start["tools"][0]["runs"]] == [1]
    assert [(row["concurrency"], row["plan"]) for row in at_start["rows"]] == [(1, plan)]
    final = json.loads(summary.read_text())
    assert [row["concurrency"] for row in final["rows"]] == [1, 4] and final["complete"] is False  # main sets it at the end
    assert final["rows"][1]["request_latency_ms"] == {"p50": 100.0, "p99": 120.0} and final["rows"][1]["requests"] == 3
    assert (out / "aiperf" / "plain-c4" / "console.log").read_text() == "fake aiperf done\n"
