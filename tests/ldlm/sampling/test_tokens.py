"""Token choice from logits (ldlm/sampling/tokens.py) against a NumPy reference of softmax,
temperature and the nucleus, written here without torch; and the pipeline's decode with it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ldlm.pipeline import LDLMPipeline
from ldlm.sampling.tokens import TokenSampling, choose_tokens, sample_tokens

LOGITS = np.array([2.0, 1.5, 0.3, 0.0, -1.0, -3.0], dtype=np.float32)  # one position, V = 6


def nucleus_reference(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The distribution a draw must follow: softmax(l / T), cut to the smallest most-likely set whose
    mass reaches top_p, renormalized (Holtzman et al. 2019)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    out = np.zeros_like(p)
    mass = 0.0
    for token in order:
        out[token] = p[token]
        mass += p[token]
        if mass >= top_p:
            break
    return out / out.sum()


def log_softmax_reference(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    return z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))


def within_binomial_bound(counts: np.ndarray, expected: np.ndarray, n: int) -> None:
    """Each token's frequency within 5 standard deviations of its binomial count (a false alarm
    about once in 3.5 million per token); tokens outside the nucleus are never drawn."""
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0:
            assert count == 0, f"token {token} is outside the nucleus but was drawn {count} times"
        else:
            assert abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, (token, count, n * p)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (1.5, 1.0), (0.7, 0.8), (1.0, 0.5)])
def test_draws_over_many_seeds_follow_the_numpy_nucleus(temperature: float, top_p: float) -> None:
    n = 3000
    logits = torch.from_numpy(LOGITS)[None, None]  # (1, 1, V)
    drawn = [int(choose_tokens(logits, TokenSampling(temperature, top_p, seed=seed))[0]) for seed in range(n)]
    counts = np.bincount(drawn, minlength=LOGITS.size)
    within_binomial_bound(counts, nucleus_reference(LOGITS, temperature, top_p), n)


def test_positions_of_one_call_are_independent_draws_from_their_own_logits() -> None:
    n = 4000
    rows = np.stack([LOGITS, LOGITS[::-1].copy()])  # two positions with different distributions
    logits = torch.from_numpy(np.repeat(rows[:, None], n, axis=1))  # (2, n, V)
    ids = sample_tokens(logits, 0.8, 0.9, torch.Generator().manual_seed(1)).numpy()
    for r in range(2):
        within_binomial_bound(np.bincount(ids[r], minlength=LOGITS.size), nucleus_reference(rows[r], 0.8, 0.9), n)


def test_temperature_zero_is_argmax_exactly() -> None:
    logits = torch.from_numpy(np.random.default_rng(0).normal(size=(3, 7, 50)).astype(np.float32))
    ids, _ = choose_tokens(logits, TokenSampling(0.0, 0.3, seed=5))
    assert np.array_equal(ids.numpy(), np.argmax(logits.numpy(), axis=-1))


def test_a_tiny_top_p_is_argmax_at_any_temperature() -> None:
    logits = torch.from_numpy(np.random.default_rng(1).normal(size=(2, 9, 40)).astype(np.float32))
    for seed in range(20):
        ids, _ = choose_tokens(logits, TokenSampling(2.0, 1e-6, seed=seed))
        assert np.array_equal(ids.numpy(), np.argmax(logits.numpy(), axis=-1))


def test_logprobs_are_numpy_log_softmax_at_the_chosen_tokens_and_the_top_alternatives_sorted() -> None:
    raw = np.random.default_rng(2).normal(scale=3.0, size=(2, 5, 30)).astype(np.float32)
    ids, logprobs = choose_tokens(torch.from_numpy(raw), TokenSampling(1.3, 0.95, top_logprobs=4, seed=7))
    assert logprobs is not None
    reference = log_softmax_reference(raw)  # the model's distribution (T = 1), whatever T drew the token
    chosen = np.take_along_axis(reference, ids.numpy()[..., None], -1)[..., 0]
    np.testing.assert_allclose(logprobs.chosen.numpy(), chosen, atol=1e-5, rtol=0)
    top_ids = np.argsort(-reference, axis=-1, kind="stable")[..., :4]
    assert np.array_equal(logprobs.top_ids.numpy(), top_ids)
    np.testing.assert_allclose(logprobs.top.numpy(), np.take_along_axis(reference, top_ids, -1), atol=1e-5, rtol=0)
    assert (np.diff(logprobs.top.numpy(), axis=-1) <= 0).all()


def test_given_tokens_keep_their_positions_and_get_their_own_logprobs_leaving_the_draws_alone() -> None:
    """A prompt's tokens (``given``) stand at the first positions, with log_softmax at them; the other
    positions are drawn exactly as without them (the same generator stream)."""
    raw = np.random.default_rng(4).normal(scale=3.0, size=(2, 6, 30)).astype(np.float32)
    given = (29, 0, 17)
    ids, logprobs = choose_tokens(torch.from_numpy(raw), TokenSampling(1.1, 0.9, top_logprobs=2, seed=5, given=given))
    free, _ = choose_tokens(torch.from_numpy(raw), TokenSampling(1.1, 0.9, top_logprobs=2, seed=5))
    assert ids[:, :3].tolist() == [list(given)] * 2 and torch.equal(ids[:, 3:], free[:, 3:])
    assert logprobs is not None
    reference = log_softmax_reference(raw)
    np.testing.assert_allclose(logprobs.chosen[:, :3].numpy(), reference[:, np.arange(3), list(given)], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="7 given tokens for 6 positions; allowed: up to 6"):
        choose_tokens(torch.from_numpy(raw), TokenSampling(given=(1,) * 7, top_logprobs=1))


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    logits = torch.from_numpy(np.random.default_rng(3).normal(size=(2, 32, 20)).astype(np.float32))
    first = choose_tokens(logits, TokenSampling(1.0, 1.0, seed=11))[0]
    assert torch.equal(first, choose_tokens(logits, TokenSampling(1.0, 1.0, seed=11))[0])
    assert not torch.equal(first, choose_tokens(logits, TokenSampling(1.0, 1.0, seed=12))[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature=-0.1 is out of range; allowed: a number in \[0, 2\]"),
        ({"temperature": 2.5}, r"temperature=2.5 is out of range; allowed: a number in \[0, 2\]"),
        ({"top_p": 0.0}, r"top_p=0.0 is out of range; allowed: a number in \(0, 1\]"),
        ({"top_p": 1.2}, r"top_p=1.2 is out of range; allowed: a number in \(0, 1\]"),
        ({"top_logprobs": 6}, "logprobs=6 is out of range; allowed: 0..5"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenSampling(**kwargs)


def test_pipeline_decode_at_temperature_zero_keeps_todays_tokens_and_reports_their_logprobs(pipeline: LDLMPipeline) -> None:
    latents = pipeline.sample_latents(2, 10, 3, seed=4, sampler="ddim")
    plain = pipeline.decode(latents)
    scored = pipeline.decode(latents, sampling=TokenSampling(0.0, 1.0, top_logprobs=2))
    assert torch.equal(plain.token_ids, scored.token_ids) and plain.texts == scored.texts
    assert scored.logprobs is not None and plain.logprobs is None
    logits = pipeline.graphs.decode_logits(latents, torch.ones(2, 10, dtype=torch.bool)).detach().numpy()  # type: ignore[attr-defined]
    chosen = np.take_along_axis(log_softmax_reference(logits), plain.token_ids.numpy()[..., None], -1)[..., 0]
    np.testing.assert_allclose(scored.logprobs.chosen.numpy(), chosen, atol=1e-4, rtol=0)


def test_pipeline_sampled_decode_does_not_depend_on_the_length_bucket(pipeline: LDLMPipeline) -> None:
    latents = pipeline.sample_latents(2, 10, 3, seed=4, sampler="ddim")
    bucketed = LDLMPipeline(pipeline.graphs, pipeline.tokenizer, config=pipeline.config, buckets=(16, 64))
    sampling = TokenSampling(1.5, 0.9, seed=3)
    assert torch.equal(pipeline.decode(latents, sampling=sampling).token_ids, bucketed.decode(latents, sampling=sampling).token_ids)


def test_pipeline_refuses_sampling_on_graphs_without_logits(pipeline: LDLMPipeline) -> None:
    class TokensOnly:
        def __init__(self, graphs) -> None:
            self.decode_tokens = graphs.decode_tokens

    argmax_only = LDLMPipeline(TokensOnly(pipeline.graphs), pipeline.tokenizer, config=pipeline.config)  # type: ignore[arg-type]
    latents = torch.zeros(1, 4, pipeline.config.d_model)
    assert argmax_only.decode(latents).token_ids.shape == (1, 4)  # argmax needs no logits
    with pytest.raises(ValueError, match="ldlm export --with-logits"):
        argmax_only.decode(latents, sampling=TokenSampling(0.7))
