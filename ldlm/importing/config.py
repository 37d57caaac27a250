"""The config of an imported checkpoint: a preset, then what the weights' shapes say, then ``--set``.

Sizes are read from tensors under our parameter names (after the mapping), so the same inference
serves any source. What the shapes cannot say keeps the preset's value; n_heads is the one size
that matters there: GPT-2's weights do not show it (its per-head split is a reshape, not a tensor),
so when the weights' d_model differs from the preset's, the preset's n_heads is not trusted and the
field must be given.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ldlm.model.checkpoint import CheckpointError
from ldlm.model.config import LDLMConfig

Shapes = Mapping[str, tuple[int, ...]]
GPT2_BLOCKS = ("all", "until_feature_layer")

# (field, tensor, axis): the first of a field's tensors that the weights hold gives its value.
SIZES: tuple[tuple[str, str, int], ...] = (
    ("d_model", "feature_model.wte.weight", 1),
    ("d_model", "latent_encoder.latent_bank", 1),
    ("d_model", "denoiser.out_norm.weight", 0),
    ("d_model", "token_decoder.head.weight", 1),
    ("gpt2_vocab_size", "feature_model.wte.weight", 0),
    ("gpt2_positions", "feature_model.wpe.weight", 0),
    ("max_seq_len", "latent_encoder.latent_bank", 0),
    ("max_seq_len", "latent_encoder.positions.weight", 0),
    ("max_seq_len", "latent_decoder.positions.weight", 0),
    ("vocab_size", "token_decoder.head.weight", 0),
    ("swiglu_hidden", "denoiser.blocks.0.mlp.w1.weight", 0),
    ("denoiser_width", "denoiser.in_proj.weight", 0),  # only a denoiser wider (or narrower) than D has it
)
# (field, prefix): the count is the highest block index under the prefix, plus one. For GPT-2 the
# count is its depth when the source holds all of it (Hugging Face's do); see resolve_config.
BLOCKS: tuple[tuple[str, str], ...] = (
    ("gpt2_layers", "feature_model.h"),
    ("encoder_layers", "latent_encoder.blocks"),
    ("decoder_layers", "latent_decoder.blocks"),
    ("denoiser_layers", "denoiser.blocks"),
    ("token_decoder_layers", "token_decoder.blocks"),
)
# The latent attention's per-head RMSNorm has head_dim entries: n_heads = d_model / its size.
HEAD_NORMS = ("latent_encoder.blocks.0.attn.q_norm.weight", "latent_decoder.blocks.0.attn.q_norm.weight")
# The shared MLP's first layer has mlp_ratio * d_model rows.
MLP_INPUTS = (
    "latent_encoder.blocks.0.mlp.fc_in.weight",
    "latent_decoder.query_mlp.fc_in.weight",
    "token_decoder.blocks.0.mlp.fc_in.weight",
)


@dataclass(frozen=True)
class Inferred:
    """A config field read from the weights, and the tensor that says so."""

    value: Any
    evidence: str  # "feature_model.wte.weight (50257, 64)"

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "from": self.evidence}


def infer_fields(shapes: Shapes) -> dict[str, Inferred]:
    """Every config field the shapes of the mapped tensors determine."""
    found: dict[str, Inferred] = {}
    for field, name, axis in SIZES:
        if field not in found and name in shapes and len(shapes[name]) > axis:
            found[field] = Inferred(shapes[name][axis], f"{name} {shapes[name]}")
    for field, prefix in BLOCKS:
        pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
        indices = sorted({int(m.group(1)) for name in shapes if (m := pattern.match(name))})
        if indices:
            found[field] = Inferred(indices[-1] + 1, f"{prefix}.{indices[0]}..{indices[-1]}")
    d_model = found.get("d_model")
    if d_model is not None:
        _derive(found, "n_heads", HEAD_NORMS, shapes, lambda n: d_model.value // n)
        _derive(found, "mlp_ratio", MLP_INPUTS, shapes, lambda n: n // d_model.value)
    for part in ("latent_encoder", "latent_decoder"):
        if f"{part}.blocks.0.attn.kv.weight" in shapes:
            per_stream = f"{part}.blocks.0.attn.kv_context.weight" in shapes
            found.setdefault(
                "per_stream_kv", Inferred(per_stream, f"{part}.blocks.0.attn.kv_context.weight {'present' if per_stream else 'absent'}")
            )
    return found


def _derive(found: dict[str, Inferred], field: str, names: Sequence[str], shapes: Shapes, value: Any) -> None:
    for name in names:
        if name in shapes and shapes[name]:
            found[field] = Inferred(value(shapes[name][0]), f"{name} {shapes[name]} with d_model={found['d_model'].value}")
            return


def resolve_config(
    start: LDLMConfig, shapes: Shapes, overrides: Mapping[str, Any] | None = None, gpt2_blocks: str = "all"
) -> tuple[LDLMConfig, dict[str, Inferred]]:
    """``start`` (a preset) updated with what the weights say, then with ``overrides`` (``--set``, which
    wins: a wrong value then shows as mis-shaped tensors); validated by LDLMConfig.

    ``gpt2_blocks`` says what the feature-model blocks of the source are (the mapping knows): "all" of
    GPT-2's, or those "until_feature_layer" only, as our own checkpoints hold; then gpt2_layers is
    their count plus the blocks after the feature layer."""
    if gpt2_blocks not in GPT2_BLOCKS:
        raise CheckpointError(f"gpt2_blocks={gpt2_blocks!r} is unknown; allowed: {', '.join(GPT2_BLOCKS)}")
    overrides = dict(overrides or {})
    inferred = infer_fields(shapes)
    feature_layer = overrides.get("feature_layer", start.feature_layer)
    if gpt2_blocks == "until_feature_layer" and "gpt2_layers" in inferred and isinstance(feature_layer, int):
        counted = inferred["gpt2_layers"]
        # hidden_states[feature_layer] is the output of block gpt2_layers + 1 + feature_layer (LDLMConfig.feature_blocks)
        inferred["gpt2_layers"] = Inferred(counted.value - 1 - feature_layer, f"{counted.evidence}, up to feature_layer={feature_layer}")
    values = start.to_dict() | {field: item.value for field, item in inferred.items()} | overrides
    if "n_heads" not in inferred and "n_heads" not in overrides and values["d_model"] != start.d_model:
        d = values["d_model"]
        hint = f" (GPT-2 sizes use 64 per head: n_heads={d // 64})" if d % 64 == 0 else f" (a divisor of d_model={d})"
        raise CheckpointError(
            f"n_heads cannot be inferred from the weights; pass --set n_heads=N{hint}. The weights' d_model={d} differs "
            f"from the preset's {start.d_model}, so the preset's n_heads={start.n_heads} does not apply"
        )
    try:
        return LDLMConfig.from_dict(values), inferred
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{error} (the weights gave {_listing(inferred)}; pass --set FIELD=VALUE to fix a field)") from None


def _listing(inferred: Mapping[str, Inferred]) -> str:
    return ", ".join(f"{field}={item.value}" for field, item in inferred.items()) or "no config field"


def parse_assignments(items: Sequence[str]) -> dict[str, Any]:
    """``["n_heads=12", "decode_final=x0"]`` -> ``{"n_heads": 12, "decode_final": "x0"}``; a value is
    read as JSON (numbers, true/false) and otherwise kept as a string."""
    known = {f.name for f in fields(LDLMConfig)}
    result: dict[str, Any] = {}
    for item in items:
        field, sep, text = item.partition("=")
        field = field.strip()
        if not sep or not field:
            raise CheckpointError(f"--set {item!r} is not FIELD=VALUE (e.g. --set n_heads=12)")
        if field not in known:
            raise CheckpointError(f"--set {field}: no such config field; known fields: {', '.join(sorted(known))}")
        try:
            result[field] = json.loads(text)
        except json.JSONDecodeError:
            result[field] = text
    return result
