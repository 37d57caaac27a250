"""Which backend the service runs when none is named: the registry's ``default_backend`` rule, and the
settings and the ``ldlm serve`` command taking it from there (nothing else decides it); where
torch.compile's caches go. No GPU is used: the rule is a function of the device's name, and a device
that is not present is refused later, when it is resolved (tests/serve/runtime/test_torch_backends.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ldlm.serve.api.service import ServerSettings
from ldlm.serve.runtime.registry import CUDA_DEFAULT_BACKEND, DEFAULT_BACKEND, EAGER, INDUCTOR, ORT, default_backend


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


def test_settings_take_the_default_for_their_device() -> None:
    assert ServerSettings().backend == ORT
    assert ServerSettings(device="cuda").backend == INDUCTOR
    assert ServerSettings(device="cuda:0", backend=EAGER).backend == EAGER  # a named backend stays


def test_ldlm_serve_on_cuda_serves_the_fast_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The command line as a user types it, up to the server's start (replaced): settings and the compile cache."""
    import ldlm.serve.api.server as server
    from ldlm.cli import build_parser

    started: dict[str, Any] = {}
    monkeypatch.setattr(server, "serve", lambda source, settings, log_level: started.update(settings=settings))
    monkeypatch.setenv("LDLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored (unset) after the test
    for argv, backend in ((["--device", "cuda"], INDUCTOR), ([], ORT), (["--device", "cuda", "--backend", EAGER], EAGER)):
        args = build_parser().parse_args(["serve", "ckpt", *argv])
        args.func(args)
        assert started["settings"].backend == backend, argv
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torch-compile")


def test_a_cache_dir_set_by_the_user_stays(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ldlm.cli.serving import compile_cache

    environ = {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}
    compile_cache(environ, tmp_path)
    assert environ == {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}
