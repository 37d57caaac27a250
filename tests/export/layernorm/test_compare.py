"""compare_outputs' cosine bound: int8 is judged by direction, every other precision by its tolerances."""

from __future__ import annotations

import math

import numpy as np

from ldlm.export.layernorm.compare import compare_outputs, min_cosine, tolerance


def test_int8_passes_on_direction_and_fails_a_sample_that_turns() -> None:
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((2, 16, 8))
    close = reference + 0.01 * rng.standard_normal(reference.shape)  # cosine ~0.99995 per sample
    turned = close.copy()
    turned[1] = rng.standard_normal((16, 8))  # one sample pointing elsewhere (cosine ~0)
    atol, rtol = tolerance("int8")
    assert math.isinf(atol) and math.isinf(rtol) and min_cosine("int8") == 0.999
    assert compare_outputs("x", reference, close, atol, rtol, min_cosine("int8")).passed
    failed = compare_outputs("x", reference, turned, atol, rtol, min_cosine("int8"))
    assert not failed.passed and failed.failed_elements == 0 and failed.cosine_min < 0.5
    # the cosine of one sample, by NumPy, is what the comparison reports
    a, b = reference[0].ravel(), close[0].ravel()
    assert compare_outputs("x", reference[:1], close[:1], atol, rtol).cosine_min == np.float64(
        a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    )


def test_other_precisions_have_no_cosine_bound() -> None:
    assert min_cosine("fp32") == min_cosine("fp16") == -1.0
    reference = np.full((1, 4), 1e-5)
    assert compare_outputs("x", reference, -reference, 1e-4, 1e-4, min_cosine("fp32")).passed  # within atol, opposite direction
