"""An initialization of the latent encoder that starts each latent reading its own position's feature.

From PyTorch's init, the reference encoder learns to route tokens to scattered latents: latent p attends
most to position p for 3 of 128 latents (docs/measurements/encoder-routing-2026-12-04.json). A window of
L tokens has latents 0..L-1 only, so at every length where no latent left reads position L-1, the last
token is lost (scripts/last_token_accuracy.py: about a third of the lengths 2..128, 16 among them).
Latent p reading position p keeps every length whole, so training starts there:

- the encoder's position table holds, in every head's dimensions, the same sinusoids of the position
  (frequencies pi/2 down to pi/2 / ``period`` per position), at ``position_rms`` x the standardized
  features' RMS of 1, so position is most of what a key says;
- the latent bank holds the same sinusoids: latent p starts as position p;
- every encoder block's query and context-key projections start as the identity, and the per-head
  q/k norms' gains at ``gain``, so a query meets the key of its own position at cosine ~1 and the
  others' at the sinusoids' kernel, sharp enough that ~80% of the first block's feature attention
  lands on the latent's own position.

Only the starting point changes: every weight trains as before, and the architecture is the spec's.
"""

from __future__ import annotations

import math

import torch

from ldlm.latent_encoder import LatentEncoder


def position_sinusoids(count: int, dim: int, heads: int, period: float) -> torch.Tensor:
    """(count, dim) rows of RMS 1: each head's dim / heads entries are [cos(p w_i), sin(p w_i)] with
    w_i = (pi/2) x period^(-i/half), the same in every head."""
    half = dim // heads // 2
    freqs = (math.pi / 2) * torch.exp(-math.log(period) * torch.arange(half) / half)
    angles = torch.arange(count)[:, None] * freqs[None]  # (count, half)
    one_head = torch.cat([angles.cos(), angles.sin()], dim=-1) * math.sqrt(2)  # cos^2 + sin^2 = 1 per pair: RMS 1
    return one_head.repeat(1, heads)


@torch.no_grad()
def align_encoder_routing(encoder: LatentEncoder, position_rms: float = 2.0, gain: float = 3.0, period: float = 64.0) -> None:
    """Start latent p attending to position p (see the module's docstring); in place."""
    count, dim = encoder.latent_bank.shape
    heads = encoder.blocks[0].attn.n_heads
    table = position_sinusoids(count, dim, heads, period)
    encoder.positions.weight.copy_(table * position_rms / encoder.positions.scale)  # the table is scaled by D^-0.5 when read
    encoder.latent_bank.copy_(table)
    eye = torch.eye(dim)
    for block in encoder.blocks:
        attn = block.attn
        context_kv = attn.kv_context if attn.kv_context is not None else attn.kv
        attn.q.weight.copy_(eye)
        context_kv.weight[:dim].copy_(eye)  # the key half; the values keep their random init
        attn.q_norm.weight.fill_(gain)
        attn.k_norm.weight.fill_(gain)
