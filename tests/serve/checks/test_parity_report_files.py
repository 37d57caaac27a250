"""The report directory gets every file of a report or none: Ctrl-C while the plots are drawn leaves no
parity.json without its PNGs, in a new directory or in one that holds an earlier report."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ldlm.export.layernorm.compare import compare_outputs
from ldlm.serve.checks import parity_report
from ldlm.serve.checks.parity_report import write_parity_report
from ldlm.serve.checks.parity_result import ParityReport

ALL_FILES = ["errors_by_graph.png", "errors_by_layernorm.png", "parity.json", "parity.md"]


def report(backend: str, with_layer_norms: bool = True) -> ParityReport:
    reference = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    graphs = [compare_outputs("denoiser/random/x0_hat", reference, reference, 1e-4, 1e-4)]
    layer_norms = [compare_outputs("decoder:model.token_decoder.norm/random", reference, reference, 1e-4, 1e-4)] if with_layer_norms else []
    return ParityReport(backend, "fp32", {}, 1e-4, 1e-4, graphs, layer_norms, token_agreement=1.0)


def visible(directory: Path) -> list[str]:
    """The names in ``directory`` a listing shows (a writer may keep a hidden record of what it wrote)."""
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))


def interrupted_plot(*_: Any) -> Any:
    raise KeyboardInterrupt


def test_ctrl_c_during_the_plots_leaves_no_new_report_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parity_report, "_plot_layer_norms", interrupted_plot)  # the second plot: one PNG is drawn by then
    with pytest.raises(KeyboardInterrupt):
        write_parity_report(report("ort"), tmp_path / "report")
    assert sorted(os.listdir(tmp_path)) == []  # neither the directory nor a temporary sibling


def test_ctrl_c_during_the_plots_keeps_the_earlier_report_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "report"
    write_parity_report(report("earlier"), out)
    (out / "notes.txt").write_text("mine\n")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    monkeypatch.setattr(parity_report, "_plot_layer_norms", interrupted_plot)
    with pytest.raises(KeyboardInterrupt):
        write_parity_report(report("later"), out)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert os.listdir(tmp_path) == ["report"]


def test_a_report_into_an_existing_directory_keeps_other_files_and_drops_its_stale_plot(tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert sorted(p.name for p in write_parity_report(report("earlier"), out)) == ALL_FILES
    (out / "notes.txt").write_text("mine\n")
    files = write_parity_report(report("eager", with_layer_norms=False), out)
    assert sorted(p.name for p in files) == ["errors_by_graph.png", "parity.json", "parity.md"]
    assert visible(out) == ["errors_by_graph.png", "notes.txt", "parity.json", "parity.md"]
    assert json.loads((out / "parity.json").read_text())["backend"] == "eager"
    assert os.listdir(tmp_path) == ["report"]


def test_ctrl_c_while_the_files_move_in_is_delivered_after_the_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The moves into an existing directory hold Ctrl-C back: it arrives after them, with every file the new report's."""
    out = tmp_path / "report"
    write_parity_report(report("earlier"), out)
    replace = os.replace

    def ctrl_c_on_the_first_move(src: Any, dst: Any) -> None:
        if Path(dst).parent == out and Path(dst).name == "parity.json":
            os.kill(os.getpid(), signal.SIGINT)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", ctrl_c_on_the_first_move)
    with pytest.raises(KeyboardInterrupt):
        write_parity_report(report("later"), out)
    assert json.loads((out / "parity.json").read_text())["backend"] == "later"
    assert "later" in (out / "parity.md").read_text() and visible(out) == ALL_FILES
