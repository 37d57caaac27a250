"""Independent NumPy references for the tests (no torch)."""

from __future__ import annotations

import numpy as np


def layer_norm(x: np.ndarray, normalized_ndim: int, weight=None, bias=None, eps: float = 1e-5) -> np.ndarray:
    """LayerNorm over the last ``normalized_ndim`` axes with the population (biased) variance."""
    axes = tuple(range(x.ndim - normalized_ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y
