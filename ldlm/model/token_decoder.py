"""Token decoder: bidirectional transformer blocks on h_hat, a final LayerNorm and the vocabulary head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ldlm.model.config import LDLMConfig
from ldlm.model.layers import MLP, SelfAttention, attention_bias

# Token ids are the argmax of the logits, found in two passes so the (B*L, V) logits never exist whole and
# never get scanned by an ArgMax (ONNX Runtime's ArgMax runs about ten times slower than its ReduceMax):
#   1. VOCABULARY_CHUNK columns of the head at a time, the product and at once the maximum of each ARGMAX_BLOCK
#      columns (a chunk stays in the CPU's cache between the two, and no allocation grows with the vocabulary);
#   2. the argmax of those block maxima (V / ARGMAX_BLOCK of them) picks a block per row, and that block's
#      ARGMAX_BLOCK logits, computed again, pick the column.
# The reference checkpoint's head alone in ONNX Runtime on 2 CPU cores at 1 x 128 / 8 x 128 positions: 1024
# columns 9.4 / 58 ms, 2048 8.7 / 69 ms; an argmax inside every chunk (gathered per row) took 10.7 / 77 ms and
# the whole logits with one ArgMax 57 / 360 ms. The decoder's b1 cost is the one a preview pays.
VOCABULARY_CHUNK = 2048
ARGMAX_BLOCK = 64


def block_argmax(rows: Tensor, weight: Tensor, chunk: int = VOCABULARY_CHUNK, block: int = ARGMAX_BLOCK) -> Tensor:
    """rows (N, K), weight (V, K) -> the first index of each row's maximum of ``rows @ weight.T``, (N,) int64,
    in the two passes above. A near-tie inside the winning block is decided by its logits computed again, which
    may round differently from the chunk's product in their last bit; an exact tie goes to the first index."""
    if chunk % block:
        raise ValueError(f"chunk={chunk} is not a multiple of block={block}; allowed: a positive multiple of it")
    vocab = weight.shape[0]
    width = -(-vocab // block) * block  # whole blocks
    maxima = [
        F.linear(rows, _filled(weight[start : start + chunk], min(chunk, width - start))).unflatten(1, (-1, block)).amax(-1)
        for start in range(0, width, chunk)
    ]
    best = torch.cat(maxima, 1).argmax(-1, keepdim=True)  # (N, 1): the first block holding the maximum
    # That block's columns, those past the vocabulary read as the last one (as _filled made them).
    columns = (best * block + torch.arange(block, device=rows.device)).clamp(max=vocab - 1)  # (N, block)
    logits = (weight[columns] @ rows.unsqueeze(-1)).squeeze(-1)  # (N, block)
    return best.squeeze(-1) * block + logits.argmax(-1)


def _filled(columns: Tensor, size: int) -> Tensor:
    """A chunk of the head's columns filled up to ``size`` (whole blocks) with copies of its last column: a copy ties
    with that column and comes after it, so it never wins. Only the last chunk is short, so only it is copied."""
    missing = size - columns.shape[0]
    return torch.cat([columns, columns[-1:].expand(missing, -1)]) if missing > 0 else columns


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


class VocabularyHead(nn.Linear):
    """features (..., D) -> logits (..., V), or with ``ids_only`` their argmax (...) int64.

    The bias is one more column of the weight, read by a column of ones appended to the features: the
    product adds it, rather than a second pass over the logits (ONNX Runtime fuses no bias into a
    MatMul on (B, L, D), and a Gemm on the (B*L, D) rows leaves a copy of the logits to reshape them).
    ``ids_only`` returns ``logits.argmax(-1)`` (the first index of the maximum, ties included) without the
    whole logits (``block_argmax``). It is the head's forward, so exported nodes keep the head's module path
    (export/quantize.py keeps them float by it)."""

    def forward(self, x: Tensor, ids_only: bool = False) -> Tensor:
        weight = self.weight
        if self.bias is not None:
            weight = torch.cat([weight, self.bias.unsqueeze(1)], 1)
            x = F.pad(x, (0, 1), value=1.0)
        if not ids_only:
            return F.linear(x, weight)
        return block_argmax(x.reshape(-1, x.shape[-1]), weight).reshape(x.shape[:-1])


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
