"""The text measures against hand-computed closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ldlm.training.evaluation import bigram_log_likelihood, unigram_entropy_bits, words


def test_bigram_log_likelihood_is_the_smoothed_conditional_by_hand() -> None:
    corpus = np.array([0, 1, 0, 1, 0, 2, 0])  # pairs 01 10 01 10 02 20: after 0 come 1, 1, 2; after 1 come 0, 0
    # P(1 | 0) = (2 + 0.1) / (3 + 0.1 * 3), P(0 | 1) = (2 + 0.1) / (2 + 0.1 * 3), over the 3 distinct ids
    expected = (math.log(2.1 / 3.3) + math.log(2.1 / 2.3)) / 2
    assert bigram_log_likelihood([[0, 1, 0]], corpus) == pytest.approx(expected, rel=1e-12)
    # a proper distribution after every id that has a successor
    for previous in (0, 1):
        total = sum(math.exp(bigram_log_likelihood([[previous, b]], corpus)) for b in (0, 1, 2))
        assert total == pytest.approx(1.0, rel=1e-12)


def test_independent_draws_score_below_the_corpus_order() -> None:
    rng = np.random.default_rng(0)
    corpus = np.tile(np.arange(50), 200)  # every id followed by the next one
    ordered = [corpus[i * 40 : (i + 1) * 40].tolist() for i in range(20)]
    shuffled = [rng.choice(corpus, 40).tolist() for _ in range(20)]
    # ordered: log(200.1 / 205) each; shuffled: mostly log(0.1 / 205)
    assert bigram_log_likelihood(ordered, corpus) > -0.05 > -3 > bigram_log_likelihood(shuffled, corpus)


def test_words_and_unigram_entropy_by_hand() -> None:
    assert words("Mr. Darcy's 2 horses--at Pemberley!") == ["mr", "darcy", "s", "horses", "at", "pemberley"]
    assert unigram_entropy_bits([1, 1, 2, 3]) == pytest.approx(1.5)
