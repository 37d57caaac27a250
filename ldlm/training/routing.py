"""An initialization of the two Perceivers that starts position p reading position p.

From PyTorch's init, the reference autoencoder learns to route tokens between positions: its encoder
sent tokens to scattered latents (latent p attends most to position p for 3 of 128 latents:
docs/measurements/encoder-routing-2026-12-04.json), and with the encoder aligned alone, the decoder
still learned to read some tokens from the next latent (GPT-2's features are causal, so latent p+1
holds token p too). A window of L tokens has latents 0..L-1 only, so wherever the reader of
position L-1 lies past the end, the window's last token is lost (scripts/research/last_token_accuracy.py).
Reading position p at position p keeps every length whole, so training starts there:

- each Perceiver's position table holds, in every head's dimensions, the same sinusoids of the
  position (frequencies pi/2 down to pi/2 / ``period`` per position), at ``position_rms`` x the RMS
  of 1 of what it is added to (standardized features in the encoder, normed latents in the decoder),
  so position is most of what a key says;
- the encoder's latent bank holds the same sinusoids: latent p starts as position p;
- every block's query and context-key projections start as the identity, and the per-head q/k
  norms' gains at ``gain``, so a query meets the key of its own position at cosine ~1 and the
  others' at the sinusoids' kernel: at init, ~99% of latents move most with their own position's
  feature, and ~99% of decoded positions with their own latent (tests/ldlm/training/test_routing.py).

Only the starting point changes: every weight trains as before, and the architecture is the spec's.
"""

from __future__ import annotations

import math

import torch

from ldlm.model.latent_decoder import LatentDecoder
from ldlm.model.latent_encoder import LatentEncoder
from ldlm.model.layers import LatentAttention
from ldlm.model.ldlm import LDLM


def position_sinusoids(count: int, dim: int, heads: int, period: float) -> torch.Tensor:
    """(count, dim) rows of RMS 1: each head's dim / heads entries are [cos(p w_i), sin(p w_i)] with
    w_i = (pi/2) x period^(-i/half), the same in every head."""
    half = dim // heads // 2
    freqs = (math.pi / 2) * torch.exp(-math.log(period) * torch.arange(half) / half)
    angles = torch.arange(count)[:, None] * freqs[None]  # (count, half)
    one_head = torch.cat([angles.cos(), angles.sin()], dim=-1) * math.sqrt(2)  # cos^2 + sin^2 = 1 per pair: RMS 1
    return one_head.repeat(1, heads)


@torch.no_grad()
def align_perceiver(
    perceiver: LatentEncoder | LatentDecoder, position_rms: float = 2.0, gain: float = 3.0, period: float = 64.0
) -> torch.Tensor:
    """Start ``perceiver`` reading position p at position p; in place. Returns the sinusoid table (rows of RMS 1)."""
    attentions = [m for m in perceiver.modules() if isinstance(m, LatentAttention)]
    count, dim = perceiver.positions.weight.shape
    table = position_sinusoids(count, dim, attentions[0].n_heads, period)
    perceiver.positions.weight.copy_(table * position_rms / perceiver.positions.scale)  # scaled by D^-0.5 when read
    eye = torch.eye(dim)
    for attn in attentions:
        context_kv = attn.kv_context if attn.kv_context is not None else attn.kv
        attn.q.weight.copy_(eye)
        context_kv.weight[:dim].copy_(eye)  # the key half; the values keep their random init
        attn.q_norm.weight.fill_(gain)
        attn.k_norm.weight.fill_(gain)
    return table


@torch.no_grad()
def align_routing(model: LDLM) -> None:
    """Start the latent encoder and decoder reading position p at position p (the module's docstring)."""
    model.latent_encoder.latent_bank.copy_(align_perceiver(model.latent_encoder))
    align_perceiver(model.latent_decoder)
