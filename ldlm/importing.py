"""Bring your own checkpoint: a trained model's weights converted into our layout (``ldlm import-checkpoint``).

1. Read the source: a safetensors file, or a ``torch.save`` state dict read with
   ``torch.load(weights_only=True)``. Pickle is never run: a file that needs it is refused.
2. Rename every tensor by the mapping (a JSON file of rules, regex -> our parameter name, tried in
   order; the first that matches the whole key wins). A rule may transpose its tensor (Hugging
   Face's Conv1D stores (in, out), nn.Linear (out, in)) or drop the key on purpose ("target": null).
3. Infer the config from the renamed tensors' shapes (``ldlm.import_config``).
4. Match every tensor against the model built from that config: see ``ldlm.import_report`` for what
   is a problem. Parameters no rule provides are a problem unless an ``allow_missing`` pattern
   covers them; those keep the seeded random init that ``ldlm init --seed`` gives.
5. Write the checkpoint to a temporary directory, run one parity round on it (ONNX Runtime against
   eager, ``run_parity``), and only then rename it to ``out``. On any problem nothing is left at ``out``.

A mapping file (``gpt2_blocks``: "all" when the source holds every GPT-2 block, the default, or
"until_feature_layer" when it holds only those that run, as our own checkpoints do)::

    {"description": "...",
     "gpt2_blocks": "all",
     "rules": [{"pattern": "(?:transformer\\.)?h\\.(\\d+)\\.attn\\.c_attn\\.weight",
                "target": "feature_model.h.\\1.attn.c_attn.weight", "transpose": true},
               {"pattern": "lm_head\\.weight", "target": null, "why": "tied to wte"}]}
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ldlm.checkpoint import WEIGHTS_FILE, CheckpointError, init_model, read_safetensors, save_checkpoint
from ldlm.config import LDLMConfig, preset
from ldlm.files import atomic_directory, refuse_existing
from ldlm.import_config import resolve_config
from ldlm.import_report import ImportCheckpointError, ImportReport, Mismatch
from ldlm.tokenizer import TextTokenizer

MAPPING_KEYS = {"description", "rules", "gpt2_blocks"}
RULE_KEYS = {"pattern", "target", "transpose", "why"}
PICKLE_FILE = "pytorch_model.bin"  # what a Hugging Face directory holds when it has no safetensors


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    target: str | None  # None drops the key on purpose
    transpose: bool = False


def shipped_mappings() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in (resources.files("ldlm") / "mappings").iterdir() if p.name.endswith(".json"))


@dataclass(frozen=True)
class KeyMapping:
    """A mapping file: its rules in order, and which of GPT-2's blocks the source holds (see resolve_config)."""

    rules: list[Rule]
    gpt2_blocks: str = "all"


def load_mapping(mapping: str | os.PathLike[str]) -> KeyMapping:
    """A mapping file, or a shipped mapping named without its folder and suffix (``hf-gpt2``)."""
    path = Path(mapping)
    if path.is_file():
        text = path.read_text()
    else:
        shipped = resources.files("ldlm") / "mappings" / f"{mapping}.json"
        if not shipped.is_file():
            raise CheckpointError(f"mapping {mapping}: no such file, nor a shipped mapping (shipped: {', '.join(shipped_mappings())})")
        text = shipped.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"mapping {mapping} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or set(data) - MAPPING_KEYS:
        raise CheckpointError(f"mapping {mapping}: expected an object with keys from {sorted(MAPPING_KEYS)}")
    return KeyMapping(parse_rules(data.get("rules"), str(mapping)), data.get("gpt2_blocks", "all"))


def parse_rules(rules: Any, where: str) -> list[Rule]:
    if not isinstance(rules, list) or not rules:
        raise CheckpointError(f'mapping {where}: expected "rules": [{{"pattern": REGEX, "target": NAME or null}}, ...]')
    parsed = []
    for i, raw in enumerate(rules):
        where_rule = f"mapping {where}: rules[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("pattern"), str) or "target" not in raw:
            raise CheckpointError(f'{where_rule} needs "pattern" (a regex) and "target" (a parameter name, or null to drop)')
        if set(raw) - RULE_KEYS:
            raise CheckpointError(f"{where_rule} has unknown key(s) {sorted(set(raw) - RULE_KEYS)}; allowed: {sorted(RULE_KEYS)}")
        if not (raw["target"] is None or isinstance(raw["target"], str)) or not isinstance(raw.get("transpose", False), bool):
            raise CheckpointError(f'{where_rule}: "target" must be a string or null, "transpose" true or false')
        try:
            pattern = re.compile(raw["pattern"])
        except re.error as error:
            raise CheckpointError(f"{where_rule}: pattern {raw['pattern']!r} is not a regular expression: {error}") from None
        parsed.append(Rule(pattern, raw["target"], raw.get("transpose", False)))
    return parsed


