"""Parity's inputs as a file: a case saved on ONNX Runtime replays with the same report numbers on ONNX Runtime
and the same reference outputs on eager PyTorch; the graphs run the file's tensors; a file that does not fit
the checkpoint, or was changed, is refused naming what differs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import torch

from ldlm.cli import main
from ldlm.export.graphs import GRAPH_NAMES
from ldlm.model.checkpoint import init_model
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.checks.parity import run_parity
from ldlm.serve.checks.parity_inputs import (
    EndToEndPlan,
    ParityInputs,
    check_inputs,
    generate_inputs,
    read_inputs,
    read_outputs,
    save_inputs,
)
from ldlm.serve.checks.parity_result import ParityReport
from ldlm.serve.runtime.torch_backends import EagerBackend

needs_ort = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None, reason="ONNX Runtime is the engine under test (pip install -e .[cpu])"
)

SEED = 7  # not the default 0: a replay that fell back to the default seed would draw other inputs


def numbers(report: ParityReport) -> dict[str, Any]:
    """Every figure the report holds; the notes (which say where the inputs came from) and the eps probes'
    wall time left out."""
    figures = report.to_dict()
    figures.pop("notes")
    if figures["eps_probes"] is not None:
        figures["eps_probes"].pop("seconds")
    return figures


def header_of(path: Path) -> dict[str, Any]:
    """The JSON header, read as the safetensors format defines it (8-byte little-endian length, then JSON)."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size])["__metadata__"]


@needs_ort
def test_saved_on_ort_replays_the_same_numbers_on_ort_and_the_same_reference_on_eager(
    tiny_checkpoint: Path, export_dir: Path, tmp_path: Path
) -> None:
    saved, outputs = tmp_path / "case.safetensors", tmp_path / "ort.safetensors"
    original = run_parity(tiny_checkpoint, "ort", source=export_dir, seed=SEED, steps=2, save_inputs=saved, save_outputs=outputs)
    again = run_parity(tiny_checkpoint, "ort", source=export_dir, load_inputs=saved, save_outputs=tmp_path / "ort-again.safetensors")
    assert numbers(again) == numbers(original)
    assert (
        original.passed and len(original.graphs) == 3 * 3 and len(original.layer_norms) == 2 * 12
    )  # graphs x input sets; 2 input sets x 12 LayerNorms

    on_eager = run_parity(tiny_checkpoint, "eager", load_inputs=saved, save_outputs=tmp_path / "eager.safetensors")
    _, ort_outputs = read_outputs(outputs)
    eager_header, eager_outputs = read_outputs(tmp_path / "eager.safetensors")
    # every output but the LayerNorms' (compared on ONNX Runtime only), and the generated tokens
    assert set(eager_outputs.reference) == {name for name in ort_outputs.reference if ":" not in name}
    assert "end_to_end/token_ids" in eager_outputs.reference and "denoiser/stress-outliers/x0_hat" in eager_outputs.reference
    for name, reference in eager_outputs.reference.items():
        assert reference.tobytes() == ort_outputs.reference[name].tobytes(), name  # bit for bit
    assert eager_header["inputs_sha256"] == json.loads(header_of(saved)["ldlm_parity"])["sha256"]
    assert eager_header["backend"] == "eager" and eager_header["seed"] == SEED
    assert on_eager.token_agreement == original.token_agreement == 1.0
    assert any(note.startswith(f"inputs replayed from {saved}, saved by a ort fp32 run on cpu") for note in on_eager.notes)


