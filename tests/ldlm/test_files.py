"""ldlm/files.py's single files: a figure appears whole, or the earlier file stays."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest

from ldlm.files import save_figure

matplotlib.use("Agg")  # files only, no display


def test_a_figure_is_written_whole_and_read_back(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "plot.png", dpi=50)
    plt.close(fig)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.imread(path).shape[:2] == (50, 100)  # 2 x 1 inches at 50 dpi
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_a_plot_interrupted_half_drawn_leaves_the_earlier_file(tmp_path: Path) -> None:
    class Interrupted:
        def savefig(self, target, **_):  # type: ignore[no-untyped-def]
            target.write(b"\x89PNG half a plot")
            raise KeyboardInterrupt

    path = tmp_path / "plot.png"
    path.write_bytes(b"the earlier plot")
    with pytest.raises(KeyboardInterrupt):
        save_figure(Interrupted(), path)
    assert path.read_bytes() == b"the earlier plot"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]
