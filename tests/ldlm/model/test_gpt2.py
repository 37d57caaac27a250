"""Our truncated GPT-2 against Hugging Face's GPT2Model, loaded from the same local directory."""

from __future__ import annotations

import pytest
import torch

from ldlm.model.checkpoint import CheckpointError, init_model

transformers = pytest.importorskip("transformers", reason="transformers is the GPT-2 oracle (pip install -e .[test])")


@pytest.fixture(scope="module", params=["GPT2Model", "GPT2LMHeadModel"])
def hf_gpt2_dir(request, tmp_path_factory, tiny_config):
    config = transformers.GPT2Config(
        n_layer=tiny_config.gpt2_layers,
        n_embd=tiny_config.d_model,
        n_head=tiny_config.n_heads,
        vocab_size=tiny_config.gpt2_vocab_size,
        n_positions=tiny_config.gpt2_positions,
    )
    torch.manual_seed(1)
    model = getattr(transformers, request.param)(config).eval()
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)  # safetensors; GPT2LMHeadModel prefixes names with transformer.
    return directory, model


def test_features_equal_hidden_states_minus_3_with_padding(hf_gpt2_dir, tiny_config) -> None:
    directory, hf = hf_gpt2_dir
    ours = init_model(tiny_config, seed=0, gpt2_dir=directory).feature_model
    ids = torch.randint(0, tiny_config.gpt2_vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-3]
        got = ours(ids, mask.bool())
    valid = mask.bool()
    assert (got[valid] - expected[valid]).abs().max().item() < 1e-5
    assert len(ours.h) == tiny_config.feature_blocks < tiny_config.gpt2_layers


def test_mask_vector_is_the_resized_token_table_row(hf_gpt2_dir, tiny_config) -> None:
    directory, hf = hf_gpt2_dir
    model = init_model(tiny_config, seed=0, gpt2_dir=directory)
    wte = hf.get_input_embeddings().weight.detach()
    torch.testing.assert_close(model.latent_decoder.mask_embedding, wte.mean(dim=0))
    torch.testing.assert_close(model.feature_model.wte.weight, wte)


def test_mismatched_gpt2_directory_is_named(hf_gpt2_dir, tiny_config, tmp_path) -> None:
    import dataclasses

    directory, _ = hf_gpt2_dir
    wider = dataclasses.replace(tiny_config, d_model=128, n_heads=4)
    with pytest.raises(CheckpointError, match="n_embd=64"):
        init_model(wider, seed=0, gpt2_dir=directory)
    with pytest.raises(CheckpointError, match="no config.json"):
        init_model(tiny_config, seed=0, gpt2_dir=tmp_path)
