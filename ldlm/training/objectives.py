"""What the reference model is trained on and against: batches, the two objectives, the statistics.

- autoencoder: token cross-entropy + ``feature_weight`` x the latent decoder's MSE to the
  standardized GPT-2 features (the spec's objective). Gaussian noise of a per-sample scale in
  [0, ``latent_noise``] x the latents' RMS is added to the latents first, so the decoders learn to
  read latents that a denoiser only gets close to. Each sample's last real token can weigh more
  (``last_token_weight``): a window's end is where a token kept in the next latent is lost.
- denoiser: x_t = alpha_t z + sigma_t eps at t ~ U(0, 1) (a share of the samples at the noise levels where
  neighbours decide a token), predicting z with an MSE loss; a
  ``self_condition`` share of the batches first runs the denoiser once without gradient and feeds
  that x0_hat back as x0_prev, as the sampler does at every step but the first.
- decoder: the autoencoder's loss for the two decoders alone (encoder and denoiser frozen). A
  ``denoised_fraction`` of the batches decode the denoiser's self-conditioned x0_hat from x_t at
  t ~ U(0, ``denoised_t_max``) instead of the encoder's latents: a sampler ends on such latents, which
  the decoders never saw (each position's token is an argmax of its own, so a latent between two
  words' decodes into a word piece that joins its neighbour into a non-word).

The vocabulary head is trained on the corpus's token ids only (the softmax over the other ~30k
GPT-2 ids costs most of a step and teaches nothing: they never occur). Those rows end with weight 0
and bias ``UNSEEN_LOGIT``, so argmax over the whole vocabulary never picks them.

Every random draw is a function of (seed, stage, step), so a resumed run makes the batches the
uninterrupted run would have made.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ldlm.model.ldlm import LDLM
from ldlm.sampling.schedule import TangentSchedule, forward_noise
from ldlm.training.plan import DENOISER_LENGTHS, FOCUS_T, TrainingPlan

STAGES = ("features", "autoencoder", "autoencoder_long", "latents", "denoiser", "decoder", "done")
UNSEEN_LOGIT = -30.0  # logit of every id the corpus never has: far below any trained logit, exact in fp16 too


def draw(seed: int, stage: str, step: int) -> tuple[np.random.Generator, torch.Generator]:
    """The random streams of one step: the same (seed, stage, step) always draws the same."""
    key = [seed, STAGES.index(stage), step]
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0] >> np.uint64(1)))
    return np.random.default_rng(key), gen


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def device_of(model: nn.Module) -> torch.device:
    """Where ``model`` trains; batches and noise are drawn on the CPU (the same on any device), then moved."""
    return next(model.parameters()).device


def windows(ids: np.ndarray, starts: np.ndarray, length: int) -> Tensor:
    return torch.from_numpy(ids[starts[:, None] + np.arange(length)[None]])


def text_batch(ids: np.ndarray, plan: TrainingPlan, rng: np.random.Generator, full_length: bool = False) -> tuple[Tensor, Tensor]:
    """(input_ids, mask): one length for the batch, max_length (``full_length``, or a ``full_length_fraction``
    of the batches) or else log-uniform in [min_length, max_length]; a ``short_fraction`` of samples cut shorter."""
    log_uniform = math.exp(rng.uniform(math.log(plan.min_length), math.log(plan.max_length)))
    full_length = full_length or rng.random() < plan.full_length_fraction
    length = plan.max_length if full_length else int(round(log_uniform))
    batch = plan.tokens_per_batch // length
    input_ids = windows(ids, rng.integers(0, len(ids) - length, batch), length)
    valid = np.full(batch, length)
    short = rng.random(batch) < plan.short_fraction
    valid[short] = rng.integers(1, length + 1, int(short.sum()))
    mask = torch.from_numpy(np.arange(length)[None] < valid[:, None]).long()
    return input_ids, mask


@torch.no_grad()
def feature_statistics(model: LDLM, ids: np.ndarray, windows_count: int = 256, length: int = 128, seed: int = 0) -> None:
    """Per-dimension mean and std of GPT-2's features over training windows, into the model."""
    rng, _ = draw(seed, "features", 0)
    feats = model.feature_model(windows(ids, rng.integers(0, len(ids) - length, windows_count), length).to(device_of(model))).flatten(0, 1)
    model.feature_mean.copy_(feats.mean(0))
    model.feature_std.copy_(feats.std(0).clamp_min(1e-4))


