"""The training objectives against independent computations through the model's own forward paths."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ldlm.model.ldlm import LDLM
from ldlm.sampling.schedule import TangentSchedule
from ldlm.training.corpus import Corpus
from ldlm.training.objectives import (
    UNSEEN_LOGIT,
    VocabularyHead,
    autoencoder_loss,
    decoder_loss,
    denoiser_loss,
    denoiser_times,
    draw,
    learning_rate,
    text_batch,
)
from ldlm.training.plan import FOCUS_T, TrainingPlan
from tests.ldlm.training.conftest import MICRO_PLAN


def test_draws_are_a_function_of_seed_stage_and_step() -> None:
    a, b, c = draw(0, "autoencoder", 5), draw(0, "autoencoder", 5), draw(0, "autoencoder", 6)
    assert a[0].integers(1 << 30) == b[0].integers(1 << 30) != c[0].integers(1 << 30)
    assert torch.equal(torch.rand(4, generator=a[1]), torch.rand(4, generator=b[1]))
    assert not torch.equal(torch.rand(4, generator=draw(0, "denoiser", 5)[1]), torch.rand(4, generator=draw(1, "denoiser", 5)[1]))


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    assert learning_rate(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert learning_rate(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert learning_rate(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert learning_rate(55, 100, 1.0, 10) == pytest.approx(0.55)  # halfway down the cosine: 0.1 + 0.9 / 2
    assert learning_rate(100, 100, 1.0, 10) == pytest.approx(0.1)


def test_text_batches_are_corpus_windows_with_padding_after_them(micro_corpus: Corpus) -> None:
    plan = dataclasses.replace(MICRO_PLAN, short_fraction=0.5)
    seen_lengths, short = set(), 0
    for step in range(40):
        ids, mask = text_batch(micro_corpus.train, plan, draw(0, "autoencoder", step)[0])
        b, n = ids.shape
        assert plan.min_length <= n <= plan.max_length and b == plan.tokens_per_batch // n
        seen_lengths.add(n)
        valid = mask.sum(1)
        assert torch.equal(mask, (torch.arange(n)[None] < valid[:, None]).long())  # real positions first
        short += int((valid < n).sum())
        text = micro_corpus.train.tobytes()
        assert all(ids[i].numpy().tobytes() in text for i in range(b))  # each row is a window of the corpus
    assert len(seen_lengths) > 5 and short > 0
    full, mask = text_batch(micro_corpus.train, dataclasses.replace(MICRO_PLAN, short_fraction=0.0), draw(0, "autoencoder", 0)[0])
    assert bool(mask.all())


@pytest.mark.parametrize(("fraction", "low", "high"), [(0.0, 0, 2), (0.5, 25, 55), (1.0, 80, 80)])
def test_a_share_of_batches_is_full_length_so_the_last_positions_are_trained(
    micro_corpus: Corpus, fraction: float, low: int, high: int
) -> None:
    plan = dataclasses.replace(MICRO_PLAN, full_length_fraction=fraction)
    full = sum(text_batch(micro_corpus.train, plan, draw(0, "autoencoder", step)[0])[0].shape[1] == plan.max_length for step in range(80))
    assert low <= full <= high


def test_vocabulary_head_is_the_full_head_at_the_corpus_ids_and_seals_the_rest(micro_model: LDLM, micro_corpus: Corpus) -> None:
    head = VocabularyHead(micro_corpus.vocabulary, micro_model)
    h = torch.randn(3, 10, micro_model.config.d_model)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0
    full = micro_model.token_decoder(h, mask)  # the model's own path: blocks, norm, full head
    with torch.no_grad():
        restricted = head.logits(micro_model, h, mask)
    torch.testing.assert_close(restricted, full[mask.bool()][:, head.ids], rtol=0, atol=1e-6)
    with torch.no_grad():
        head.weight.mul_(2.0)  # a trained restricted head differs from the full one until sealed
        head.seal(micro_model)
        sealed = micro_model.token_decoder(h, mask)
    unseen = torch.ones(micro_model.config.vocab_size, dtype=torch.bool)
    unseen[head.ids] = False
    assert bool((sealed[..., unseen] == UNSEEN_LOGIT).all())
    torch.testing.assert_close(sealed[mask.bool()][:, head.ids], head.logits(micro_model, h, mask), rtol=0, atol=1e-5)
    assert set(sealed.argmax(-1).flatten().tolist()) <= set(micro_corpus.vocabulary.tolist())


def test_autoencoder_loss_is_cross_entropy_plus_feature_mse(micro_model: LDLM, micro_corpus: Corpus) -> None:
    plan = dataclasses.replace(MICRO_PLAN, latent_noise=0.0, feature_weight=0.5)
    ids, mask = text_batch(micro_corpus.train, dataclasses.replace(plan, short_fraction=0.5), draw(0, "autoencoder", 3)[0])
    head = VocabularyHead(micro_corpus.vocabulary, micro_model)
    loss, stats = autoencoder_loss(micro_model, head, ids, mask, plan, torch.Generator().manual_seed(0))
    # Independently: the model's standardized features and its decode path over the whole vocabulary.
    m, real = micro_model, mask.bool()
    features = (m.feature_model(ids, mask) - m.feature_mean) / m.feature_std
    h = m.latent_decoder(m.latent_encoder(features, mask), mask)
    logits = m.token_decoder(h, mask)[real][:, head.ids]
    targets = torch.searchsorted(head.ids, ids[real])
    expected = F.cross_entropy(logits, targets) + 0.5 * ((h - features)[real] ** 2).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    assert stats["accuracy"] == pytest.approx((logits.argmax(-1) == targets).float().mean().item())


def test_the_last_real_token_of_each_sample_weighs_last_token_weight(micro_model: LDLM, micro_corpus: Corpus) -> None:
    plan = dataclasses.replace(MICRO_PLAN, latent_noise=0.0, feature_weight=0.5, last_token_weight=5.0)
    ids, mask = text_batch(micro_corpus.train, dataclasses.replace(plan, short_fraction=0.5), draw(0, "autoencoder", 3)[0])
    assert len(set(mask.sum(1).tolist())) > 1  # samples end at different positions
    head = VocabularyHead(micro_corpus.vocabulary, micro_model)
    loss, _ = autoencoder_loss(micro_model, head, ids, mask, plan, torch.Generator().manual_seed(0))
    # Independently, sample by sample: every real position's cross-entropy, the last one counted 5 times.
    m = micro_model
    features = (m.feature_model(ids, mask) - m.feature_mean) / m.feature_std
    h = m.latent_decoder(m.latent_encoder(features, mask), mask)
    logits = m.token_decoder(h, mask)[..., head.ids]
    total, count = torch.zeros(()), 0.0
    for i, valid in enumerate(mask.sum(1).tolist()):
        per_token = F.cross_entropy(logits[i, :valid], torch.searchsorted(head.ids, ids[i, :valid]), reduction="none")
        total, count = total + per_token.sum() + 4.0 * per_token[-1], count + valid + 4.0
    real = mask.bool()
    expected = total / count + 0.5 * ((h - features)[real] ** 2).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_denoiser_loss_is_the_x0_mse_at_the_forward_process(micro_model: LDLM) -> None:
    schedule = TangentSchedule(micro_model.config.schedule_d, micro_model.config.beta_clip_t)
    z = torch.randn(4, 8, micro_model.config.d_model)
    for self_condition in (False, True):
        loss, _ = denoiser_loss(micro_model, schedule, z, self_condition, torch.Generator().manual_seed(7), 0.5)
        gen = torch.Generator().manual_seed(7)  # the same draws, in the same order: t, then the noise
        t = denoiser_times(4, 0.5, gen)
        alpha = torch.rsqrt(1 + 9 * torch.tan(np.pi * t / 2) ** 2)[:, None, None]  # the tangent schedule, d = 3
        x_t = alpha * z + torch.sqrt(1 - alpha**2) * torch.randn(z.shape, generator=gen)
        prev = micro_model.denoise(x_t, t, torch.zeros_like(z)) if self_condition else torch.zeros_like(z)
        expected = ((micro_model.denoise(x_t, t, prev) - z) ** 2).mean()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def uniform_gap(samples: np.ndarray, low: float, high: float) -> float:
    """Kolmogorov's statistic against U(low, high): the largest gap between the samples' CDF and the uniform one."""
    x = np.sort((samples - low) / (high - low))
    return float(np.max(np.abs(np.arange(1, len(x) + 1) / len(x) - x)))


def test_denoiser_times_are_uniform_with_a_focused_share() -> None:
    n = 20000
    everywhere = denoiser_times(n, 0.0, torch.Generator().manual_seed(0)).numpy()
    focused = denoiser_times(n, 1.0, torch.Generator().manual_seed(1)).numpy()
    mixed = denoiser_times(n, 0.5, torch.Generator().manual_seed(2)).numpy()
    # 1.63 / sqrt(n) is the statistic's 1% critical value: uniform draws pass it 99 times in 100
    assert uniform_gap(everywhere, 0.0, 1.0) < 1.63 / np.sqrt(n)
    assert FOCUS_T[0] <= focused.min() and focused.max() <= FOCUS_T[1]
    assert uniform_gap(focused, *FOCUS_T) < 1.63 / np.sqrt(n)
    # half focused, half uniform: P(t in FOCUS_T) = 0.5 + 0.5 * its width; the binomial's sd at n is 0.0032
    inside = np.mean((mixed >= FOCUS_T[0]) & (mixed <= FOCUS_T[1]))
    assert abs(inside - (0.5 + 0.5 * (FOCUS_T[1] - FOCUS_T[0]))) < 0.015, inside


def test_decoder_loss_decodes_the_denoisers_x0_hat_and_trains_the_decoders_alone(micro_model: LDLM, micro_corpus: Corpus) -> None:
    plan = dataclasses.replace(MICRO_PLAN, feature_weight=0.5, denoised_t_max=0.4)
    schedule = TangentSchedule(micro_model.config.schedule_d, micro_model.config.beta_clip_t)
    batch = text_batch(micro_corpus.train, dataclasses.replace(plan, short_fraction=0.5), draw(0, "decoder", 3)[0])
    ids, mask = batch
    head = VocabularyHead(micro_corpus.vocabulary, micro_model)
    m, real = micro_model, mask.bool()
    with torch.no_grad():  # with a latent mean and scale of their own, so a missing (un)standardization shows
        m.latent_mean.normal_(0.0, 0.5)
        m.latent_std.uniform_(0.5, 2.0)
    loss, _ = decoder_loss(m, head, schedule, batch, True, plan, torch.Generator().manual_seed(5))
    # Independently: the same draws in the same order (t, then the noise), the sampler's two calls.
    gen = torch.Generator().manual_seed(5)
    features = (m.feature_model(ids, mask) - m.feature_mean) / m.feature_std
    z = m.encode_latents(ids, mask)
    t = 0.4 * torch.rand(ids.shape[0], generator=gen)
    alpha = torch.rsqrt(1 + 9 * torch.tan(np.pi * t / 2) ** 2)[:, None, None]  # the tangent schedule, d = 3
    x_t = alpha * z + torch.sqrt(1 - alpha**2) * torch.randn(z.shape, generator=gen)
    x0_hat = m.denoise(x_t, t, m.denoise(x_t, t, torch.zeros_like(z), mask), mask)
    h = m.latent_decoder(x0_hat * m.latent_std + m.latent_mean, mask)
    logits = m.token_decoder(h, mask)[real][:, head.ids]
    expected = F.cross_entropy(logits, torch.searchsorted(head.ids, ids[real])) + 0.5 * ((h - features)[real] ** 2).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    loss.backward()
    trained = {name for name, p in m.named_parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert trained and all(name.startswith(("latent_decoder.", "token_decoder.")) for name in trained), sorted(trained)
    assert head.weight.grad is not None
    # Without denoising it is the autoencoder's loss on the frozen encoder's latents, latent noise included.
    plain, _ = decoder_loss(m, head, schedule, batch, False, plan, torch.Generator().manual_seed(6))
    torch.testing.assert_close(plain, autoencoder_loss(m, head, ids, mask, plan, torch.Generator().manual_seed(6))[0])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("autoencoder_steps", -1, "autoencoder_steps=-1 (allowed: >= 0)"),
        ("min_length", 0, "min_length=0, max_length=128 (allowed: 1 <= min_length <= max_length)"),
        ("tokens_per_batch", 64, "tokens_per_batch=64 (allowed: >= max_length 128)"),
        ("self_condition", 1.5, "self_condition=1.5 (allowed: 0..1)"),
        ("focus_fraction", -0.2, "focus_fraction=-0.2 (allowed: 0..1)"),
        ("full_length_fraction", -0.5, "full_length_fraction=-0.5 (allowed: 0..1)"),
        ("decoder_steps", -2, "decoder_steps=-2 (allowed: >= 0)"),
        ("denoised_fraction", 2.0, "denoised_fraction=2.0 (allowed: 0..1)"),
        ("denoised_t_max", 1.5, "denoised_t_max=1.5 (allowed: 0..1)"),
        ("latent_noise", -0.1, "latent_noise=-0.1 (allowed: >= 0)"),
        ("last_token_weight", 0.5, "last_token_weight=0.5 (allowed: >= 1)"),
    ],
)
def test_a_plan_out_of_range_names_the_field_and_range(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"training plan out of range: {message}")):
        dataclasses.replace(TrainingPlan(), **{field: value}).check()
