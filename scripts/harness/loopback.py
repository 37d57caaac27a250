"""``ldlm serve`` in a child process on 127.0.0.1, for the measuring scripts (load_test, fairness,
preview_cost, attack_check, gpu_service, triton_compare) and the tests: a free port, a start that waits
for readiness and fails fast, with the server's own output, when the server dies first, and a tiny
export to serve. Traffic goes to loopback only."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx

from ldlm.export.onnx_export import export_graphs
from ldlm.model.checkpoint import init_model, save_checkpoint
from ldlm.model.config import preset
from ldlm.model.tokenizer import TextTokenizer
from ldlm.serve.deploy.ports import free_port as free_port  # with the server helpers, for the scripts and tests

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def serve_command(source: str | Path, port: int, flags: list[str] | None = None, python: str = sys.executable) -> list[str]:
    # -P: from the repository root, `-m` would otherwise import the source folder ldlm/ (which has no
    # ldlm.serve; that lives in serve/) instead of the installed package.
    return [python, "-P", "-m", "ldlm.cli", "serve", str(source), "--port", str(port), "--log-level", "warning", *(flags or [])]


def wait_ready(process: subprocess.Popen, url: str, timeout_s: float = 120.0, log: Path | None = None) -> float:
    """Seconds until ``url``'s /v2/health/ready answers 200; an error naming the exit code (and the
    end of ``log``) if the server exits first, or after ``timeout_s``."""
    started = time.perf_counter()
    while True:
        if process.poll() is not None:
            tail = f": {log.read_text(errors='replace')[-2000:]}" if log is not None and log.is_file() else ""
            raise RuntimeError(f"ldlm serve exited with {process.returncode} before it was ready{tail}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                return time.perf_counter() - started
        except httpx.TransportError:
            pass
        if time.perf_counter() - started > timeout_s:
            process.kill()
            raise RuntimeError(f"ldlm serve was not ready after {timeout_s:g} s")
        time.sleep(0.2)


def start_server(
    source: str | Path,
    port: int,
    flags: list[str] | None = None,
    log: IO[Any] | None = None,
    log_path: Path | None = None,
    timeout_s: float = 120.0,
    **popen: Any,
) -> subprocess.Popen:
    """``ldlm serve SOURCE --port PORT FLAGS`` started and ready; its output goes to ``log`` (none by default)."""
    output = log if log is not None else subprocess.DEVNULL
    process = subprocess.Popen(serve_command(source, port, flags), stdout=output, stderr=subprocess.STDOUT, **popen)
    wait_ready(process, f"http://127.0.0.1:{port}", timeout_s, log_path)
    return process


def stop_server(process: subprocess.Popen, timeout_s: float = 60.0) -> int | str:
    """SIGTERM (the server drains in-flight requests, then exits), killed after ``timeout_s``:
    its exit code, or a note that it had to be killed."""
    if process.poll() is not None:
        return process.returncode
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return f"killed after {timeout_s:g} s"


def tiny_export(work: Path, progress: bool = True) -> Path:
    """A random-init tiny checkpoint under ``work``, exported to ONNX: something to serve in seconds."""
    checkpoint = save_checkpoint(init_model(preset("tiny"), seed=0), TextTokenizer.gpt2(), work / "ckpt")
    return export_graphs(checkpoint, work / "onnx", progress=progress).out