class VocabularyHead(nn.Module):
    """The token decoder's head restricted to the corpus's ids, trained as its own (V', D) weight:
    gathering rows of the full (V, D) head every step would scatter a full-size gradient back."""

    def __init__(self, vocabulary: np.ndarray, model: LDLM) -> None:
        super().__init__()
        ids = torch.from_numpy(vocabulary).long()
        index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        self.ids: Tensor
        self.index: Tensor
        self.register_buffer("ids", ids, persistent=False)  # buffers: they go where the head goes
        self.register_buffer("index", index, persistent=False)
        full = model.token_decoder.head
        self.weight = nn.Parameter(full.weight.detach()[self.ids].clone())
        self.bias = nn.Parameter(full.bias.detach()[self.ids].clone())

    def logits(self, model: LDLM, h: Tensor, mask: Tensor) -> Tensor:
        """Logits (real positions, V') of the real positions only: the head never runs on padding."""
        return F.linear(model.token_decoder.hidden(h, mask)[mask.bool()], self.weight, self.bias)

    @torch.no_grad()
    def seal(self, model: LDLM) -> None:
        """Write the trained rows into the full head; every id outside the corpus gets weight 0 and
        bias UNSEEN_LOGIT."""
        full = model.token_decoder.head
        unseen = self.index < 0
        full.weight[unseen] = 0.0
        full.bias[unseen] = UNSEEN_LOGIT
        full.weight[self.ids] = self.weight
        full.bias[self.ids] = self.bias


def standard_features(model: LDLM, input_ids: Tensor, mask: Tensor) -> Tensor:
    """GPT-2's (frozen) features, standardized: the encoder's input and the latent decoder's target."""
    with torch.no_grad():
        return (model.feature_model(input_ids, mask) - model.feature_mean) / model.feature_std


def with_latent_noise(latents: Tensor, plan: TrainingPlan, gen: torch.Generator) -> Tensor:
    """Gaussian noise of a per-sample scale in [0, latent_noise] x the latents' RMS."""
    rms = latents.detach().pow(2).mean().sqrt()
    scale = plan.latent_noise * torch.rand(latents.shape[0], 1, 1, generator=gen).to(latents.device)
    return latents + scale * rms * torch.randn(latents.shape, generator=gen).to(latents.device)


def token_weights(real: Tensor, last_weight: float) -> Tensor:
    """Weights (real positions,) of the token loss, from the (B, L) bool mask of real positions:
    ``last_weight`` at each sample's last real position, 1 elsewhere (padding is on the right)."""
    last = torch.zeros_like(real)
    last[torch.arange(real.shape[0], device=real.device), real.sum(1) - 1] = True
    return torch.where(last, last_weight, 1.0)[real]


def decoding_loss(
    model: LDLM, head: VocabularyHead, latents: Tensor, features: Tensor, input_ids: Tensor, mask: Tensor, plan: TrainingPlan, measure: bool
) -> tuple[Tensor, dict[str, float]]:
    """Token cross-entropy (each sample's last real token weighted ``last_token_weight``) + ``feature_weight``
    x the latent decoder's MSE to ``features``, from raw latents."""
    h = model.latent_decoder(latents, mask)
    real = mask.bool()
    logits = head.logits(model, h, mask)
    targets = head.index[input_ids[real]]
    weights = token_weights(real, plan.last_token_weight)
    token_loss = (weights * F.cross_entropy(logits, targets, reduction="none")).sum() / weights.sum()
    feature_loss = F.mse_loss(h[real], features[real])
    stats = {"token_loss": token_loss.item(), "feature_mse": feature_loss.item()}
    if measure:  # an argmax over (tokens, V') costs a tenth of a step: only when it is logged
        stats["accuracy"] = (logits.detach().argmax(-1) == targets).float().mean().item()
    return token_loss + plan.feature_weight * feature_loss, stats


