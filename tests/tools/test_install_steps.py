"""scripts/install_steps.sh, the install steps of scripts/bootstrap.sh and scripts/test.sh, sourced by a real
bash with a heartbeat of a fraction of a second, a fake dpkg state directory and a stand-in ``apt-get``
that writes down its arguments: what an install says, and that it waits for nothing it cannot finish."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests import REPO

STEPS = REPO / "scripts" / "install_steps.sh"
APT_LOG = "apt-get.log"
BEAT_S = 0.2


def steps(tmp_path: Path, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by bash after sourcing the install steps, with ``tmp_path/bin`` first on PATH."""
    base = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "LDLM_HEARTBEAT_S": str(BEAT_S)}
    base.setdefault("LDLM_DPKG_DIR", str(dpkg_dir(tmp_path)))
    return subprocess.run(
        ["bash", "-c", f'source "{STEPS}"\n{script}'], cwd=tmp_path, env={**base, **env}, capture_output=True, text=True, timeout=30
    )


def dpkg_dir(tmp_path: Path, *pending: str) -> Path:
    """A dpkg state directory whose updates/ holds ``pending`` (dpkg's journal of unfinished steps)."""
    updates = tmp_path / "dpkg" / "updates"
    updates.mkdir(parents=True, exist_ok=True)
    for name in pending:
        (updates / name).write_text("")
    return updates.parent


def fake_apt_get(tmp_path: Path, *, lists_know_chromium: bool = True, install_s: float = 0.0) -> None:
    """An ``apt-get`` that logs its arguments; its package lists know chromium once an update ran when
    ``lists_know_chromium`` is false; an install takes ``install_s`` seconds."""
    known = "true" if lists_know_chromium else f'[ -e "{tmp_path}/updated" ]'
    body = f"""#!/usr/bin/env bash
echo "$*" >> "{tmp_path / APT_LOG}"
case "$*" in
  update) touch "{tmp_path}/updated" ;;
  *--print-uris*) if {known}; then echo "Need to get 103 MB/115 MB of archives."; else exit 100; fi ;;
  install*) sleep {install_s}; {known} || exit 100 ;;
esac
"""
    (tmp_path / "bin").mkdir(exist_ok=True)
    apt = tmp_path / "bin" / "apt-get"
    apt.write_text(body)
    apt.chmod(0o755)


def apt_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / APT_LOG
    return log.read_text().splitlines() if log.exists() else []


def test_a_quiet_command_gets_a_heartbeat_and_keeps_its_status(tmp_path: Path) -> None:
    done = steps(tmp_path, 'with_heartbeat "sleeping" sleep 1.1; echo "status $?"')
    beats = [line for line in done.stdout.splitlines() if line.startswith("  still sleeping (")]
    assert len(beats) >= 3, done.stdout  # one every 0.2 s over 1.1 s
    assert done.stdout.rstrip().endswith("status 0")
    failed = steps(tmp_path, 'with_heartbeat "failing" bash -c "exit 3"; echo "status $?"')
    assert failed.stdout.strip() == "status 3"


def test_the_heartbeat_stops_with_its_command(tmp_path: Path) -> None:
    done = steps(tmp_path, f'with_heartbeat "quick" true; sleep {4 * BEAT_S}')
    assert "still quick" not in done.stdout


def test_an_interrupted_dpkg_is_named_with_its_fix(tmp_path: Path) -> None:
    interrupted = steps(tmp_path, "dpkg_interrupted", LDLM_DPKG_DIR=str(dpkg_dir(tmp_path, "0001", "tmp.i")))
    assert interrupted.returncode == 0
    assert "dpkg was left interrupted (1 unfinished step(s)" in interrupted.stdout
    assert "run 'dpkg --configure -a' as root" in interrupted.stdout


def test_dpkg_in_order_says_nothing(tmp_path: Path) -> None:
    for state in (dpkg_dir(tmp_path, "tmp.i"), tmp_path / "no-dpkg-here"):
        done = steps(tmp_path, "dpkg_interrupted", LDLM_DPKG_DIR=str(state))
        assert (done.returncode, done.stdout) == (1, "")


def test_chromium_is_not_tried_while_dpkg_is_interrupted(tmp_path: Path) -> None:
    fake_apt_get(tmp_path)
    done = steps(tmp_path, 'install_chromium; echo "status $?"', LDLM_DPKG_DIR=str(dpkg_dir(tmp_path, "0007")))
    assert done.stdout.strip() == "status 0"  # the tests still run, the browser test skipping
    assert "'dpkg --configure -a'" in done.stderr and "test_playground.py will skip" in done.stderr
    assert apt_calls(tmp_path) == []


def test_chromium_install_says_its_size_then_beats(tmp_path: Path) -> None:
    fake_apt_get(tmp_path, install_s=5 * BEAT_S)
    done = steps(tmp_path, "install_chromium")
    said = done.stdout.splitlines()
    assert said[0] == "apt-get install chromium (103 MB/115 MB to download), for tests/serve/api/routes/test_playground.py"
    assert any(line.startswith("  still installing chromium (apt-get install) (") for line in said[1:]), said
    assert apt_calls(tmp_path)[-1] == "install -y --no-install-recommends chromium"
    assert done.stderr == ""


def test_chromium_unknown_to_apt_lists_updates_them_first(tmp_path: Path) -> None:
    fake_apt_get(tmp_path, lists_know_chromium=False)
    done = steps(tmp_path, "install_chromium")
    assert [call.split()[0] for call in apt_calls(tmp_path)] == ["install", "update", "install", "install"]
    assert "apt-get update: apt's package lists are missing or stale for chromium" in done.stdout
    assert "apt-get install chromium (103 MB/115 MB to download)" in done.stdout
    assert done.stderr == ""
