"""Model-level properties of the three inference graphs on the tiny config."""

from __future__ import annotations

import torch

from ldlm.model.ldlm import LDLM

ATOL = 1e-5


def padded_batch(ids: torch.Tensor, pad_to: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a (1, T) sequence to pad_to with pad_id; return ids and the (1, pad_to) mask."""
    t = ids.shape[1]
    padded = torch.full((1, pad_to), pad_id, dtype=ids.dtype)
    padded[:, :t] = ids
    mask = torch.zeros(1, pad_to, dtype=torch.bool)
    mask[:, :t] = True
    return padded, mask


@torch.no_grad()
def test_encoder_padding_does_not_change_valid_positions(tiny_model: LDLM) -> None:
    v = tiny_model.config.gpt2_vocab_size
    ids = torch.randint(0, v, (1, 9), generator=torch.Generator().manual_seed(0))
    alone = tiny_model.encode_latents(ids, torch.ones_like(ids, dtype=torch.bool))
    for pad_to, pad_id in ((12, 50256), (20, 17)):
        padded, mask = padded_batch(ids, pad_to, pad_id)
        latents = tiny_model.encode_latents(padded, mask)
        assert (latents[:, :9] - alone).abs().max().item() < ATOL
    # Without the mask the padding leaks in: the check above can fail.
    padded, _ = padded_batch(ids, 20, 17)
    assert (tiny_model.encode_latents(padded)[:, :9] - alone).abs().max().item() > 1e-3


@torch.no_grad()
def test_encoder_batch_of_mixed_lengths_equals_single_runs(tiny_model: LDLM) -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = (5, 11, 8)
    seqs = [torch.randint(0, 50257, (1, n), generator=gen) for n in lengths]
    ids = torch.full((3, 11), 50256)
    mask = torch.zeros(3, 11, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : s.shape[1]] = s[0]
        mask[i, : s.shape[1]] = True
    batch = tiny_model.encode_latents(ids, mask)
    for i, s in enumerate(seqs):
        single = tiny_model.encode_latents(s, torch.ones_like(s, dtype=torch.bool))
        assert (batch[i, : s.shape[1]] - single[0]).abs().max().item() < ATOL


@torch.no_grad()
def test_denoiser_and_decoder_padding_invariance(tiny_model: LDLM) -> None:
    d = tiny_model.config.d_model
    gen = torch.Generator().manual_seed(2)
    x_t, x0_prev = torch.randn(1, 7, d, generator=gen), torch.randn(1, 7, d, generator=gen)
    t = torch.tensor([0.4])
    alone = tiny_model.denoise(x_t, t, x0_prev)
    pad = torch.randn(1, 5, d, generator=gen) * 10
    mask = torch.cat([torch.ones(1, 7), torch.zeros(1, 5)], dim=1).bool()
    padded = tiny_model.denoise(torch.cat([x_t, pad], 1), t, torch.cat([x0_prev, pad], 1), mask)
    assert (padded[:, :7] - alone).abs().max().item() < ATOL

    logits_alone = tiny_model.decode_logits(x_t)
    logits_padded = tiny_model.decode_logits(torch.cat([x_t, pad], 1), mask)
    assert (logits_padded[:, :7] - logits_alone).abs().max().item() < ATOL


@torch.no_grad()
def test_denoiser_takes_one_time_per_sample(tiny_model: LDLM) -> None:
    """Samples at different steps share a batch: each row equals its own single run."""
    d = tiny_model.config.d_model
    gen = torch.Generator().manual_seed(3)
    x_t, x0_prev = torch.randn(3, 6, d, generator=gen), torch.randn(3, 6, d, generator=gen)
    t = torch.tensor([0.9, 0.5, 0.1])
    batch = tiny_model.denoise(x_t, t, x0_prev)
    for i in range(3):
        single = tiny_model.denoise(x_t[i : i + 1], t[i : i + 1], x0_prev[i : i + 1])
        assert (batch[i] - single[0]).abs().max().item() < ATOL
    assert (batch[0] - tiny_model.denoise(x_t[:1], t[1:2], x0_prev[:1])[0]).abs().max().item() > 1e-4


@torch.no_grad()
def test_graph_shapes_and_dtypes(tiny_model: LDLM) -> None:
    c = tiny_model.config
    ids = torch.randint(0, c.gpt2_vocab_size, (2, 10))
    z = tiny_model.encode_latents(ids)
    assert z.shape == (2, 10, c.d_model) and z.dtype == torch.float32
    assert tiny_model.denoise(z, torch.rand(2), z).shape == z.shape
    logits = tiny_model.decode_logits(z)
    assert logits.shape == (2, 10, c.vocab_size)
    tokens = tiny_model.decode_tokens(z)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, logits.argmax(-1))
