"""``ldlm import-checkpoint``: a real Hugging Face GPT-2 into the tiny config, checked against Hugging Face's
own hidden states; and every refusal (a key no rule maps, a parameter nothing provides, a shape mismatch,
a file that needs pickle, a field the weights cannot tell) with its message and nothing left at OUT."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ldlm.cli import main
from ldlm.importing import key_mapping
from ldlm.importing.convert import import_checkpoint
from ldlm.importing.report import ImportCheckpointError
from ldlm.model.checkpoint import CheckpointError, init_model, load_checkpoint
from ldlm.model.config import LDLMConfig, preset
from ldlm.serve.checks.parity_result import ParityReport
from tests import REPO

transformers = pytest.importorskip("transformers", reason="transformers is the GPT-2 oracle (pip install -e .[test])")

ALL_BUT_FEATURES = r"(?!feature_model\.)"  # the parts a GPT-2 does not hold keep their random init
SHIPPED = REPO / "ldlm" / "importing" / "mappings" / "hf-gpt2.json"


@pytest.fixture(scope="module")
def hf_sources(tmp_path_factory: pytest.TempPathFactory, tiny_config: LDLMConfig) -> dict[str, tuple[Path, Any]]:
    """A tiny GPT2LMHeadModel as save_pretrained writes it (safetensors, transformer. prefix, no tied lm_head),
    its torch.save state dict (with lm_head), and a GPT2Model's safetensors (no prefix)."""
    config = transformers.GPT2Config(
        n_layer=tiny_config.gpt2_layers,
        n_embd=tiny_config.d_model,
        n_head=tiny_config.n_heads,
        vocab_size=tiny_config.gpt2_vocab_size,
        n_positions=tiny_config.gpt2_positions,
    )
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(1)
    lm = transformers.GPT2LMHeadModel(config).eval()
    lm.save_pretrained(root / "lm")
    torch.save(lm.state_dict(), root / "lm.pt")
    torch.manual_seed(2)
    bare = transformers.GPT2Model(config).eval()
    bare.save_pretrained(root / "bare")
    return {
        "lm-safetensors": (root / "lm" / "model.safetensors", lm),
        "lm-state-dict": (root / "lm.pt", lm),
        "bare-safetensors": (root / "bare" / "model.safetensors", bare),
    }


def tiny_import(source: Path, out: Path, **kwargs: Any) -> Any:
    kwargs = {"config": preset("tiny"), "allow_missing": [ALL_BUT_FEATURES], "parity": None} | kwargs
    return import_checkpoint(source, out, **kwargs)


def mapping_file(tmp_path: Path, edit: Any) -> Path:
    """The shipped mapping with ``edit(rules)`` applied, written next to the test's files."""
    data = json.loads(SHIPPED.read_text())
    edit(data["rules"])
    path = tmp_path / "mapping.json"
    path.write_text(json.dumps(data))
    return path


def refused(tmp_path: Path, out: Path) -> None:
    """Nothing at OUT, and no temporary sibling left behind."""
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.parametrize("kind", ["lm-safetensors", "lm-state-dict", "bare-safetensors"])
def test_imported_features_equal_hugging_face_hidden_states(kind: str, hf_sources: dict, tmp_path: Path) -> None:
    source, hf = hf_sources[kind]
    report = tiny_import(source, tmp_path / "out")
    model, _ = load_checkpoint(tmp_path / "out")
    ids = torch.randint(0, 50257, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-3]
        got = model.feature_model(ids, mask.bool())
    valid = mask.bool()
    assert (got[valid] - expected[valid]).abs().max().item() < 1e-5
    # 4 blocks read (hence gpt2_layers), blocks 2 and 3 never run: 12 tensors each, skipped, not refused
    assert report.inferred["gpt2_layers"].value == 4 and model.config.gpt2_layers == 4
    prefix = "" if kind.startswith("bare") else "transformer."
    assert len(report.skipped) == 24 and all(key.startswith((f"{prefix}h.2.", f"{prefix}h.3.")) for key in report.skipped)
    assert f"{prefix}ln_f.weight" in report.dropped and ("lm_head.weight" in report.dropped) == (kind == "lm-state-dict")


def test_parts_the_source_lacks_keep_the_seeded_random_init(hf_sources: dict, tmp_path: Path) -> None:
    source, _ = hf_sources["lm-safetensors"]
    tiny_import(source, tmp_path / "out", seed=7)
    model, _ = load_checkpoint(tmp_path / "out")
    seeded = init_model(preset("tiny"), seed=7)
    torch.testing.assert_close(model.denoiser.state_dict(), seeded.denoiser.state_dict(), rtol=0, atol=0)
    assert not torch.equal(model.feature_model.wte.weight, seeded.feature_model.wte.weight)


