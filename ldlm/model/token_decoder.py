"""Token decoder: bidirectional transformer blocks on h_hat, a final LayerNorm and the vocabulary head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ldlm.model.config import LDLMConfig
from ldlm.model.layers import MLP, SelfAttention, attention_bias

# Token ids are the argmax of the logits, computed VOCABULARY_CHUNK columns of the head at a time, so the
# (B*L, V) logits never exist whole: a chunk stays in the CPU's cache between its product and its reduction,
# and no allocation grows with the vocabulary (at 8 x 128 positions and GPT-2's vocabulary the whole logits
# are 206 MB, allocated and freed at every call). The reference checkpoint's decoder in ONNX Runtime on
# 2 CPU cores, whole graph at 1 x 128 / 8 x 128 positions: 1024 columns 16.9 / 85 ms, 2048 15.5 / 90 ms,
# 4096 14.7 / 107 ms, 8192 15.5 / 127 ms (the whole logits, as one argmax: 57 / 360 ms).
VOCABULARY_CHUNK = 2048
# Within a chunk, the maximum of each ARGMAX_BLOCK columns first (a vectorized reduction), then the argmax of
# those block maxima and of the one block that holds the winner: ONNX Runtime's ArgMax (and TopK) scans
# about ten times slower than its ReduceMax.
ARGMAX_BLOCK = 64


class TokenDecoderBlock(nn.Module):
    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        d = config.d_model
        self.attn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.attn = SelfAttention(d, config.n_heads)
        self.mlp = MLP(d, config.mlp_ratio * d, config.layer_norm_eps, config.dropout)

    def forward(self, x: Tensor, attn_bias: Tensor | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), attn_bias)
        return x + self.mlp(x)


def vocabulary_chunks(vocab_size: int, chunk: int = VOCABULARY_CHUNK, block: int = ARGMAX_BLOCK) -> list[tuple[int, int]]:
    """The [start, stop) column ranges the head's argmax runs over: ``chunk`` columns each (a multiple of
    ``block``), then the rest split into whole blocks and a tail shorter than one block."""
    if chunk % block:
        raise ValueError(f"chunk={chunk} is not a multiple of block={block}; allowed: a positive multiple of it")
    bounds = list(range(0, vocab_size, chunk))
    last = bounds[-1]
    whole = last + (vocab_size - last) // block * block
    spans = [(start, start + chunk) for start in bounds[:-1]] + [(last, whole)]
    if whole < vocab_size:
        spans.append((whole, vocab_size))
    return [(start, stop) for start, stop in spans if stop > start]


def row_max(logits: Tensor, block: int = ARGMAX_BLOCK) -> tuple[Tensor, Tensor]:
    """logits (N, C) -> (max (N,), its first index (N,) int64), as ``logits.max(-1)``: by blocks of
    ``block`` columns where C is a multiple of it (module notes), else by one argmax."""
    n, width = logits.shape
    if width % block:
        return logits.max(-1)
    blocks = logits.reshape(n, width // block, block)
    block_max = blocks.amax(-1)  # (N, C / block)
    best = block_max.argmax(-1, keepdim=True)  # the first block holding the maximum
    within = blocks.gather(1, best.unsqueeze(-1).expand(-1, -1, block)).argmax(-1)  # its first maximum
    return block_max.gather(1, best).squeeze(-1), (best * block + within).squeeze(-1)


class VocabularyHead(nn.Linear):
    """features (..., D) -> logits (..., V), or with ``ids_only`` their argmax (...) int64.

    The bias is one more column of the weight, read by a column of ones appended to the features: the
    product adds it, rather than a second pass over the logits (ONNX Runtime fuses no bias into a
    MatMul on (B, L, D), and a Gemm on the (B*L, D) rows leaves a copy of the logits to reshape them).
    ``ids_only`` goes a chunk of the vocabulary at a time (``vocabulary_chunks``) and returns exactly
    ``logits.argmax(-1)``: the first index of the maximum, ties included. It is the head's forward, so
    exported nodes keep the head's module path (export/quantize.py keeps them float by it)."""

    def forward(self, x: Tensor, ids_only: bool = False) -> Tensor:
        weight = self.weight
        if self.bias is not None:
            weight = torch.cat([weight, self.bias.unsqueeze(1)], 1)
            x = F.pad(x, (0, 1), value=1.0)
        if not ids_only:
            return F.linear(x, weight)
        rows = x.reshape(-1, x.shape[-1])
        values, ids = [], []
        for start, stop in vocabulary_chunks(self.out_features):
            value, index = row_max(F.linear(rows, weight[start:stop]))
            values.append(value)
            ids.append(index + start)
        if len(ids) == 1:
            return ids[0].reshape(x.shape[:-1])
        chunk = torch.stack(values, -1).argmax(-1, keepdim=True)  # the first chunk holding the maximum
        return torch.stack(ids, -1).gather(-1, chunk).reshape(x.shape[:-1])


class TokenDecoder(nn.Module):
    """h_hat (B, L, D), mask (B, L) -> logits (B, L, V), or their argmax (``token_ids``)."""

    def __init__(self, config: LDLMConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TokenDecoderBlock(config) for _ in range(config.token_decoder_layers))
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.head = VocabularyHead(config.d_model, config.vocab_size)

    def hidden(self, h: Tensor, mask: Tensor | None = None) -> Tensor:
        """The blocks and the final LayerNorm: the features (B, L, D) the vocabulary head reads."""
        bias = attention_bias(mask, h.dtype)  # bidirectional: padding only
        for block in self.blocks:
            h = block(h, bias)
        return self.norm(h)

    def forward(self, h: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.head(self.hidden(h, mask))

    def token_ids(self, h: Tensor, mask: Tensor | None = None) -> Tensor:
        """h_hat (B, L, D) -> ``forward(h, mask).argmax(-1)`` (B, L) int64, without the whole logits."""
        return self.head(self.hidden(h, mask), ids_only=True)
