"""Checkpoints: a directory with ``config.json``, ``model.safetensors`` and ``tokenizer.json``.

Weights are only ever read from safetensors, never from pickle. A checkpoint may carry
``SHA256SUMS`` (``sha256sum`` format; the reference checkpoint does): every file it lists is
checked before use, so a truncated or corrupted copy is refused by name. Loading checks every tensor's name
and shape first and names what is missing, unexpected or mis-shaped. Writing goes to a temporary
directory next to the target, renamed into place when complete, so no partial checkpoint is left.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from ldlm.device import resolve_device
from ldlm.files import CONFIG_FILE, WEIGHTS_FILE, atomic_directory, sha256_file
from ldlm.model.config import LDLMConfig
from ldlm.model.layers import RMSNorm
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer

CHECKSUMS_FILE = "SHA256SUMS"
SAVE_CHECKPOINT = "ldlm.save_checkpoint"  # the writer a checkpoint saved through the Python API is recorded as
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be used; the message names the file or tensor."""


def save_checkpoint(
    model: LDLM, tokenizer: TextTokenizer, out: str | os.PathLike[str], overwrite: bool = False, writer: str = SAVE_CHECKPOINT
) -> Path:
    """Write ``model`` and ``tokenizer`` as a checkpoint directory at ``out``, recorded as ``writer``'s output
    (``ldlm.files.OUTPUT_RECORD``): ``overwrite`` replaces only an earlier checkpoint of the same writer,
    unchanged since (``ldlm init --force`` never replaces trained or imported weights)."""
    with atomic_directory(out, overwrite, writer) as tmp:
        model.config.save(tmp / CONFIG_FILE)
        state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "config_sha256": model.config.config_hash()})
        tokenizer.save(tmp)
    return Path(out)


def load_config(path: str | os.PathLike[str]) -> LDLMConfig:
    """A checkpoint directory's config alone, without building the model."""
    directory = Path(path)
    if not directory.exists():
        raise CheckpointError(f"checkpoint {directory} does not exist; expected a directory with {CONFIG_FILE} + {WEIGHTS_FILE}")
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} is not a directory (expected {CONFIG_FILE} + {WEIGHTS_FILE})")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {CONFIG_FILE}")
    return LDLMConfig.load(config_path)


def write_checksums(directory: Path, names: list[str]) -> None:
    """``SHA256SUMS`` for ``names`` in ``directory``, in ``sha256sum``'s format (``sha256sum -c`` reads it)."""
    lines = [f"{sha256_file(directory / name)}  {name}\n" for name in sorted(names)]
    (directory / CHECKSUMS_FILE).write_text("".join(lines))


def check_checksums(directory: Path) -> None:
    """Every file ``SHA256SUMS`` lists must be there with that sha256 (nothing to check without the file)."""
    sums = directory / CHECKSUMS_FILE
    if not sums.is_file():
        return
    for number, line in enumerate(sums.read_text().splitlines(), 1):
        expected, _, name = line.partition("  ")
        if len(expected) != 64 or not name or "/" in name or name.startswith("."):
            raise CheckpointError(f"{sums}:{number}: {line!r} is not a 'SHA256  NAME' line of a file in the checkpoint")
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory}: {name} is listed in {CHECKSUMS_FILE} but missing")
        found = sha256_file(path)
        if found != expected:
            raise CheckpointError(_changed_file(directory, name, f"{name} has sha256 {found}, {CHECKSUMS_FILE} says {expected}"))


