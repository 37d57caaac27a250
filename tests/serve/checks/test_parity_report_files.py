"""The report directory gets every file of a report or none: Ctrl-C while the plots are drawn leaves no
parity.json without its PNGs, in a new directory or in place of an earlier report, which is replaced only on
request and only as parity left it."""

from __future__ import annotations

import json
import os
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
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    monkeypatch.setattr(parity_report, "_plot_layer_norms", interrupted_plot)
    with pytest.raises(KeyboardInterrupt):
        write_parity_report(report("later"), out, overwrite=True)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert os.listdir(tmp_path) == ["report"]


def test_an_earlier_report_is_replaced_only_on_request_and_as_parity_left_it(tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert sorted(p.name for p in write_parity_report(report("earlier"), out)) == ALL_FILES
    with pytest.raises(FileExistsError, match="report already exists; pass overwrite=True"):
        write_parity_report(report("later"), out)
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match="holds files `ldlm parity` did not write: notes.txt"):
        write_parity_report(report("later"), out, overwrite=True)
    (out / "notes.txt").unlink()
    files = write_parity_report(report("eager", with_layer_norms=False), out, overwrite=True)
    assert sorted(p.name for p in files) == visible(out) == ["errors_by_graph.png", "parity.json", "parity.md"]  # no stale plot
    assert json.loads((out / "parity.json").read_text())["backend"] == "eager"
    assert os.listdir(tmp_path) == ["report"]


DOCS_OF_THE_REPORT = ("docs/cli.md", "docs/engines-and-parity.md")
CONDITION = "only where LayerNorm outputs were compared"


def test_the_docs_say_which_reports_get_the_layernorm_plot() -> None:
    """eager's report has three files, ort's four (above): no doc may promise the LayerNorm plot of every
    report, and the backends named as drawing none are exactly those that run no export."""
    from ldlm.serve.runtime.registry import backend_names
    from tests import REPO

    for doc in DOCS_OF_THE_REPORT:
        text = " ".join((REPO / doc).read_text().split())
        mentions = [at for at in range(len(text)) if text.startswith("`errors_by_layernorm.png`", at)]
        assert mentions, f"{doc} names no errors_by_layernorm.png"
        for at in mentions:
            before = text[max(0, at - 160) : at]
            assert CONDITION in before, f"{doc} names the LayerNorm plot without its condition: {text[at - 120 : at + 30]!r}"
    text = " ".join((REPO / "docs" / "engines-and-parity.md").read_text().split())
    named = text.split("in fp32 or int8; not ", 1)[1].split(")", 1)[0].replace(" or ", ", ").split(", ")
    assert set(named) == set(backend_names()) - set(backend_names("export"))
