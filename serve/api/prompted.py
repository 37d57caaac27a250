"""/v1/generate with a prompt: the prompt conditions every sample by prefix inpainting, as on
/v1/completions (``LDLMPipeline.inpaint_prefix``): its P tokens are encoded once and held at the
first P positions at every step, and ``length`` more are written after them (P + length at most the
model's max_seq_len). Texts, token ids and streamed previews are of what follows the prompt: the P
positions are the prompt's own latents, and what the decoder makes of them is not the model's answer.
"""

from __future__ import annotations

from torch import Tensor

from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.serve.api.errors import HTTPError


def prompt_prefix(pipeline: LDLMPipeline, prompt: str, length: int) -> tuple[Tensor | None, int]:
    """The prompt's latents (P, D) to inpaint and its token count P; (None, 0) for no prompt. Encoding
    runs the encoder: call this off the event loop."""
    if prompt == "":
        return None, 0
    if not prompt.strip():
        raise HTTPError(400, f'prompt={prompt!r} is blank; allowed: text with a non-space character, or "" for none', param="prompt")
    ids = pipeline.tokenizer.encode([prompt])[0]
    limit = pipeline.config.max_seq_len
    if len(ids) + length > limit:
        raise HTTPError(
            400,
            f"prompt has {len(ids)} tokens and length is {length}: {len(ids) + length} tokens in all; "
            f"allowed: up to {limit} (the model's max_seq_len)",
            param="prompt",
        )
    return pipeline.prompt_latents(ids, len(ids) + length).cpu(), len(ids)  # ldlm generate --prompt's encoding


def text_after(token_ids: list[int], kept: int, tokenizer: TextTokenizer) -> str:
    """The text of a row's ids after its first ``kept`` (the prompt's), cut at end-of-text."""
    return tokenizer.decode(token_ids[kept:])


def texts_after(decoded: TextResult, kept: list[int], tokenizer: TextTokenizer) -> list[str]:
    """Each row's text after its own ``kept`` prompt tokens (0: the row's text as decoded)."""
    rows = [row[:n] for row, n in zip(decoded.token_ids.tolist(), decoded.lengths)]
    return [text_after(row, k, tokenizer) if k else text for row, k, text in zip(rows, kept, decoded.texts)]


def after_prompt(result: TextResult, kept: int, tokenizer: TextTokenizer) -> TextResult:
    """``result`` without the prompt's ``kept`` positions: its ids, texts and lengths from there on."""
    if kept == 0:
        return result
    rows = [row[:n].tolist() for row, n in zip(result.token_ids, result.lengths)]
    texts = [text_after(row, kept, tokenizer) for row in rows]
    return TextResult(result.token_ids[:, kept:], texts, [n - kept for n in result.lengths], plan=result.plan)
