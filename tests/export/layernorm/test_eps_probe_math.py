"""The eps probe's own math (export/layernorm/eps_probe.py) against hand-computed values: the float32
budget k(n) and the tolerances its docstring states, the probe rows' moments, and the error bound,
which must pass a correct float32 LayerNorm in every row family and fail one that computes the
variance as E[x^2] - E[x]^2 (off by ~6 at a mean of 1e4, as the docstring says)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ldlm.export.layernorm.cases import float32_budget
from ldlm.export.layernorm.eps_probe import (
    CONSTANT_VALUES,
    LARGE_MEAN,
    LARGE_MEAN_VARIANCES,
    SWEEP_DRAWS,
    SWEEP_VARIANCES,
    LayerNormProbe,
    analyse_outputs,
    eps_rtol,
    probe_rows,
)


def test_float32_budget_and_tolerances_by_hand() -> None:
    # k(n) = 2 ceil(log2 n) + 8
    assert [float32_budget(n) for n in (1, 2, 3, 64, 65, 768)] == [10, 10, 12, 20, 22, 28]
    # eps_rtol = 2 (v_max + eps) / eps * k(n) * 2^-24: the docstring's 2.6e-5 at n = 64 and 3.7e-5 at n = 768
    assert eps_rtol(64, 1e-5) == pytest.approx(2 * 11 * 20 / 2**24, rel=1e-12)
    assert round(eps_rtol(64, 1e-5), 6) == 2.6e-5 and round(eps_rtol(768, 1e-5), 6) == 3.7e-5
    assert SWEEP_VARIANCES[0] == pytest.approx(1e-7) and SWEEP_VARIANCES[-1] == pytest.approx(1e-4) and len(SWEEP_VARIANCES) == 13


def test_probe_rows_have_the_moments_they_claim() -> None:
    n = 96
    rows = probe_rows(n, seed=3)
    assert rows.x.dtype == np.float32 and rows.x.shape == (13 * SWEEP_DRAWS + len(CONSTANT_VALUES) + len(LARGE_MEAN_VARIANCES), n)
    assert rows.family == ["sweep"] * 39 + ["constant"] * 4 + ["large-mean"] * 5
    x = rows.x.astype(np.float64)
    sweep = x[:39]
    v = np.repeat(SWEEP_VARIANCES, SWEEP_DRAWS)
    np.testing.assert_allclose(sweep.var(axis=1), v, rtol=1e-5)  # population variance v, up to float32 rounding
    assert np.all(np.abs(sweep.mean(axis=1)) < 1e-6 * np.sqrt(v))  # centered
    np.testing.assert_array_equal(x[39:43], np.repeat(np.array(CONSTANT_VALUES)[:, None], n, axis=1))
    large = x[43:]
    np.testing.assert_allclose(large.mean(axis=1), LARGE_MEAN, rtol=1e-7)
    np.testing.assert_allclose(large.var(axis=1), LARGE_MEAN_VARIANCES, rtol=2e-2)  # float32 at 1e4 rounds to ~1e-3
    assert not np.array_equal(probe_rows(n, seed=4).x[:39], rows.x[:39])


def module(n: int, eps: float) -> torch.nn.LayerNorm:
    m = torch.nn.LayerNorm(n, eps=eps)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        m.weight.copy_(1 + 0.2 * torch.randn(n, generator=gen))
        m.bias.copy_(0.2 * torch.randn(n, generator=gen))
    return m


def probe_of(kernel, n: int = 64, eps: float = 1e-5) -> LayerNormProbe:
    m = module(n, eps)
    rows = probe_rows(n)
    g, b = m.weight.detach().numpy(), m.bias.detach().numpy()
    y = kernel(rows.x, g, b, eps)
    probe = LayerNormProbe("g", "node", "mod", eps, eps, eps_rtol(n, eps))
    analyse_outputs(probe, rows, y, g, b, m)
    return probe


def two_pass_float32(x, g, b, eps):
    """A correct float32 LayerNorm: the mean, then the variance of the centered values (NumPy's
    pairwise sums)."""
    mean = x.mean(axis=1, keepdims=True, dtype=np.float32)
    centered = x - mean
    var = (centered * centered).mean(axis=1, keepdims=True, dtype=np.float32)
    return (centered / np.sqrt(var + np.float32(eps)) * g + b).astype(np.float32)


def one_pass_float32(x, g, b, eps):
    """Var = E[x^2] - E[x]^2 in float32: cancellation at large means."""
    mean = x.mean(axis=1, keepdims=True, dtype=np.float32)
    var = (x * x).mean(axis=1, keepdims=True, dtype=np.float32) - mean * mean
    return ((x - mean) / np.sqrt(np.maximum(var, 0) + np.float32(eps)) * g + b).astype(np.float32)


def test_a_correct_float32_kernel_passes_every_family() -> None:
    probe = probe_of(two_pass_float32)
    assert probe.passed, probe.problems
    assert 0 < probe.worst_error_over_bound <= 1
    assert probe.implied_eps == pytest.approx(1e-5, rel=eps_rtol(64, 1e-5))
    assert set(probe.max_abs_error) == {"sweep", "constant", "large-mean"}


@pytest.mark.parametrize("n", [64, 256, 768])
@pytest.mark.parametrize("seed", range(4))
def test_torch_float32_layer_norm_passes_every_family(n: int, seed: int) -> None:
    """torch's own CPU kernel, a correct float32 LayerNorm written by others, with random scale and bias:
    it exceeded the per-element bound (8.9x at n = 768) while the bound took the mean's rounding as
    relative to |mean| instead of to mean|x|, failing a correct backend where z ~ 0 in rows of mean ~0."""
    m = module(n, 1e-5)
    with torch.no_grad():
        m.weight.copy_(1 + 0.5 * torch.randn(n, generator=torch.Generator().manual_seed(seed)))
        m.bias.copy_(0.1 * torch.randn(n, generator=torch.Generator().manual_seed(seed + 100)))
    rows = probe_rows(n, seed)
    g, b = m.weight.detach().numpy(), m.bias.detach().numpy()
    with torch.no_grad():
        y = torch.nn.functional.layer_norm(torch.from_numpy(rows.x), (n,), m.weight, m.bias, 1e-5).numpy()
    probe = LayerNormProbe("g", "node", "mod", 1e-5, 1e-5, eps_rtol(n, 1e-5))
    analyse_outputs(probe, rows, y, g, b, m)
    assert probe.passed, probe.problems
    assert probe.worst_error_over_bound <= 1


def test_the_one_pass_variance_fails_in_the_large_mean_rows_only() -> None:
    probe = probe_of(one_pass_float32)
    assert not probe.passed
    assert any("in the large-mean rows" in p for p in probe.problems), probe.problems
    assert probe.max_abs_error["large-mean"] > 100 * probe.max_abs_error["sweep"]


def test_a_wrong_eps_is_named_with_the_implied_value() -> None:
    probe = probe_of(lambda x, g, b, eps: two_pass_float32(x, g, b, 2 * eps))
    assert probe.implied_eps == pytest.approx(2e-5, rel=1e-3)
    assert any("implied eps 2e-05 != module eps 1e-05" in p for p in probe.problems), probe.problems
    with np.errstate(invalid="ignore"):
        nan = probe_of(lambda x, g, b, eps: two_pass_float32(x, g, b, 0.0))  # constant rows: 0/0
    assert any("NaN/Inf output(s) in the constant rows" in p for p in nan.problems), nan.problems


def test_a_layer_norm_node_whose_scale_is_computed_cannot_be_probed_alone(tiny_model) -> None:
    from onnx import helper

    from ldlm.export.layernorm.eps_probe_ort import probe_node

    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], name="ln", axis=-1, epsilon=1e-5)
    module = "model.feature_model.h.0.ln_1"
    for tensors in ({}, {"scale": np.ones(64, np.float32)}):  # scale (or the bias) is an activation, not an initializer
        probe = probe_node(None, "encoder", node, module, tiny_model, tensors, 17, 8, 0)  # type: ignore[arg-type]
        assert probe.problems == [f"node 'ln' (module {module}): scale or bias is not an initializer or constant; cannot run it alone"]
        assert not probe.passed and probe.module_eps == 1e-5
