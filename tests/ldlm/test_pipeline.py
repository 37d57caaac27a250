from __future__ import annotations

import pytest
import torch

from ldlm.pipeline import LDLMPipeline


def test_ddim_is_deterministic_for_a_seed(pipeline: LDLMPipeline) -> None:
    a = pipeline.generate(n=2, length=12, steps=4, seed=5, sampler="ddim")
    b = pipeline.generate(n=2, length=12, steps=4, seed=5, sampler="ddim")
    assert torch.equal(a.token_ids, b.token_ids) and a.texts == b.texts
    other = pipeline.sample_latents(n=2, length=12, steps=4, seed=6, sampler="ddim")
    assert not torch.equal(pipeline.sample_latents(n=2, length=12, steps=4, seed=5, sampler="ddim"), other)


def test_sde_is_reproducible_and_uses_step_noise(pipeline: LDLMPipeline) -> None:
    a = pipeline.sample_latents(n=2, length=8, steps=3, seed=1, sampler="sde")
    b = pipeline.sample_latents(n=2, length=8, steps=3, seed=1, sampler="sde")
    ddim = pipeline.sample_latents(n=2, length=8, steps=3, seed=1, sampler="ddim")
    assert torch.equal(a, b)
    assert not torch.allclose(a, ddim)


def test_a_samples_noise_does_not_depend_on_its_batch(pipeline: LDLMPipeline) -> None:
    alone = pipeline.sample_latents(n=1, length=8, steps=3, seed=9, sampler="sde")
    in_batch = pipeline.sample_latents(n=3, length=8, steps=3, seed=9, sampler="sde")
    assert (in_batch[0] - alone[0]).abs().max().item() < 1e-5


def test_generate_result_shapes(pipeline: LDLMPipeline) -> None:
    result = pipeline.generate(n=3, length=10, steps=2, seed=0)
    assert result.token_ids.shape == (3, 10) and len(result.texts) == 3
    assert all(isinstance(t, str) for t in result.texts)
    assert ((result.token_ids >= 0) & (result.token_ids < pipeline.config.vocab_size)).all()


def test_encode_texts_equals_encode_ids(pipeline: LDLMPipeline) -> None:
    texts = ["The quick brown fox.", "Hello"]
    from_texts = pipeline.encode(texts)
    from_ids = pipeline.encode(pipeline.tokenizer.encode(texts))
    assert torch.equal(from_texts.latents, from_ids.latents)
    assert from_texts.attention_mask.sum(1).tolist() == [len(i) for i in pipeline.tokenizer.encode(texts)]


def test_a_text_too_long_is_named_as_a_text_with_its_token_count(pipeline: LDLMPipeline) -> None:
    """The caller gave texts: the message names texts[i] and its length in tokens (it said len(ids[1]))."""
    limit = pipeline.config.max_seq_len
    too_long = " a" * (limit + 3)  # GPT-2 encodes " a" as one token
    with pytest.raises(ValueError, match=rf"^texts\[1\] is {limit + 3} tokens long; allowed: 1\.\.{limit} tokens \(config max_seq_len\)$"):
        pipeline.reconstruct(["fine", too_long])
    assert len(pipeline.encode([" a" * limit]).token_ids[0]) == limit  # the edge itself is allowed


def test_reconstruct_keeps_lengths(pipeline: LDLMPipeline) -> None:
    texts = ["one two three four", "five"]
    result = pipeline.reconstruct(texts)
    assert len(result.texts) == 2 and result.token_ids.shape[0] == 2


def test_decode_cuts_at_end_of_text(pipeline: LDLMPipeline) -> None:
    tok = pipeline.tokenizer
    ids = tok.encode(["Hello world"])[0] + [tok.eos_token_id] + tok.encode([" ignored"])[0]
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids[:2] + [pipeline.config.mask_token_id]) == "Hello world"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.encode([[1, 2, 50257]]), r"ids\[0\]\[2\]=50257 is out of range; allowed: \[0, 50257\)"),
        (lambda p: p.encode([[5, -1]]), r"ids\[0\]\[1\]=-1 is out of range"),
        (lambda p: p.encode(["fine", ""]), r"texts\[1\]='' is empty"),
        (lambda p: p.encode(["   "]), r"texts\[0\]='   ' is empty"),
        (lambda p: p.encode([]), "no inputs given"),
        (lambda p: p.encode([[7] * 129]), r"len\(ids\[0\]\)=129 is out of range; allowed: 1..128"),
        (lambda p: p.generate(n=1, length=129), r"length=129 is out of range; allowed: 1..128"),
        (lambda p: p.generate(n=1, length=0), r"length=0 is out of range"),
        (lambda p: p.generate(n=1, length=8, steps=0), r"steps=0 is invalid; allowed: an integer >= 1"),
        (lambda p: p.generate(n=1, length=8, steps=-2), r"steps=-2 is invalid"),
        (lambda p: p.generate(n=0, length=8), r"n=0 is out of range"),
        (lambda p: p.generate(n=1, length=8, sampler="euler"), r"sampler='euler' is unknown"),
        (lambda p: p.decode(torch.zeros(1, 4, 3)), r"latents have shape \(1, 4, 3\); allowed: \(B, L, 64\)"),
    ],
)
def test_bad_input_raises_value_error_naming_value_and_range(pipeline: LDLMPipeline, call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(pipeline)


def test_shape_buckets_do_not_change_results(pipeline: LDLMPipeline) -> None:
    bucketed = LDLMPipeline(pipeline.graphs, pipeline.tokenizer, config=pipeline.config, buckets=(16, 64, 128))
    assert bucketed.bucket_length(5) == 16 and bucketed.bucket_length(17) == 64
    texts = ["A short one.", "A somewhat longer sentence, with a comma."]
    plain, padded = pipeline.encode(texts), bucketed.encode(texts)
    assert padded.latents.shape == plain.latents.shape
    assert (padded.latents - plain.latents)[plain.attention_mask].abs().max().item() < 1e-5
    a = pipeline.sample_latents(n=2, length=9, steps=3, seed=4, sampler="sde")
    b = bucketed.sample_latents(n=2, length=9, steps=3, seed=4, sampler="sde")
    assert b.shape == a.shape and (a - b).abs().max().item() < 1e-4
    assert torch.equal(pipeline.decode(a).token_ids, bucketed.decode(a).token_ids)
    with pytest.raises(ValueError, match=r"buckets \[0, 500\] are out of range; allowed: 1..128"):
        LDLMPipeline(pipeline.graphs, pipeline.tokenizer, config=pipeline.config, buckets=(0, 500))