def _changed_file(directory: Path, name: str, said: str) -> str:
    """Why a file differs from its SHA256SUMS line: JSON that still reads was edited, not damaged, and an edited
    config is checked field by field, so a bad field is named with its allowed values; anything else is a damaged copy."""
    path = directory / name
    if path.suffix == ".json":
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):  # not JSON any more: damaged in the copy
            pass
        else:
            if name == CONFIG_FILE:
                try:
                    LDLMConfig.load(path)
                except ValueError as error:
                    return f"{error} (checkpoint {directory}: {said})"
            return (
                f"checkpoint {directory}: {said}: it was edited (it is still valid JSON); restore it from the checkpoint's "
                f"source, or, if the edit is meant, list its new sha256 in {CHECKSUMS_FILE} (sha256sum {name})"
            )
    return f"checkpoint {directory}: {said}: the file is truncated or corrupted; copy it again from its source"


def check_checkpoint_files(directory: Path) -> LDLMConfig:
    """The checks a checkpoint's files pass before its weights are read, and its config: the directory, every
    file ``SHA256SUMS`` lists, ``config.json`` and the weights (a pickle found instead is named, never loaded).
    Every command that takes a checkpoint words a missing or damaged file the same way."""
    if directory.is_dir():
        check_checksums(directory)
    config = load_config(directory)
    if not (directory / WEIGHTS_FILE).is_file():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        hint = f" ({', '.join(pickles)} found: pickle files are never loaded, convert them to safetensors)" if pickles else ""
        raise CheckpointError(f"checkpoint {directory} has no {WEIGHTS_FILE}{hint}")
    return config


