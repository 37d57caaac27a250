"""Which TensorRT is used: a machine with neither flavour, or without the one named, is told so in plain words."""

from __future__ import annotations

import re

import pytest

from ldlm.export import trt_flavor
from ldlm.export.trt_flavor import INSTALL_HINT, FlavorError, load_flavor


def test_a_missing_flavour_is_said_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing_installed(name: str) -> None:
        raise ImportError(f"No module named '{name}'")

    monkeypatch.setattr(trt_flavor.importlib, "import_module", nothing_installed)
    with pytest.raises(FlavorError) as none:
        load_flavor()
    assert str(none.value) == (
        "no TensorRT flavour (tensorrt, tensorrt_rtx) is installed (tensorrt: No module named 'tensorrt'; "
        f"tensorrt_rtx: No module named 'tensorrt_rtx'); install one with {INSTALL_HINT}"
    )
    assert "not installed" not in str(none.value)  # no double negative
    with pytest.raises(
        FlavorError,
        match=re.escape(
            f"TensorRT flavour 'tensorrt' is not installed (tensorrt: No module named 'tensorrt'); install it with {INSTALL_HINT}"
        ),
    ):
        load_flavor("tensorrt")
    with pytest.raises(FlavorError, match=re.escape("flavor='tensorrt9' is unknown; allowed: tensorrt, tensorrt_rtx")):
        load_flavor("tensorrt9")
