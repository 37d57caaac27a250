"""scripts/demo.sh's arguments, run as a real bash subprocess on a copy of the script beside stand-ins: a
``bootstrap.sh`` and ``.venv/bin/{python,ldlm}`` that only write down that they ran (and ldlm its
arguments), so what the demo would install or run is seen without installing or running it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests import REPO

RECORD = "ran.log"


def demo_copy(tmp_path: Path) -> Path:
    """A checkout holding scripts/demo.sh and the stand-ins; returns its root."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "demo.sh", tmp_path / "scripts" / "demo.sh")
    stand_ins = {
        "scripts/bootstrap.sh": f'echo "bootstrap $*" >> "{tmp_path / RECORD}"\n',
        ".venv/bin/python": "exit 1\n",  # no TensorRT flavour: engines skipped
        ".venv/bin/ldlm": f'echo "ldlm $*" >> "{tmp_path / RECORD}"\n',
    }
    for name, body in stand_ins.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    return tmp_path


def demo(root: Path, *args: str, port_env: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), **({"LDLM_PORT": port_env} if port_env is not None else {})}
    return subprocess.run(["bash", "scripts/demo.sh", *args], cwd=root, env=env, capture_output=True, text=True, timeout=60)


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_changes_nothing(tmp_path: Path, flag: str) -> None:
    root = demo_copy(tmp_path)
    before = files_under(root)
    done = demo(root, flag)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: bash scripts/demo.sh [--port N]") and "--port N" in done.stdout
    assert files_under(root) == before  # nothing installed, nothing run, nothing written


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--port", "0"], None, "port '0'"),
        (["--port", "65536"], None, "port '65536'"),
        (["--port=http"], None, "port 'http'"),
        ([], "-1", "port '-1'"),
        (["--port"], None, "--port needs a value"),
        (["--prot", "8001"], None, "unknown argument '--prot'"),
    ],
)
def test_a_bad_port_is_refused_before_anything_runs(tmp_path: Path, args: list[str], env: str | None, named: str) -> None:
    root = demo_copy(tmp_path)
    before = files_under(root)
    done = demo(root, *args, port_env=env)
    assert done.returncode == 2 and named in done.stderr, (done.returncode, done.stderr)
    assert "1..65535" in done.stderr or "allowed: --port N, --help" in done.stderr
    assert files_under(root) == before


@pytest.mark.parametrize(("args", "env", "port"), [(["--port", "8123"], None, "8123"), ([], None, "8000"), ([], "9001", "9001")])
def test_the_port_reaches_ldlm_serve(tmp_path: Path, args: list[str], env: str | None, port: str) -> None:
    """--port, else LDLM_PORT, else 8000: what `ldlm serve` is started with and what the printed curl names."""
    root = demo_copy(tmp_path)
    done = demo(root, *args, port_env=env)
    assert done.returncode == 0, done.stderr
    ran = (root / RECORD).read_text().splitlines()
    assert ran[0] == "bootstrap cpu"
    assert ran[-1] == f"ldlm serve runs/onnx --backend ort --port {port}"
    assert f"curl -s http://127.0.0.1:{port}/v1/generate" in done.stdout
