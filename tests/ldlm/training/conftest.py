"""A model and corpus small enough that every stage of a training run takes seconds."""

from __future__ import annotations

import numpy as np
import pytest

from ldlm.model.checkpoint import init_model
from ldlm.model.config import LDLMConfig
from ldlm.model.ldlm import LDLM
from ldlm.training import TrainingPlan
from ldlm.training.corpus import Corpus

MICRO = LDLMConfig(
    d_model=32,
    n_heads=2,
    max_seq_len=32,
    vocab_size=64,
    gpt2_vocab_size=63,
    mask_token_id=63,
    eos_token_id=62,
    gpt2_layers=3,
    gpt2_positions=32,
    encoder_layers=1,
    decoder_layers=1,
    denoiser_layers=2,
    swiglu_hidden=64,
    token_decoder_layers=1,
)


@pytest.fixture
def micro_model() -> LDLM:
    return init_model(MICRO, seed=0)


@pytest.fixture(scope="session")
def micro_corpus() -> Corpus:
    """Text over 40 of the 64 ids: a fixed 'sentence' of 12 ids repeated with random ids between, so
    there is something to learn and ids 40..61 never occur."""
    rng = np.random.default_rng(0)
    sentence = rng.integers(0, 40, 12)
    parts = [np.concatenate([sentence, rng.integers(0, 40, int(rng.integers(0, 6)))]) for _ in range(400)]
    ids = np.concatenate(parts).astype(np.int64)
    cut = int(len(ids) * 0.9)
    return Corpus(ids[:cut], ids[cut:], ("micro",))


MICRO_PLAN = TrainingPlan(
    autoencoder_steps=6,
    long_steps=3,
    denoiser_steps=6,
    decoder_steps=4,
    tokens_per_batch=128,
    min_length=4,
    max_length=32,
    warmup_steps=2,
    cache_tokens=4096,
)