def load_checkpoint(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> tuple[LDLM, TextTokenizer]:
    """Load a checkpoint directory; the model comes back in eval mode on ``device``."""
    device = resolve_device(device)  # an absent GPU is named before any file is read
    directory = Path(path)
    config = check_checkpoint_files(directory)
    weights = directory / WEIGHTS_FILE
    with torch.device("meta"):
        model = LDLM(config)
    state = read_safetensors(weights, device)
    check_state_dict(model.state_dict(), state, weights)
    model.load_state_dict(state, assign=True)
    model.feature_model.requires_grad_(False)
    has_tokenizer = (directory / "tokenizer.json").is_file() or (directory / "vocab.json").is_file()
    tokenizer = TextTokenizer.from_directory(directory) if has_tokenizer else TextTokenizer.gpt2()
    return model.eval(), tokenizer


def read_safetensors(path: Path, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict: it has keys(), no __iter__)
    except Exception as error:  # safetensors raises its own error types, plus OSError
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from error


def check_state_dict(expected: Mapping[str, Tensor], found: Mapping[str, Tensor], source: Path) -> None:
    """Raise CheckpointError naming every missing, unexpected and mis-shaped tensor."""
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    for name in sorted(set(expected) & set(found)):
        want, got = tuple(expected[name].shape), tuple(found[name].shape)
        if want != got:
            problems.append(f"tensor {name} has shape {got}, expected {want}")
        elif not found[name].is_floating_point():
            problems.append(f"tensor {name} has dtype {found[name].dtype}, expected a floating-point dtype")
    if problems:
        raise CheckpointError(f"{source} does not match the config: " + "; ".join(problems))


# --- random initialization, optionally with real GPT-2 weights -----------------------------------

_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


NORM_INITS: tuple[str, ...] = ("default", "random")


def init_model(config: LDLMConfig, seed: int, gpt2_dir: str | os.PathLike[str] | None = None, norm_init: str = "default") -> LDLM:
    """A seeded random-init LDLM; GPT-2 weights come from ``gpt2_dir`` when given.

    ``norm_init="random"`` gives every norm and the standardization statistics their own values
    (see ``randomize_norms``); "default" leaves them at PyTorch's init (scale 1, bias 0, identity).
    """
    if norm_init not in NORM_INITS:
        raise ValueError(f"norm_init={norm_init!r} is unknown; allowed: {', '.join(NORM_INITS)}")
    torch.manual_seed(seed)
    model = LDLM(config)
    if gpt2_dir is not None:
        load_gpt2_weights(model, Path(gpt2_dir))
    if norm_init == "random":
        randomize_norms(model, seed, keep_feature_model=gpt2_dir is not None)
    return model.eval()


@torch.no_grad()
def randomize_norms(model: LDLM, seed: int, keep_feature_model: bool = False) -> None:
    """Give every LayerNorm and RMSNorm scale and bias, and the feature and latent statistics,
    distinct seeded values, as a trained checkpoint has.

    At PyTorch's init every norm has scale 1 and bias 0: the exporter then shares one initializer
    between all of them and a scale or bias paired with the wrong module cannot be seen. Scales are
    1 + 0.1 N(0, 1), biases 0.1 N(0, 1), means 0.1 N(0, 1), stds exp(0.2 N(0, 1)) (positive, ~1),
    drawn from their own generator so that every other weight stays as ``seed`` made it.
    ``keep_feature_model`` leaves loaded GPT-2 weights alone.
    """
    gen = torch.Generator().manual_seed(seed + 0x5EED)

    def normal(like: Tensor, scale: float) -> Tensor:
        return scale * torch.randn(like.shape, generator=gen).to(like.dtype)

    for name, module in model.named_modules():
        if keep_feature_model and name.startswith("feature_model"):
            continue
        if isinstance(module, (nn.LayerNorm, RMSNorm)):
            if module.weight is not None:
                module.weight.copy_(1 + normal(module.weight, 0.1))
            bias = getattr(module, "bias", None)
            if isinstance(bias, Tensor):
                bias.copy_(normal(bias, 0.1))
    for stats in ("feature", "latent"):
        mean, std = getattr(model, f"{stats}_mean"), getattr(model, f"{stats}_std")
        mean.copy_(normal(mean, 0.1))
        std.copy_(torch.exp(normal(std, 0.2)))


def load_gpt2_weights(model: LDLM, gpt2_dir: Path) -> None:
    """Copy a local Hugging Face GPT-2 (``config.json`` + ``model.safetensors``) into the feature
    model, and set the mask vector to the mask token's row of GPT-2's token table resized to V."""
    config = model.config
    hf_config_path = gpt2_dir / "config.json"
    if not hf_config_path.is_file():
        raise CheckpointError(f"GPT-2 directory {gpt2_dir} has no config.json")
    hf = json.loads(hf_config_path.read_text())
    expected = {
        "n_embd": config.d_model,
        "n_head": config.n_heads,
        "n_layer": config.gpt2_layers,
        "vocab_size": config.gpt2_vocab_size,
        "n_positions": config.gpt2_positions,
        "layer_norm_epsilon": config.layer_norm_eps,
    }
    mismatched = [f"{k}={hf.get(k)!r} (config needs {v!r})" for k, v in expected.items() if hf.get(k) != v]
    if mismatched:
        raise CheckpointError(f"{hf_config_path} does not match the LDLM config: {', '.join(mismatched)}")
    weights = gpt2_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"GPT-2 directory {gpt2_dir} has no {WEIGHTS_FILE} (pickle weights are never loaded)")
    found = read_safetensors(weights)
    found = {name.removeprefix("transformer."): t for name, t in found.items()}
    ours = model.feature_model.state_dict()
    state = {}
    for name, target in ours.items():
        if name not in found:
            raise CheckpointError(f"{weights} has no tensor {name} (nor transformer.{name})")
        tensor = found[name]
        if name.endswith(_CONV1D_WEIGHTS):
            tensor = tensor.t()  # Hugging Face's Conv1D stores (in, out); nn.Linear wants (out, in)
        if tensor.shape != target.shape:
            raise CheckpointError(f"{weights}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        state[name] = tensor.to(target.dtype)
    model.feature_model.load_state_dict(state)
    wte = state["wte.weight"]
    # Resizing an embedding table fills new rows with the mean of the old ones (transformers'
    # default mean_resizing, without its sampled noise).
    mask = wte[config.mask_token_id] if config.mask_token_id < wte.shape[0] else wte.mean(dim=0)
    model.latent_decoder.mask_embedding.copy_(mask)
