"""The pipeline's batched jobs against single runs of the model itself: padding in a batch must
never change a sequence's result (encode, decode, reconstruct)."""

from __future__ import annotations

import pytest
import torch

from ldlm.model.ldlm import LDLM
from ldlm.pipeline import LDLMPipeline

TEXTS = ["one two three four five six seven", "five", "A short line."]


def single_run_tokens(model: LDLM, ids: list[int]) -> torch.Tensor:
    """The round trip of one unpadded sequence, straight through the model's graphs."""
    with torch.no_grad():
        input_ids = torch.tensor([ids])
        latents = model.encode_latents(input_ids, torch.ones_like(input_ids, dtype=torch.bool))
        return model.decode_tokens(latents, torch.ones(1, len(ids), dtype=torch.bool))[0]


def test_batched_reconstruct_equals_each_texts_single_run(pipeline: LDLMPipeline, tiny_model: LDLM) -> None:
    ids = pipeline.tokenizer.encode(TEXTS)
    assert len({len(r) for r in ids}) == 3, ids  # three lengths: two rows are padded
    result = pipeline.reconstruct(TEXTS)
    for i, row in enumerate(ids):
        expected = single_run_tokens(tiny_model, row)
        assert torch.equal(result.token_ids[i, : len(row)], expected), TEXTS[i]
        assert result.texts[i] == pipeline.tokenizer.decode(expected.tolist()), TEXTS[i]


def test_batched_encode_equals_single_runs(pipeline: LDLMPipeline, tiny_model: LDLM) -> None:
    ids = pipeline.tokenizer.encode(TEXTS)
    encoded = pipeline.encode(TEXTS)
    longest = max(len(r) for r in ids)
    assert encoded.latents.shape == (3, longest, tiny_model.config.d_model)
    assert encoded.attention_mask.sum(1).tolist() == [len(r) for r in ids]
    for i, row in enumerate(ids):
        with torch.no_grad():
            alone = tiny_model.encode_latents(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.bool))[0]
        assert (encoded.latents[i, : len(row)] - alone).abs().max().item() < 1e-5
        assert encoded.token_ids[i, : len(row)].tolist() == row


def test_decode_with_mask_equals_single_runs(pipeline: LDLMPipeline, tiny_model: LDLM) -> None:
    gen = torch.Generator().manual_seed(4)
    latents = torch.randn(2, 9, tiny_model.config.d_model, generator=gen)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 4:] = False
    decoded = pipeline.decode(latents, mask)
    with torch.no_grad():
        first = tiny_model.decode_tokens(latents[:1], torch.ones(1, 9, dtype=torch.bool))[0]
        second = tiny_model.decode_tokens(latents[1:, :4], torch.ones(1, 4, dtype=torch.bool))[0]
    assert torch.equal(decoded.token_ids[0], first)
    assert torch.equal(decoded.token_ids[1, :4], second)
    assert decoded.texts[1] == pipeline.tokenizer.decode(second.tolist())


def test_generate_equals_a_hand_written_ddim_loop(pipeline: LDLMPipeline, tiny_model: LDLM) -> None:
    """DDIM written out from its equations (x_next = alpha' x0 + sigma' eps_hat), with the tangent
    schedule alpha = (1 + d^2 tan^2(pi t / 2))^(-1/2), against the pipeline's sampler."""
    import math

    cfg = pipeline.config
    n, length, steps, seed = 2, 6, 3, 8
    from ldlm.sampling import NoiseStream, sample_seeds

    x = torch.stack([NoiseStream(s, (length, cfg.d_model)).draw() for s in sample_seeds(seed, n)]).double()
    ts = [1.0 + (cfg.t_min - 1.0) * i / steps for i in range(steps + 1)]

    def alpha(t: float) -> float:
        return (1 + cfg.schedule_d**2 * math.tan(math.pi * t / 2) ** 2) ** -0.5

    x0 = torch.zeros_like(x)
    for t, t_next in zip(ts[:-1], ts[1:]):
        with torch.no_grad():
            x0 = tiny_model.denoise(x.float(), torch.full((n,), t), x0.float(), torch.ones(n, length, dtype=torch.bool)).double()
        a, s = alpha(t), math.sqrt(1 - alpha(t) ** 2)
        a_next, s_next = alpha(t_next), math.sqrt(1 - alpha(t_next) ** 2)
        eps = (x - a * x0) / s
        x = a_next * x0 + s_next * eps
    got = pipeline.sample_latents(n, length, steps, seed, "ddim")
    assert (got.double() - x).abs().max().item() < 1e-3


def test_samples_of_one_request_are_independent(pipeline: LDLMPipeline) -> None:
    """Each sample has its own seed: no two rows of a request share a prior or their noise."""
    from ldlm.sampling import sample_seeds

    seeds = sample_seeds(3, 4)
    assert len(set(seeds)) == 4 and sample_seeds(3, 4) == seeds and sample_seeds(4, 4) != seeds
    assert sample_seeds(3, 2) == seeds[:2]  # a sample's seed does not depend on n
    latents = pipeline.sample_latents(n=3, length=5, steps=2, seed=3, sampler="sde")
    for i in range(3):
        for j in range(i + 1, 3):
            assert (latents[i] - latents[j]).abs().max().item() > 1e-2


def test_bucket_boundaries(pipeline: LDLMPipeline) -> None:
    """A length equal to a bucket stays in it; one past the last bucket is its own length."""
    bucketed = LDLMPipeline(pipeline.graphs, pipeline.tokenizer, config=pipeline.config, buckets=(8, 16))
    assert [bucketed.bucket_length(n) for n in (1, 8, 9, 16, 17, 128)] == [8, 8, 16, 16, 17, 128]
    assert pipeline.bucket_length(5) == 5  # no buckets: no padding


def test_a_bare_string_is_refused_not_split_into_characters(pipeline) -> None:
    """reconstruct("hello") once returned five texts, one per character; a list of one text is what works."""
    for call in (pipeline.reconstruct, pipeline.encode):
        with pytest.raises(TypeError, match=r"inputs is the string 'hello'; allowed: a list of texts or token-id lists, e.g. \['hello'\]"):
            call("hello")
    assert len(pipeline.reconstruct(["hello"]).texts) == 1
