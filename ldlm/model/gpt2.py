"""The feature model: GPT-2, truncated so that the blocks after ``feature_layer`` never run.

Parameter names follow Hugging Face's ``GPT2Model`` (wte, wpe, h.{i}.ln_1, h.{i}.attn.c_attn, ...),
so a local GPT-2 checkpoint maps onto this module by name (see ``ldlm.model.checkpoint``). GPT-2 uses the
tanh approximation of GELU ("gelu_new").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ldlm.model.config import LDLMConfig
from ldlm.model.layers import SelfAttention, attention_bias


class GPT2MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.attn = SelfAttention(dim, n_heads)
        self.ln_2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = GPT2MLP(dim)

    def forward(self, x: Tensor, attn_bias: Tensor | None) -> Tensor:
        """``attn_bias`` holds causality and padding together; None: no padding, causal through SDPA's is_causal."""
        x = x + self.attn(self.ln_1(x), attn_bias, causal=attn_bias is None)
        return x + self.mlp(self.ln_2(x))


class GPT2Features(nn.Module):
    """input_ids (B, T), attention_mask (B, T) -> hidden_states[feature_layer] (B, T, D).

    Only ``config.feature_blocks`` blocks exist; ``ln_f`` is never applied to an index below -1. Without
    ``attention_mask`` (every position real) no bias tensor is made: causality is SDPA's ``is_causal``, so the
    flash kernel stays eligible on CUDA. With one, causality and padding are one merged bias, as exported.
    """

    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        d = config.d_model
        self.wte = nn.Embedding(config.gpt2_vocab_size, d)
        self.wpe = nn.Embedding(config.gpt2_positions, d)
        self.h = nn.ModuleList(GPT2Block(d, config.n_heads, config.layer_norm_eps) for _ in range(config.feature_blocks))
        self.requires_grad_(False)  # frozen (known)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)[None]  # (B, T, D)
        bias = None if attention_mask is None else attention_bias(attention_mask, x.dtype, causal_len=input_ids.shape[1])  # (B, 1, T, T)
        for block in self.h:
            x = block(x, bias)
        return x
