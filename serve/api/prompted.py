"""/v1/generate with a prompt: the prompt conditions every sample by prefix inpainting, as ``ldlm generate
--prompt`` and ``LDLMPipeline.generate(prompt=)`` do: its P tokens are encoded once and held at the first P
positions at every step. ``length`` counts the whole sample, the prompt's P tokens included (P < length), and
the answer's texts, token ids and streamed previews start with the prompt verbatim: what the decoder makes of
its latents is not the model's answer. (/v1/completions keeps OpenAI's meaning instead: ``max_tokens`` counts
what follows the prompt, and the text is that alone unless ``echo``.)
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.api.errors import HTTPError


def prompt_prefix(pipeline: LDLMPipeline, prompt: str, length: int) -> tuple[Tensor | None, list[int]]:
    """The prompt's latents (P, D) to inpaint and its token ids; (None, []) for no prompt. A prompt that leaves
    no room in ``length`` is refused as ``ldlm generate`` refuses it (``LDLMPipeline.prompt_latents``).
    Encoding runs the encoder: call this off the event loop."""
    if prompt == "":
        return None, []
    if not prompt.strip():
        raise HTTPError(400, f'prompt={prompt!r} is blank; allowed: text with a non-space character, or "" for none', param="prompt")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise HTTPError(
            400, f"prompt is not valid Unicode ({error.reason} at character {error.start}); allowed: UTF-8 text", param="prompt"
        ) from None
    ids = pipeline.text_ids([prompt])[0]
    return pipeline.prompt_latents(ids, length).cpu(), ids  # ldlm generate --prompt's encoding and refusal


def with_prompt(token_ids: Sequence[int], ids: Sequence[int], tokenizer: TextTokenizer) -> str:
    """The text of a row whose first positions are the prompt's ``ids``, as given (a preview's)."""
    return tokenizer.decode([*ids, *token_ids[len(ids) :]])
