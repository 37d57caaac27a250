"""Service checks that need none of the optional extras (Ray, Triton): the CLI's Ray options."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ldlm.cli import main


def test_cli_ray_options_need_ray(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--replicas without --ray is refused by name (never silently ignored), before anything loads."""
    assert main(["serve", str(tmp_path), "--replicas", "2"]) == 2
    assert "ldlm serve: error: --replicas only applies with --ray; add --ray, or leave it out" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--replicas", "2", "--autoscale", "1:3"]) == 2
    assert "ldlm serve: error: --replicas, --autoscale only apply with --ray; add --ray, or leave them out" in capsys.readouterr().err


def test_cli_ray_without_ray_installed_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as where Ray is not installed
    monkeypatch.delitem(sys.modules, "ldlm.serve.deploy.ray_app", raising=False)
    assert main(["serve", str(tmp_path), "--ray"]) == 2
    assert "--ray needs Ray Serve: pip install 'ldlm[ray]'" in capsys.readouterr().err


def test_large_list_payloads_are_encoded_in_a_worker_process() -> None:
    """``result.ids()`` is a list of lists: its size must count, or 64 x 1024 ids are encoded next to the event loop."""
    import asyncio
    import json
    from concurrent.futures import Future
    from types import SimpleNamespace

    from ldlm.serve.api import offload as server

    class RecordingService:  # only what json_response touches: where the codec call is sent
        settings = SimpleNamespace(request_timeout_s=30.0)
        sent_to_workers: list[object] = []

        def submit_json(self, fn, *args):  # type: ignore[no-untyped-def]
            self.sent_to_workers.append(args[0])
            future: Future[bytes] = Future()
            future.set_result(fn(*args))
            return future

    service = RecordingService()
    small = {"texts": ["a"] * 2, "token_ids": [[1, 2, 3]] * 2}
    large = {"texts": ["a"] * 64, "token_ids": [[7] * 1024] * 64}  # 64 x 1024 = 65536 ids > JSON_WORKER_ELEMENTS
    assert server.JSON_WORKER_ELEMENTS < 64 * 1024
    for payload in (small, large):
        response = asyncio.run(server.json_response(service, payload))  # type: ignore[arg-type]
        assert json.loads(response.body) == payload
    assert service.sent_to_workers == [large]
