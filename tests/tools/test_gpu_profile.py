"""scripts/research/gpu_profile.py on CPU with the tiny config: its report and the stages that are cheap there.

What it measures is meant for a GPU (CUDA events, kernels, Inductor in CUDA graphs); on CPU the
host clock and the aten ops stand in, so only the plumbing and the report's shape are checked, and
the sums that hold on any device. The Inductor part is not run here: compiling even the tiny
denoiser takes about 30 s on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ldlm.model.config import SAMPLERS
from tests import REPO

SCRIPT = REPO / "scripts" / "research" / "gpu_profile.py"


def test_tiny_run_splits_each_step_and_lists_the_ops(tmp_path: Path) -> None:
    done = subprocess.run(
        # both stages must run, however loaded the machine: a budget far beyond the subprocess timeout
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--stages", "step_split,kernels", "--budget-s", "3600"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert data["config"] == "tiny" and data["device"] == "cpu"
    stages = data["stages"]
    assert stages["inductor"] == {"skipped": "not selected (--stages)"}
    split = stages["step_split"]
    assert split["length"] == 128 and set(split["per_step_ms"]) == set(SAMPLERS)
    for cell in split["per_step_ms"].values():  # the overhead is the step less the denoiser call, as stated
        assert abs(cell["step_ms"] - split["denoiser_call_ms"] - cell["sampler_overhead_ms"]) < 1e-3
    kernels = stages["kernels"]
    for shape in ("b1/L128", "b8/L32"):
        top = kernels[shape]["top"]
        assert top and kernels[shape]["kernels"] >= sum(row["count"] for row in top)
        assert [row["ms"] for row in top] == sorted((row["ms"] for row in top), reverse=True)
        assert any("mm" in row["name"] for row in top)  # the matmuls are among the costliest ops


def test_unknown_part_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--stages", "warp"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "names unknown stages; allowed: step_split, kernels, inductor" in done.stderr
    assert not (tmp_path / "gpu_profile.json").exists()
