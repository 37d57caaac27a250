"""The vocabulary head: its logits against nn.Linear's, and its two-pass argmax against the argmax of the
whole logits (NumPy's, an independent reference), ties between chunks, blocks and the last block included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ldlm.model.token_decoder import ARGMAX_BLOCK, VOCABULARY_CHUNK, VocabularyHead, block_argmax

D = 8
# two whole chunks, three whole blocks and a last block of five columns
V = 2 * VOCABULARY_CHUNK + 3 * ARGMAX_BLOCK + 5
TAIL = V - 5


def head(seed: int = 0) -> VocabularyHead:
    torch.manual_seed(seed)
    module = VocabularyHead(D, V)
    with torch.no_grad():
        module.bias.normal_()
    return module


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 37, 64])
@pytest.mark.parametrize(("chunk", "block"), [(4, 4), (8, 4), (12, 4), (64, 16)])
def test_block_argmax_is_numpys_argmax(vocab: int, chunk: int, block: int) -> None:
    """In float64 (no rounding to speak of), for vocabularies of whole blocks and not, one chunk and many. The
    third feature is a bias of about -50, and the first row reads only it: every logit of that row is negative,
    and the columns that fill the last block must still never win."""
    gen = torch.Generator().manual_seed(vocab * chunk + block)
    rows, weight = torch.randn(50, 3, generator=gen, dtype=torch.float64), torch.randn(vocab, 3, generator=gen, dtype=torch.float64)
    weight[:, 2] = -50 + 0.1 * weight[:, 2]
    rows[:, 2] = 1.0
    rows[0, :2] = 0.0
    expected = (rows.numpy() @ weight.numpy().T).argmax(-1)
    np.testing.assert_array_equal(block_argmax(rows, weight, chunk, block).numpy(), expected)


def test_a_chunk_of_partial_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk=100 is not a multiple of block=64"):
        block_argmax(torch.zeros(1, 2), torch.zeros(3, 2), 100, 64)


@torch.no_grad()
def test_logits_are_a_linear_layers() -> None:
    module = head()
    x = torch.randn(2, 5, D)
    logits = module(x)
    assert logits.shape == (2, 5, V)
    torch.testing.assert_close(logits, F.linear(x, module.weight, module.bias), rtol=0, atol=1e-5)


@torch.no_grad()
def test_token_ids_are_the_argmax_of_the_whole_logits() -> None:
    module = head(1)
    x = torch.randn(3, 40, D) * 3
    ids = module(x, ids_only=True)
    assert ids.shape == (3, 40) and ids.dtype == torch.int64
    expected = F.linear(x, module.weight, module.bias).argmax(-1)  # the whole logits, as the head ran before
    torch.testing.assert_close(ids, expected, rtol=0, atol=0)
    assert len(set(ids.flatten().tolist())) > 10  # the winners spread over the vocabulary, not one column


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (10, 20),  # one block
        (100, 1000),  # one chunk, two blocks
        (500, VOCABULARY_CHUNK + 500),  # two chunks
        (VOCABULARY_CHUNK + 7, 2 * VOCABULARY_CHUNK + 70),  # a whole chunk and the last chunk
        (2 * VOCABULARY_CHUNK + 3, TAIL + 2),  # the last chunk's whole blocks and its last block
        (TAIL, TAIL + 4),  # within the last block
    ],
)
@torch.no_grad()
def test_a_tie_goes_to_the_first_index(first: int, second: int) -> None:
    """Two columns with the same weights and a bias above every other: equal logits at every position,
    the largest ones; argmax (torch's and NumPy's) takes the first."""
    module = head(2)
    module.weight[second] = module.weight[first]
    module.bias[first] = module.bias[second] = 1e3
    x = torch.randn(4, 9, D)
    logits = (x.numpy().astype(np.float64) @ module.weight.numpy().T.astype(np.float64)) + module.bias.numpy()
    assert (logits.argmax(-1) == first).all()  # the reference: NumPy on the same numbers
    assert (module(x, ids_only=True) == first).all()


@torch.no_grad()
def test_the_winner_can_be_the_last_column() -> None:
    module = head(3)
    module.bias[V - 1] = 1e3
    assert (module(torch.randn(2, 3, D), ids_only=True) == V - 1).all()
