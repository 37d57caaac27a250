"""What a training run does: the stages' lengths, learning rates and batch mixes, checked once."""

from __future__ import annotations

from dataclasses import dataclass

DENOISER_LENGTHS = (16, 32, 64, 128)  # the latent cache's window lengths, equal in tokens
FOCUS_T = (0.15, 0.6)  # the noise levels where a position's token is decided by its neighbours (objectives.denoiser_times)


@dataclass(frozen=True)
class TrainingPlan:
    seed: int = 0
    autoencoder_steps: int = 4000  # the reference checkpoint's recipe: about 40 minutes on 2 cores
    denoiser_steps: int = 12000  # about 16 minutes with the reference's 4 x 512 denoiser
    tokens_per_batch: int = 2048  # batch size = tokens_per_batch // length
    min_length: int = 8
    max_length: int = 128
    # Batches at max_length among the first stage's: position i learns only from batches at least i long, and
    # log-uniform lengths reach the last quarter in 10% of them (45-48% held out there, 98-99% before 64).
    full_length_fraction: float = 0.5
    autoencoder_lr: float = 2e-3
    long_steps: int = 400  # then full-length windows only, at a lower learning rate
    long_lr: float = 5e-4
    denoiser_lr: float = 2e-3  # 1e-3 left the held-out MSE 0.06 higher after 6000 steps (denoiser-screen-*)
    decoder_steps: int = 1200  # the decoders alone, on denoised latents too: about 8 minutes
    decoder_lr: float = 5e-4
    denoised_fraction: float = 0.35
    denoised_t_max: float = 0.3
    warmup_steps: int = 200
    weight_decay: float = 0.01
    feature_weight: float = 1.0
    latent_noise: float = 0.3
    self_condition: float = 0.5  # fraction of denoiser batches trained with x0_prev from a first pass
    # Share of denoiser samples with t drawn from FOCUS_T rather than U(0, 1): at U(0, 1) alone the tiny denoiser
    # learned to read its own position only, and its samples' words were unigram soup (docs/measurements/denoiser-screen-*).
    focus_fraction: float = 0.5
    short_fraction: float = 0.25  # samples cut shorter than the batch's length (padding after)
    # Weight of the token loss at each sample's last real position (1 elsewhere). Tried against lost window ends
    # from PyTorch's init: it costs long windows' last positions (docs/measurements/reference-retrain-*).
    last_token_weight: float = 1.0
    # Start both Perceivers reading position p at p (ldlm/training/routing.py): from PyTorch's init they route
    # tokens between positions, and lose a window's last token at a third of the lengths.
    aligned_routing: bool = True
    cache_tokens: int = 2_000_000  # tokens of training windows whose latents the denoiser trains on

    def check(self) -> None:
        problems = []
        for name in ("autoencoder_steps", "long_steps", "denoiser_steps", "decoder_steps"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} (allowed: >= 0)")
        if not 1 <= self.min_length <= self.max_length:
            problems.append(f"min_length={self.min_length}, max_length={self.max_length} (allowed: 1 <= min_length <= max_length)")
        if self.tokens_per_batch < self.max_length:
            problems.append(f"tokens_per_batch={self.tokens_per_batch} (allowed: >= max_length {self.max_length})")
        if self.last_token_weight < 1:
            problems.append(f"last_token_weight={self.last_token_weight} (allowed: >= 1)")
        for name in ("latent_noise", "feature_weight"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} (allowed: >= 0)")
        for name in ("self_condition", "focus_fraction", "short_fraction", "full_length_fraction", "denoised_fraction", "denoised_t_max"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name}={getattr(self, name)} (allowed: 0..1)")
        if problems:
            raise ValueError("training plan out of range: " + "; ".join(problems))
