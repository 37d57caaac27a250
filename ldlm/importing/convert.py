"""Bring your own checkpoint: a trained model's weights converted into our layout (``ldlm import-checkpoint``).

1. Read the source: a safetensors file, or a ``torch.save`` state dict read with
   ``torch.load(weights_only=True)``. Pickle is never run: a file that needs it is refused.
2. Rename every tensor by the mapping (``ldlm.importing.key_mapping``: JSON rules, regex -> our parameter name,
   tried in order; the first that matches the whole key wins). A rule may transpose its tensor
   (Hugging Face's Conv1D stores (in, out), nn.Linear (out, in)) or drop the key on purpose.
3. Infer the config from the renamed tensors' shapes (``ldlm.importing.config``).
4. Match every tensor against the model built from that config: see ``ldlm.importing.report`` for what
   is a problem. Parameters no rule provides are a problem unless an ``allow_missing`` pattern
   covers them; those keep the seeded random init that ``ldlm init --seed`` gives.
5. Write the checkpoint to a temporary directory, run the check the caller passes on it (``ldlm import-checkpoint``
   passes one parity round, ONNX Runtime against eager), and only then rename it to ``out``. On any problem nothing is left at ``out``.

The mapping format is in ``ldlm.importing.key_mapping``; the shipped one for a Hugging Face GPT-2 is
``ldlm/importing/mappings/hf-gpt2.json``, and ``ldlm/importing/mappings/ldlm.json`` keeps ldlm's own parameter names.
Without a mapping named, ``ldlm`` is chosen when every source key already is one of ldlm's parameter
names (a checkpoint's model.safetensors), else ``hf-gpt2``.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ldlm.files import atomic_directory, command_writer, refuse_existing
from ldlm.importing.config import resolve_config
from ldlm.importing.key_mapping import Renamed, load_mapping, rename
from ldlm.importing.report import CheckOutcome, ImportCheckpointError, ImportReport, Mismatch
from ldlm.model.checkpoint import PICKLE_SUFFIXES, WEIGHTS_FILE, CheckpointError, init_model, read_safetensors, save_checkpoint
from ldlm.model.config import LDLMConfig, preset
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer

PICKLE_FILE = "pytorch_model.bin"  # what a Hugging Face directory holds when it has no safetensors
DEFAULT_MAPPING = "hf-gpt2"  # a source whose keys are not ldlm's: most often a Hugging Face GPT-2
OWN_MAPPING = "ldlm"  # the identity: weights already under ldlm's parameter names
IMPORT_WRITER = command_writer("import-checkpoint")  # what an import's output is recorded as written by (ldlm.files.OUTPUT_RECORD)


def has_ldlm_names(keys: Collection[str]) -> bool:
    """Whether every key already is under one of ldlm's parameter names' first parts (``feature_model.``,
    ``denoiser.``, ``latent_mean``, ...): a state dict of LDLM, which a Hugging Face GPT-2's never is."""
    with torch.device("meta"):  # the names alone: no memory, no init
        parts = {name.split(".")[0] for name in LDLM(preset("tiny")).state_dict()}
    return bool(keys) and all(key.split(".")[0] in parts for key in keys)


def choose_mapping(keys: Collection[str]) -> str:
    """The mapping for a source when none is named: ``ldlm`` for keys already ldlm's, else ``hf-gpt2``."""
    return OWN_MAPPING if has_ldlm_names(keys) else DEFAULT_MAPPING


SOURCES_ALLOWED = "a .safetensors file, a torch.save state dict (.pt, .bin), or a directory holding model.safetensors"


