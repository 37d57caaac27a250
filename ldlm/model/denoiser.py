"""Denoiser: a Llama-style diffusion transformer with U-Net long skips that predicts x0 from x_t.

Each sample carries its own t, so samples at different steps can share a batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ldlm.model.config import LDLMConfig
from ldlm.model.layers import RMSNorm, attention_bias, merge_heads, sinusoidal_embedding, split_heads


def rotary_tables(length: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (T, hd/2) for rotary embeddings: angle(p, i) = p * theta^(-2i/hd)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (first-half, second-half) feature pair of x (B, H, T, hd) by its position's angle."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, hd/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class RotarySelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor, rotary: tuple[Tensor, Tensor], attn_bias: Tensor | None) -> Tensor:
        q, k, v = (split_heads(proj(x), self.n_heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rotary  # (T, hd/2) each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        return self.o_proj(merge_heads(y))


class SwiGLU(nn.Module):
    """w2(SiLU(w1 x) * w3 x), no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DenoiserBlock(nn.Module):
    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        w = config.denoiser_d_model
        self.time_proj = nn.Linear(w, w)  # x += time_proj(SiLU(t_emb)) before the block
        self.self_cond_proj = nn.Linear(config.d_model, w)  # x += self_cond_proj(x0_prev) before the block
        self.attn_norm = RMSNorm(w, config.rms_norm_eps)
        self.attn = RotarySelfAttention(w, config.n_heads)
        self.mlp_norm = RMSNorm(w, config.rms_norm_eps)
        self.mlp = SwiGLU(w, config.swiglu_hidden)

    def forward(self, x: Tensor, time: Tensor, x0_prev: Tensor, rotary: tuple[Tensor, Tensor], attn_bias: Tensor | None) -> Tensor:
        x = x + self.time_proj(time)[:, None, :] + self.self_cond_proj(x0_prev)
        x = x + self.attn(self.attn_norm(x), rotary, attn_bias)
        return x + self.mlp(self.mlp_norm(x))


class Denoiser(nn.Module):
    """x_t (B, N, D), t (B,), x0_prev (B, N, D), mask (B, N) -> x0_hat (B, N, D).

    The blocks run at config.denoiser_d_model (W). When denoiser_width is set, x_t is projected from D to W
    before the first block and the stream back to D before the output norm; unset, W = D and the latents
    are the stream.
    """

    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        d, w = config.d_model, config.denoiser_d_model
        self.width = w
        self.head_dim = w // config.n_heads
        self.rope_theta = config.rope_theta
        self.time_max_period = config.time_max_period
        wide = config.denoiser_width is not None
        self.in_proj: nn.Module = nn.Linear(d, w, bias=False) if wide else nn.Identity()
        self.time_mlp = nn.Sequential(nn.Linear(w, 2 * w), nn.SiLU(), nn.Linear(2 * w, w))
        self.blocks = nn.ModuleList(DenoiserBlock(config) for _ in range(config.denoiser_layers))
        self.out_proj: nn.Module = nn.Linear(w, d, bias=False) if wide else nn.Identity()
        self.out_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x_t: Tensor, t: Tensor, x0_prev: Tensor, mask: Tensor | None = None) -> Tensor:
        t_emb = self.time_mlp(sinusoidal_embedding(t, self.width, self.time_max_period).to(x_t.dtype))
        time = F.silu(t_emb)  # (B, W), shared by every block's time_proj
        rotary = rotary_tables(x_t.shape[1], self.head_dim, self.rope_theta, x_t.device)
        bias = attention_bias(mask, x_t.dtype)
        x = self.in_proj(x_t)
        half = len(self.blocks) // 2
        skips = []
        for block in self.blocks[:half]:
            x = block(x, time, x0_prev, rotary, bias)
            skips.append(x)
        for block in self.blocks[half:]:
            x = block(x + skips.pop(), time, x0_prev, rotary, bias)  # U-Net long skip, in reverse order
        return self.out_norm(self.out_proj(x))
