"""`ldlm serve`, `ldlm parity` and `ldlm bench` run the same backend in the same precision on a device: each
command line as a user types it, up to where the work would start (replaced), for every backend of the registry
and none named, on the CPU and on CUDA. No GPU is used: the choice is made from the device's name. The
expected pair is read from the registry's entries and its two defaults, not from the function that resolves."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from ldlm.cli import main
from ldlm.serve.checks.bench import run_bench
from ldlm.serve.runtime.registry import (
    CUDA_DEFAULT_BACKEND,
    CUDA_DEFAULT_PRECISION,
    DEFAULT_BACKEND,
    DEFAULT_PRECISION,
    REGISTRY,
)

DEVICES = ["cpu", "cuda", "cuda:1"]
RUN_BENCH = inspect.signature(run_bench)  # the real one's: what `ldlm bench` passes, read by name


def expected(device: str, backend: str | None) -> tuple[str, str]:
    """The registry's rule, read from its entries: on CUDA the torch fast path, each torch backend (one that runs
    the checkpoint) in half precision; elsewhere, and for an export or engines, the defaults."""
    cuda = device == "cuda" or device.startswith("cuda:")
    backend = backend or (CUDA_DEFAULT_BACKEND if cuda else DEFAULT_BACKEND)
    torch_backend = REGISTRY[backend].opens == "checkpoint"
    return backend, CUDA_DEFAULT_PRECISION if cuda and torch_backend else DEFAULT_PRECISION


class Started(Exception):
    """Where the command's work would start."""


def served(device: str, backend: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[str, str]:
    import ldlm.serve.api.server as server

    def serve(source: str, settings: Any, log_level: str) -> None:
        raise Started(settings.backend, settings.precision)

    monkeypatch.setattr(server, "serve", serve)
    monkeypatch.setenv("LDLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # `ldlm serve` sets it; restored after the test
    with pytest.raises(Started) as started:
        main(["serve", "ckpt", "--device", device, *(["--backend", backend] if backend else [])])
    return started.value.args


def checked(device: str, backend: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[str, str]:
    import ldlm.serve.checks.parity as parity

    def run_parity(checkpoint: str, backend: str, precision: str, *args: Any, **kwargs: Any) -> None:
        raise Started(backend, precision)

    monkeypatch.setattr(parity, "run_parity", run_parity)
    with pytest.raises(Started) as started:
        main(["parity", "ckpt", "--device", device, "--out", str(tmp_path / "parity"), *(["--backend", backend] if backend else [])])
    return started.value.args


def timed(device: str, backend: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """Each backend bench times, in the precision it runs it in: the torch backends in ``precision``, an export
    backend in its --precisions (fp32 unless told); and the workload's backend under the key "workload"."""
    import ldlm.serve.checks.bench as bench

    def run_bench(*args: Any, **kwargs: Any) -> None:
        given = RUN_BENCH.bind(*args, **kwargs).arguments  # by name, however `ldlm bench` passes them
        torch_precision, export_precision = given["precision"], given.get("ort_precisions", ["fp32"])[0]
        precisions = {b: torch_precision if REGISTRY[b].opens == "checkpoint" else export_precision for b in given["backends"]}
        raise Started({**precisions, "workload": given["workload_backend"]})

    monkeypatch.setattr(bench, "run_bench", run_bench)
    argv = ["bench", "ckpt", "--device", device, "--threads", "1", "--out", str(tmp_path / "bench")]
    with pytest.raises(Started) as started:
        main([*argv, *(["--backends", backend, "--workload-backend", backend] if backend else [])])
    return started.value.args[0]


@pytest.mark.parametrize("backend", [None, *REGISTRY])
@pytest.mark.parametrize("device", DEVICES)
def test_serve_parity_and_bench_resolve_alike(device: str, backend: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    want = expected(device, backend)
    assert served(device, backend, monkeypatch, tmp_path) == want, "ldlm serve"
    assert checked(device, backend, monkeypatch, tmp_path) == want, "ldlm parity"
    bench = timed(device, backend, monkeypatch, tmp_path)
    assert bench["workload"] == want[0], "ldlm bench's workload runs another backend than ldlm serve"
    assert bench[want[0]] == want[1], f"ldlm bench times {want[0]} in {bench[want[0]]}, ldlm serve runs it in {want[1]}"
    for timed_backend, precision in bench.items():
        if timed_backend != "workload":
            assert precision == expected(device, timed_backend)[1], f"ldlm bench: {timed_backend}"


def test_bench_times_the_reference_and_onnx_runtime_beside_the_served_backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert list(timed("cpu", None, monkeypatch, tmp_path)) == ["eager", "ort", "workload"]
    assert list(timed("cuda", None, monkeypatch, tmp_path)) == ["eager", "ort", "inductor", "workload"]
