"""The fixed LayerNorm cases (export/layernorm/cases.py), against eager PyTorch and NumPy.

Every case checks torch.nn.LayerNorm against the golden values recorded with it and against
the independent NumPy reference in tests/reference.py. The last tests check our own model: every
LayerNorm it holds has the configured eps, and lives where the export must find it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ldlm.model.config import LDLMConfig
from ldlm.model.ldlm import LDLM
from tests.reference import layer_norm as np_layer_norm

F64 = torch.float64


def run(module: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.tensor(x, dtype=F64)).numpy()


def test_case1_normalized_shape_picks_the_axes() -> None:
    x = np.array([[[1, 2, 4], [10, 20, 40]], [[3, 5, 9], [2, 3, 8]]], dtype=np.float64)
    last = run(nn.LayerNorm(3, elementwise_affine=False, dtype=F64), x)
    two = run(nn.LayerNorm((2, 3), elementwise_affine=False, dtype=F64), x)
    assert last.shape == two.shape == x.shape
    np.testing.assert_allclose(last[0, 0], [-1.069, -0.2673, 1.3363], atol=1e-4)
    np.testing.assert_allclose(two[0, 0], [-0.8612, -0.7884, -0.6429], atol=1e-4)
    assert not np.allclose(last, two)
    np.testing.assert_allclose(last, np_layer_norm(x, 1), atol=1e-12)
    np.testing.assert_allclose(two, np_layer_norm(x, 2), atol=1e-12)


def test_case2_population_variance_and_constant_rows() -> None:
    x = np.array([[1, 2, 4], [8, 8, 8]], dtype=np.float64)
    y = run(nn.LayerNorm(3, eps=1e-5, elementwise_affine=False, dtype=F64), x)
    mean, var = 7 / 3, 14 / 9
    np.testing.assert_allclose(x[0].mean(), mean)
    np.testing.assert_allclose(x[0].var(), var)  # numpy's default ddof=0 is the population variance
    np.testing.assert_array_equal(y[1], np.zeros(3))
    np.testing.assert_allclose(y[0].var(), var / (var + 1e-5), rtol=1e-12)
    assert y[0].var() < 1.0
    np.testing.assert_allclose(y, np_layer_norm(x, 1, eps=1e-5), atol=1e-12)


def test_case3_affine_parameters_and_counts() -> None:
    x = np.array([[1, 2, 4], [2, 4, 8]], dtype=np.float64)
    weight, bias = np.array([2, 0.5, -1.0]), np.array([1, -2, 3.0])
    layer = nn.LayerNorm(3, dtype=F64)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight))
        layer.bias.copy_(torch.tensor(bias))
    y = run(layer, x)
    np.testing.assert_allclose(y.mean(axis=-1), [-0.536, -0.536], atol=1e-3)
    np.testing.assert_allclose(y, np_layer_norm(x, 1, weight, bias), atol=1e-12)

    def count(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    assert count(nn.LayerNorm(3)) == 6
    assert count(nn.LayerNorm(3, bias=False)) == 3
    assert count(nn.LayerNorm(3, elementwise_affine=False)) == 0
    assert count(nn.LayerNorm((2, 3))) == 12
    assert nn.LayerNorm(3, bias=False).bias is None


def test_case4_eps_is_the_modules_not_a_default() -> None:
    x = np.array([[1, 1.001, 0.999], [7, 7, 7]], dtype=np.float64)
    small = run(nn.LayerNorm(3, eps=1e-5, elementwise_affine=False, dtype=F64), x)
    large = run(nn.LayerNorm(3, eps=0.1, elementwise_affine=False, dtype=F64), x)
    np.testing.assert_allclose(small[0], [0.0, 0.306186, -0.306186], atol=1e-6)
    np.testing.assert_allclose(large[0], [0.0, 0.003162, -0.003162], atol=1e-6)
    assert np.isfinite(small).all() and np.isfinite(large).all()
    np.testing.assert_allclose(small, np_layer_norm(x, 1, eps=1e-5), atol=1e-12)
    np.testing.assert_allclose(large, np_layer_norm(x, 1, eps=0.1), atol=1e-12)


def test_case5_train_and_eval_agree_without_running_stats() -> None:
    x = torch.tensor([[1.0, 2.0, 4.0], [3.0, 7.0, 8.0]], dtype=F64)
    layer = nn.LayerNorm(3, dtype=F64)
    training = layer.train()(x)
    evaluation = layer.eval()(x)
    assert torch.equal(training, evaluation)
    assert list(layer.named_buffers()) == []
    np.testing.assert_allclose(evaluation.detach().numpy(), np_layer_norm(x.numpy(), 1), atol=1e-12)


def test_case6_channels_need_a_permute() -> None:
    x = np.arange(12, dtype=np.float64).reshape(1, 2, 2, 3)  # NCHW, C = 2, W = 3
    with pytest.raises(RuntimeError):
        nn.LayerNorm(2, elementwise_affine=False)(torch.tensor(x))
    channels_last = torch.tensor(x).permute(0, 2, 3, 1)
    with torch.no_grad():
        back = nn.LayerNorm(2, elementwise_affine=False, dtype=F64)(channels_last).permute(0, 3, 1, 2).numpy()
    assert back.shape == (1, 2, 2, 3)
    np.testing.assert_allclose(back[0, :, 0, 0], [-0.999999, 0.999999], atol=1e-6)
    np.testing.assert_allclose(back.mean(axis=1), 0.0, atol=1e-12)
    reference = np_layer_norm(x.transpose(0, 2, 3, 1), 1).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(back, reference, atol=1e-12)
    # Normalizing the width instead gives other values: the mistake a shape check cannot see.
    wrong = run(nn.LayerNorm(3, elementwise_affine=False, dtype=F64), x)
    assert not np.allclose(wrong, back)


def test_case7_hand_written_matches_library_in_float32() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 128) * 3 + 5
    gamma = 1 + 0.1 * torch.randn(128)
    beta = 0.1 * torch.randn(128)
    library = nn.LayerNorm(128)
    with torch.no_grad():
        library.weight.copy_(gamma)
        library.bias.copy_(beta)
        lib = library(x)
    mean = x.mean(-1, keepdim=True)
    hand = (x - mean) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5) * gamma + beta
    assert (hand - lib).abs().max().item() < 2e-6
    ref = np_layer_norm(x.double().numpy(), 1, gamma.double().numpy(), beta.double().numpy())
    np.testing.assert_allclose(lib.numpy(), ref, atol=2e-6)


def test_case8_default_init_golden_values() -> None:
    x = np.array([8, -3, 0, 1, 5, -2], dtype=np.float64)
    y = run(nn.LayerNorm(6, dtype=F64), x)
    np.testing.assert_allclose(y, [1.6830, -1.1651, -0.3884, -0.1295, 0.9062, -0.9062], atol=1e-4)
    np.testing.assert_allclose(y, np_layer_norm(x, 1), atol=1e-12)


def test_low_variance_input_shows_eps() -> None:
    """Large mean, tiny spread (GPT-2's outlier channels): eps dominates, both sides agree."""
    rng = np.random.default_rng(0)
    x = 3000.0 + 1e-3 * rng.standard_normal((2, 768))
    for eps in (1e-5, 1e-3):
        y = run(nn.LayerNorm(768, eps=eps, elementwise_affine=False, dtype=F64), x)
        np.testing.assert_allclose(y, np_layer_norm(x, 1, eps=eps), atol=1e-9)
    assert not np.allclose(run(nn.LayerNorm(768, eps=1e-5, dtype=F64), x), run(nn.LayerNorm(768, eps=1e-3, dtype=F64), x))


def expected_layer_norms(config: LDLMConfig) -> dict[str, int]:
    """LayerNorms per component, from the specification: the count the ONNX export must match."""
    return {
        "feature_model": 2 * config.feature_blocks,  # ln_1, ln_2 per block; ln_f never runs
        "latent_encoder": config.encoder_layers,  # one MLP per block
        "denoiser": 0,  # RMSNorm only
        "latent_decoder": 1 + config.decoder_layers,  # the query MLP and one MLP per block
        "token_decoder": 2 * config.token_decoder_layers + 1,  # attention and MLP norms, final norm
    }


def test_model_layer_norms_have_the_configured_eps(tiny_model: LDLM) -> None:
    config = tiny_model.config
    for component, count in expected_layer_norms(config).items():
        norms = [m for m in getattr(tiny_model, component).modules() if isinstance(m, nn.LayerNorm)]
        assert len(norms) == count, component
        for norm in norms:
            assert norm.eps == config.layer_norm_eps == 1e-5
            assert norm.normalized_shape == (config.d_model,)
            assert norm.weight is not None and norm.bias is not None


def test_model_layer_norm_matches_numpy_on_outlier_features(tiny_model: LDLM) -> None:
    norm = tiny_model.latent_encoder.blocks[0].mlp.norm
    x = np.full((3, tiny_model.config.d_model), 0.1)
    x[:, :2] = [2500.0, -1800.0]  # two outlier channels, as in GPT-2's middle layers
    with torch.no_grad():
        y = norm(torch.tensor(x, dtype=torch.float32)).double().numpy()
    ref = np_layer_norm(x, 1, norm.weight.double().detach().numpy(), norm.bias.double().detach().numpy())
    np.testing.assert_allclose(y, ref, atol=1e-5)
