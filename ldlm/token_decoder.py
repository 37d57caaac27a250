"""Token decoder: bidirectional transformer blocks on h_hat, a final LayerNorm and the vocabulary head."""

from __future__ import annotations

from torch import Tensor, nn

from ldlm.config import LDLMConfig
from ldlm.layers import MLP, SelfAttention, attention_bias


class TokenDecoderBlock(nn.Module):
    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        d = config.d_model
        self.attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.attn = SelfAttention(d, config.n_heads)
        self.mlp = MLP(d, config.mlp_ratio * d, config.layer_norm_eps, config.dropout)

    def forward(self, x: Tensor, attn_bias: Tensor | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), attn_bias)
        return x + self.mlp(x)


class TokenDecoder(nn.Module):
    """h_hat (B, L, D), mask (B, L) -> logits (B, L, V)."""

    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TokenDecoderBlock(config) for _ in range(config.token_decoder_layers))
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size)

    def hidden(self, h: Tensor, mask: Tensor | None = None) -> Tensor:
        """The blocks and the final LayerNorm: the features (B, L, D) the vocabulary head reads."""
        bias = attention_bias(mask, h.dtype)  # bidirectional: padding only
        for block in self.blocks:
            h = block(h, bias)
        return self.norm(h)

    def forward(self, h: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.head(self.hidden(h, mask))
