"""Which backend and precision the service runs when none is named: the registry's ``default_backend`` and
``default_precision`` rules, and the settings, ``ldlm serve``, ``ldlm parity`` and ``ldlm bench`` taking them from
there (nothing else decides them); where
torch.compile's caches go. No GPU is used: the rule is a function of the device's name, and a device
that is not present is refused later, when it is resolved (tests/serve/runtime/test_torch_backends.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ldlm.serve.api.service import ServerSettings
from ldlm.serve.runtime.registry import (
    COMPILED,
    CUDA_DEFAULT_BACKEND,
    CUDA_DEFAULT_PRECISION,
    DEFAULT_BACKEND,
    DEFAULT_PRECISION,
    EAGER,
    INDUCTOR,
    ORT,
    TRT,
    default_backend,
    default_precision,
)


@pytest.mark.parametrize(("device", "expected"), [("cuda", INDUCTOR), ("cuda:1", INDUCTOR), ("cpu", ORT)])
def test_cuda_gets_the_compiled_fast_path(device: str, expected: str) -> None:
    assert (CUDA_DEFAULT_BACKEND, DEFAULT_BACKEND) == (INDUCTOR, ORT)  # the rule's two ends, as written in the registry
    assert default_backend(device) == expected


def test_the_rule_does_not_depend_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the user asked for decides, not what is installed: --device cuda on a machine without CUDA is
    inductor, refused with the device's own error, never a silent fall back to the CPU."""
    for present in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda present=present: present)
        assert default_backend("cuda") == INDUCTOR and default_backend("cpu") == ORT


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [(INDUCTOR, "cuda", "fp16"), (EAGER, "cuda:1", "fp16"), (COMPILED, "cpu", "fp32"), (ORT, "cuda", "fp32"), (TRT, "cuda", "fp32")],
)
def test_torch_on_cuda_runs_fp16_everything_else_fp32(backend: str, device: str, expected: str) -> None:
    """fp16, the half precision that kept >= 99.5% of fp32's tokens on the trained reference, for the torch backends on
    CUDA; an export or engines run as they were written, and the CPU in fp32."""
    assert (CUDA_DEFAULT_PRECISION, DEFAULT_PRECISION) == ("fp16", "fp32")
    assert default_precision(backend, device) == expected


def test_settings_take_the_default_for_their_device() -> None:
    assert (ServerSettings().backend, ServerSettings().precision) == (ORT, "fp32")
    assert (ServerSettings(device="cuda").backend, ServerSettings(device="cuda").precision) == (INDUCTOR, "fp16")
    assert ServerSettings(device="cuda:0", backend=EAGER).backend == EAGER  # a named backend stays
    assert ServerSettings(device="cuda", precision="bf16").precision == "bf16"  # so does a named precision
    assert ServerSettings(device="cuda", backend=ORT).precision == "fp32"


def test_ldlm_serve_on_cuda_serves_the_fast_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The command line as a user types it, up to the server's start (replaced): settings and the compile cache."""
    import ldlm.serve.api.server as server
    from ldlm.cli import build_parser

    started: dict[str, Any] = {}
    monkeypatch.setattr(server, "serve", lambda source, settings, log_level: started.update(settings=settings))
    monkeypatch.setenv("LDLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored (unset) after the test
    cases = (
        (["--device", "cuda"], INDUCTOR, "fp16"),
        ([], ORT, "fp32"),
        (["--device", "cuda", "--backend", EAGER], EAGER, "fp16"),
        (["--device", "cuda", "--precision", "bf16"], INDUCTOR, "bf16"),
    )
    for argv, backend, precision in cases:
        args = build_parser().parse_args(["serve", "ckpt", *argv])
        args.func(args)
        assert (started["settings"].backend, started["settings"].precision) == (backend, precision), argv
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torch-compile")


def test_a_cache_dir_set_by_the_user_stays(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ldlm.cli.serving import compile_cache

    environ = {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}
    compile_cache(environ, tmp_path)
    assert environ == {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [(["--backend", COMPILED, "--device", "cuda"], "fp16"), (["--backend", COMPILED], "fp32"), (["--device", "cuda"], "fp16")],
)
def test_ldlm_parity_checks_the_precision_ldlm_serve_runs(monkeypatch: pytest.MonkeyPatch, argv: list[str], expected: str) -> None:
    """Parity with no --precision checks what `ldlm serve` would run with the same backend and device; with no
    --backend either, serve's own default for the device (on cuda: inductor in fp16)."""
    import ldlm.serve.checks.parity as parity
    from ldlm.cli import build_parser

    class Stop(Exception):
        pass

    def stop(checkpoint: str, backend: str, precision: str, *args: Any, **kwargs: Any) -> None:
        raise Stop(precision)

    monkeypatch.setattr(parity, "run_parity", stop)
    args = build_parser().parse_args(["parity", "ckpt", *argv])
    with pytest.raises(Stop) as ran:
        args.func(args)
    assert str(ran.value) == expected
