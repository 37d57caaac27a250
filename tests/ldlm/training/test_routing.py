"""The aligned start of the two Perceivers: position p reads position p, checked by what they compute."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ldlm.model.checkpoint import init_model
from ldlm.model.config import preset
from ldlm.training import train
from ldlm.training.corpus import Corpus
from ldlm.training.evaluation import own_position_share
from ldlm.training.routing import align_routing, position_sinusoids
from tests.ldlm.training.conftest import MICRO, MICRO_PLAN


def test_position_sinusoids_are_the_closed_form_with_rms_one() -> None:
    table = position_sinusoids(count=128, dim=64, heads=4, period=64.0).numpy()
    p = np.arange(128)[:, None]
    w = (math.pi / 2) * 64.0 ** (-np.arange(8) / 8)
    head = np.concatenate([np.cos(p * w), np.sin(p * w)], axis=1) * math.sqrt(2)
    np.testing.assert_allclose(table, np.tile(head, (1, 4)), atol=1e-4)  # float32 angles up to 200 rad
    np.testing.assert_allclose(np.sqrt((table**2).mean(1)), 1.0, atol=1e-5)


def gaussian_features(length: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, length, 64, generator=torch.Generator().manual_seed(seed))  # standardized, as the encoder reads them


class Permuted(nn.Module):
    """latent p = feature perm[p] x 2: a router whose answer is known."""

    def __init__(self, perm: torch.Tensor) -> None:
        super().__init__()
        self.perm = perm

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return 2 * features[:, self.perm]


def test_own_position_share_counts_the_latents_that_read_their_own_position() -> None:
    perm = torch.arange(32)
    perm[:8] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])  # 8 latents read a neighbour, 24 their own position
    assert own_position_share(Permuted(perm), gaussian_features()) == 24 / 32
    assert own_position_share(Permuted(torch.arange(32).flip(0)), gaussian_features()) == 0.0


def test_the_aligned_perceivers_read_each_position_at_its_own_position() -> None:
    model = init_model(preset("tiny"), seed=0)
    # PyTorch's init routes at random
    assert own_position_share(model.latent_encoder, gaussian_features()) < 0.3
    assert own_position_share(model.latent_decoder, gaussian_features()) < 0.3
    align_routing(model)
    for seed in (0, 1):
        assert own_position_share(model.latent_encoder, gaussian_features(seed=seed)) >= 0.9
        assert own_position_share(model.latent_decoder, gaussian_features(seed=seed)) >= 0.9  # latents in, positions out


def test_a_run_aligns_a_new_model_and_a_resumed_run_keeps_its_trained_weights(micro_corpus: Corpus, tmp_path: Path) -> None:
    plan = dataclasses.replace(MICRO_PLAN, aligned_routing=True, autoencoder_steps=0, long_steps=0, denoiser_steps=0, decoder_steps=0)
    fresh = init_model(MICRO, seed=0)
    train(fresh, micro_corpus, plan, tmp_path / "untrained", progress_bar=False)
    expected = position_sinusoids(MICRO.max_seq_len, MICRO.d_model, MICRO.n_heads, period=64.0)
    assert torch.equal(fresh.latent_encoder.latent_bank.detach(), expected)

    trained = init_model(MICRO, seed=0)
    plan = dataclasses.replace(plan, autoencoder_steps=3)
    train(trained, micro_corpus, plan, tmp_path / "trained", progress_bar=False)
    assert not torch.equal(trained.latent_encoder.latent_bank.detach(), expected)
    resumed = init_model(MICRO, seed=1)
    train(resumed, micro_corpus, plan, tmp_path / "trained", progress_bar=False)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
