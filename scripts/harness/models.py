"""What the measurement scripts call a model: a checkpoint directory or a preset's name."""

from __future__ import annotations

from pathlib import Path

from ldlm.model.checkpoint import init_model, load_checkpoint
from ldlm.model.config import preset
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer


def preset_or_checkpoint(name: str, seed: int = 0) -> tuple[LDLM, TextTokenizer]:
    """What the measurement scripts call a model: a checkpoint directory (a trained one, such as the
    reference checkpoint), or a preset's seeded random init with random norms."""
    if Path(name).is_dir():
        return load_checkpoint(name)
    return init_model(preset(name), seed, norm_init="random"), TextTokenizer.gpt2()
