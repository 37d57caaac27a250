"""Every bound of LDLMConfig at its edge: the last allowed value loads, the first refused one raises a
ValueError that names the field, the value and the allowed range. The expectations are the ranges
as documented (INT_RANGES / FLOAT_RANGES and the cross-field rules), written out here by hand."""

from __future__ import annotations

import json
import math
import re

import pytest

from ldlm.model.config import LDLMConfig, preset

# Fields that other rules tie to the one under test, set so that only the tested bound decides.
COMPANIONS: dict[tuple[str, int], dict[str, object]] = {
    ("d_model", 2): {"n_heads": 1},
    ("d_model", 16384): {"n_heads": 1},
    ("n_heads", 256): {"d_model": 512},  # head_dim 2, even
    ("max_seq_len", 65536): {"gpt2_positions": 65536},
    ("vocab_size", 2): {"gpt2_vocab_size": 1, "mask_token_id": 1, "eos_token_id": 0},
    ("gpt2_layers", 1): {"feature_layer": -2},
    ("gpt2_vocab_size", 1 << 20): {"vocab_size": 1 << 20},
    ("gpt2_positions", 1): {"max_seq_len": 1},
}
INT_BOUNDS = [  # (field, low, high), from the documented ranges
    ("d_model", 2, 16384),
    ("n_heads", 1, 256),
    ("max_seq_len", 1, 65536),
    ("vocab_size", 2, 1 << 20),
    ("gpt2_layers", 1, 96),
    ("gpt2_vocab_size", 1, 1 << 20),
    ("gpt2_positions", 1, 65536),
    ("encoder_layers", 1, 128),
    ("decoder_layers", 1, 128),
    ("mlp_ratio", 1, 64),
    ("denoiser_layers", 2, 256),
    ("swiglu_hidden", 1, 262144),
    ("token_decoder_layers", 1, 128),
    ("default_steps", 1, 100000),
]
FLOAT_BOUNDS = [("layer_norm_eps", 1.0), ("rms_norm_eps", 1.0), ("rope_theta", 1e9), ("time_max_period", 1e6), ("schedule_d", 1e3)]


def config(**fields) -> LDLMConfig:
    return LDLMConfig(**fields)


def refused(message: str, **fields) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        LDLMConfig(**fields)


@pytest.mark.parametrize(("field", "low", "high"), INT_BOUNDS, ids=[b[0] for b in INT_BOUNDS])
def test_integer_fields_at_their_edges(field: str, low: int, high: int) -> None:
    for edge, outside in ((low, low - 1), (high, high + 1)):
        companions = COMPANIONS.get((field, edge), {})
        assert getattr(config(**companions, **{field: edge}), field) == edge
        refused(f"config field {field}={outside} is invalid; allowed: an integer in {low}..{high}", **companions, **{field: outside})
    refused(f"config field {field}=True is invalid; allowed: an integer in {low}..{high}", **{field: True})  # a bool is no integer
    refused(f"config field {field}={float(high)!r} is invalid", **{field: float(high)})


@pytest.mark.parametrize(("field", "high"), FLOAT_BOUNDS, ids=[b[0] for b in FLOAT_BOUNDS])
def test_float_fields_are_open_at_zero_closed_at_the_top(field: str, high: float) -> None:
    assert getattr(config(**{field: high}), field) == high
    assert getattr(config(**{field: 1e-12}), field) == 1e-12
    for bad in (0.0, -1e-12, math.nextafter(high, math.inf), math.inf, math.nan):
        with pytest.raises(ValueError, match=rf"config field {field}={re.escape(repr(bad))} is invalid; allowed: a number in \(0, "):
            config(**{field: bad})
    refused(f"config field {field}='1' is invalid", **{field: "1"})


def test_token_ids_lie_in_the_vocabulary() -> None:
    v = preset("base").vocab_size
    for field in ("eos_token_id", "mask_token_id"):
        assert getattr(config(**{field: v - 1}), field) == v - 1
        assert getattr(config(**{field: 0}), field) == 0
        refused(f"config field {field}={v} is invalid; allowed: [0, {v})", **{field: v})
        refused(f"config field {field}=-1 is invalid; allowed: [0, {v})", **{field: -1})
        refused(f"config field {field}=1.0 is invalid; allowed: an integer", **{field: 1.0})


