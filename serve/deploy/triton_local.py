"""A real Triton Inference Server on this machine, without docker or a GPU.

The ``nvidia-pytriton`` wheel bundles a ``tritonserver`` binary (2.51) with the Python backend only
(no ONNX Runtime, TensorRT or PyTorch backend), so it serves a repository written with
``ldlm triton-repo --graph-backend python``. Setting it up takes three things, done once by
:func:`prepare_env` under a cache folder (network needed that once):

1. the wheel, unpacked with ``pip install --no-deps --target``: it pins ``numpy<2`` and cannot be
   installed beside our NumPy 2, and we need none of its Python code, only its files;
2. the Python backend stub of the running Python copied to ``backends/python/triton_python_backend_stub``
   (the wheel ships one per Python, 3.8 to 3.13, as pytriton's own launcher does);
3. an environment for the stub in which NumPy 1.26 comes first: the stub predates NumPy 2, and with
   NumPy 2 every tensor reaches the model with 0 bytes (BYTES tensors arrive garbled). The stub's
   embedded Python runs isolated (``sys.flags.isolated``: PYTHONPATH is ignored) and takes its
   environment from the ``python3`` first on ``PATH``. So the stub gets a venv of its own
   (``stub-<hash>/``) whose ``.pth`` files put ``numpy1/`` (NumPy 1.26, installed once) before
   the running environment's site-packages, where ``ldlm``, ONNX Runtime and torch are.

The server then runs with ``LD_LIBRARY_PATH`` at the wheel's ``nvidia_pytriton.libs`` (the stub,
copied away from its RPATH, finds its libraries there), the stub venv's ``bin/`` first on ``PATH``
and every endpoint on 127.0.0.1. Without a GPU it logs CUDA warnings and serves on CPU.

    python -P -m ldlm.serve.deploy.triton_local prepare
    python -P -m ldlm.serve.deploy.triton_local serve runs/triton --http-port 8000
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ldlm.files import write_atomically

PYTRITON = "nvidia-pytriton==0.7.0"  # tritonserver 2.51
STUB_NUMPY = "numpy==1.26.4"  # the last NumPy before 2: the stub's tensors arrive empty with NumPy 2
DEFAULT_CACHE = Path(".cache/triton-env")
STUB_PYTHONS = ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13")  # the wheel's python_backend_stubs/


class TritonEnvError(RuntimeError):
    """The local Triton cannot be set up or started."""


class TritonUnavailable(TritonEnvError):
    """The wheel cannot be installed here: no network for the first set-up, a platform other than
    manylinux_2_35 x86_64, or a Python without a stub. (Anything else is a TritonEnvError: a bug.)"""


@dataclass(frozen=True)
class TritonEnv:
    """A prepared folder: ``pytriton/`` (the unpacked wheel, the stub in place) and ``numpy1/``,
    shared by every environment of one Python version, and ``stub-<hash>/``, the stub's venv for
    one environment (the one this process runs in)."""

    root: Path
    stub_env: Path

    @property
    def tritonserver(self) -> Path:
        return self.root / "pytriton" / "pytriton" / "tritonserver"

    @property
    def server_binary(self) -> Path:
        return self.tritonserver / "bin" / "tritonserver"

    @property
    def backends(self) -> Path:
        return self.tritonserver / "backends"

    @property
    def libs(self) -> Path:
        return self.root / "pytriton" / "nvidia_pytriton.libs"

    @property
    def numpy_dir(self) -> Path:
        return self.root / "numpy1"

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The server's environment: base (default os.environ), the wheel's libraries on
        LD_LIBRARY_PATH and the stub venv's bin/ first on PATH."""
        env = dict(os.environ if base is None else base)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(self.libs), env.get("LD_LIBRARY_PATH", "")) if p)
        env["PATH"] = os.pathsep.join((str(self.stub_env / "bin"), env.get("PATH", "")))
        return env


def python_tag() -> str:
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if version not in STUB_PYTHONS:
        raise TritonUnavailable(f"Python {version} has no Triton Python backend stub in {PYTRITON}; allowed: {', '.join(STUB_PYTHONS)}")
    return version


def prepare_env(cache: str | os.PathLike[str] = DEFAULT_CACHE, timeout_s: float = 600.0) -> TritonEnv:
    """The environment under ``cache/cpXY``, made on first use (two pip installs and the stub copy;
    then the stub venv for this process's environment, checked to import NumPy 1.x, ONNX Runtime,
    torch and ldlm the way the stub will). Safe against concurrent callers; nothing half-made stays."""
    version = python_tag()
    cache = Path(cache).absolute()
    root = cache / f"cp{version.replace('.', '')}"
    # one stub venv per environment (a venv's site-packages differ), named after its prefix
    env = TritonEnv(root, root / f"stub-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]}")
    if not ((root / READY).is_file() and (env.stub_env / READY).is_file()):
        cache.mkdir(parents=True, exist_ok=True)
        with _locked(cache / ".lock"):
            if not (root / READY).is_file():  # another process may have made it while we waited
                _make_shared(root, version, timeout_s)
            if not (env.stub_env / READY).is_file():
                _make_stub_env(env, timeout_s)
    check_libraries(env)
    return env


