"""Which tuned step count becomes a sampler's default: the fewest whose held-out error is no larger and
whose token agreement is no lower than DDIM@50's, at every held-out length (``schedules_of``). Hand-made
scores, so each rule is met or missed on purpose; no model runs."""

from __future__ import annotations

import numpy as np

from ldlm.model.config import preset
from ldlm.sampling.tuned_grids import TunedGrid
from ldlm.training.grid_search import matches_ddim50, schedules_of

CONFIG = preset("tiny")
DDIM50 = {"32": {"error": 0.10, "tokens": 0.94}, "64": {"error": 0.11, "tokens": 0.94}}


def grid(steps: int, held_out: dict[str, dict[str, float]], sampler: str = "dpm3m-psc") -> TunedGrid:
    times = tuple(float(t) for t in np.linspace(1.0, CONFIG.t_min, steps + 1))
    return TunedGrid(sampler, steps, times, {"held_out": held_out, "ddim50_held_out": DDIM50})


# better error and tokens at 32 tokens, a larger error at 64
MISSES_ONE_LENGTH = grid(8, {"32": {"error": 0.09, "tokens": 0.95}, "64": {"error": 0.20, "tokens": 0.95}})
# a smaller error everywhere, fewer tokens at 32
MISSES_ON_TOKENS = grid(10, {"32": {"error": 0.05, "tokens": 0.93}, "64": {"error": 0.05, "tokens": 0.96}})
# DDIM@50's own figures at 32, better at 64: "at least" holds
MATCHES = grid(12, {"32": {"error": 0.10, "tokens": 0.94}, "64": {"error": 0.09, "tokens": 0.95}})
MATCHES_TOO = grid(14, {"32": {"error": 0.08, "tokens": 0.96}, "64": {"error": 0.08, "tokens": 0.96}})


def test_a_grid_matches_ddim50_only_on_error_and_tokens_at_every_length() -> None:
    assert [matches_ddim50(g) for g in (MISSES_ONE_LENGTH, MISSES_ON_TOKENS, MATCHES, MATCHES_TOO)] == [False, False, True, True]


def test_the_default_is_the_fewest_steps_that_match_ddim50() -> None:
    never = grid(6, {"32": {"error": 0.30, "tokens": 0.80}, "64": {"error": 0.30, "tokens": 0.80}}, sampler="ddim")
    grids = [MATCHES_TOO, MISSES_ONE_LENGTH, MATCHES, never, MISSES_ON_TOKENS]  # in no particular order
    schedules = schedules_of(grids, "a" * 64, CONFIG)
    assert schedules.defaults == {"dpm3m-psc": 12}  # a sampler none of whose grids match has no tuned default
    assert [(g.sampler, g.steps) for g in schedules.grids] == [
        ("ddim", 6),
        ("dpm3m-psc", 8),
        ("dpm3m-psc", 10),
        ("dpm3m-psc", 12),
        ("dpm3m-psc", 14),
    ]
