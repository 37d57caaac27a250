"""``ldlm serve``'s own checks, made before anything loads (no source exists here): an empty API key is
an error that says how to serve without one, never a server that quietly runs with auth off."""

from __future__ import annotations

from pathlib import Path

import pytest

from ldlm.cli import main


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_option_is_an_error(key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("LDLM_API_KEY", raising=False)
    assert main(["serve", str(tmp_path / "no-export"), "--api-key", key]) == 2
    err = capsys.readouterr().err
    assert (
        f"ldlm serve: error: --api-key {key!r} is empty; allowed: a key of at least one non-space character. "
        "To serve without a key, leave --api-key out (and LDLM_API_KEY unset)" in err
    ), err


@pytest.mark.parametrize("key", ["", "\n"])
def test_an_empty_api_key_variable_is_an_error(key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("LDLM_API_KEY", key)
    assert main(["serve", str(tmp_path / "no-export")]) == 2
    err = capsys.readouterr().err
    assert (
        f"ldlm serve: error: LDLM_API_KEY={key!r} is empty; allowed: a key of at least one non-space character. "
        "To serve without a key, unset it (unset LDLM_API_KEY)" in err
    ), err


def test_the_option_wins_over_an_empty_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A key given as an option is used; the empty variable is not consulted, so the next error is the source's."""
    monkeypatch.setenv("LDLM_API_KEY", "")
    assert main(["serve", str(tmp_path / "no-export"), "--api-key", "s3cret"]) == 2
    err = capsys.readouterr().err
    assert "no-export" in err and "LDLM_API_KEY" not in err, err