def test_a_mapping_that_misses_a_key(hf_sources: dict, tmp_path: Path) -> None:
    def drop_wpe(rules: list) -> None:
        rules[0]["pattern"] = r"(?:transformer\.)?(wte)\.weight"

    source, _ = hf_sources["lm-safetensors"]
    with pytest.raises(ImportCheckpointError) as caught:
        tiny_import(source, tmp_path / "out", mapping=mapping_file(tmp_path, drop_wpe))
    message = str(caught.value)
    assert "source key transformer.wpe.weight matches no mapping rule" in message
    assert "1 parameter(s) missing from the source: feature_model.wpe.weight " in message
    assert caught.value.report.missing == ["feature_model.wpe.weight"]
    refused(tmp_path, tmp_path / "out")


def test_missing_parameters_fail_unless_allowed(hf_sources: dict, tmp_path: Path) -> None:
    source, _ = hf_sources["lm-safetensors"]
    with pytest.raises(ImportCheckpointError, match="31 parameter.s. missing from the source: denoiser.time_mlp.0.weight, ") as caught:
        tiny_import(source, tmp_path / "out", allow_missing=[r"(?!feature_model\.|denoiser\.)"])
    # the tiny denoiser: time MLP (2 Linears) 4, each of 2 blocks 13 (time and self-cond Linears 4, 2 norms,
    # q k v o, w1 w3 w2), the output norm 1
    assert len(caught.value.report.missing) == 4 + 2 * 13 + 1
    assert all(name.startswith("denoiser.") for name in caught.value.report.missing)
    refused(tmp_path, tmp_path / "out")


def test_a_shape_mismatch_names_expected_and_found(hf_sources: dict, tmp_path: Path) -> None:
    def no_transpose(rules: list) -> None:
        rules[1]["transpose"] = False

    source, _ = hf_sources["lm-safetensors"]
    with pytest.raises(ImportCheckpointError) as caught:
        tiny_import(source, tmp_path / "out", mapping=mapping_file(tmp_path, no_transpose))
    # Conv1D keeps (in, out) = (64, 3 * 64); nn.Linear wants (out, in)
    assert (
        "shape mismatch: feature_model.h.0.attn.c_attn.weight (from transformer.h.0.attn.c_attn.weight): "
        "expected shape (192, 64), found (64, 192)" in str(caught.value)
    )
    assert "missing" not in str(caught.value)  # a mis-shaped parameter is not reported as missing too
    refused(tmp_path, tmp_path / "out")


def test_an_unmatched_key_is_named(hf_sources: dict, tmp_path: Path) -> None:
    source, hf = hf_sources["lm-state-dict"]
    state = dict(hf.state_dict()) | {"transformer.extra.scale": torch.ones(3)}
    torch.save(state, tmp_path / "extra.pt")
    with pytest.raises(ImportCheckpointError) as caught:
        tiny_import(tmp_path / "extra.pt", tmp_path / "out")
    assert caught.value.report.unmatched == ["transformer.extra.scale"]
    assert 'source key transformer.extra.scale matches no mapping rule (add a rule for it, or one with "target": null' in str(caught.value)
    refused(tmp_path, tmp_path / "out")


def test_a_duplicate_and_an_unknown_target_are_named(hf_sources: dict, tmp_path: Path) -> None:
    def typo(rules: list) -> None:
        rules.insert(0, {"pattern": r"transformer\.h\.0\.ln_1\.bias", "target": "feature_model.h.0.ln1.bias"})

    _, hf = hf_sources["lm-state-dict"]
    state = dict(hf.state_dict())
    torch.save(state | {"wte.weight": state["transformer.wte.weight"]}, tmp_path / "twice.pt")
    with pytest.raises(ImportCheckpointError) as caught:
        tiny_import(tmp_path / "twice.pt", tmp_path / "out", mapping=mapping_file(tmp_path, typo))
    message = str(caught.value)
    assert "two source keys for one parameter: feature_model.wte.weight <- transformer.wte.weight, wte.weight" in message
    assert "rule maps transformer.h.0.ln_1.bias -> feature_model.h.0.ln1.bias, a parameter the model does not have" in message
    assert "missing from the source: feature_model.h.0.ln_1.bias " in message
    refused(tmp_path, tmp_path / "out")