def autoencoder_loss(
    model: LDLM,
    head: VocabularyHead,
    input_ids: Tensor,
    mask: Tensor,
    plan: TrainingPlan,
    gen: torch.Generator,
    measure: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    features = standard_features(model, input_ids, mask)
    latents = with_latent_noise(model.latent_encoder(features, mask), plan, gen)
    return decoding_loss(model, head, latents, features, input_ids, mask, plan, measure)


def decoder_loss(
    model: LDLM,
    head: VocabularyHead,
    schedule: TangentSchedule,
    batch: tuple[Tensor, Tensor],
    denoised: bool,
    plan: TrainingPlan,
    gen: torch.Generator,
    measure: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    """The decoders' loss on the frozen encoder's latents (with latent noise), or on ``denoised`` ones:
    x0_hat from x_t at t ~ U(0, denoised_t_max), self-conditioned as the sampler's every step but the first."""
    input_ids, mask = batch
    features = standard_features(model, input_ids, mask)
    with torch.no_grad():
        latents = model.latent_encoder(features, mask)
        if denoised:
            z = (latents - model.latent_mean) / model.latent_std
            t = plan.denoised_t_max * torch.rand(z.shape[0], generator=gen).to(z.device)
            x_t = forward_noise(schedule, z, t, torch.randn(z.shape, generator=gen).to(z.device))
            latents = self_conditioned_x0(model, x_t, t, mask) * model.latent_std + model.latent_mean
        else:
            latents = with_latent_noise(latents, plan, gen)
    return decoding_loss(model, head, latents, features, input_ids, mask, plan, measure)


@torch.no_grad()
def cache_latents(model: LDLM, ids: np.ndarray, tokens: int, seed: int, lengths: tuple[int, ...] = DENOISER_LENGTHS) -> dict[int, Tensor]:
    """Raw (unstandardized) latents of random training windows, per window length, equal in tokens."""
    rng, _ = draw(seed, "latents", 0)
    out = {}
    for length in lengths:
        starts = rng.integers(0, len(ids) - length, tokens // len(lengths) // length)
        parts = []
        for chunk in np.array_split(starts, max(1, len(starts) // 64)):
            features = (model.feature_model(windows(ids, chunk, length).to(device_of(model))) - model.feature_mean) / model.feature_std
            parts.append(model.latent_encoder(features))
        out[length] = torch.cat(parts)
    return out


@torch.no_grad()
def latent_statistics(model: LDLM, cache: dict[int, Tensor]) -> None:
    """Per-dimension mean and std of the latents, into the model (the cache holds raw latents)."""
    flat = torch.cat([z.flatten(0, 1) for z in cache.values()])
    model.latent_mean.copy_(flat.mean(0))
    model.latent_std.copy_(flat.std(0).clamp_min(1e-4))


def latent_batch(cache: dict[int, Tensor], plan: TrainingPlan, model: LDLM, rng: np.random.Generator) -> Tensor:
    """A batch of standardized latents at one cached length."""
    length = list(cache)[rng.integers(len(cache))]
    z = cache[length][rng.integers(0, len(cache[length]), max(1, plan.tokens_per_batch // length))]
    return (z - model.latent_mean) / model.latent_std


def self_conditioned_x0(model: LDLM, x_t: Tensor, t: Tensor, mask: Tensor | None = None) -> Tensor:
    """x0_hat as the sampler makes it at every step but the first: a pass without x0_prev, fed back to a second."""
    return model.denoise(x_t, t, model.denoise(x_t, t, torch.zeros_like(x_t), mask), mask)


def denoiser_times(count: int, focus_fraction: float, gen: torch.Generator) -> Tensor:
    """t ~ U(0, 1), except a ``focus_fraction`` share drawn from U(FOCUS_T): where a token is decided by its
    neighbours, the denoiser's one lever beyond its own position (from its own x_t alone, the reference's
    token accuracy falls from 85% at t = 0.2 to 20% at t = 0.5)."""
    t = torch.rand(count, generator=gen)
    focused = FOCUS_T[0] + (FOCUS_T[1] - FOCUS_T[0]) * torch.rand(count, generator=gen)
    return torch.where(torch.rand(count, generator=gen) < focus_fraction, focused, t)


def denoiser_loss(
    model: LDLM, schedule: TangentSchedule, z: Tensor, self_condition: bool, gen: torch.Generator, focus_fraction: float
) -> tuple[Tensor, dict[str, float]]:
    t = denoiser_times(z.shape[0], focus_fraction, gen).to(z.device)
    x_t = forward_noise(schedule, z, t, torch.randn(z.shape, generator=gen).to(z.device))
    x0_prev = torch.zeros_like(z)
    if self_condition:
        with torch.no_grad():
            x0_prev = model.denoise(x_t, t, x0_prev)
    loss = F.mse_loss(model.denoise(x_t, t, x0_prev), z)
    return loss, {"mse": loss.item()}