def test_feature_layer_range_follows_gpt2_layers() -> None:
    assert config(feature_layer=-13).feature_blocks == 0 and config(feature_layer=-2).feature_blocks == 11
    refused("config field feature_layer=-14 is invalid; allowed: [-13, -2]", feature_layer=-14)
    refused("config field feature_layer=-1 is invalid; allowed: [-13, -2]", feature_layer=-1)
    assert config(gpt2_layers=4, feature_layer=-3).feature_blocks == 2  # hidden_states[-3] of 4 blocks: block 2's output


def test_cross_field_rules_name_both_values() -> None:
    refused("config field n_heads=7 is invalid; allowed: a divisor of d_model=768", n_heads=7)
    refused("config field n_heads=256 is invalid; allowed: a value giving an even head_dim", n_heads=256, d_model=768)
    refused("config field denoiser_layers=13 is invalid; allowed: an even number", denoiser_layers=13)
    assert config(max_seq_len=1024, gpt2_positions=1024).max_seq_len == 1024
    refused("config field max_seq_len=1025 is invalid; allowed: <= gpt2_positions=1024", max_seq_len=1025)
    assert config(gpt2_vocab_size=50258).gpt2_vocab_size == 50258
    refused("config field gpt2_vocab_size=50259 is invalid; allowed: <= vocab_size=50258", gpt2_vocab_size=50259)


def test_sampler_fields() -> None:
    assert config(dropout=0.0).dropout == 0.0 and config(dropout=0.999).dropout == 0.999
    refused("config field dropout=1.0 is invalid; allowed: [0, 1)", dropout=1.0)
    refused("config field dropout=-0.1 is invalid; allowed: [0, 1)", dropout=-0.1)
    refused("config field dropout=nan is invalid; allowed: a finite number", dropout=math.nan)
    for field, allowed in (("t_min", "a number in (0, 1), both ends excluded"), ("beta_clip_t", "(0, 1)")):
        assert getattr(config(**{field: 0.001}), field) == 0.001 and getattr(config(**{field: 0.999}), field) == 0.999
        refused(f"config field {field}=0.0 is invalid; allowed: {allowed}", **{field: 0.0})
        refused(f"config field {field}=1.0 is invalid; allowed: {allowed}", **{field: 1.0})
        refused(f"config field {field}=inf is invalid; allowed: a finite number", **{field: math.inf})
    refused("config field per_stream_kv=1 is invalid; allowed: true or false", per_stream_kv=1)
    refused("config field decode_final='last' is invalid; allowed: 'mean' or 'x0'", decode_final="last")
    refused(
        "config field default_sampler='euler' is invalid; allowed: sde, ddim, dpm2m, dpm3m, dpm3m-psc, dpm3m-psc-unic",
        default_sampler="euler",
    )
    assert config(default_sampler="dpm3m-psc", decode_final="x0").default_sampler == "dpm3m-psc"


def test_json_that_is_not_a_flat_object_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['dmodel', 'heads'\]; known fields are \["):
        LDLMConfig.from_dict({"dmodel": 8, "heads": 2})
    with pytest.raises(ValueError, match="config JSON must be an object, got list"):
        LDLMConfig.from_json("[1, 2]")
    with pytest.raises(ValueError, match="config JSON is nested too deeply; allowed: a flat object"):
        LDLMConfig.from_json("[" * 100000 + "]" * 100000)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"d_model": 0}))
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a valid LDLM config: config field d_model=0 is invalid")):
        LDLMConfig.load(path)
    path.write_text("{not json")  # unreadable JSON, and only that, is called corrupted
    with pytest.raises(ValueError, match=re.escape(f"{path} is not readable JSON (Expecting property name")) as refused:
        LDLMConfig.load(path)
    assert str(refused.value).endswith("the file is truncated or corrupted; copy it again")
    with pytest.raises(ValueError, match=re.escape("unknown preset 'huge'; choose one of ['base', 'tiny']")):
        preset("huge")
