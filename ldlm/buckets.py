"""Shape buckets: the padded sizes a graph runs at, so an engine sees few shapes. One home for the
pipeline (sequence buckets) and the torch backends (batch and length buckets); it imports nothing of
the project, so ldlm.serve's backends use it without importing the pipeline that opens them."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= size (buckets sorted); size itself when it is above every bucket."""
    i = bisect.bisect_left(buckets, size)
    return buckets[i] if i < len(buckets) else size