def read_source(path: str | os.PathLike[str]) -> tuple[dict[str, Tensor], list[str]]:
    """The tensors of a safetensors file or a ``torch.save`` state dict (nested dicts are joined with
    dots), and the names of entries that are not tensors. A directory means its model.safetensors.
    The file's format is read from its first bytes, not its name; anything else is refused by name."""
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in (WEIGHTS_FILE, PICKLE_FILE) if (path / name).is_file()]
        if not found:
            raise CheckpointError(f"{path} holds neither {WEIGHTS_FILE} nor {PICKLE_FILE}; allowed: {SOURCES_ALLOWED}")
        path = found[0]
    if not path.is_file():
        raise CheckpointError(f"source {path} does not exist; allowed: {SOURCES_ALLOWED}")
    kind = file_format(path)
    if kind == "safetensors":
        return read_safetensors(path), []
    if kind != "torch.save":
        raise CheckpointError(f"{path} is {kind}, not weights; allowed: {SOURCES_ALLOWED}. {_fix_for(path, kind)}")
    return _read_state_dict(path)


def file_format(path: Path) -> str:
    """``"safetensors"``, ``"torch.save"`` (a zip archive, or a pickle as the legacy format writes), or in
    words what else the file is (empty, text, a JSON file, other binary data), from its first bytes."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(512)
    if not head:
        return "an empty file"
    if len(head) >= 9 and 2 <= int.from_bytes(head[:8], "little") <= size - 8 and head[8:9] == b"{":
        return "safetensors"  # an 8-byte header length, then the JSON header
    pickled = len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5
    if head.startswith(b"PK\x03\x04") or pickled:
        return "torch.save"  # torch.save's zip archive, or the legacy format's pickle (protocol 2 to 5)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"binary data of neither format (its first bytes are {head[:8].hex(' ')})"
    if text.lstrip().startswith(("{", "[")):
        return "a JSON file"
    return f"a text file (it starts {text.splitlines()[0][:40]!r})" if text.strip() else "a text file of blank lines"


def _fix_for(path: Path, kind: str) -> str:
    """What to do about a source that is not weights."""
    if kind.startswith("binary") or path.suffix in (".safetensors", *PICKLE_SUFFIXES):
        return "If it should be weights, it is damaged or incomplete: fetch or save it again"
    return "Pass the weights file itself (e.g. model.safetensors), or the directory that holds it"


def _read_state_dict(path: Path) -> tuple[dict[str, Tensor], list[str]]:
    """A torch.save file read with ``weights_only=True``: pickle that needs more than tensors is never run."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} needs full pickle to load, which can run arbitrary code, so it is never loaded "
            f"(torch.load(weights_only=True) refused it: {str(error).splitlines()[0]}). Where you trust the file, "
            "save its state dict alone (torch.save(model.state_dict(), 'weights.pt')) or as safetensors"
        ) from None
    except Exception as error:  # a damaged archive or pickle fails in many ways (RuntimeError, EOFError, IndexError ...)
        raise CheckpointError(
            f"{path} starts as a torch.save file but cannot be read ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'}); "
            "it is damaged or incomplete: save or fetch it again, as safetensors where you can"
        ) from None
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a state dict (a mapping of names to tensors)")
    tensors: dict[str, Tensor] = {}
    others: list[str] = []
    _flatten(data, "", tensors, others)
    return tensors, others


def _flatten(data: Mapping[Any, Any], prefix: str, tensors: dict[str, Tensor], others: list[str]) -> None:
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Tensor):
            tensors[name] = value
        elif isinstance(value, Mapping):
            _flatten(value, f"{name}.", tensors, others)
        else:
            others.append(name)


def match_model(
    report: ImportReport, renamed: Renamed, model: Mapping[str, Tensor], config: LDLMConfig, allow_missing: Sequence[re.Pattern[str]]
) -> dict[str, Tensor]:
    """The state dict to load: every model tensor, from the source where it has one. Fills ``report``."""
    block = re.compile(r"feature_model\.h\.(\d+)\.")
    state = {}
    for target, tensor in renamed.tensors.items():
        source = renamed.sources[target]
        if target not in model:
            # GPT-2's blocks after the feature layer count towards gpt2_layers but never run (LDLMConfig.feature_blocks)
            m = block.match(target)
            if m is not None and config.feature_blocks <= int(m.group(1)) < config.gpt2_layers:
                report.skipped.append(source)
            else:
                report.unknown_targets.append(f"{source} -> {target}")
            continue
        want = model[target]
        if tensor.shape != want.shape or not tensor.is_floating_point():
            report.mismatches.append(Mismatch(target, source, list(want.shape), list(tensor.shape), str(tensor.dtype)))
            continue
        state[target] = tensor.to(want.dtype).contiguous()
    for name in model:
        if name in state or name in renamed.tensors:
            continue  # a mismatched tensor is reported as such, not as missing too
        (report.kept_init if any(p.match(name) for p in allow_missing) else report.missing).append(name)
    report.imported = sorted(state)
    return {name: state.get(name, tensor) for name, tensor in model.items()}


