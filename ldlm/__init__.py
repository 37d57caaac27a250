"""LDLM: a latent diffusion language model, from PyTorch to production inference.

Heavy modules (torch, tokenizers) load on first use, so ``import ldlm`` and ``ldlm --help`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ldlm.model.checkpoint import CheckpointError, init_model, load_checkpoint, save_checkpoint
    from ldlm.model.config import LDLMConfig, preset
    from ldlm.model.ldlm import LDLM
    from ldlm.model.tokenizer import TextTokenizer
    from ldlm.pipeline import LDLMPipeline
    from ldlm.serve.runtime.backends import open_pipeline

_EXPORTS = {
    "LDLMConfig": "ldlm.model.config",
    "preset": "ldlm.model.config",
    "LDLM": "ldlm.model.ldlm",
    "LDLMPipeline": "ldlm.pipeline",
    "open_pipeline": "ldlm.serve.runtime.backends",
    "TextTokenizer": "ldlm.model.tokenizer",
    "CheckpointError": "ldlm.model.checkpoint",
    "init_model": "ldlm.model.checkpoint",
    "load_checkpoint": "ldlm.model.checkpoint",
    "save_checkpoint": "ldlm.model.checkpoint",
}
__all__ = [
    "__version__",
    "LDLMConfig",
    "preset",
    "LDLM",
    "LDLMPipeline",
    "open_pipeline",
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
