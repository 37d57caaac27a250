"""Building blocks shared by the LDLM components: norms, the MLP, position tables, attention.

Shapes: B batch, T query positions, S key positions, D features, H heads, hd = D / H.
Padding masks are (B, T) bool tensors, True at real tokens; padding is on the right. Each model part
turns its mask into one additive attention bias per forward pass and hands it to every block. A mask of
None means every position is real: then no bias tensor is made at all and SDPA runs without ``attn_mask``
(causal attention through ``is_causal``), which is what lets PyTorch pick its flash or memory-efficient
kernels on CUDA; an all-zero bias would compute the same numbers but keep the flash kernel out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g: root-mean-square normalization with a learned gain."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Written with a division (not rsqrt) so ONNX Runtime fuses it into SimplifiedLayerNormalization.
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    """LayerNorm(D, eps) -> Linear(D, 4D) -> exact GELU -> Dropout -> Linear(4D, D).

    The pre-norm lives inside the MLP, so a block reads ``x = x + mlp(x)``.
    """

    def __init__(self, dim: int, hidden: int, eps: float, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.fc_in = nn.Linear(dim, hidden)
        self.dropout = nn.Dropout(dropout)
        self.fc_out = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(self.dropout(F.gelu(self.fc_in(self.norm(x)))))


class PositionTable(nn.Module):
    """Learned embedding of arange(T), scaled by D^-0.5."""

    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_len, dim))
        self.scale = dim**-0.5

    def forward(self, length: int) -> Tensor:
        return self.weight[:length] * self.scale  # (T, D)


# Additive bias of a masked key. exp(-1e4) is exactly 0 in float32 and float16, and unlike -inf a
# row with every key masked stays finite instead of turning into NaN.
MASKED_BIAS = -1e4


def attention_bias(key_mask: Tensor | None, dtype: torch.dtype, causal_len: int | None = None) -> Tensor | None:
    """Additive SDPA mask (B|1, 1, T|1, S): 0 where a query may attend a key, MASKED_BIAS elsewhere.

    ``key_mask`` (B, S) marks real keys; ``causal_len`` adds a lower-triangular (T, T) mask. SDPA
    cannot combine ``is_causal`` with an explicit mask, so the two are merged here. None: no mask.
    """
    allowed = None if key_mask is None else key_mask[:, None, None, :].bool()  # (B, 1, 1, S)
    if causal_len is not None:
        device = None if key_mask is None else key_mask.device
        causal = torch.ones(causal_len, causal_len, dtype=torch.bool, device=device).tril()[None, None]
        allowed = causal if allowed is None else allowed & causal  # (B, 1, T, T)
    if allowed is None:
        return None
    return (1.0 - allowed.to(dtype)) * MASKED_BIAS


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    b, t, d = x.shape
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)  # (B, H, T, hd)


def merge_heads(x: Tensor) -> Tensor:
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)  # (B, T, D)


class SelfAttention(nn.Module):
    """GPT-2-style multi-head self-attention: fused qkv with biases.

    Causality is either in ``attn_bias`` (merged with padding by ``attention_bias``) or, with no bias at all,
    ``causal=True``: SDPA's own ``is_causal``, which keeps the flash kernel eligible on CUDA (a bias tensor rules
    it out). SDPA refuses both at once, so a caller passes one or the other."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, attn_bias: Tensor | None = None, causal: bool = False) -> Tensor:
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=-1)
        q, k, v = (split_heads(z, self.n_heads) for z in (q, k, v))  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, is_causal=causal)
        return self.c_proj(merge_heads(y))


class LatentAttention(nn.Module):
    """Perceiver attention: queries from the query stream; keys and values from [context; queries].

    Each stream has its own RMSNorm; q and k get a per-head RMSNorm; no biases, no causal mask.
    With ``per_stream_kv`` each stream has its own key/value projection.
    """

    def __init__(self, dim: int, n_heads: int, eps: float, per_stream_kv: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm_query = RMSNorm(dim, eps)
        self.norm_context = RMSNorm(dim, eps)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * dim, bias=False)
        self.kv_context = nn.Linear(dim, 2 * dim, bias=False) if per_stream_kv else None
        self.q_norm = RMSNorm(dim // n_heads, eps)
        self.k_norm = RMSNorm(dim // n_heads, eps)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, query: Tensor, context: Tensor, attn_bias: Tensor | None) -> Tensor:
        """``attn_bias`` masks the keys [context; query], see ``stream_bias``."""
        d = query.shape[-1]
        xq, xc = self.norm_query(query), self.norm_context(context)
        kv_context = self.kv_context if self.kv_context is not None else self.kv
        kv = torch.cat([kv_context(xc), self.kv(xq)], dim=1)  # (B, S_ctx + T, 2D)
        k, v = kv.split(d, dim=-1)
        q = self.q_norm(split_heads(self.q(xq), self.n_heads))  # (B, H, T, hd)
        k = self.k_norm(split_heads(k, self.n_heads))  # (B, H, S, hd)
        v = split_heads(v, self.n_heads)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        return self.out(merge_heads(y))


def stream_bias(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Attention bias of the keys [context; query] when both streams have one entry per position
    (N = L), so position i's token and latent are padding together."""
    return None if mask is None else attention_bias(torch.cat([mask, mask], dim=1), dtype)


def sinusoidal_embedding(t: Tensor, dim: int, max_period: float) -> Tensor:
    """(B,) times in [0, 1] -> (B, dim) embedding [cos(t w_i), sin(t w_i)], w_i = max_period^(-i/half)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None, :]  # (B, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, dim), float32