def test_the_file_holds_every_input_with_a_header_that_describes_it(tiny_model: LDLM, tmp_path: Path) -> None:
    """Read with the safetensors library itself; the noise and the seeds recomputed from their documented recipe
    (numpy's SeedSequence, torch's CPU generator), not through parity's code."""
    plan = EndToEndPlan(SEED, 4, 32, 2, "ddim", False)
    path = save_inputs(generate_inputs(tiny_model, SEED, plan), tmp_path / "case.safetensors")
    header = json.loads(header_of(path)["ldlm_parity"])
    tensors = safetensors.numpy.load_file(str(path))
    assert header["format"] == "ldlm-parity-inputs" and header["version"] == 2 and header["seed"] == SEED
    assert header["config_sha256"] == tiny_model.config.config_hash()
    assert header["tensors"]["graphs/denoiser/stress-outliers/x_t"] == {"shape": [3, 24, 64], "dtype": "float32"}
    assert header["tensors"]["graphs/encoder/padded/attention_mask"] == {"shape": [3, 24], "dtype": "int64"}
    assert set(header["tensors"]) == set(tensors)
    assert {name.split("/")[1] for name in tensors if name.startswith("graphs/")} == set(GRAPH_NAMES)
    assert tensors["graphs/encoder/padded/attention_mask"][1].tolist() == [1] * 12 + [0] * 12  # row 1 padded from the middle
    rows = tensors["eps_probe_rows/64"]
    assert rows.shape == (13 * 3 + 4 + 5, 64)  # sweep 13 variances x 3 draws, 4 constant rows, 5 large-mean rows
    assert rows[39:43, 0].tolist() == [0.0, 1.0, -3.25, 1e4]  # the constant rows
    seeds = [int(s) >> 1 for s in np.random.SeedSequence(SEED).generate_state(4, dtype=np.uint64)]
    assert header["end_to_end"] == {
        "seed": SEED,
        "n": 4,
        "length": 32,
        "steps": 2,
        "sampler": "ddim",
        "tuned_grids": False,
        "sample_seeds": seeds,
    }
    for i, seed in enumerate(seeds):
        drawn = torch.randn((32, 64), generator=torch.Generator().manual_seed(seed)).numpy()
        assert np.array_equal(tensors["end_to_end/noise"][i], drawn)


def test_the_graphs_run_the_files_tensors_and_the_generation_its_plan(
    tiny_checkpoint: Path, tiny_model: LDLM, tokenizer: TextTokenizer, tmp_path: Path
) -> None:
    """A file whose denoiser inputs differ from what its seed draws: the replay runs those, not the seed's; and
    its generation is the file's seed, samples, length, steps and sampler, as the pipeline generates them."""
    inputs = generate_inputs(tiny_model, SEED, EndToEndPlan(SEED, 2, 8, 1, "ddim", False))
    edited = {**inputs.graphs["denoiser"]["random"], "x_t": inputs.graphs["denoiser"]["random"]["x_t"] * np.float32(0.5)}
    inputs.graphs["denoiser"]["random"] = edited
    path = save_inputs(inputs, tmp_path / "edited.safetensors")
    run_parity(tiny_checkpoint, "eager", load_inputs=path, save_outputs=tmp_path / "out.safetensors")
    _, outputs = read_outputs(tmp_path / "out.safetensors")
    eager = EagerBackend(tiny_model, "denoiser")
    expected = eager.run(edited)["x0_hat"]
    assert outputs.reference["denoiser/random/x0_hat"].tobytes() == expected.tobytes()
    assert not np.array_equal(
        expected, eager.run(generate_inputs(tiny_model, SEED, inputs.end_to_end).graphs["denoiser"]["random"])["x0_hat"]
    )
    generated = LDLMPipeline(tiny_model, tokenizer).generate(2, 8, 1, SEED, "ddim").token_ids
    assert np.array_equal(outputs.reference["end_to_end/token_ids"], generated.numpy())


@pytest.fixture(scope="module")
def saved_case(tiny_model: LDLM) -> ParityInputs:
    return generate_inputs(tiny_model, SEED, EndToEndPlan(SEED, 2, 8, 1, "ddim", False))


def resaved(inputs: ParityInputs, path: Path, **changes: Any) -> ParityInputs:
    """``inputs`` with ``changes``, through a file, as a replay reads them."""
    return read_inputs(save_inputs(dataclasses.replace(inputs, **changes), path))


