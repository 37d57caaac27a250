"""What a generation will cost, measured as the scheduler runs: admission control and fair order.

``CostModel`` keeps, per length bucket, a moving fit of one denoiser step's wall time as
``a + b * k`` for a batch of ``k`` samples (an exponentially weighted least-squares line: ``a`` the
per-call overhead, ``b`` the per-sample cost). From it:

- ``solo_s``: a request's time alone: ``steps`` steps of ``min(n, max_batch)`` samples, once per
  ``max_batch`` chunk of its samples;
- ``sample_step_s``: the throughput cost of one sample-step at a full batch, ``(a + b B) / B``, which
  prices work queued ahead (that work shares full batches) and a request's remaining work.

A bucket never measured borrows the nearest measured one, scaled by length (a step's cost grows
with the tokens it holds); with nothing measured at all the model says ``None`` and nothing is
refused on a guess.

The refusals: ``RequestTooLargeError`` (413) when a request could not meet its deadline even on an
idle server, ``DeadlineUnreachableError`` (503 + Retry-After) when it could, but not behind the work
queued ahead of it. Both name the estimate and the limit.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass


class DeadlineUnreachableError(RuntimeError):
    """The work ahead of a request and its own would take longer than its deadline: retry later (503)."""

    status = 503

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLargeError(RuntimeError):
    """A request that could not meet its deadline even alone (413): fewer samples or steps, or a longer deadline."""

    status = 413


@dataclass
class _Fit:
    """Exponentially weighted sums of (k, seconds) for a least-squares line seconds = a + b k."""

    w: float = 0.0
    k: float = 0.0
    kk: float = 0.0
    t: float = 0.0
    kt: float = 0.0
    slope: float = 0.0  # the last slope fitted from a spread of batch sizes; kept while batches are all alike

    def add(self, k: int, seconds: float, decay: float) -> None:
        self.w, self.k, self.kk = decay * self.w + 1, decay * self.k + k, decay * self.kk + k * k
        self.t, self.kt = decay * self.t + seconds, decay * self.kt + k * seconds
        mean_k, mean_t = self.k / self.w, self.t / self.w
        var_k = self.kk / self.w - mean_k**2
        if var_k > 0.1:  # batch sizes differ enough to see the slope (1 and 2 in equal shares: 0.25)
            self.slope = max(0.0, (self.kt / self.w - mean_k * mean_t) / var_k)

    def seconds(self, k: int) -> float:
        mean_k, mean_t = self.k / self.w, self.t / self.w
        b = min(self.slope, mean_t / mean_k)  # the per-call overhead a is never negative
        return (mean_t - b * mean_k) + b * k


class CostModel:
    """Per length bucket, a moving fit of a denoiser step's seconds for k samples (see the module docs)."""

    def __init__(self, max_batch: int, decay: float = 0.98) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} is out of range; allowed: >= 1")
        if not 0 < decay < 1:
            raise ValueError(f"decay={decay} is out of range; allowed: (0, 1)")
        self.max_batch, self.decay = max_batch, decay
        self._fits: dict[int, _Fit] = {}
        self._lock = threading.Lock()

    def observe(self, bucket: int, samples: int, seconds: float) -> None:
        """One step of ``samples`` samples padded to ``bucket`` tokens took ``seconds``."""
        if samples < 1 or not seconds >= 0:
            return
        with self._lock:
            self._fits.setdefault(bucket, _Fit()).add(samples, seconds, self.decay)

    def step_s(self, bucket: int, samples: int) -> float | None:
        """Seconds of one step of ``samples`` samples in ``bucket``; None before anything was measured."""
        with self._lock:
            if not self._fits:
                return None
            if bucket in self._fits:
                return self._fits[bucket].seconds(samples)
            nearest = min(self._fits, key=lambda b: (abs(b - bucket), b))  # borrowed, scaled by tokens held
            return self._fits[nearest].seconds(samples) * bucket / nearest

    def sample_step_s(self, bucket: int) -> float | None:
        """Seconds one sample-step costs when batches are full (the throughput price of queued work)."""
        full = self.step_s(bucket, self.max_batch)
        return None if full is None else full / self.max_batch

    def solo_s(self, n: int, steps: int, bucket: int) -> float | None:
        """A request's time on an idle server: ``steps`` steps per chunk of at most ``max_batch`` samples."""
        chunks, width = math.ceil(n / self.max_batch), min(n, self.max_batch)
        step = self.step_s(bucket, width)
        return None if step is None else chunks * steps * step

    def rates(self) -> dict[int, float]:
        """Per measured bucket: samples x steps per second at a full batch (for /metrics)."""
        return {bucket: 1 / s for bucket in sorted(self._fits) if (s := self.sample_step_s(bucket))}