def check_libraries(env: TritonEnv) -> None:
    """The server and the stub find every shared library (the stub links the system's libpython3.X.so,
    which a Python built without a shared library, or a host without the libpython package, lacks)."""
    for binary in (env.server_binary, env.backends / "python" / "triton_python_backend_stub"):
        done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env.environ())
        missing = [line.split("=>")[0].strip() for line in done.stdout.splitlines() if "not found" in line]
        if done.returncode != 0 or missing:
            raise TritonUnavailable(
                f"{binary.name} cannot load {', '.join(missing) or done.stderr.strip()}; "
                f"the wheel's own are in {env.libs}, the system must provide the rest "
                f"(the stub's libpython: Debian/Ubuntu apt-get install libpython{python_tag()})"
            )


READY = "READY.json"  # written last: a folder without it is unfinished


def _make_shared(root: Path, version: str, timeout_s: float) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".tmp", dir=root.parent))
    try:
        staged = TritonEnv(tmp, tmp)
        _pip(["--target", str(tmp / "pytriton"), PYTRITON], timeout_s)
        _pip(["--target", str(staged.numpy_dir), STUB_NUMPY], timeout_s)
        stub = staged.tritonserver / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file() or not staged.server_binary.is_file():
            raise TritonEnvError(f"{PYTRITON} unpacked into {tmp} has no {stub.name} for Python {version} or no tritonserver binary")
        shutil.copy2(stub, staged.backends / "python" / "triton_python_backend_stub")
        shutil.rmtree(root, ignore_errors=True)  # a half-made folder from a killed run has no marker
        tmp.rename(root)
        write_atomically(root / READY, json.dumps({"pytriton": PYTRITON, "numpy": STUB_NUMPY, "python": version}, indent=2) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_stub_env(env: TritonEnv, timeout_s: float) -> None:
    shutil.rmtree(env.stub_env, ignore_errors=True)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env.stub_env)
    site_packages = env.stub_env / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    # .pth files run in name order, each appending to sys.path: NumPy 1.26 first, then this environment's
    # site-packages through site.addsitedir, so its own .pth files (editable installs) work too.
    write_atomically(site_packages / "00-ldlm-numpy1.pth", f"{env.numpy_dir}\n")
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    write_atomically(site_packages / "01-ldlm-env.pth", "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    probe = "import numpy, onnxruntime, torch, ldlm.serve; print(numpy.__version__, ldlm.serve.__file__)"
    check = subprocess.run(
        [str(env.stub_env / "bin" / "python3"), "-I", "-c", probe],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=tempfile.gettempdir(),
    )
    if check.returncode != 0 or not check.stdout.startswith("1."):
        raise TritonEnvError(
            f"the stub's environment {env.stub_env} (isolated, as the stub runs it) does not import NumPy 1.x "
            f"first, then onnxruntime, torch and ldlm: {check.stdout.strip()} {check.stderr.strip()[-1500:]}"
        )
    record = {"numpy_and_ldlm": check.stdout.strip(), "site_packages": dirs, "for_prefix": sys.prefix}
    write_atomically(env.stub_env / READY, json.dumps(record, indent=2) + "\n")


def _pip(args: list[str], timeout_s: float) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        raise TritonUnavailable(f"`{' '.join(command)}` took over {timeout_s:g} s (the first set-up downloads ~60 MB)") from error
    if done.returncode != 0:
        raise TritonUnavailable(
            f"`{' '.join(command)}` failed with exit code {done.returncode} (the first set-up needs "
            f"network and a manylinux_2_35 x86_64 host): {done.stderr.strip()[-1500:]}"
        )


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    ports = [p if p is not None else free_port() for p in (http_port, grpc_port, metrics_port)]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -P -m ldlm.serve.deploy.triton_local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help=f"where the environment is made (default: {DEFAULT_CACHE})")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="make the environment (network needed once) and print its folder")
    serve = sub.add_parser("serve", help="run tritonserver on 127.0.0.1 with REPO until Ctrl-C")
    serve.add_argument("repo", help="a repository from `ldlm triton-repo EXPORT OUT --graph-backend python --cpu`")
    for name, default in (("http", 8000), ("grpc", 8001), ("metrics", 8002)):
        serve.add_argument(f"--{name}-port", type=int, default=default, help=f"default: {default}")
    args = parser.parse_args(argv)
    env = prepare_env(args.cache)
    if args.command == "prepare":
        print(f"{env.root} (stub environment {env.stub_env})")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so `finally` stops the server on SIGTERM too
    server = start_server(args.repo, env, sys.stdout, args.http_port, args.grpc_port, args.metrics_port)
    print(f"tritonserver (pid {server.pid}) ready: http://{server.http_url}, grpc {server.grpc_url}", flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print(f"tritonserver exited with {server.stop()}", flush=True)


if __name__ == "__main__":
    main()
