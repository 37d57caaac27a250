"""The local Triton's environment (the set-up ``ldlm.serve.deploy.triton_local`` describes): the
``nvidia-pytriton`` wheel unpacked, the Python backend stub of this Python in place, NumPy 1.26 for
the stub, and a venv of its own per environment, made once under a cache folder by ``prepare_env``."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import venv
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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
