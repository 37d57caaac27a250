#!/usr/bin/env python
"""`ldlm serve`'s OpenAI API (POST /v1/completions) measured by the benchmarks users already point at
OpenAI-compatible servers, NVIDIA's AIPerf (`aiperf`) and GuideLLM (`guidellm`), with the plan that ran and
a quality figure beside each speed figure.

The script serves `--checkpoint` (default: the reference, models/ldlm-austen-tiny, on the server's default
backend) on a free loopback port, then:

- plan and quality, through the server: `--seeds` requests of one prompt at the served default, each beside
  the same request (prompt, seed) at DDIM@200; the answers' `ldlm_plan` (sampler, steps, grid) and the
  fraction of equal tokens position by position (the tokens as `logprobs` names them; a completion cut
  short by end-of-text counts its missing positions as unequal);
- speed, by each tool in `--tools`, run as its documentation runs it against an OpenAI-compatible server:
  `--requests` requests of `--prompt-tokens` synthetic prompt tokens and `--max-tokens` output tokens per
  (mode, concurrency), modes plain and streamed: p50/p99 request latency, time to first token (TTFT),
  inter-token latency (ITL) and output tokens per second, as the tool reports them. A streamed completion
  arrives as one chunk once its text is final (diffusion writes every position at once), so TTFT is about the
  request's latency and the tools' ITL is what they make of one chunk;
- the held-out figures the checkpoint's training.json records (cited, not recomputed).

GuideLLM runs with its own synthetic data (`prompt_tokens`, `output_tokens`) and, for the streamed mode, its
streaming default; its requests then carry vLLM's `ignore_eos` and, streamed,
`stream_options.continuous_usage_stats`, which the server takes. A diffusion model samples every one of
`max_tokens` positions whatever `ignore_eos` says: it only keeps a choice from ending at an end-of-text token,
so GuideLLM's completions always have `--max-tokens` tokens and AIPerf's may be shorter (the server's docs,
docs/serving.md, say so).

Each tool runs from its own virtualenv, `.cache/bench-env/<tool>` under the repository (gitignored, or
`--env-root`), made on first use with `python -m venv` and pip: in the project's .venv, AIPerf 0.13.0 would move
transformers to 5.24.0 and GuideLLM 0.8.1 torch to 2.14.1. A first install downloads and takes minutes and
gigabytes (FIRST_INSTALL); a tool already installed is reused. A tool that cannot be installed, or a run that
fails, is recorded with its error and the rest still run. The tools read the checkpoint's own tokenizer.json
(GPT-2's BPE) from a Hugging Face cache written under --out/hf (the tools' HF_HOME); HF_HUB_OFFLINE=1 keeps them
from fetching anything. Their own reports and console logs stay under --out/<tool>/<mode>-c<concurrency>/, the
server's log in --out/server.log; --out/openai_bench.json is the summary, rewritten after every run that ends
(`complete` is false until the last), so a stopped run leaves what finished. Each stage (an install, the server
start, each run with its result) is a line on stderr as it starts, and a wait on a child process or the server
says it is still going at least every 30 s. Traffic goes to 127.0.0.1 only.

    python scripts/research/openai_bench.py --out runs/openai-bench --tools aiperf,guidellm --concurrency 1,4 --requests 12
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import venv
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # scripts.harness, when this file runs as a script

from ldlm.files import write_atomically  # noqa: E402
from scripts.harness.loopback import free_port, start_server, stop_server  # noqa: E402

OUT_FILE = "openai_bench.json"
PINS = {"aiperf": "aiperf==0.13.0", "guidellm": "guidellm==0.8.1"}  # the versions this script's parsing reads
MODES = ("plain", "stream")
REFERENCE = {"sampler": "ddim", "steps": 200}  # the long run the served default is compared with
PROMPT = "It is a truth universally acknowledged, that a single man"
MODEL = "ldlm"  # the served model's id on /v1/models
ENV_ROOT = ROOT / ".cache" / "bench-env"
# A first install on this project's machine (Python 3.11, Linux x86-64, a shared 2-core CPU), said before an install
# starts: the virtualenv's files (dir_size; `du -sh` says 1.2G and 6.0G) and the install's time, read from the
# files' times. GuideLLM's torch comes with its CUDA libraries, 4 of its 6 GB.
FIRST_INSTALL = {"aiperf": "about 1.1 GB on disk, about 2.5 min", "guidellm": "about 6.3 GB on disk (torch with CUDA), about 2 min"}
HEARTBEAT_S = 30.0  # the longest a wait goes without a line on stderr
NOTES = [
    "a streamed completion is one chunk once its text is final: TTFT is the request latency and ITL is 0 (AIPerf)",
    "GuideLLM runs with its synthetic data's prompt_tokens and output_tokens and its streaming default: its requests "
    "carry vLLM's ignore_eos, which samples nothing more here (every position is sampled at once) and only keeps a "
    "choice from ending at end-of-text, so its completions have max_tokens tokens; AIPerf's may end earlier",
]


class ToolUnavailable(RuntimeError):
    """A tool that could not be installed or run here; its message is the tool's or pip's own error."""


def stage(message: str) -> None:
    """One progress line on stderr, flushed at once: a run of minutes says what it is doing as it goes."""
    print(message, file=sys.stderr, flush=True)


def dir_size(path: Path) -> int:
    """Bytes of the files under ``path``, links not followed: what an install takes on disk."""
    total = 0
    for folder, _, files in os.walk(path):
        total += sum((Path(folder) / name).lstat().st_size for name in files)
    return total


def size_text(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"


ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a progress bar's terminal codes, kept out of a heartbeat line


def last_line(log: Path, limit: int = 120) -> str:
    """The last non-blank line a child wrote to ``log`` (progress bars redraw with carriage returns)."""
    with log.open("rb") as file:
        file.seek(max(0, log.stat().st_size - 4096))
        tail = ESCAPES.sub("", file.read().decode(errors="replace"))
    lines = [line.strip() for line in re.split(r"[\r\n]", tail) if line.strip()]
    return lines[-1][:limit] if lines else ""


def run_watched(
    argv: list[str], log: Path, label: str, timeout_s: float, env: dict[str, str] | None = None, every_s: float = HEARTBEAT_S
) -> tuple[int, float]:
    """``argv`` with its output in ``log``: its exit code and seconds. A line on stderr every ``every_s`` while it
    runs (with its last output line), so a wait of minutes is never silent; killed, with its children (the tools
    start workers), after ``timeout_s``, when the exit code is -9 and the log says so."""
    started = time.perf_counter()
    beat = started + every_s
    with log.open("w") as output:
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while process.poll() is None:
            now = time.perf_counter()
            if now - started > timeout_s:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                output.write(f"\nkilled after {timeout_s:g} s\n")
                break
            if now >= beat:
                stage(f"{label}: still running after {now - started:.0f} s: {last_line(log) or '(no output yet)'}")
                beat += every_s
            time.sleep(min(0.2, every_s / 4))
    return process.returncode, time.perf_counter() - started


@contextmanager
def heartbeat(label: str, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """A line on stderr every ``every_s`` until the block ends: for a wait that is no child of this script's
    (the server's readiness, its answers)."""
    done, started = threading.Event(), time.perf_counter()

    def beat() -> None:
        while not done.wait(every_s):
            stage(f"{label}: still waiting after {time.perf_counter() - started:.0f} s")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def tool_env(name: str, root: Path = ENV_ROOT, timeout_s: float = 1800.0) -> Path:
    """The executable of ``name`` in its own virtualenv under ``root``, installed there on first use."""
    home = root / name
    exe = home / "bin" / name
    if exe.is_file():
        stage(f"{name}: already installed in {shown(home)} ({size_text(dir_size(home))}), reused")
        return exe
    stage(f"{name}: installing {PINS[name]} into {shown(home)} (first use: {FIRST_INSTALL.get(name, 'a download')})")
    venv.EnvBuilder(with_pip=True, clear=True).create(home)
    log = root / f"{name}-install.log"  # beside the env: a failed install removes the env, not why it failed
    argv = [str(home / "bin" / "python"), "-m", "pip", "install", PINS[name]]
    code, seconds = run_watched(argv, log, f"installing {PINS[name]}", timeout_s)
    if code != 0 or not exe.is_file():
        shutil.rmtree(home, ignore_errors=True)  # a half-installed env would be taken for a good one next time
        raise ToolUnavailable(f"pip install {PINS[name]} failed ({code}): {log.read_text(errors='replace').strip()[-1500:]}")
    stage(f"{name}: installed {PINS[name]} in {seconds:.0f} s, {size_text(dir_size(home))} in {shown(home)}")
    return exe


TOKENIZER_REPO = "ldlm/gpt2-bpe"  # the name the tools' Hugging Face cache holds the checkpoint's tokenizer under


def tokenizer_cache(checkpoint: Path, home: Path, max_len: int) -> Path:
    """A Hugging Face cache at ``home`` (the tools' HF_HOME) holding the checkpoint's own tokenizer.json as the
    repository TOKENIZER_REPO, so no tool downloads GPT-2's; the snapshot directory, which
    ``AutoTokenizer.from_pretrained`` also reads as a path. A cache entry, not only a directory: with
    HF_HUB_OFFLINE=1, AIPerf 0.13 looks every tokenizer name up in the cache, a local path included."""
    entry = home / "hub" / f"models--{TOKENIZER_REPO.replace('/', '--')}"
    snapshot = entry / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text("local")
    shutil.copyfile(checkpoint / "tokenizer.json", snapshot / "tokenizer.json")
    special = "<|endoftext|>"
    config = {
        "tokenizer_class": "GPT2TokenizerFast",
        "model_max_length": max_len,
        "bos_token": special,
        "eos_token": special,
        "unk_token": special,
        "add_prefix_space": False,
    }
    (snapshot / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return snapshot


def completion(http: httpx.Client, seed: int, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "seed": seed, "logprobs": 0, **extra}
    response = http.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/completions answered {response.status_code}: {response.text[:500]}")
    return response.json()


def agreement(served: Sequence[str], reference: Sequence[str], positions: int) -> float:
    """Fraction of ``positions`` where both completions have the same token (missing counts as unequal)."""
    return sum(a == b for a, b in zip(served, reference)) / positions


def plan_and_quality(url: str, seeds: int, max_tokens: int) -> dict[str, Any]:
    """The served default's plan and its token agreement with DDIM@200, same prompt and seed, seed by seed."""
    rows, plans = [], []
    with httpx.Client(base_url=url, timeout=600) as http:
        for seed in range(seeds):
            served = completion(http, seed, max_tokens, {})
            reference = completion(http, seed, max_tokens, REFERENCE)
            plans.append(served["ldlm_plan"])
            tokens = [answer["choices"][0]["logprobs"]["tokens"] for answer in (served, reference)]
            rows.append(
                {"seed": seed, "token_agreement": agreement(tokens[0], tokens[1], max_tokens), "reference_plan": reference["ldlm_plan"]}
            )
    if any(plan != plans[0] for plan in plans):
        raise RuntimeError(f"the served default changed between requests: {plans}")
    mean = sum(row["token_agreement"] for row in rows) / len(rows)
    return {
        "plan": plans[0],
        "token_agreement_vs_ddim200": round(mean, 4),
        "how": f"{seeds} seeds, prompt {PROMPT!r}, {max_tokens} tokens, temperature 0: equal tokens position by position",
        "per_seed": rows,
    }


def held_out(checkpoint: Path) -> dict[str, Any]:
    """The held-out figures the checkpoint's training.json records, cited as they are."""
    path = checkpoint / "training.json"
    if not path.is_file():
        return {"source": None, "why": f"{path} does not exist"}
    recorded = json.loads(path.read_text())
    generated = recorded.get("generated_text", {})
    return {
        "source": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
        "reconstruction_token_accuracy_by_length": recorded.get("reconstruction_held_out"),
        "denoiser_mse": recorded.get("denoiser_held_out", {}).get("denoiser_mse"),
        "generated_words_in_corpus": generated.get("words_in_corpus_vocabulary"),
        "generated_words_how": f"the default sampler, {generated.get('samples')} x {generated.get('length')} tokens",
    }


def aiperf_command(exe: Path, url: str, tokenizer: Path, mode: str, concurrency: int, args: argparse.Namespace, out: Path) -> list[str]:
    """``aiperf profile`` of one (mode, concurrency): synthetic prompts of exactly --prompt-tokens tokens."""
    # fmt: off
    return [
        str(exe), "profile", "--model", MODEL, "--url", url, "--endpoint-type", "completions",
        "--tokenizer", TOKENIZER_REPO, "--concurrency", str(concurrency), "--request-count", str(args.requests),
        "--synthetic-input-tokens-mean", str(args.prompt_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(args.max_tokens), "--output-tokens-stddev", "0",
        "--random-seed", "0", "--artifact-dir", str(out), "--ui-type", "none",
        *(["--streaming"] if mode == "stream" else []),
    ]
    # fmt: on


def aiperf_figures(out: Path) -> dict[str, Any]:
    """p50/p99 request latency, TTFT and ITL (ms) and output tokens/s from AIPerf's profile_export_aiperf.json."""
    reports = sorted(out.rglob("profile_export_aiperf.json"))
    if not reports:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {out}")
    metrics = json.loads(reports[0].read_text())

    def quantiles(name: str) -> dict[str, float] | None:
        stats = metrics.get(name)
        return None if not stats else {"p50": stats["p50"], "p99": stats["p99"]}

    return {
        "requests": (metrics.get("request_count") or {}).get("avg", 0),
        "errors": (metrics.get("error_request_count") or {}).get("avg", 0),
        "request_latency_ms": quantiles("request_latency"),
        "ttft_ms": quantiles("time_to_first_token"),
        "itl_ms": quantiles("inter_token_latency"),
        "output_tokens_per_s": (metrics.get("output_token_throughput") or {}).get("avg"),
    }


def guidellm_command(exe: Path, url: str, tokenizer: Path, mode: str, concurrency: int, args: argparse.Namespace, out: Path) -> list[str]:
    """``guidellm run`` of one (mode, concurrency) as its documentation runs a server: its synthetic data of
    --prompt-tokens and --max-tokens (it asks for max_tokens with vLLM's ignore_eos) and, streamed, its backend's
    streaming default, which only the plain mode turns off."""
    backend = f"kind=openai_http,target={url},model={MODEL},request_format=/v1/completions"
    data = f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.max_tokens}"
    # fmt: off
    return [
        str(exe), "run", "--backend", backend + ("" if mode == "stream" else ",stream=false"),
        "--profile", f"kind=concurrent,streams={concurrency}", "--constraint", f"kind=max_requests,count={args.requests}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--data", data,
        "--seed", "kind=static,value=0", "--output", f"kind=json,path={out / 'benchmarks.json'}", "--disable-console-interactive",
    ]
    # fmt: on


def guidellm_figures(out: Path) -> dict[str, Any]:
    """The same figures from GuideLLM's benchmarks.json (its request latency in seconds, made ms here)."""
    benchmark = json.loads((out / "benchmarks.json").read_text())["benchmarks"][0]
    metrics, totals = benchmark["metrics"], benchmark["metrics"]["request_totals"]
    if not totals["successful"]:
        errors = {str(r.get("info", {}).get("error") or r.get("error"))[:300] for r in benchmark["requests"]["errored"]}
        raise RuntimeError(f"guidellm: none of {totals['total']} requests succeeded: {sorted(errors)}")

    def quantiles(name: str, scale: float = 1.0) -> dict[str, float] | None:
        stats = metrics[name]["successful"]
        return None if not stats["count"] else {q: stats["percentiles"][q] * scale for q in ("p50", "p99")}

    return {
        "requests": totals["successful"],
        "errors": totals["errored"],
        "request_latency_ms": quantiles("request_latency", 1000.0),
        "ttft_ms": quantiles("time_to_first_token_ms"),
        "itl_ms": quantiles("inter_token_latency_ms"),
        "output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
    }


Command = Callable[[Path, str, Path, str, int, argparse.Namespace, Path], list[str]]
TOOLS: dict[str, tuple[Command, Callable[[Path], dict[str, Any]]]] = {
    "aiperf": (aiperf_command, aiperf_figures),
    "guidellm": (guidellm_command, guidellm_figures),
}


def tool_version(exe: Path, name: str) -> str:
    """The installed version as its env's metadata says (the pin where that cannot be read)."""
    try:
        done = subprocess.run(
            [str(exe.parent / "python"), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return PINS[name]
    return done.stdout.strip() or PINS[name]


def tool_run(name: str, exe: Path, url: str, tokenizer: Path, mode: str, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    """One (mode, concurrency) by one tool: its figures, or why it failed; said on stderr as it starts and ends."""
    command, figures = TOOLS[name]
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env = {**os.environ, **offline, "HF_HOME": str(tokenizer.parents[3])}  # the cache tokenizer_cache made
    out = args.out / name / f"{mode}-c{concurrency}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    label = f"{name} {mode} c{concurrency}"
    stage(f"{label}: {args.requests} requests of {args.prompt_tokens} + {args.max_tokens} tokens ...")
    argv = command(exe, url, tokenizer, mode, concurrency, args, out)
    code, seconds = run_watched(argv, out / "console.log", label, args.tool_timeout_s, env)
    row: dict[str, Any] = {"mode": mode, "concurrency": concurrency, "wall_s": round(seconds, 2)}
    try:
        if code != 0:
            raise RuntimeError(f"exit {code}: {(out / 'console.log').read_text(errors='replace').strip()[-1500:]}")
        row |= figures(out)
    except (RuntimeError, KeyError, IndexError, json.JSONDecodeError) as error:
        row |= {"failed": f"{type(error).__name__}: {error}"}
    outcome = f"failed ({row['failed'][:200]})" if "failed" in row else f"{row['requests']:g} requests, {row['errors']:g} errors"
    stage(f"{label}: done in {seconds:.1f} s, {outcome}")
    row["argv"] = [Path(argv[0]).name, *argv[1:]]
    return row


def run_tool(name: str, url: str, tokenizer: Path, args: argparse.Namespace, entry: dict[str, Any], save: Callable[[], None]) -> None:
    """Every (mode, concurrency) of ``args`` by one tool into ``entry`` (its figures, or why it could not run),
    ``save`` called after each run ends, so a stopped benchmark keeps the runs that finished."""
    try:
        exe = tool_env(name, args.env_root)
    except ToolUnavailable as error:
        entry |= {"available": False, "why": str(error)}
        save()
        return
    entry |= {"available": True, "version": tool_version(exe, name), "runs": []}
    for mode in args.modes:
        for concurrency in args.concurrency:
            row = tool_run(name, exe, url, tokenizer, mode, concurrency, args)
            entry["command"] = row.pop("argv")  # the last run's, as an example of how the tool was called
            entry["runs"].append(row)
            save()


def run_tools(url: str, tokenizer: Path, args: argparse.Namespace, report: dict[str, Any], save: Callable[[], None]) -> None:
    """Each tool of ``args.tools`` in turn, its entry in ``report["tools"]`` from its start."""
    for name in args.tools:
        entry: dict[str, Any] = {"tool": name}
        report.setdefault("tools", []).append(entry)
        run_tool(name, url, tokenizer, args, entry, save)


def speed_rows(tools: list[dict[str, Any]], plan: dict[str, Any], agreement_figure: float) -> list[dict[str, Any]]:
    """Each run's speed figures with the plan that ran and the quality figure beside them, one row per run."""
    rows = []
    for tool in tools:
        for run in tool.get("runs", []):
            if "failed" in run:
                continue
            row = {
                "tool": tool["tool"],
                **{k: run[k] for k in ("mode", "concurrency", "requests", "request_latency_ms", "ttft_ms", "itl_ms")},
            }
            rows.append(
                row | {"output_tokens_per_s": run["output_tokens_per_s"], "plan": plan, "token_agreement_vs_ddim200": agreement_figure}
            )
    return rows


def save_summary(path: Path, report: dict[str, Any]) -> None:
    """``report`` with its speed rows made from the runs so far, written whole (never a torn file)."""
    if "plan" in report:
        report["rows"] = speed_rows(report.get("tools", []), report["plan"], report["quality"]["token_agreement_vs_ddim200"])
    write_atomically(path, json.dumps(report, indent=2) + "\n")


def quality_stage(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """The plan and quality part of the summary, said on stderr as it starts and ends."""
    stage(f"plan and quality: {args.seeds} seeds, the served default beside DDIM@200 ...")
    with heartbeat("plan and quality"):
        quality = plan_and_quality(url, args.seeds, args.max_tokens)
    plan, figure = quality["plan"], quality["token_agreement_vs_ddim200"]
    stage(f"plan and quality: {plan['sampler']}@{plan['steps']}, {figure:.1%} of DDIM@200's tokens")
    return {
        "plan": plan,
        "plan_source": "the ldlm_plan of the answers to the default body (no sampler, steps or grid named, as the tools send it)",
        "notes": NOTES,
        "quality": {**{k: v for k, v in quality.items() if k != "plan"}, "held_out": held_out(args.checkpoint)},
    }


def measure(args: argparse.Namespace, report: dict[str, Any], save: Callable[[], None]) -> None:
    """Serve the checkpoint, take its plan and quality, run each tool, into ``report``; ``save`` after each step."""
    tokenizer = tokenizer_cache(args.checkpoint, args.out / "hf", args.prompt_tokens + args.max_tokens)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = args.out / "server.log"
    stage(f"server: starting ldlm serve {shown(args.checkpoint)} on port {port} ({url}), its log in {log_path}")
    report["server"] = {"checkpoint": shown(args.checkpoint), "flags": args.serve_flags, "url": url}
    with log_path.open("w") as log:
        started = time.perf_counter()
        with heartbeat("server: starting"):
            server = start_server(args.checkpoint, port, args.serve_flags, log=log, log_path=log_path, timeout_s=args.ready_timeout_s)
        report["server"]["ready_s"] = round(time.perf_counter() - started, 2)
        stage(f"server: ready in {report['server']['ready_s']:.1f} s at {url}")
        try:
            report |= quality_stage(args, url)
            save()
            run_tools(url, tokenizer, args, report, save)
        finally:
            stage("server: stopping")
            report["server"]["exit"] = stop_server(server)


def listed(kind: Callable[[str], Any], allowed: Sequence[Any] | None = None) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        if not values or (allowed is not None and set(values) - set(allowed)):
            raise argparse.ArgumentTypeError(
                f"{text!r}: allowed: a comma-separated list" + (f" of {', '.join(allowed)}" if allowed else "")
            )
        return values

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help=f"the tools' reports and DIR/{OUT_FILE}")
    p.add_argument("--checkpoint", type=Path, default=ROOT / "models" / "ldlm-austen-tiny", help="what to serve (default: the reference)")
    p.add_argument("--serve-flags", default="", help='extra `ldlm serve` flags, one string (default: none; e.g. "--backend eager")')
    p.add_argument("--tools", type=listed(str, list(TOOLS)), default=list(TOOLS), help="comma-separated (default: aiperf,guidellm)")
    p.add_argument("--modes", type=listed(str, MODES), default=list(MODES), help="plain, stream or both (default: both)")
    p.add_argument("--concurrency", type=listed(int), default=[1, 4], help="requests in flight, comma-separated (default: 1,4)")
    p.add_argument("--requests", type=int, default=12, help="requests per (tool, mode, concurrency) (default: 12)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="synthetic prompt tokens per request (default: 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default: 32)")
    p.add_argument("--seeds", type=int, default=4, help="seeds of the served default against DDIM@200 (default: 4)")
    p.add_argument("--ready-timeout-s", type=float, default=900.0, help="wait for the server, its first export included (default: 900)")
    p.add_argument("--tool-timeout-s", type=float, default=600.0, help="one tool run's limit (default: 600)")
    p.add_argument(
        "--env-root", type=Path, default=ENV_ROOT, metavar="DIR", help="the tools' virtualenvs, DIR/<tool> (default: .cache/bench-env)"
    )
    args = p.parse_args(argv)
    if min([args.requests, args.prompt_tokens, args.max_tokens, args.seeds, *args.concurrency]) < 1:
        p.error("--requests, --prompt-tokens, --max-tokens, --seeds and every concurrency: allowed >= 1")
    args.serve_flags = args.serve_flags.split()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "what": "ldlm serve's /v1/completions under AIPerf and GuideLLM, beside the plan that ran and its token agreement with DDIM@200",
        "command": ["scripts/research/openai_bench.py", *(argv if argv is not None else sys.argv[1:])],
        "complete": False,  # true once every run has ended; until then the file holds the runs that did
        "machine": {
            "cpu": f"shared {os.cpu_count()}-core CPU (other jobs ran beside it)",
            "platform": platform.platform(),
            "load_average": list(os.getloadavg()),
        },
        "workload": {
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "requests": args.requests,
            "modes": args.modes,
            "concurrency": args.concurrency,
        },
    }
    path = args.out / OUT_FILE
    measure(args, report, lambda: save_summary(path, report))
    report["machine"]["load_average_end"] = list(os.getloadavg())
    report["complete"] = True
    save_summary(path, report)
    stage(f"summary: {path}")
    print(json.dumps(report["rows"], indent=1))
    failed = [t["tool"] for t in report.get("tools", []) if not t["available"] or any("failed" in r for r in t["runs"])]
    return 1 if failed and not report["rows"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