def compile_patterns(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            raise CheckpointError(f"--allow-missing {pattern!r} is not a regular expression: {error}") from None
    return compiled


def import_checkpoint(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    mapping: str | os.PathLike[str] | None = None,
    config: LDLMConfig | None = None,
    overrides: Mapping[str, Any] | None = None,
    allow_missing: Sequence[str] = (),
    seed: int = 0,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    parity: Callable[[Path], CheckOutcome] | None = None,
    overwrite: bool = False,
) -> ImportReport:
    """Convert ``source``'s weights into a checkpoint directory at ``out``, by ``mapping`` (None: ``ldlm``
    when the source's keys already are ldlm's parameter names, else ``hf-gpt2``).

    ``config`` is the starting point (default: the base preset) that the weights' shapes and then
    ``overrides`` update; ``allow_missing`` are regexes matched at the start of our parameter names
    whose parameters may keep the random init of ``seed``. ``parity`` runs on the written checkpoint before it
    appears at ``out`` (``functools.partial(ldlm.serve.checks.parity.run_parity, progress=True)`` is what
    the CLI passes; None: no check). Raises ImportCheckpointError (with the report) on any problem, a failed
    parity round included; then nothing is written. ``overwrite`` replaces only an earlier import's output,
    unchanged since (``ldlm.files.refuse_existing``).
    """
    refuse_existing(out, overwrite, {"source": source}, IMPORT_WRITER)  # before the source is read
    allowed = compile_patterns(allow_missing)
    tensors, non_tensors = read_source(source)
    own_names = has_ldlm_names(tensors)
    chosen = mapping is None
    mapping = choose_mapping(tensors) if mapping is None else mapping
    key_mapping = load_mapping(mapping)
    renamed = rename(tensors, key_mapping.rules)
    shapes = {name: tuple(t.shape) for name, t in renamed.tensors.items()}
    resolved, inferred = resolve_config(config or preset("base"), shapes, overrides, key_mapping.gpt2_blocks)
    report = ImportReport(str(source), str(mapping), resolved.to_dict(), inferred, dict(overrides or {}))
    report.mapping_chosen, report.ldlm_names = chosen, own_names
    report.unmatched, report.dropped, report.duplicates = renamed.unmatched, renamed.dropped, renamed.duplicates
    report.non_tensors = non_tensors
    model = init_model(resolved, seed)
    state = match_model(report, renamed, model.state_dict(), resolved, allowed)
    if not report.passed:
        raise ImportCheckpointError(report)
    model.load_state_dict(state)
    tokenizer = TextTokenizer.from_directory(tokenizer_dir) if tokenizer_dir else TextTokenizer.gpt2()
    with atomic_directory(out, overwrite, IMPORT_WRITER) as tmp:
        staged = save_checkpoint(model, tokenizer, tmp / "staged")
        if parity is not None:
            check_parity(report, staged, parity)
        for path in staged.iterdir():
            path.rename(tmp / path.name)
        staged.rmdir()
    report.out = str(out)
    return report


def check_parity(report: ImportReport, checkpoint: Path, parity: Callable[[Path], CheckOutcome]) -> None:
    """The caller's parity check on the written checkpoint, recorded in the report; raises when it fails."""
    result = parity(checkpoint)
    report.parity, report.parity_summary = result.to_dict(), result.summary()
    if not result.passed:
        raise ImportCheckpointError(report)
