"""The three inference graphs as exportable modules, with their I/O contracts.

Each wrapper calls the same ``LDLM`` method the eager pipeline calls, so eager and exported
graphs cannot drift apart. Every graph takes an ``attention_mask`` (B, L) int64 (1 = real
position, padding on the right, the convention of Hugging Face and Triton clients), so requests of
different lengths can share a padded shape bucket without changing each other's results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ldlm.model.ldlm import LDLM

GRAPH_NAMES: tuple[str, ...] = ("encoder", "denoiser", "decoder")
# What the exported graphs compute and how: raised when that changes with no change of weights or versions
# (2: the decoder's vocabulary head chunked, its bias folded in), so an export cache made before is not reused.
GRAPHS_FORMAT = 2


class EncoderGraph(nn.Module):
    """(input_ids (B, L) int64, attention_mask (B, L) int64) -> latents (B, L, D)."""

    def __init__(self, model: LDLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model.encode_latents(input_ids, attention_mask.bool())


class DenoiserGraph(nn.Module):
    """(x_t (B, N, D), t (B,), x0_prev (B, N, D), attention_mask (B, N)) -> x0_hat (B, N, D)."""

    def __init__(self, model: LDLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, x_t: Tensor, t: Tensor, x0_prev: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model.denoise(x_t, t, x0_prev, attention_mask.bool())


class DecoderGraph(nn.Module):
    """(latents (B, L, D), attention_mask (B, L)) -> token_ids (B, L) int64 [, logits (B, L, V)].
    The argmax is in the graph. Without logits the token ids come from the head a chunk of the
    vocabulary at a time (``VocabularyHead``), so the (B, L, V) logits are never made; with them, the
    logits are made once and the ids are their one argmax."""

    def __init__(self, model: LDLM, with_logits: bool = False) -> None:
        super().__init__()
        self.model = model
        self.with_logits = with_logits

    def forward(self, latents: Tensor, attention_mask: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if not self.with_logits:
            return self.model.decode_tokens(latents, attention_mask.bool())
        logits = self.model.decode_logits(latents, attention_mask.bool())
        return logits.argmax(dim=-1), logits


@dataclass(frozen=True)
class GraphIO:
    """What one exported graph takes and gives: names, symbolic shapes and dtypes."""

    name: str
    module: nn.Module
    components: tuple[str, ...]  # the LDLM submodules the graph runs (their LayerNorms must appear)
    example_inputs: tuple[Tensor, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    # Symbolic shapes, "batch" and "seq" are dynamic; ints are fixed.
    input_shapes: tuple[tuple[str | int, ...], ...]
    output_shapes: tuple[tuple[str | int, ...], ...]

    def dynamic_shapes(self, max_seq_len: int) -> dict[str, dict[int, torch.export.Dim]] | None:
        """torch.export Dims for the symbolic axes; None when every axis is fixed."""
        names = {size for shape in self.input_shapes for size in shape if isinstance(size, str)}
        if not names:
            return None
        bounds = {"batch": (1, 65536), "seq": (1, max_seq_len)}
        dims = {name: torch.export.Dim(name, min=bounds[name][0], max=bounds[name][1]) for name in names}
        return {
            name: {axis: dims[size] for axis, size in enumerate(shape) if isinstance(size, str)}
            for name, shape in zip(self.input_names, self.input_shapes)
        }


def graph_io(model: LDLM, name: str, with_logits: bool = False) -> GraphIO:
    """The export contract of graph ``name``. Example inputs avoid sizes 0 and 1 on dynamic axes,
    which torch.export would specialize."""
    d, v = model.config.d_model, model.config.vocab_size
    b, length = 2, 8
    mask = torch.ones(b, length, dtype=torch.int64)
    if name == "encoder":
        ids = torch.randint(0, model.config.gpt2_vocab_size, (b, length), generator=torch.Generator().manual_seed(0))
        return GraphIO(
            name,
            EncoderGraph(model),
            ("feature_model", "latent_encoder"),
            (ids, mask),
            ("input_ids", "attention_mask"),
            ("latents",),
            (("batch", "seq"), ("batch", "seq")),
            (("batch", "seq", d),),
        )
    if name == "denoiser":
        x = torch.zeros(b, length, d)
        return GraphIO(
            name,
            DenoiserGraph(model),
            ("denoiser",),
            (x, torch.full((b,), 0.5), x.clone(), mask),
            ("x_t", "t", "x0_prev", "attention_mask"),
            ("x0_hat",),
            (("batch", "seq", d), ("batch",), ("batch", "seq", d), ("batch", "seq")),
            (("batch", "seq", d),),
        )
    if name == "decoder":
        outputs: tuple[str, ...] = ("token_ids", "logits") if with_logits else ("token_ids",)
        shapes: tuple[tuple[str | int, ...], ...] = (("batch", "seq"), ("batch", "seq", v))[: len(outputs)]
        return GraphIO(
            name,
            DecoderGraph(model, with_logits),
            ("latent_decoder", "token_decoder"),
            (torch.zeros(b, length, d), mask),
            ("latents", "attention_mask"),
            outputs,
            (("batch", "seq", d), ("batch", "seq")),
            shapes,
        )
    raise ValueError(f"unknown graph {name!r}; allowed: {', '.join(GRAPH_NAMES)}")
