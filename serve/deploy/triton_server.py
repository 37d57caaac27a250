"""A tritonserver process from a prepared environment (``triton_env``): the command line (loopback
only), the start that waits until every model is loaded, and the stop by PID."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ldlm.serve.deploy.ports import free_port
from ldlm.serve.deploy.triton_env import TritonEnv, TritonEnvError


@dataclass
class TritonServer:
    """A running tritonserver: its process, loopback ports and log file."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path | None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path and self.log_path.is_file() else ""

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM by PID (Triton unloads its models and exits), SIGKILL after ``timeout_s``: the exit
        code (negative: the signal that ended it)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return int(self.process.returncode)


def server_command(
    env: TritonEnv, repo: Path, http_port: int, grpc_port: int, metrics_port: int, extra: list[str] | None = None
) -> list[str]:
    return [
        str(env.server_binary),
        f"--model-repository={repo}",
        f"--backend-directory={env.backends}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics_port}",
        "--allow-gpu-metrics=false",
        "--disable-auto-complete-config",  # the configs as written, nothing filled in by the backend
        # Python-backend shared-memory regions get a name of their own, so two servers never share one.
        f"--backend-config=python,shm-region-prefix-name=ldlm_triton_{os.getpid()}_{http_port}_",
        "--exit-timeout-secs=30",
        "--log-verbose=0",
        *(extra or []),
    ]


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (a test run killed
    with SIGKILL never leaves a server behind; Linux's PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def start_server(
    repo: str | os.PathLike[str],
    env: TritonEnv,
    log: IO[Any] | Path | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    timeout_s: float = 300.0,
    extra: list[str] | None = None,
) -> TritonServer:
    """tritonserver on 127.0.0.1 (free ports unless given), returned once /v2/health/ready answers
    200 (every model loaded); an error with the log's end if it exits first or after ``timeout_s``."""
    import httpx  # optional (the [test] extra): only a local tritonserver needs it

    ports: list[int] = []
    for given in (http_port, grpc_port, metrics_port):
        ports.append(given if given is not None else free_port(taken=ports))
    http, grpc, metrics = ports
    for port in ports:
        if not 1 <= port <= 65535:
            raise TritonEnvError(f"port {port} is out of range; allowed: 1..65535")
    log_path = log if isinstance(log, Path) else None
    handle = open(log, "w") if isinstance(log, Path) else log  # noqa: SIM115 (Popen keeps writing to it)
    # cwd: the log's folder, never a checkout (its ldlm/ would shadow the installed package)
    cwd = log_path.parent if log_path else Path(tempfile.gettempdir())
    process = subprocess.Popen(
        server_command(env, Path(repo).absolute(), http, grpc, metrics, extra),
        env=env.environ(),
        cwd=cwd,
        stdout=handle if handle is not None else subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        preexec_fn=_terminate_with_parent,
    )
    if isinstance(log, Path) and handle is not None:
        handle.close()  # the child holds its own copy
    server = TritonServer(process, http, grpc, metrics, log_path)
    started = time.perf_counter()
    while True:
        if process.poll() is not None:
            raise TritonEnvError(f"tritonserver exited with {process.returncode} before it was ready: {server.log_tail()}")
        try:
            if httpx.get(f"http://{server.http_url}/v2/health/ready", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.perf_counter() - started > timeout_s:
            server.stop(10)
            raise TritonEnvError(f"tritonserver was not ready after {timeout_s:g} s: {server.log_tail()}")
        time.sleep(0.25)
