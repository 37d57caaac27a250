"""scripts/research/soak.py's judging of memory and latency trends, on hand-made samples (the real soak runs in
tests/tools/test_soak.py): a run too short to judge says so, with the length it needed, and is never a miss."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from tests import REPO, import_script


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    return import_script(REPO / "scripts" / "research" / "soak.py")


def samples(until_s: float, rss_at: Any) -> list[dict[str, Any]]:
    """An RSS sample every 10 s from 0 to ``until_s``, ``rss_at(t)`` MB each."""
    return [{"t_s": float(t), "rss_mb": rss_at(t)} for t in range(0, int(until_s) + 1, 10)]


def report(duration_s: float, restart_at_s: float | None, rss_at: Any, latency: dict[str, Any] | None = None) -> dict[str, Any]:
    faults = {} if restart_at_s is None else {"sigkill": {"at_s": restart_at_s, "recovery_s": 5.0}}
    return {"duration_s": duration_s, "faults": faults, "samples": samples(duration_s, rss_at), "traffic": {"latency": latency or {}}}


def test_a_restart_too_late_to_judge_memory_is_not_judged_and_not_missed(soak: ModuleType) -> None:
    """A 600 s soak restarted at 309.5 s: its warm-up ends at 609.5 s, after the run. It says so, not NaN, missed."""
    rows = soak.trends(report(600.0, 309.5, lambda t: 200.0))
    assert rows["rss_growth"]["met"] is None and rows["rss_growth"]["value"] is None
    assert rows["rss_growth"]["not_judged"] == (
        "run shorter than 729.5 s: the server last started at 309.5 s, RSS is judged after 300 s of warm-up over at least "
        "120 s, and the run ended at 600 s"
    )


def test_memory_is_judged_from_the_warm_up_to_the_end(soak: ModuleType) -> None:
    flat = soak.rss_growth(samples(600, lambda t: 200.0 + (20.0 if t >= 300 else 0.0) + t / 100), 0.0, 600.0)
    # 223 MB at 300 s, 226 MB at 600 s: the warm-up's 20 MB step is not counted
    assert flat == {"value": round(226 / 223 - 1, 3), "window_s": [300.0, 600.0], "met": True}
    leaking = soak.rss_growth(samples(600, lambda t: 200.0 + t / 5), 0.0, 600.0)
    assert leaking["met"] is False and leaking["value"] == round(320 / 260 - 1, 3)


def test_the_shortest_judged_run_is_warm_up_plus_the_window(soak: ModuleType) -> None:
    shortest = soak.RSS_WARM_UP_S + soak.RSS_JUDGED_S
    assert soak.rss_growth(samples(shortest, lambda t: 100.0), 0.0, shortest)["met"] is True
    assert "run shorter than 420 s" in soak.rss_growth(samples(shortest - 1, lambda t: 100.0), 0.0, shortest - 1)["not_judged"]
    sparse = soak.rss_growth([{"t_s": 0.0, "rss_mb": 100.0}, {"t_s": 500.0, "rss_mb": 100.0}], 0.0, 600.0)
    assert sparse["met"] is None and sparse["not_judged"] == "fewer than 2 RSS samples from 300 s to the end (1)"


def test_latency_drift_without_its_minutes_is_not_judged(soak: ModuleType) -> None:
    short = soak.trends(report(60.0, None, lambda t: 100.0))
    assert short["p99_drift"] == {"value": None, "met": None, "not_judged": "run shorter than 600 s (it ran 60 s)"}
    no_minute_5 = soak.trends(report(600.0, None, lambda t: 100.0, {"generate small@9": {"p99_ms": 40.0}}))
    assert no_minute_5["p99_drift"]["not_judged"] == "no small generate answered in minute 5"
    both = {"generate small@5": {"p99_ms": 40.0}, "generate small@9": {"p99_ms": 80.0}}
    assert soak.trends(report(600.0, None, lambda t: 100.0, both))["p99_drift"] == {"value": 2.0, "met": False}
