from __future__ import annotations

import dataclasses

import pytest

from ldlm.model.config import PRESETS, LDLMConfig, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_json_round_trip(name: str, tmp_path) -> None:
    config = preset(name)
    assert LDLMConfig.from_json(config.to_json()) == config
    config.save(tmp_path / "config.json")
    assert LDLMConfig.load(tmp_path / "config.json") == config
    assert LDLMConfig.load(tmp_path / "config.json").config_hash() == config.config_hash()


def test_config_is_frozen_and_hash_tracks_fields() -> None:
    config = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 8  # type: ignore[misc]
    assert dataclasses.replace(config, t_min=0.1).config_hash() != config.config_hash()


def test_tiny_keeps_layer_norms_at_index_minus_3() -> None:
    tiny = preset("tiny")
    assert tiny.gpt2_layers >= 4 and tiny.feature_blocks >= 1
    assert preset("base").feature_blocks == 10  # blocks 11 and 12 of GPT-2 small never run


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n_heads", 5, "n_heads=5"),
        ("feature_layer", -1, "feature_layer=-1"),
        ("max_seq_len", 4096, "max_seq_len=4096"),
        ("t_min", 1.5, "t_min=1.5"),
        ("denoiser_layers", 3, "denoiser_layers=3"),
        ("decode_final", "last", "decode_final='last'"),
        ("mask_token_id", 50258, "mask_token_id=50258"),
    ],
)
def test_invalid_fields_are_named(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        dataclasses.replace(preset("base"), **{field: value})


def test_unknown_fields_and_presets_are_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="dmodel"):
        LDLMConfig.from_dict({"dmodel": 8})
    with pytest.raises(ValueError, match="huge"):
        preset("huge")
    bad = tmp_path / "config.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json"):
        LDLMConfig.load(bad)
