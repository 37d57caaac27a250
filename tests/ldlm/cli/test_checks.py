"""``ldlm parity``'s gate on the command line: a token agreement below the precision's gate fails with the figure,
the gate and the ways out; --min-token-agreement judges by the share asked for and the report says so."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ldlm.cli import main
from ldlm.export.layernorm.compare import compare_outputs
from ldlm.serve.checks import parity
from ldlm.serve.checks.parity_result import ParityReport


def shipped_int8_figures(*_: Any, **__: Any) -> ParityReport:
    """What int8 parity measured on the shipped checkpoint: every output within the cosine gate, 96.875% of tokens."""
    reference = np.linspace(-1, 1, 64).reshape(2, 32)
    graphs = [compare_outputs("denoiser/random/x0_hat", reference, reference + 1e-4, math.inf, math.inf, 0.999)]
    return ParityReport("ort", "int8", {}, math.inf, math.inf, graphs, [], {"random": 1.0}, 0.96875, 0.99)


def test_parity_below_the_int8_gate_names_the_way_out_and_min_token_agreement_takes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parity, "run_parity", shipped_int8_figures)
    args = ["parity", str(tmp_path), "--precision", "int8", "--quiet", "--out"]
    with pytest.raises(SystemExit) as failed:
        main([*args, str(tmp_path / "strict")])
    assert failed.value.code == 1
    said = capsys.readouterr().out
    assert "token agreement 96.88% is below the int8 gate of 99%; to accept it, pass --min-token-agreement 0.96" in said
    assert "atol inf" not in said
    assert main([*args, str(tmp_path / "lenient"), "--min-token-agreement", "0.96"]) == 0
    written = json.loads((tmp_path / "lenient" / "parity.json").read_text())
    assert written["passed"] and written["token_agreement_required"] == 0.96
    assert "token agreement required: 96% (--min-token-agreement) in place of the int8 gate of 99%" in written["notes"]
    assert capsys.readouterr().out.splitlines()[-2].startswith("PASSED parity ort (int8)")
    with pytest.raises(SystemExit) as refused:
        main([*args, str(tmp_path / "none"), "--min-token-agreement", "0"])
    assert refused.value.code == 2 and "0 is out of range; allowed: a number in (0, 1], 0 excluded" in capsys.readouterr().err
