r"""Key mappings: JSON rules that rename a source's tensors to our parameter names.

A mapping file holds ``rules``, tried in order; the first whose ``pattern`` (a regular expression)
matches the whole key wins. Its ``target`` may refer to the pattern's groups (``\1``, written
``\\1`` in JSON, as every backslash); ``"target": null`` drops the key on purpose;
``"transpose": true`` transposes a 2-D tensor (Hugging Face's Conv1D stores (in, out), nn.Linear
(out, in)); ``why`` is for people. ``gpt2_blocks`` says whether the source holds
"all" of GPT-2's blocks (the default) or those "until_feature_layer" only (see
``ldlm.importing.config.resolve_config``). Shipped mappings live in ``ldlm/importing/mappings/`` and are named
without their suffix (``hf-gpt2``)::

    {"description": "...",
     "gpt2_blocks": "all",
     "rules": [{"pattern": "(?:transformer\\.)?h\\.(\\d+)\\.attn\\.c_attn\\.weight",
                "target": "feature_model.h.\\1.attn.c_attn.weight", "transpose": true},
               {"pattern": "lm_head\\.weight", "target": null, "why": "tied to wte"}]}

Nothing here knows our model: renaming is names and tensors only, so any loader can use it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from torch import Tensor


class MappingError(ValueError):
    """A mapping file that cannot be used; the message names the file and the rule."""


MAPPING_KEYS = {"description", "rules", "gpt2_blocks"}
RULE_KEYS = {"pattern", "target", "transpose", "why"}


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    target: str | None  # None drops the key on purpose
    transpose: bool = False


def shipped_mappings() -> list[str]:
    return sorted(
        p.name.removesuffix(".json") for p in (resources.files("ldlm.importing") / "mappings").iterdir() if p.name.endswith(".json")
    )


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
        shipped = resources.files("ldlm.importing") / "mappings" / f"{mapping}.json"
        if not shipped.is_file():
            raise MappingError(f"mapping {mapping}: no such file, nor a shipped mapping (shipped: {', '.join(shipped_mappings())})")
        text = shipped.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise MappingError(f"mapping {mapping} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or set(data) - MAPPING_KEYS:
        raise MappingError(f"mapping {mapping}: expected an object with keys from {sorted(MAPPING_KEYS)}")
    return KeyMapping(parse_rules(data.get("rules"), str(mapping)), data.get("gpt2_blocks", "all"))


def parse_rules(rules: Any, where: str) -> list[Rule]:
    if not isinstance(rules, list) or not rules:
        raise MappingError(f'mapping {where}: expected "rules": [{{"pattern": REGEX, "target": NAME or null}}, ...]')
    parsed = []
    for i, raw in enumerate(rules):
        where_rule = f"mapping {where}: rules[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("pattern"), str) or "target" not in raw:
            raise MappingError(f'{where_rule} needs "pattern" (a regex) and "target" (a parameter name, or null to drop)')
        if set(raw) - RULE_KEYS:
            raise MappingError(f"{where_rule} has unknown key(s) {sorted(set(raw) - RULE_KEYS)}; allowed: {sorted(RULE_KEYS)}")
        if not (raw["target"] is None or isinstance(raw["target"], str)) or not isinstance(raw.get("transpose", False), bool):
            raise MappingError(f'{where_rule}: "target" must be a string or null, "transpose" true or false')
        try:
            pattern = re.compile(raw["pattern"])
        except re.error as error:
            raise MappingError(f"{where_rule}: pattern {raw['pattern']!r} is not a regular expression: {error}") from None
        parsed.append(Rule(pattern, raw["target"], raw.get("transpose", False)))
    return parsed


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