def test_a_file_of_another_config_is_refused_naming_the_field(tiny_checkpoint: Path, tiny_model: LDLM, tmp_path: Path) -> None:
    other = init_model(dataclasses.replace(tiny_model.config, max_seq_len=96), seed=0)
    plan = EndToEndPlan(SEED, 2, 8, 1, "ddim", False)
    path = save_inputs(generate_inputs(other, SEED, plan), tmp_path / "other.safetensors")
    with pytest.raises(
        ValueError, match=r"made for another config than the checkpoint's \(max_seq_len 96 in the file, 128 in the checkpoint\)"
    ):
        run_parity(tiny_checkpoint, "eager", load_inputs=path)
    check_inputs(read_inputs(path), other)  # the model it was made for takes it


def test_inputs_that_do_not_fit_the_graphs_are_refused_naming_what_differs(
    tiny_model: LDLM, saved_case: ParityInputs, tmp_path: Path
) -> None:
    graphs = saved_case.graphs
    no_denoiser = {g: sets for g, sets in graphs.items() if g != "denoiser"}
    with pytest.raises(ValueError, match="hold the graphs encoder, decoder; allowed: encoder, denoiser, decoder"):
        check_inputs(resaved(saved_case, tmp_path / "a.safetensors", graphs=no_denoiser), tiny_model)
    narrow = {
        **graphs,
        "denoiser": {**graphs["denoiser"], "random": {**graphs["denoiser"]["random"], "x_t": np.zeros((3, 24, 32), np.float32)}},
    }
    with pytest.raises(ValueError, match=r"graphs/denoiser/random/x_t has shape \(3, 24, 32\); allowed: \(batch, seq, 64\)"):
        check_inputs(resaved(saved_case, tmp_path / "b.safetensors", graphs=narrow), tiny_model)
    mask = graphs["decoder"]["padded"]["attention_mask"].astype(np.float32)
    floats = {**graphs, "decoder": {**graphs["decoder"], "padded": {**graphs["decoder"]["padded"], "attention_mask": mask}}}
    with pytest.raises(ValueError, match="graphs/decoder/padded/attention_mask is float32; allowed: int64"):
        check_inputs(resaved(saved_case, tmp_path / "c.safetensors", graphs=floats), tiny_model)
    ids = graphs["encoder"]["random"]["input_ids"].copy()
    ids[0, 0] = tiny_model.config.gpt2_vocab_size
    out_of_vocabulary = {**graphs, "encoder": {**graphs["encoder"], "random": {**graphs["encoder"]["random"], "input_ids": ids}}}
    with pytest.raises(ValueError, match=r"graphs/encoder/random/input_ids holds ids \d+\.\.50257; allowed: 0\.\.50256"):
        check_inputs(resaved(saved_case, tmp_path / "d.safetensors", graphs=out_of_vocabulary), tiny_model)
    with pytest.raises(ValueError, match="seed 7 draws other prior noise here than the file holds"):
        check_inputs(resaved(saved_case, tmp_path / "e.safetensors", noise=saved_case.noise + 1), tiny_model)


