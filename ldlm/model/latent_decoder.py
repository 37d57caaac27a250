"""Latent decoder: a Perceiver whose queries are the (fully masked) mask token, reading latents."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ldlm.model.config import LDLMConfig
from ldlm.model.layers import MLP, LatentAttention, PositionTable, stream_bias


class DecoderBlock(nn.Module):
    """q += s_a * attention(q <- [latents; q]); q += s_m * MLP(q), with learned scalars s_a, s_m."""

    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        d = config.d_model
        self.attn = LatentAttention(d, config.n_heads, config.rms_norm_eps, config.per_stream_kv)
        self.mlp = MLP(d, config.mlp_ratio * d, config.layer_norm_eps, config.dropout)
        self.attn_scale = nn.Parameter(torch.ones(()))
        self.mlp_scale = nn.Parameter(torch.ones(()))

    def forward(self, queries: Tensor, latents: Tensor, attn_bias: Tensor | None) -> Tensor:
        queries = queries + self.attn_scale * self.attn(queries, latents, attn_bias)
        return queries + self.mlp_scale * self.mlp(queries)


class LatentDecoder(nn.Module):
    """latents (B, L, D) de-standardized, mask (B, L) -> h_hat (B, L, D).

    h_hat predicts the standardized GPT-2 features at ``feature_layer``. No final norm (known).
    """

    mask_embedding: Tensor  # a buffer

    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        d = config.d_model
        self.positions = PositionTable(config.max_seq_len, d)
        # The mask token's row of GPT-2's token table resized to vocab_size; frozen (known).
        self.register_buffer("mask_embedding", torch.randn(d) * 0.02)
        self.query_mlp = MLP(d, config.mlp_ratio * d, config.layer_norm_eps, config.dropout)
        # Trained as Linear(1, 1) on the is-masked indicator; every query is masked at inference,
        # so the scale is 1 + w * 1 + b (inferred).
        self.query_scale = nn.Linear(1, 1)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.decoder_layers))
        nn.init.zeros_(self.query_scale.weight)
        nn.init.zeros_(self.query_scale.bias)

    def forward(self, latents: Tensor, mask: Tensor | None = None) -> Tensor:
        b, length, _ = latents.shape
        positions = self.positions(length)[None]  # (1, L, D)
        scale = 1 + self.query_scale.weight[0, 0] + self.query_scale.bias[0]
        query = self.query_mlp(self.mask_embedding[None, None]) * scale  # (1, 1, D)
        queries = (query + positions).expand(b, -1, -1)  # (B, L, D)
        latents = latents + positions
        bias = stream_bias(mask, latents.dtype)
        for block in self.blocks:
            queries = block(queries, latents, bias)
        return queries
