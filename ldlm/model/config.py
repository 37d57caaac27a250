"""The one LDLM configuration: a frozen dataclass, validated once, saved as JSON next to every artifact.

What the paper states is fixed by the ``base`` preset; everything inferred or guessed is a field, so that
a real checkpoint can set it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from ldlm.limits import PRIOR_TEMPERATURE, T_MIN

DecodeFinal = Literal["mean", "x0"]
# The samplers every generating path offers (ldlm/sampling/samplers.py implements them); listed here, with no
# torch import, so the config, the CLI and the HTTP schemas all take the names from one place.
SAMPLERS: tuple[str, ...] = ("sde", "ddim", "dpm2m", "dpm3m", "dpm3m-psc", "dpm3m-psc-unic")
# The time grids (ldlm/sampling/schedule.py draws them) and the one tuned for a checkpoint (ldlm/sampling/tuned_grids.py).
GRIDS: tuple[str, ...] = ("uniform", "power", "logsnr")
TUNED_GRID = "tuned"
# What `ldlm tune-schedule` minimizes over its tuning samples' relative latent errors (ldlm/training/grid_search.py).
TUNING_OBJECTIVES: tuple[str, ...] = ("worst", "pooled")
DEFAULT_TUNING_OBJECTIVE = "pooled"  # why: ldlm/training/grid_search.py


@dataclass(frozen=True)
class LDLMConfig:
    # --- sizes shared by every component ---
    d_model: int = 768  # D: GPT-2 width, latent width and transformer width (known)
    n_heads: int = 12  # heads in every attention (known: 12 x 64)
    max_seq_len: int = 1024  # L_max: position tables and the latent bank (N = L, known)
    vocab_size: int = 50258  # V: GPT-2's 50257 + one mask token (known; the trainer may override)
    mask_token_id: int = 50257
    eos_token_id: int = 50256  # GPT-2 <|endoftext|>; decoded text is cut at its first occurrence
    layer_norm_eps: float = 1e-5  # every nn.LayerNorm (known; the export promise is about it)
    rms_norm_eps: float = 1e-5  # every RMSNorm (inferred)
    dropout: float = 0.0  # inside the MLPs; inference runs in eval mode either way

    # --- feature model: frozen GPT-2 (known) ---
    gpt2_layers: int = 12  # depth of the GPT-2 the features come from
    gpt2_vocab_size: int = 50257
    gpt2_positions: int = 1024
    feature_layer: int = -3  # index into Hugging Face's hidden_states; later blocks never run

    # --- latent encoder and decoder: Perceivers (block counts known, structure inferred) ---
    encoder_layers: int = 6
    decoder_layers: int = 6
    mlp_ratio: int = 4  # the MLP's hidden width is mlp_ratio * D (known for the shared MLP)
    # Guessed: each stream projects its own keys and values. Shared projections land the
    # Perceivers at ~44M/48M parameters, per-stream ones at ~51M/55M, which is what the paper's
    # table (~50M, ~50-55M) reports.
    per_stream_kv: bool = True

    # --- denoiser: Llama-style diffusion transformer (known: 12 layers, ~132M) ---
    denoiser_layers: int = 12
    swiglu_hidden: int = 3072
    # Guessed, and unset by default: the denoiser's residual width, when it differs from the latents'. Set, the
    # latents are projected in and out of the blocks (Linear, no bias), so a small latent space can get a wider
    # denoiser; unset, the blocks run on the latents themselves, as the spec reads.
    denoiser_width: int | None = None
    rope_theta: float = 10000.0
    time_max_period: float = 10.0  # sinusoidal embedding of t in [0, 1]

    # --- token decoder (known: 3 layers) ---
    token_decoder_layers: int = 3

    # --- sampler (inferred or guessed, see ldlm/sampling/schedule.py and ldlm/sampling/samplers.py) ---
    schedule_d: float = 3.0  # tangent schedule's d
    beta_clip_t: float = 0.95  # beta(t) is evaluated at min(t, this): beta -> inf as t -> 1
    t_min: float = 0.05
    # What a request that names neither gets (CLI, HTTP, Triton): the fewest steps at which dpm3m-psc agrees
    # with DDIM@2000 at least as well as DDIM@50 does, in tokens and in latent error, on tiny (20) and base (21)
    # (docs/measurements/solvers-2026-12-01.json, solvers-base-crossover-2026-12-01.json).
    default_steps: int = 21
    default_sampler: str = "dpm3m-psc"
    decode_final: DecodeFinal = "mean"
    # The prior's temperature tau: x_1 ~ N(0, tau^2 I). Unset is 1, the prior the denoiser was trained from;
    # below 1 the ODE ends nearer the data's modes, trading diversity for text nearer the training data
    # (Glow's temperature; docs/measurements/prior-temperature-*.json measures the trade).
    prior_temperature: float | None = None

    def __post_init__(self) -> None:
        _validate(self)

    # --- derived sizes ---
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def effective_prior_temperature(self) -> float:
        """The prior temperature a request that names none gets: prior_temperature, 1 when unset."""
        return 1.0 if self.prior_temperature is None else float(self.prior_temperature)

    def prior_temperature_for(self, requested: float | None) -> float:
        """The prior temperature a request that asks for ``requested`` gets (None: this config's); the
        caller checks the value (a request's may be anything)."""
        return self.effective_prior_temperature if requested is None else requested

    @property
    def denoiser_d_model(self) -> int:
        """The width of the denoiser's residual stream: denoiser_width when set, else D."""
        return self.d_model if self.denoiser_width is None else self.denoiser_width

    @property
    def feature_blocks(self) -> int:
        """GPT-2 blocks that run: hidden_states has gpt2_layers + 1 entries, the first being the
        embeddings, so index -3 of 12 layers is the output of block 10."""
        return self.gpt2_layers + 1 + self.feature_layer

    # --- JSON round trip ---
    def to_dict(self) -> dict[str, Any]:
        # An optional field left unset is left out, so a config saved before that field existed hashes the same.
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LDLMConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> LDLMConfig:
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("config JSON is nested too deeply; allowed: a flat object of fields") from None
        if not isinstance(data, dict):
            raise ValueError(f"config JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LDLMConfig:
        try:
            text = Path(path).read_text()
            json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:  # unreadable: no field to name
            raise ValueError(f"{path} is not readable JSON ({error}): the file is truncated or corrupted; copy it again") from error
        try:
            return cls.from_json(text)
        except (TypeError, ValueError) as error:  # readable, with a field that is unknown or out of its range
            raise ValueError(f"{path}: not a valid LDLM config: {error}") from error

    def config_hash(self) -> str:
        """sha256 of the canonical JSON: names the exact architecture an artifact was made from."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


# Allowed range of every field, checked at load: wide enough for any GPT-2-sized LDLM, narrow
# enough that a config cannot ask for unbounded memory (a billion layers, a 10**9-wide model).
INT_RANGES: dict[str, tuple[int, int]] = {
    "d_model": (2, 16384),
    "n_heads": (1, 256),
    "max_seq_len": (1, 65536),
    "vocab_size": (2, 1 << 20),
    "gpt2_layers": (1, 96),
    "gpt2_vocab_size": (1, 1 << 20),
    "gpt2_positions": (1, 65536),
    "encoder_layers": (1, 128),
    "decoder_layers": (1, 128),
    "mlp_ratio": (1, 64),
    "denoiser_layers": (2, 256),
    "swiglu_hidden": (1, 262144),
    "denoiser_width": (2, 16384),  # optional: unset (None) is allowed too
    "token_decoder_layers": (1, 128),
    "default_steps": (1, 100000),
}
OPTIONAL_FIELDS = ("denoiser_width",)
FLOAT_RANGES: dict[str, tuple[float, float]] = {  # open at 0 (must be > 0), closed at the top
    "layer_norm_eps": (0.0, 1.0),
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1e9),
    "time_max_period": (0.0, 1e6),
    "schedule_d": (0.0, 1e3),
}


PRIOR_TEMPERATURES = f"unset (null, meaning 1) or {PRIOR_TEMPERATURE}"


def is_prior_temperature(value: object) -> bool:
    """A prior temperature in (0, 1]: above 1 the ODE starts wider than anything it was trained on.
    A bool is no temperature; NaN fails both comparisons."""
    return value in PRIOR_TEMPERATURE


def _validate(c: LDLMConfig) -> None:
    def require(ok: bool, field: str, value: object, allowed: str) -> None:
        if not ok:
            raise ValueError(f"config field {field}={value!r} is invalid; allowed: {allowed}")

    for name, (low, high) in INT_RANGES.items():
        value = getattr(c, name)
        optional = name in OPTIONAL_FIELDS
        if optional and value is None:
            continue
        allowed = f"{'unset (null) or ' if optional else ''}an integer in {low}..{high}"
        require(type(value) is int and low <= value <= high, name, value, allowed)  # type(): no bools
    for name, (above, at_most) in FLOAT_RANGES.items():
        value = getattr(c, name)
        ok = type(value) in (int, float) and math.isfinite(value) and above < value <= at_most
        require(ok, name, value, f"a number in ({above:g}, {at_most:g}]")
    if c.prior_temperature is not None:
        require(is_prior_temperature(c.prior_temperature), "prior_temperature", c.prior_temperature, PRIOR_TEMPERATURES)
    for name in ("mask_token_id", "eos_token_id", "feature_layer"):
        require(type(getattr(c, name)) is int, name, getattr(c, name), "an integer")
    for name in ("dropout", "t_min", "beta_clip_t"):
        value = getattr(c, name)
        require(type(value) in (int, float) and math.isfinite(value), name, value, "a finite number")
    require(type(c.per_stream_kv) is bool, "per_stream_kv", c.per_stream_kv, "true or false")
    require(c.d_model % c.n_heads == 0, "n_heads", c.n_heads, f"a divisor of d_model={c.d_model}")
    require(c.head_dim % 2 == 0, "n_heads", c.n_heads, "a value giving an even head_dim (rotary embeddings)")
    if c.denoiser_width is not None:
        width, heads = c.denoiser_width, c.n_heads
        require(width % heads == 0 and width // heads % 2 == 0, "denoiser_width", width, f"a multiple of 2 * n_heads = {2 * heads}")
    require(
        c.denoiser_layers % 2 == 0,
        "denoiser_layers",
        c.denoiser_layers,
        "an even number (the U-Net skips pair the first half with the second)",
    )
    require(
        -c.gpt2_layers - 1 <= c.feature_layer <= -2,
        "feature_layer",
        c.feature_layer,
        f"[{-c.gpt2_layers - 1}, -2] (index -1 is ln_f's output, which is not a block output)",
    )
    require(c.max_seq_len <= c.gpt2_positions, "max_seq_len", c.max_seq_len, f"<= gpt2_positions={c.gpt2_positions}")
    require(c.gpt2_vocab_size <= c.vocab_size, "gpt2_vocab_size", c.gpt2_vocab_size, f"<= vocab_size={c.vocab_size}")
    require(0 <= c.mask_token_id < c.vocab_size, "mask_token_id", c.mask_token_id, f"[0, {c.vocab_size})")
    require(0 <= c.eos_token_id < c.vocab_size, "eos_token_id", c.eos_token_id, f"[0, {c.vocab_size})")
    require(0.0 <= c.dropout < 1.0, "dropout", c.dropout, "[0, 1)")
    require(c.t_min in T_MIN, "t_min", c.t_min, str(T_MIN))
    require(0.0 < c.beta_clip_t < 1.0, "beta_clip_t", c.beta_clip_t, "(0, 1)")
    require(c.decode_final in ("mean", "x0"), "decode_final", c.decode_final, "'mean' or 'x0'")
    require(c.default_sampler in SAMPLERS, "default_sampler", c.default_sampler, ", ".join(SAMPLERS))


PRESETS: dict[str, LDLMConfig] = {
    # The paper's sizes.
    "base": LDLMConfig(),
    # For tests and demos: small D and few layers, but a GPT-2 of 4 layers so that
    # hidden_states[-3] is the output of a real block (2 layers would give the embeddings).
    "tiny": LDLMConfig(
        d_model=64,
        n_heads=4,
        max_seq_len=128,
        gpt2_layers=4,
        gpt2_positions=128,
        encoder_layers=2,
        decoder_layers=2,
        denoiser_layers=2,
        swiglu_hidden=128,
        token_decoder_layers=1,
    ),
}


def preset(name: str) -> LDLMConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
