"""The docs' `ldlm tune-schedule` lines run as written: each parses and passes the command's check of where it
writes (``--out FILE``, or the checkpoint's own schedules.json with ``--force``), which runs before any work."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from ldlm.cli import build_parser
from ldlm.cli.tuning import _target
from tests import REPO

CHECKPOINT = "models/ldlm-austen-tiny"  # what CKPT stands for in a usage line
PAGES = (REPO / "README.md", REPO / "docs" / "sampling.md")


def documented_lines() -> list[str]:
    """Each whole command (the checkpoint and options) in a code span; `ldlm tune-schedule CKPT` alone names it."""
    spans = [m for page in PAGES for m in re.findall(r"`(ldlm tune-schedule \S+ --[^`]+)`", page.read_text())]
    return [line.replace("CKPT", CHECKPOINT) for line in spans]


def parsed(line: str) -> argparse.Namespace:
    return build_parser().parse_args(shlex.split(line)[1:])


def test_the_docs_have_whole_tune_schedule_lines() -> None:
    """The reference's own run, as sampling.md gives it, is among them (read by eye)."""
    assert any("--sampler dpm3m-psc-unic --steps 8,10" in line for line in documented_lines())


@pytest.mark.parametrize("line", documented_lines())
def test_a_documented_tune_schedule_line_gets_past_its_output_check(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the docs' paths are the checkout's
    assert _target(parsed(line)).resolve() == REPO / CHECKPOINT / "schedules.json"


def test_a_line_without_out_or_force_is_refused_naming_both() -> None:
    """What the check answers a line that names neither, the doc line as it was (so the test above can fail)."""
    with pytest.raises(ValueError, match=r"pass --out FILE .* or --force"):
        _target(parsed(f"ldlm tune-schedule {REPO / CHECKPOINT} --sampler dpm3m-psc --steps 10,12"))
