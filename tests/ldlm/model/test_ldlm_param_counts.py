"""Base-size parameter counts per component against the paper's table (ldlm-model.md), +-5%."""

from __future__ import annotations

import pytest
import torch

from ldlm.model.config import preset
from ldlm.model.gpt2 import GPT2Block
from ldlm.model.ldlm import LDLM, count_parameters

# (low, high) of the table's figure; the check allows 5% beyond either end.
PAPER_TABLE = {
    "latent_encoder": (50e6, 50e6),
    "denoiser": (132e6, 132e6),
    "latent_decoder": (50e6, 55e6),
    "token_decoder": (60e6, 66e6),
}


@pytest.fixture(scope="module")
def base_on_meta() -> LDLM:
    with torch.device("meta"):  # shapes only: no memory, no init cost
        return LDLM(preset("base"))


@pytest.mark.parametrize("component", sorted(PAPER_TABLE))
def test_component_within_5_percent(base_on_meta: LDLM, component: str) -> None:
    low, high = PAPER_TABLE[component]
    count = count_parameters(getattr(base_on_meta, component))
    assert 0.95 * low <= count <= 1.05 * high, f"{component}: {count / 1e6:.1f}M vs {low / 1e6:.0f}-{high / 1e6:.0f}M"


def test_feature_model_is_gpt2_small_truncated(base_on_meta: LDLM) -> None:
    """The table's 124M is the whole GPT-2 small; we hold only the 10 blocks that run."""
    config = base_on_meta.config
    d = config.d_model
    # GPT-2 by hand: a block is ln_1 (2D) + qkv (3D^2 + 3D) + proj (D^2 + D) + ln_2 (2D)
    # + fc (4D^2 + 4D) + proj (4D^2 + D) = 12D^2 + 13D; embeddings are (vocab + positions) x D.
    block = 12 * d * d + 13 * d
    embeddings = (config.gpt2_vocab_size + config.gpt2_positions) * d
    ln_f = 2 * d
    with torch.device("meta"):
        assert count_parameters(GPT2Block(d, config.n_heads, config.layer_norm_eps)) == block
    assert len(base_on_meta.feature_model.h) == 10
    assert count_parameters(base_on_meta.feature_model) == embeddings + 10 * block
    full = embeddings + config.gpt2_layers * block + ln_f
    assert 0.95 * 124e6 <= full <= 1.05 * 124e6, f"full GPT-2: {full / 1e6:.1f}M"
