"""Service checks that need none of the optional extras (Ray, Triton): the CLI's Ray options."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ldlm.cli import main


def test_cli_ray_options_need_ray(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--replicas without --ray is refused by name (never silently ignored), before anything loads."""
    assert main(["serve", str(tmp_path), "--replicas", "2"]) == 2
    assert "--replicas only apply with --ray" in capsys.readouterr().err


def test_cli_ray_without_ray_installed_says_what_to_install(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as where Ray is not installed
    monkeypatch.delitem(sys.modules, "ldlm.serve.deploy.ray_app", raising=False)
    assert main(["serve", str(tmp_path), "--ray"]) == 2
    assert "--ray needs Ray Serve: pip install 'ldlm[ray]'" in capsys.readouterr().err
