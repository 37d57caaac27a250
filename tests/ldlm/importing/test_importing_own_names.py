"""Weights already under ldlm's own parameter names (a checkpoint's model.safetensors) import by the shipped
``ldlm`` mapping, chosen without being named: every tensor as it was, the config the shapes tell."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from ldlm.cli import main
from ldlm.importing.convert import choose_mapping, import_checkpoint
from ldlm.importing.key_mapping import load_mapping, shipped_mappings
from ldlm.importing.report import ImportCheckpointError
from ldlm.model.checkpoint import load_config
from tests import REPO

REFERENCE = REPO / "models" / "ldlm-austen-tiny"


def test_the_reference_checkpoints_weights_import_unnamed_as_they_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["import-checkpoint", str(REFERENCE / "model.safetensors"), str(out), "--skip-parity", "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "mapping ldlm (chosen by the source's keys; --mapping names another): 177 parameter(s) imported" in said
    source, written = load_file(REFERENCE / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(written) == sorted(source) and all(written[k].equal(source[k]) for k in source)
    assert load_config(out) == load_config(REFERENCE)  # every size from the shapes; the rest is the base preset's, as there


def test_a_mapping_that_does_not_fit_ldlm_names_says_to_use_the_ldlm_one(tmp_path: Path) -> None:
    with pytest.raises(ImportCheckpointError) as refused:
        import_checkpoint(REFERENCE / "model.safetensors", tmp_path / "out", "hf-gpt2", parity=False)
    assert "the source's keys already are ldlm's parameter names, which mapping hf-gpt2 does not expect: pass --mapping ldlm" in str(
        refused.value
    )
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_the_mapping_is_chosen_by_the_keys() -> None:
    assert "ldlm" in shipped_mappings() and load_mapping("ldlm").gpt2_blocks == "until_feature_layer"
    with safe_open(REFERENCE / "model.safetensors", "pt") as weights:
        assert choose_mapping(list(weights.keys())) == "ldlm"
    for keys in (
        ["transformer.wte.weight", "transformer.h.0.ln_1.weight"],
        ["wte.weight"],
        ["feature_model.wte.weight", "lm_head.weight"],
        [],
    ):
        assert choose_mapping(keys) == "hf-gpt2", keys
