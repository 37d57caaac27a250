"""Latent encoder: a Perceiver that reads standardized GPT-2 features into N = L latents."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ldlm.model.config import LDLMConfig
from ldlm.model.layers import MLP, LatentAttention, PositionTable, RMSNorm, stream_bias


class EncoderBlock(nn.Module):
    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        d = config.d_model
        self.attn = LatentAttention(d, config.n_heads, config.rms_norm_eps, config.per_stream_kv)
        self.mlp = MLP(d, config.mlp_ratio * d, config.layer_norm_eps, config.dropout)

    def forward(self, latents: Tensor, features: Tensor, attn_bias: Tensor | None) -> Tensor:
        latents = latents + self.attn(latents, features, attn_bias)
        return latents + self.mlp(latents)


class LatentEncoder(nn.Module):
    """features (B, L, D) standardized, mask (B, L) -> latents z (B, L, D).

    Latent i belongs to position i, so a padded position's latent is masked out of the keys just
    like its token: padding never changes the latents at real positions.
    """

    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        d = config.d_model
        self.positions = PositionTable(config.max_seq_len, d)
        self.latent_bank = nn.Parameter(torch.randn(config.max_seq_len, d) * 0.02)  # (N_max, D)
        self.latent_norm = RMSNorm(d, config.rms_norm_eps)
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.encoder_layers))
        self.out_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, features: Tensor, mask: Tensor | None = None) -> Tensor:
        b, length, _ = features.shape
        features = features + self.positions(length)[None]
        latents = self.latent_norm(self.latent_bank[:length])[None].expand(b, -1, -1)  # (B, L, D)
        bias = stream_bias(mask, features.dtype)
        for block in self.blocks:
            latents = block(latents, features, bias)
        return self.out_norm(latents)