def read_source(path: str | os.PathLike[str]) -> tuple[dict[str, Tensor], list[str]]:
    """The tensors of a safetensors file or a ``torch.save`` state dict (nested dicts are joined with
    dots), and the names of entries that are not tensors. A directory means its model.safetensors."""
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in (WEIGHTS_FILE, PICKLE_FILE) if (path / name).is_file()]
        if not found:
            raise CheckpointError(f"{path} holds neither {WEIGHTS_FILE} nor {PICKLE_FILE}")
        path = found[0]
    if not path.is_file():
        raise CheckpointError(f"source {path} does not exist")
    if path.suffix == ".safetensors":
        return read_safetensors(path), []
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} needs full pickle to load, which can run arbitrary code, so it is never loaded "
            f"(torch.load(weights_only=True) refused it: {str(error).splitlines()[0]}). Where you trust the file, "
            "save its state dict alone (torch.save(model.state_dict(), 'weights.pt')) or as safetensors"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as error:
        raise CheckpointError(f"{path} is neither a safetensors file (name it .safetensors) nor a torch.save state dict: {error}") from None
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


@dataclass
class Renamed:
    """The source under our names: ``tensors[target]`` (transposed where a rule says), from ``sources[target]``."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    unmatched: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


def rename(tensors: Mapping[str, Tensor], rules: Sequence[Rule]) -> Renamed:
    """Apply the first rule whose pattern matches the whole key to every source tensor."""
    out = Renamed()
    for key in sorted(tensors):
        rule, match = next(((r, m) for r in rules if (m := r.pattern.fullmatch(key))), (None, None))
        if rule is None or match is None:
            out.unmatched.append(key)
            continue
        if rule.target is None:
            out.dropped.append(key)
            continue
        target = match.expand(rule.target)
        if target in out.sources:
            out.duplicates.append(f"{target} <- {out.sources[target]}, {key}")
            continue
        tensor = tensors[key]
        # Conv1D keeps (in, out); a 1-D tensor under a transposing rule is left as it is and shows as mis-shaped.
        out.tensors[target] = tensor.t() if rule.transpose and tensor.dim() == 2 else tensor
        out.sources[target] = key
    return out


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
    mapping: str | os.PathLike[str] = "hf-gpt2",
    config: LDLMConfig | None = None,
    overrides: Mapping[str, Any] | None = None,
    allow_missing: Sequence[str] = (),
    seed: int = 0,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    parity: bool = True,
    overwrite: bool = False,
    progress: bool = False,
) -> ImportReport:
    """Convert ``source``'s weights into a checkpoint directory at ``out``, by ``mapping``.

    ``config`` is the starting point (default: the base preset) that the weights' shapes and then
    ``overrides`` update; ``allow_missing`` are regexes matched at the start of our parameter names
    whose parameters may keep the random init of ``seed``. Raises ImportCheckpointError (with the
    report) on any problem, a failed parity round included; then nothing is written.
    """
    refuse_existing(out, overwrite)
    allowed = compile_patterns(allow_missing)
    key_mapping = load_mapping(mapping)
    tensors, non_tensors = read_source(source)
    renamed = rename(tensors, key_mapping.rules)
    shapes = {name: tuple(t.shape) for name, t in renamed.tensors.items()}
    resolved, inferred = resolve_config(config or preset("base"), shapes, overrides, key_mapping.gpt2_blocks)
    report = ImportReport(str(source), str(mapping), resolved.to_dict(), inferred, dict(overrides or {}))
    report.unmatched, report.dropped, report.duplicates = renamed.unmatched, renamed.dropped, renamed.duplicates
    report.non_tensors = non_tensors
    model = init_model(resolved, seed)
    state = match_model(report, renamed, model.state_dict(), resolved, allowed)
    if not report.passed:
        raise ImportCheckpointError(report)
    model.load_state_dict(state)
    tokenizer = TextTokenizer.from_directory(tokenizer_dir) if tokenizer_dir else TextTokenizer.gpt2()
    with atomic_directory(out, overwrite) as tmp:
        staged = save_checkpoint(model, tokenizer, tmp / "staged")
        if parity:
            check_parity(report, staged, progress)
        for path in staged.iterdir():
            path.rename(tmp / path.name)
        staged.rmdir()
    report.out = str(out)
    return report


def check_parity(report: ImportReport, checkpoint: Path, progress: bool) -> None:
    """One parity round, ONNX Runtime against eager, on the written checkpoint; raises when it fails."""
    from ldlm.serve.checks.parity import run_parity  # exports and runs ONNX: only when asked

    result = run_parity(checkpoint, "ort", progress=progress)
    report.parity, report.parity_summary = result.to_dict(), result.summary()
    if not result.passed:
        raise ImportCheckpointError(report)
