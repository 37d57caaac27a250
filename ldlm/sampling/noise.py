"""Where a sample's randomness comes from: one seeded stream per sample.

One stream per sample makes a sample's noise independent of the batch it runs in, so static
batches, continuous batches and single runs all see the same numbers. On a GPU the stream draws on
the device (no host-to-device copy per step); a CUDA generator gives other numbers than the CPU one
for the same seed, so runs that must share noise across devices draw on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from ldlm.limits import SEED


class NoiseSource(Protocol):
    """Anything that hands out a sample's next noise tensor (L, D)."""

    def draw(self) -> Tensor: ...


class NoiseStream:
    """The noise of one sample: its prior x_1, then one draw per step, all from its own seed."""

    def __init__(self, seed: int, shape: tuple[int, ...], device: str | torch.device = "cpu") -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def draw(self) -> Tensor:
        return torch.randn(self.shape, generator=self.generator, device=self.device)


class BatchNoiseRows:
    """Noise drawn a batch at a time, ``draw_batch()`` -> (B, L, D), handed out row by row: row 0's
    draw takes the next batch, so the rows must be drawn in order, as one lockstep step draws them."""

    def __init__(self, draw_batch: Callable[[], Tensor]) -> None:
        self.draw_batch = draw_batch
        self.batch: Tensor | None = None

    def row(self, i: int) -> NoiseSource:
        return _Row(self, i)

    def take(self, i: int) -> Tensor:
        if i == 0 or self.batch is None:
            self.batch = self.draw_batch()
        return self.batch[i]


class _Row:
    def __init__(self, rows: BatchNoiseRows, i: int) -> None:
        self.rows, self.i = rows, i

    def draw(self) -> Tensor:
        return self.rows.take(self.i)


def check_seed(seed: object, name: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{name}={seed!r} is not an integer; allowed: {SEED}")
    SEED.check(name, seed)  # the one range refusal, both ends named
    return seed


def sample_seeds(seed: int, n: int) -> list[int]:
    """n independent per-sample seeds derived from one user seed."""
    check_seed(seed)
    states = np.random.SeedSequence(seed).generate_state(n, dtype=np.uint64)
    return [int(s) >> 1 for s in states]


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device`` without a host sync: through pinned memory on CUDA (a
    pageable copy would wait for the GPU to drain)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
