"""LDLM: the five components, the standardization statistics, and the three inference graphs.

The graphs are what runs in production and what gets exported:
  encode_latents (input_ids, attention_mask) -> z        GPT-2 to feature_layer, latent encoder
  denoise        (x_t, t, x0_prev)            -> x0_hat   one t per sample
  decode_logits  (z)                          -> logits   latent decoder, token decoder
Latents z live in the standardized space the denoiser works in.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ldlm.model.config import LDLMConfig
from ldlm.model.denoiser import Denoiser
from ldlm.model.gpt2 import GPT2Features
from ldlm.model.latent_decoder import LatentDecoder
from ldlm.model.latent_encoder import LatentEncoder
from ldlm.model.token_decoder import TokenDecoder


class LDLM(nn.Module):
    # buffers: the standardization statistics of GPT-2's features and of the latents
    feature_mean: Tensor
    feature_std: Tensor
    latent_mean: Tensor
    latent_std: Tensor

    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.feature_model = GPT2Features(config)
        self.latent_encoder = LatentEncoder(config)
        self.denoiser = Denoiser(config)
        self.latent_decoder = LatentDecoder(config)
        self.token_decoder = TokenDecoder(config)
        # Per-dimension standardization of GPT-2 features and of latents (inferred); identity
        # until a trained checkpoint provides statistics.
        self.register_buffer("feature_mean", torch.zeros(d))
        self.register_buffer("feature_std", torch.ones(d))
        self.register_buffer("latent_mean", torch.zeros(d))
        self.register_buffer("latent_std", torch.ones(d))

    def encode_latents(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """input_ids (B, L) int64, attention_mask (B, L) -> standardized latents (B, L, D)."""
        features = self.feature_model(input_ids, attention_mask)
        features = (features - self.feature_mean) / self.feature_std
        latents = self.latent_encoder(features, attention_mask)
        return (latents - self.latent_mean) / self.latent_std

    def denoise(self, x_t: Tensor, t: Tensor, x0_prev: Tensor, mask: Tensor | None = None) -> Tensor:
        """x_t (B, N, D), t (B,), x0_prev (B, N, D) -> x0_hat (B, N, D), all standardized."""
        return self.denoiser(x_t, t, x0_prev, mask)

    def decode_logits(self, latents: Tensor, mask: Tensor | None = None) -> Tensor:
        """standardized latents (B, L, D) -> logits (B, L, V)."""
        return self.token_decoder(self._latent_decoded(latents, mask), mask)

    def decode_tokens(self, latents: Tensor, mask: Tensor | None = None) -> Tensor:
        """standardized latents (B, L, D) -> token ids (B, L) int64: ``decode_logits(...).argmax(-1)``,
        without the whole logits (``TokenDecoder.token_ids``)."""
        return self.token_decoder.token_ids(self._latent_decoded(latents, mask), mask)

    def _latent_decoded(self, latents: Tensor, mask: Tensor | None) -> Tensor:
        return self.latent_decoder(latents * self.latent_std + self.latent_mean, mask)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