class _Touch:
    """Unpickling this object creates a file: proof that a refused file's pickle never ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


def test_a_file_that_needs_pickle_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "pickle-ran"
    torch.save({"wte.weight": torch.zeros(2, 2), "trap": _Touch(marker)}, tmp_path / "trap.pt")
    with pytest.raises(CheckpointError, match=r"trap.pt needs full pickle to load, which can run arbitrary code, so it is never loaded"):
        tiny_import(tmp_path / "trap.pt", tmp_path / "out")
    assert not marker.exists()
    refused(tmp_path, tmp_path / "out")


def test_a_field_the_weights_cannot_tell_is_asked_for_by_name(hf_sources: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, _ = hf_sources["lm-safetensors"]
    out = tmp_path / "out"
    # The base preset's n_heads (12) is for d_model 768; the weights' d_model is 64.
    assert main(["import-checkpoint", str(source), str(out), "--allow-missing", ALL_BUT_FEATURES, "--skip-parity", "--quiet"]) == 2
    assert "n_heads cannot be inferred from the weights; pass --set n_heads=N" in capsys.readouterr().err
    refused(tmp_path, out)
    flags = ["--set", "n_heads=4", "--set", "max_seq_len=128", "--allow-missing", ALL_BUT_FEATURES, "--skip-parity", "--json", "--quiet"]
    assert main(["import-checkpoint", str(source), str(out), *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["config"]["n_heads"] == 4 and report["config"]["d_model"] == 64
    assert report["overrides"] == {"n_heads": 4, "max_seq_len": 128} and report["inferred"]["gpt2_positions"]["value"] == 128


def test_the_documented_mapping_example_is_a_mapping() -> None:
    doc = key_mapping.__doc__ or ""
    example = json.loads(doc[doc.index('{"description"') : doc.index("\n\nNothing")])
    rules = key_mapping.parse_rules(example["rules"], "the docstring")
    renamed = key_mapping.rename({"transformer.h.3.attn.c_attn.weight": torch.zeros(2, 6), "lm_head.weight": torch.zeros(1)}, rules)
    assert renamed.dropped == ["lm_head.weight"] and renamed.tensors["feature_model.h.3.attn.c_attn.weight"].shape == (6, 2)


def test_a_full_checkpoint_tells_its_whole_config(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Our own tiny checkpoint under an identity mapping, from the base preset: every size comes from the
    shapes (n_heads from the per-head norm), so the config is the tiny one it was made from."""
    mapping = tmp_path / "identity.json"
    mapping.write_text(json.dumps({"gpt2_blocks": "until_feature_layer", "rules": [{"pattern": "(.*)", "target": r"\1"}]}))
    report = import_checkpoint(tiny_checkpoint / "model.safetensors", tmp_path / "out", mapping, parity=None)
    assert LDLMConfig.from_dict(report.config) == preset("tiny")
    assert not report.kept_init and not report.skipped and len(report.imported) == len(load_checkpoint(tiny_checkpoint)[0].state_dict())


def test_a_failed_parity_round_leaves_nothing(hf_sources: dict, tmp_path: Path) -> None:
    seen = []

    def nothing_compared(checkpoint: Path, backend: str = "ort", **_: Any) -> ParityReport:
        seen.append(sorted(p.name for p in Path(checkpoint).iterdir()))
        return ParityReport(backend, "fp32", {}, 1e-4, 1e-4)  # compared nothing: a failure, not a pass

    source, _ = hf_sources["lm-safetensors"]
    with pytest.raises(ImportCheckpointError, match="parity round on the imported weights: FAILED parity ort"):
        tiny_import(source, tmp_path / "out", parity=nothing_compared)
    assert seen == [[".ldlm-output.json", "config.json", "model.safetensors", "tokenizer.json"]]
    refused(tmp_path, tmp_path / "out")


def test_the_command_runs_its_parity_round_before_writing(hf_sources: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, _ = hf_sources["lm-state-dict"]
    out = tmp_path / "out"
    args = ["import-checkpoint", str(source), str(out), "--preset", "tiny", "--allow-missing", ALL_BUT_FEATURES, "--json", "--quiet"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["parity"]["passed"] and report["parity"]["token_agreement"] == 1.0
    assert sorted(p.name for p in out.iterdir()) == [".ldlm-output.json", "config.json", "model.safetensors", "tokenizer.json"]
    assert main(args) == 2  # OUT exists now: refused without --force
    assert "already exists" in capsys.readouterr().err
