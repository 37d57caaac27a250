"""The model's math against NumPy float64 written from the architecture (tests/reference_model.py).

Parity compares eager with an engine made from the same graph, so a bug in the graph is on both
sides. Here the other side is independent, and the config is chosen so that each constant shows:
eps far from their defaults and from each other (RMSNorm 0.25, LayerNorm 0.0625: an eps dropped,
hard-coded or swapped moves outputs by percent, not by 1e-6), rope_theta, time_max_period and
mlp_ratio off their defaults, four denoiser blocks (two U-Net skips, so their order shows), and
inputs of small magnitude where eps decides a norm's output.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from ldlm.model.checkpoint import init_model
from ldlm.model.config import LDLMConfig
from ldlm.model.layers import RMSNorm
from tests import reference_model as ref

CONFIG = LDLMConfig(
    d_model=32,
    n_heads=4,
    max_seq_len=16,
    gpt2_layers=3,
    gpt2_positions=16,
    encoder_layers=2,
    decoder_layers=2,
    denoiser_layers=4,
    swiglu_hidden=48,
    token_decoder_layers=2,
    mlp_ratio=3,
    rms_norm_eps=0.25,
    layer_norm_eps=0.0625,
    rope_theta=500.0,
    time_max_period=7.0,
)
RTOL, ATOL = 2e-5, 2e-5  # float32 against float64: measured worst ~1e-6 on these sizes


@pytest.fixture(scope="module", params=[True, False], ids=["per_stream_kv", "shared_kv"])
def model(request):
    config = dataclasses.replace(CONFIG, per_stream_kv=request.param)
    model = init_model(config, seed=7, norm_init="random")
    # Parameters that init leaves at a constant (query_scale 0, attn_scale and mlp_scale 1): a bug
    # that drops one would not change a thing, so they get values of their own here.
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("query_scale.weight", "query_scale.bias", "attn_scale", "mlp_scale")):
                p.copy_(0.5 + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def with_config(model, **changes):
    """The same weights read under another config: a reference with one constant changed."""
    return types.SimpleNamespace(config=dataclasses.replace(model.config, **changes), state_dict=model.state_dict)


def close(got: torch.Tensor, expected: np.ndarray) -> bool:
    return np.allclose(got.double().numpy(), expected, rtol=RTOL, atol=ATOL)


def batch_mask() -> np.ndarray:
    mask = np.ones((2, 9), dtype=bool)
    mask[1, 5:] = False  # the second row is padded after 5 positions
    return mask


# --- RMSNorm alone ----------------------------------------------------------------------------------


def test_rms_norm_against_numpy_where_eps_decides() -> None:
    gen = np.random.default_rng(0)
    scales = np.array([1e-4, 1e-3, 3e-3, 1e-2, 1.0, 30.0])[:, None]  # mean(x^2) from 1e-8 to 1e3, eps 1e-5
    x = gen.standard_normal((6, 16)) * scales
    weight = 1 + 0.3 * gen.standard_normal(16)
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(weight))
        got = norm(torch.from_numpy(x).float()).double().numpy()
    expected = ref.rms_norm(x, weight, 1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    without_eps = ref.rms_norm(x, weight, 0.0)
    # the small rows are where eps decides: without it they would be ~unit size, not ~x/sqrt(eps)
    assert np.abs(got[:2] - without_eps[:2]).max() > 0.5
    np.testing.assert_allclose(got[4:], without_eps[4:], rtol=1e-4)  # and the large rows barely feel it
    # the hand value: a row of 0.001s has mean(x^2) = 1e-6, so y = 0.001 / sqrt(1.1e-5) * g
    with torch.no_grad():
        one = RMSNorm(4, 1e-5)(torch.full((1, 4), 1e-3))
    np.testing.assert_allclose(one.numpy(), np.full((1, 4), 1e-3 / np.sqrt(1.1e-5)), rtol=1e-6)


def test_rms_norm_without_eps_is_the_plain_rms_and_eps_zero_is_kept() -> None:
    x = torch.tensor([[3.0, -4.0]])  # rms 5/sqrt(2)
    with torch.no_grad():
        y = RMSNorm(2, 0.0)(x)
    np.testing.assert_allclose(y.numpy(), [[3 * np.sqrt(2) / 5, -4 * np.sqrt(2) / 5]], rtol=1e-6)
    with torch.no_grad():
        y = RMSNorm(2, 12.5)(x)  # mean(x^2) = 12.5: the denominator is sqrt(25) = 5
    np.testing.assert_allclose(y.numpy(), [[0.6, -0.8]], rtol=1e-6)


def test_every_norm_takes_the_configs_own_eps(model) -> None:
    """Each RMSNorm gets rms_norm_eps and each LayerNorm layer_norm_eps (0.25 and 0.0625 here)."""
    rms = {n: m.eps for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    ln = {n: m.eps for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    assert len(rms) == 1 + 1 + 4 * 2 + 2 * 4 + 4 * 2 + 1  # latent_norm, out_norm, enc attn x4, dec attn x4, denoiser
    assert set(rms.values()) == {0.25}, {n: e for n, e in rms.items() if e != 0.25}
    assert set(ln.values()) == {0.0625}, {n: e for n, e in ln.items() if e != 0.0625}


# --- the three graphs ---------------------------------------------------------------------------------


@torch.no_grad()
def test_denoiser_equals_numpy(model) -> None:
    gen = torch.Generator().manual_seed(1)
    d = model.config.d_model
    x_t, x0_prev = torch.randn(2, 9, d, generator=gen), 0.5 * torch.randn(2, 9, d, generator=gen)
    t = torch.tensor([0.83, 0.21])  # one time per sample
    mask = batch_mask()
    got = model.denoise(x_t, t, x0_prev, torch.from_numpy(mask))
    args = (x_t.double().numpy(), t.double().numpy(), x0_prev.double().numpy(), mask)
    expected = ref.denoise(model, *args)
    assert close(got, expected), np.abs(got.double().numpy() - expected).max()
    # the constants matter at these values: the reference under another eps, theta or period is far off
    for changed in ({"rms_norm_eps": 1e-5}, {"rope_theta": 10000.0}, {"time_max_period": 10.0}):
        assert not close(got, ref.denoise(with_config(model, **changed), *args)), changed


@torch.no_grad()
def test_encode_latents_equals_numpy(model) -> None:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.gpt2_vocab_size, (2, 9), generator=gen)
    mask = batch_mask()
    got = model.encode_latents(ids, torch.from_numpy(mask))
    expected = ref.encode_latents(model, ids.numpy(), mask)
    assert close(got, expected), np.abs(got.double().numpy() - expected).max()
    for changed in ({"rms_norm_eps": 1e-5}, {"layer_norm_eps": 1e-5}):
        assert not close(got, ref.encode_latents(with_config(model, **changed), ids.numpy(), mask)), changed


@torch.no_grad()
def test_decode_logits_equals_numpy(model) -> None:
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 9, model.config.d_model, generator=gen)
    mask = batch_mask()
    got = model.decode_logits(latents, torch.from_numpy(mask))
    expected = ref.decode_logits(model, latents.double().numpy(), mask)
    assert close(got, expected), np.abs(got.double().numpy() - expected).max()
    for changed in ({"rms_norm_eps": 1e-5}, {"layer_norm_eps": 1e-5}):
        assert not close(got, ref.decode_logits(with_config(model, **changed), latents.double().numpy(), mask)), changed
    # decode_tokens is the argmax of these logits
    assert torch.equal(model.decode_tokens(latents, torch.from_numpy(mask)), torch.from_numpy(expected.argmax(-1)))
