"""Attention without a mask for rows with no padding: the model's denoiser and encoder, called with a mask of None,
must hand SDPA no ``attn_mask`` at all (the flash kernel takes none; an all-zero bias gives the same numbers and
rules it out), GPT-2's causality going through ``is_causal`` instead, and give the all-ones mask's outputs.

``recorded_sdpa`` wraps ``torch.nn.functional.scaled_dot_product_attention`` (every attention of the model calls it
through ``F``) and records what each call got, so a bias made from no mask, or a padded batch run without its
mask, shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ldlm.model.ldlm import LDLM

SdpaCalls = list[dict[str, Any]]


@pytest.fixture
def recorded_sdpa(monkeypatch: pytest.MonkeyPatch) -> Iterator[SdpaCalls]:
    """Every SDPA call's ``attn_mask`` and ``is_causal``, the call itself unchanged."""
    calls: SdpaCalls = []
    original = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, **kwargs: Any) -> torch.Tensor:
        calls.append({"attn_mask": attn_mask, "is_causal": kwargs.get("is_causal", False)})
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    yield calls


def denoiser_inputs(model: LDLM, batch: int = 3, length: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    d = model.config.d_model
    x = torch.randn(batch, length, d, generator=gen)
    return x, torch.rand(batch, generator=gen), torch.randn(batch, length, d, generator=gen)


def token_ids(model: LDLM, batch: int = 3, length: int = 10) -> torch.Tensor:
    return torch.randint(0, model.config.gpt2_vocab_size, (batch, length), generator=torch.Generator().manual_seed(4))


def padded_mask(batch: int = 3, length: int = 10) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 6:] = False
    return mask


@torch.no_grad()
def test_denoiser_without_a_mask_passes_none_to_sdpa_and_gives_the_all_ones_output(tiny_model: LDLM, recorded_sdpa: SdpaCalls) -> None:
    x, t, x0_prev = denoiser_inputs(tiny_model)
    free = tiny_model.denoise(x, t, x0_prev, None)
    layers = len(tiny_model.denoiser.blocks)
    assert len(recorded_sdpa) == layers and all(c["attn_mask"] is None and not c["is_causal"] for c in recorded_sdpa)
    recorded_sdpa.clear()
    ones = tiny_model.denoise(x, t, x0_prev, torch.ones(x.shape[:2], dtype=torch.bool))
    assert len(recorded_sdpa) == layers and all(isinstance(c["attn_mask"], torch.Tensor) for c in recorded_sdpa)
    torch.testing.assert_close(free, ones, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_encoder_without_a_mask_passes_none_to_sdpa_causal_for_gpt2(tiny_model: LDLM, recorded_sdpa: SdpaCalls) -> None:
    """GPT-2's blocks are causal: with no mask that is SDPA's is_causal, not a bias; the latent encoder's are not."""
    ids = token_ids(tiny_model)
    free = tiny_model.encode_latents(ids, None)
    gpt2, encoder = len(tiny_model.feature_model.h), len(tiny_model.latent_encoder.blocks)
    assert [c["attn_mask"] for c in recorded_sdpa] == [None] * (gpt2 + encoder)
    assert [c["is_causal"] for c in recorded_sdpa] == [True] * gpt2 + [False] * encoder
    recorded_sdpa.clear()
    ones = tiny_model.encode_latents(ids, torch.ones(ids.shape, dtype=torch.bool))
    assert all(isinstance(c["attn_mask"], torch.Tensor) and not c["is_causal"] for c in recorded_sdpa)
    torch.testing.assert_close(free, ones, rtol=1e-5, atol=1e-5)
    # the causal path is causal: a token changed at the end changes no feature before it
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % tiny_model.config.gpt2_vocab_size
    features, features_changed = tiny_model.feature_model(ids), tiny_model.feature_model(changed)
    torch.testing.assert_close(features[:, :-1], features_changed[:, :-1], rtol=0, atol=0)
    assert not torch.equal(features[:, -1], features_changed[:, -1])


@torch.no_grad()
def test_a_padded_batch_keeps_its_mask_in_every_attention(tiny_model: LDLM, recorded_sdpa: SdpaCalls) -> None:
    mask = padded_mask()
    x, t, x0_prev = denoiser_inputs(tiny_model)
    tiny_model.denoise(x, t, x0_prev, mask)
    tiny_model.encode_latents(token_ids(tiny_model), mask)
    assert recorded_sdpa and all(isinstance(c["attn_mask"], torch.Tensor) and not c["is_causal"] for c in recorded_sdpa)
    # and a padded row's real positions do not see its padding: they match the row run alone at its own length
    alone = tiny_model.denoise(x[1:2, :6], t[1:2], x0_prev[1:2, :6], None)
    torch.testing.assert_close(tiny_model.denoise(x, t, x0_prev, mask)[1:2, :6], alone, rtol=1e-5, atol=1e-5)
