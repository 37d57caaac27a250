"""LDLM: a latent diffusion language model, from PyTorch to production inference.

Heavy modules (torch, tokenizers) load on first use, so ``import ldlm`` and ``ldlm --help`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ldlm.checkpoint import CheckpointError, init_model, load_checkpoint, save_checkpoint
    from ldlm.config import LDLMConfig, preset
    from ldlm.model import LDLM
    from ldlm.pipeline import LDLMPipeline
    from ldlm.tokenizer import TextTokenizer

_EXPORTS = {
    "LDLMConfig": "ldlm.config",
    "preset": "ldlm.config",
    "LDLM": "ldlm.model",
    "LDLMPipeline": "ldlm.pipeline",
    "TextTokenizer": "ldlm.tokenizer",
    "CheckpointError": "ldlm.checkpoint",
    "init_model": "ldlm.checkpoint",
    "load_checkpoint": "ldlm.checkpoint",
    "save_checkpoint": "ldlm.checkpoint",
}
__all__ = [
    "__version__",
    "LDLMConfig",
    "preset",
    "LDLM",
    "LDLMPipeline",
    "TextTokenizer",
    "CheckpointError",
    "init_model",
    "load_checkpoint",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ldlm' has no attribute {name!r}")