def test_a_changed_or_foreign_file_and_a_contradicting_option_are_refused(
    tiny_checkpoint: Path, saved_case: ParityInputs, tmp_path: Path
) -> None:
    path = save_inputs(saved_case, tmp_path / "case.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    (tmp_path / "changed.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="its tensors were changed after it was written"):
        read_inputs(tmp_path / "changed.safetensors")
    with pytest.raises(ValueError, match="model.safetensors has no ldlm parity header"):
        read_inputs(tiny_checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        read_inputs(tiny_checkpoint / "config.json")
    with pytest.raises(ValueError, match="seed=3 disagrees with the parity inputs .* made with seed 7; a replay runs the file's own"):
        run_parity(tiny_checkpoint, "eager", seed=3, load_inputs=path)
    with pytest.raises(ValueError, match="steps=5 disagrees"):
        run_parity(tiny_checkpoint, "eager", steps=5, load_inputs=path)
    with pytest.raises(ValueError, match="case.safetensors' is also load_inputs: the outputs would replace the inputs"):
        run_parity(tiny_checkpoint, "eager", load_inputs=path, save_outputs=tmp_path / "." / "case.safetensors")
    assert read_inputs(path).seed == SEED
    run_parity(tiny_checkpoint, "eager", seed=SEED, steps=1, save_outputs=tmp_path / "out.safetensors", load_inputs=path)
    with pytest.raises(
        ValueError, match="out.safetensors is format ldlm-parity-outputs version 2; allowed: a file written by `ldlm parity --save-inputs`"
    ):
        read_inputs(tmp_path / "out.safetensors")


def edited(path: Path, to: Path, edit: Any) -> Path:
    """``path`` written again at ``to`` with the same tensors and its JSON header changed by ``edit``, its sha256s
    as they were: what a hand edit of the header leaves."""
    header = json.loads(header_of(path)["ldlm_parity"])
    edit(header)
    tensors = safetensors.numpy.load_file(str(path))
    to.write_bytes(safetensors.numpy.save(tensors, metadata={"ldlm_parity": json.dumps(header)}))
    return to


@pytest.mark.parametrize(
    ("field", "edit"),
    [
        ("steps 10 -> 11", lambda h: h["end_to_end"].update(steps=11)),
        ("sampler ddim -> sde", lambda h: h["end_to_end"].update(sampler="sde")),
    ],
)
def test_a_case_whose_header_was_edited_is_refused_on_replay(
    field: str, edit: Any, tiny_checkpoint: Path, tiny_model: LDLM, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The header defines the case (the plan, the seeds, the checkpoint): an edit there is refused as a changed
    tensor is, and the edited case is not run."""
    case = save_inputs(generate_inputs(tiny_model, SEED, EndToEndPlan(SEED, 2, 8, 10, "ddim", False)), tmp_path / "case.safetensors")
    changed = edited(case, tmp_path / "edited.safetensors", edit)
    message = "edited.safetensors: its header was changed after it was written (header_sha256 differs)"
    with pytest.raises(ValueError, match=re.escape(message)):
        read_inputs(changed)
    run = ["parity", str(tiny_checkpoint), "--backend", "eager", "--quiet", "--out", str(tmp_path / "report")]
    assert main([*run, "--load-inputs", str(changed)]) == 2, field
    err = capsys.readouterr().err
    assert message in err and "save the case again (--save-inputs) rather than edit it" in err, err
    assert not (tmp_path / "report").exists()
    assert read_inputs(edited(case, tmp_path / "same.safetensors", lambda h: None)).end_to_end.steps == 10  # rewritten unedited: read


@pytest.mark.parametrize("where", ["first", "last"])
def test_eps_probe_rows_one_ulp_from_their_seeds_are_refused(
    saved_case: ParityInputs, tiny_model: LDLM, tmp_path: Path, where: str
) -> None:
    """The eps probes draw their rows from the seed, so a replay must hold exactly those rows: one value moved by
    its last bit (a file saved with another numpy) is refused, not compared within a tolerance, which would let the
    probes read a LayerNorm on rows the seed never drew."""
    check_inputs(resaved(saved_case, tmp_path / "same.safetensors"), tiny_model)  # the file as saved replays
    size, rows = next(iter(saved_case.probe_rows.items()))
    moved = rows.copy()
    flat = moved.reshape(-1)
    i = 0 if where == "first" else flat.size - 1
    flat[i] = np.nextafter(flat[i], np.inf, dtype=flat.dtype)
    assert not np.array_equal(moved, rows) and np.allclose(moved, rows, atol=1e-6)  # what a tolerant comparison would take
    changed = resaved(saved_case, tmp_path / "moved.safetensors", probe_rows={**saved_case.probe_rows, size: moved})
    with pytest.raises(ValueError, match=f"seed {SEED} draws other eps-probe rows for LayerNorms of {size} values"):
        check_inputs(changed, tiny_model)
