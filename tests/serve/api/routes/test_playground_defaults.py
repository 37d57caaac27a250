"""The playground page carries what this server runs for a request naming no steps, per sampler, as
``ldlm.sampling.resolve`` plans it (the checkpoint's tuned defaults included), so the page can leave steps
to the server and show its default instead of sending a number of its own. No browser needed."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from ldlm.model.checkpoint import load_config
from ldlm.model.config import SAMPLERS
from ldlm.sampling import GenerateRequest, resolve
from ldlm.sampling.tuned_grids import TunedGrid, TunedSchedules, weights_sha256
from ldlm.serve.api.routes.playground import page_with_defaults, server_defaults
from ldlm.serve.api.service import LDLMService, ServerSettings
from tests.servers import RunningServer, free_port

SLOT = re.compile(r'<script id="server-defaults" type="application/json">(.*?)</script>', re.S)


def tuned_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> tuple[Path, TunedSchedules]:
    """The tiny checkpoint whose default sampler has a tuned 3-step grid that is its default: the server's
    default steps for it are 3, not the config's default_steps."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    config = load_config(ckpt)
    grid = TunedGrid(config.default_sampler, 3, (1.0, 0.6, 0.2, config.t_min))
    tuned = TunedSchedules(weights_sha256(ckpt / "model.safetensors"), config.t_min, (grid,), {config.default_sampler: 3})
    tuned.save(ckpt / "schedules.json")
    return ckpt, tuned


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    ckpt, tuned = tuned_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("tuned"))
    running = RunningServer(LDLMService(str(ckpt), ServerSettings(port=free_port(), backend="eager")))
    yield running, ckpt, tuned
    running.stop()
    running.service.close()


def test_the_page_carries_the_servers_default_plans(served: Any) -> None:
    running, ckpt, tuned = served
    page = httpx.get(running.url + "/", timeout=30).text
    carried = json.loads(SLOT.search(page).group(1))  # type: ignore[union-attr]
    config = load_config(ckpt)
    for sampler in (None, *SAMPLERS):  # the independent reference: resolve itself, on the checkpoint's config and grids
        plan = resolve(GenerateRequest(1, 1, sampler=sampler), config, schedules=tuned)
        shown = carried["default"] if sampler is None else carried["samplers"][sampler]
        assert shown == {"sampler": plan.sampler.name, "steps": plan.steps, "grid": plan.grid}, sampler
    assert carried["default"] == {"sampler": config.default_sampler, "steps": 3, "grid": "tuned"}
    assert carried["samplers"]["ddim"]["steps"] == config.default_steps != 3  # untuned: the config's


def test_a_default_the_server_refuses_is_carried_as_its_reason() -> None:
    class Refusing:
        def plan(self, spec: GenerateRequest) -> Any:
            raise ValueError("steps=21 is invalid; allowed: 1..10 (this server's max_steps)")

    carried = server_defaults(type("Service", (), {"scheduler": Refusing()})())
    assert carried["default"] == {"error": "steps=21 is invalid; allowed: 1..10 (this server's max_steps)"}
    assert set(carried["samplers"]) == set(SAMPLERS)


def test_the_slot_cannot_close_its_script() -> None:
    page = page_with_defaults({"default": {"error": "</script><script>alert(1)</script>"}, "samplers": {}})
    carried = SLOT.search(page).group(1)  # type: ignore[union-attr]
    assert "</" not in carried and json.loads(carried)["default"]["error"] == "</script><script>alert(1)</script>"
    assert SLOT.search(page_with_defaults(None)).group(1) == "null"  # type: ignore[union-attr]
