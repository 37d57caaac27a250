"""INT8 variants: made beside the fp32 graphs, every LayerNorm still one float32 LayerNormalization with
its module's eps, and every way a quantized artifact can be wrong refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from ldlm.export.artifact import MANIFEST_FILE, ArtifactError, check_artifacts, read_manifest, sha256_file
from ldlm.export.layernorm.verify import LayerNormSpec, node_name_scopes, verify_onnx
from ldlm.export.onnx_export import export_graphs, verify_export
from ldlm.export.quantize import DEFAULT_QUANTIZED_GRAPHS, FLOAT_MODULES, QUANTIZABLE_GRAPHS
from ldlm.serve.checks.eps_probe_artifact import probe_layer_norm_eps
from ldlm.serve.runtime.backends import open_graphs
from ldlm.serve.runtime.graph_backend import BackendError
from tests.artifacts import node_of

DECODER_LN = "model.token_decoder.blocks.0.mlp.norm"


@pytest.fixture
def int8_export(int8_export_dir: Path) -> Path:
    return int8_export_dir


def reseal_variant(directory: Path, graph: str, precision: str = "int8") -> None:
    """The manifest made to agree with an edited variant file, as whoever edits both could."""
    manifest = read_manifest(directory)
    variant = manifest["graphs"][graph]["variants"][precision]
    for name in variant["files"]:
        variant["files"][name] = {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def test_variants_sit_beside_the_fp32_graphs_with_their_own_sha256(int8_export: Path) -> None:
    manifest = read_manifest(int8_export)
    assert QUANTIZABLE_GRAPHS == ("denoiser", "decoder") and DEFAULT_QUANTIZED_GRAPHS == ("denoiser",)
    assert "variants" not in manifest["graphs"]["encoder"]  # GPT-2's outlier channels stay float
    for graph in QUANTIZABLE_GRAPHS:
        entry = manifest["graphs"][graph]
        variant = entry["variants"]["int8"]
        assert variant["file"] == f"{graph}.int8.onnx" and (int8_export / entry["file"]).is_file()
        assert variant["files"][variant["file"]]["sha256"] == sha256_file(int8_export / variant["file"])
        model = onnx.load(str(int8_export / variant["file"]))
        quantized = [n for n in model.graph.node if n.op_type == "MatMulInteger"]
        assert len(quantized) == len(variant["quantized_nodes"]) > 0
        # what stays float: the kept nodes are still float MatMuls, made from the fp32 graph's time embedding or head
        by_name = {n.name: n for n in model.graph.node}
        source = {n.name: n for n in onnx.load(str(int8_export / entry["file"]), load_external_data=False).graph.node}
        for name in variant["kept_float_nodes"]:
            assert by_name[name].op_type == "MatMul"
            origin = source[name.removesuffix("_MatMul")]  # a Gemm is split into <name>_MatMul + <name>_Add
            assert any(scope.endswith(FLOAT_MODULES) for scope in node_name_scopes(origin))
    kept = {n for g in QUANTIZABLE_GRAPHS for n in manifest["graphs"][g]["variants"]["int8"]["kept_float_nodes"]}
    assert len(kept) >= 3  # time_mlp's two Linears, the time projections, the vocabulary head


def test_every_layer_norm_of_the_int8_decoder_is_one_float32_node_with_the_modules_eps(int8_export: Path, tiny_model) -> None:
    model = onnx.load(str(int8_export / "decoder.int8.onnx"))
    nodes = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    spec_names = [d["name"] for d in read_manifest(int8_export)["graphs"]["decoder"]["layer_norms"]]
    assert len(nodes) == len(spec_names) == 6
    for node in nodes:
        eps = next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon")
        assert np.float32(eps) == np.float32(1e-5)
    results = verify_export(int8_export, None)
    assert [r.graph for r in results] == ["encoder", "denoiser", "denoiser.int8", "decoder", "decoder.int8"]
    assert all(r.passed for r in results), [r.summary() for r in results]


def test_onnx_runtimes_default_static_qdq_is_refused_naming_the_node(export_dir: Path, tmp_path: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Latents(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.feeds = iter(
                [{"latents": rng.standard_normal((1, 8, 64)).astype(np.float32), "attention_mask": np.ones((1, 8), np.int64)}]
            )

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    qdq = tmp_path / "decoder.qdq.onnx"
    quantize_static(str(export_dir / "decoder.onnx"), str(qdq), Latents(), quant_format=QuantFormat.QDQ)  # its default op list
    specs = [LayerNormSpec.from_dict(d) for d in read_manifest(export_dir)["graphs"]["decoder"]["layer_norms"]]
    result = verify_onnx(qdq, specs, "decoder", "int8")
    assert not result.passed
    node = node_of(onnx.load(str(qdq)).graph, DECODER_LN)
    assert any(
        p.startswith(f"LayerNormalization {node.name!r}: its scale ") and "comes from DequantizeLinear" in p for p in result.problems
    ), result.problems


def test_a_manifest_claiming_int8_for_an_fp32_file_is_refused(int8_export: Path, tmp_path: Path) -> None:
    out = tmp_path / "onnx"
    shutil.copytree(int8_export, out)
    onnx.save(onnx.load(str(out / "denoiser.onnx")), str(out / "denoiser.int8.onnx"))  # fp32 weights, one file
    reseal_variant(out, "denoiser")
    failed = [r for r in verify_export(out, None) if not r.passed]
    assert [r.graph for r in failed] == ["denoiser.int8"]
    assert any(p.startswith("the manifest says int8, but the graph has no quantized op") for p in failed[0].problems), failed[0].problems


def test_an_eps_resealed_into_the_int8_variant_fails_verification_and_the_probe(
    int8_export: Path, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    out = tmp_path / "onnx"
    shutil.copytree(int8_export, out)
    model = onnx.load(str(out / "decoder.int8.onnx"))
    node = node_of(model.graph, DECODER_LN)
    kept = [a for a in node.attribute if a.name != "epsilon"]
    del node.attribute[:]
    node.attribute.extend([*kept, onnx.helper.make_attribute("epsilon", 1e-6)])
    onnx.save(model, str(out / "decoder.int8.onnx"))
    reseal_variant(out, "decoder")
    failed = [r for r in verify_export(out, None) if not r.passed]
    assert [r.graph for r in failed] == ["decoder.int8"]
    assert any(f"node {node.name!r} (module {DECODER_LN}): epsilon 1e-06 != module eps 1e-05" in p for p in failed[0].problems)
    report = probe_layer_norm_eps(str(tiny_checkpoint), onnx_dir=out)
    failing = [p for p in report.layer_norms if p.problems]
    assert [(p.graph, p.module) for p in failing] == [("decoder.int8", DECODER_LN)]
    assert not report.passed


def test_a_variant_without_its_fp32_sibling_is_refused(int8_export: Path, tmp_path: Path) -> None:
    out = tmp_path / "onnx"
    shutil.copytree(int8_export, out)
    (out / "decoder.onnx").unlink()
    with pytest.raises(
        ArtifactError, match=r"decoder.onnx is missing: the variant\(s\) int8 \(decoder.int8.onnx\) are kept only beside their fp32 sibling"
    ):
        check_artifacts(out, read_manifest(out))


def test_the_int8_backend_runs_the_variants_close_to_fp32(int8_export: Path) -> None:
    fp32, _, _ = open_graphs("ort", int8_export)
    int8, _, _ = open_graphs("ort", int8_export, "int8")
    assert {g: b.precision for g, b in int8.items()} == {"encoder": "fp32", "denoiser": "int8", "decoder": "int8"}
    rng = np.random.default_rng(0)
    feed = {
        "x_t": rng.standard_normal((2, 16, 64)).astype(np.float32),
        "t": np.array([0.3, 0.9], np.float32),
        "x0_prev": rng.standard_normal((2, 16, 64)).astype(np.float32),
        "attention_mask": np.ones((2, 16), np.int64),
    }
    a, b = fp32["denoiser"].run(feed)["x0_hat"], int8["denoiser"].run(feed)["x0_hat"]
    cosine = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert cosine > 0.999 and np.abs(a - b).max() > 1e-3  # another computation (int8 weights), in the same direction


def test_int8_where_there_is_no_int8_path_is_refused(export_dir: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(
        BackendError, match="has no int8 variants .exported without --quantize.; re-export with `ldlm export CKPT OUT --quantize int8`"
    ):
        open_graphs("ort", export_dir, "int8")
    with pytest.raises(BackendError, match="backend 'eager' cannot run precision='int8'"):
        open_graphs("eager", tiny_checkpoint, "int8")
    with pytest.raises(ValueError, match="quantize='int4' is unknown; allowed: int8"):
        export_graphs(tiny_checkpoint, tmp_path / "out", quantize="int4")
    with pytest.raises(ValueError, match=r"quantize_graphs=\['encoder'\] is invalid; allowed: a non-empty subset of denoiser, decoder"):
        export_graphs(tiny_checkpoint, tmp_path / "out", quantize="int8", quantize_graphs=("encoder",))
    with pytest.raises(ValueError, match=r"min_cosine=1\.5 is out of range; allowed: 0\.\.1 \(0: no accuracy floor\)"):
        export_graphs(tiny_checkpoint, tmp_path / "out", quantize="int8", min_cosine=1.5)
    assert not (tmp_path / "out").exists()


def test_a_failed_quantization_leaves_no_partial_export(tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ldlm.export.onnx_export as onnx_export

    def broken(src: object, dst: object, *rest: object) -> None:
        raise RuntimeError("quantizer crashed")

    monkeypatch.setattr(onnx_export, "quantize_int8", broken)
    with pytest.raises(RuntimeError, match="quantizer crashed"):
        export_graphs(tiny_checkpoint, tmp_path / "out", quantize="int8")
    assert list(tmp_path.iterdir()) == []


def test_an_edited_variant_file_is_refused_by_its_sha256(int8_export: Path, tmp_path: Path) -> None:
    out = tmp_path / "onnx"
    shutil.copytree(int8_export, out)
    data = bytearray((out / "denoiser.int8.onnx").read_bytes())
    data[-10] ^= 0x01
    (out / "denoiser.int8.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"denoiser.int8.onnx does not match the sha256 in .*manifest.json \(edited or replaced\)"):
        check_artifacts(out, read_manifest(out))


def test_a_layer_norm_computing_in_fp16_is_named_and_fp64_is_allowed() -> None:
    from onnx import TensorProto, helper

    from ldlm.export.layernorm.verify_quantized import check_quantized_layer_norms

    def one_node(dtype: int) -> onnx.ModelProto:
        node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], name="ln", axis=-1, epsilon=1e-5)
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("x", dtype, [2, 4])],
            [helper.make_tensor_value_info("y", dtype, [2, 4])],
            [helper.make_tensor("scale", dtype, [4], [1.0] * 4), helper.make_tensor("bias", dtype, [4], [0.0] * 4)],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    problems = check_quantized_layer_norms(one_node(TensorProto.FLOAT16))
    assert "LayerNormalization 'ln': its X 'x' is FLOAT16; a LayerNorm computes in float32 (or float64)" in problems
    assert "LayerNormalization 'ln': its output is FLOAT16; a LayerNorm computes in float32 (or float64)" in problems
    assert check_quantized_layer_norms(one_node(TensorProto.DOUBLE)) == check_quantized_layer_norms(one_node(TensorProto.FLOAT)) == []


# --- the accuracy floor: nodes whose quantization would break it stay float ---


@pytest.fixture(scope="module")
def floor_feeds(pipeline) -> list[dict[str, np.ndarray]]:
    """The tiny denoiser's inputs along the default sampler's trajectory (what the exporter's floor uses)."""
    from ldlm.export.calibration import CalibrationSettings, denoiser_feeds

    return denoiser_feeds(pipeline, CalibrationSettings(samples=4, length=32))[0]


def worst_cosine_by_hand(fp32: Path, variant: Path, feeds: list[dict[str, np.ndarray]]) -> float:
    """The variant's worst per-sample cosine against fp32, computed here with NumPy on ONNX Runtime's outputs."""
    import onnxruntime as ort

    a = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(variant), providers=["CPUExecutionProvider"])
    worst = 1.0
    for feed in feeds:
        x, y = (s.run(None, feed)[0].reshape(len(feed["t"]), -1).astype(np.float64) for s in (a, b))
        worst = min(worst, float(((x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)).min()))
    return worst


def test_a_floor_the_whole_graph_misses_keeps_its_most_harmful_nodes_float(export_dir: Path, floor_feeds, tmp_path: Path) -> None:
    from ldlm.export.quantize import AccuracyFloor, float_kept_nodes, quantize_int8, weight_nodes

    fp32 = export_dir / "denoiser.onnx"
    whole = quantize_int8(fp32, tmp_path / "whole.onnx")
    whole_cosine = worst_cosine_by_hand(fp32, tmp_path / "whole.onnx", floor_feeds)
    source = onnx.load(str(fp32), load_external_data=False)
    candidates = [n for n in weight_nodes(source) if n not in float_kept_nodes(source)]
    assert len(whole.quantized) == len(candidates) and whole_cosine < 1.0

    floor = 1.0 - (1.0 - whole_cosine) / 4  # four times tighter than the whole int8 graph reaches
    report = quantize_int8(fp32, tmp_path / "floored.onnx", AccuracyFloor(floor_feeds, floor))
    measured = worst_cosine_by_hand(fp32, tmp_path / "floored.onnx", floor_feeds)
    assert measured >= floor and report.worst_cosine == pytest.approx(measured, abs=1e-6)
    assert 0 < len(report.quantized) < len(candidates)
    assert sorted(report.quantized + report.kept_for_accuracy) == sorted(candidates)
    assert set(report.node_errors) == set(candidates)
    # the nodes kept float are the ones that cost most when quantized alone
    assert max(report.node_errors[n] for n in report.quantized) <= min(report.node_errors[n] for n in report.kept_for_accuracy)


def test_a_floor_the_whole_graph_meets_quantizes_every_weight_node(export_dir: Path, floor_feeds, tmp_path: Path) -> None:
    from ldlm.export.quantize import AccuracyFloor, quantize_int8

    fp32 = export_dir / "denoiser.onnx"
    plain = quantize_int8(fp32, tmp_path / "plain.onnx")
    report = quantize_int8(fp32, tmp_path / "floored.onnx", AccuracyFloor(floor_feeds, 0.99))
    assert report.quantized == plain.quantized and report.kept_for_accuracy == [] and report.node_errors == {}
    assert report.worst_cosine == pytest.approx(worst_cosine_by_hand(fp32, tmp_path / "floored.onnx", floor_feeds), abs=1e-6)


def test_the_exported_int8_denoiser_records_its_floor(int8_export: Path) -> None:
    floor = read_manifest(int8_export)["graphs"]["denoiser"]["variants"]["int8"]["accuracy_floor"]
    assert floor["min_cosine"] == 0.9999 and floor["worst_cosine"] >= floor["min_cosine"]
    assert "decoder" not in {
        g for g, e in read_manifest(int8_export)["graphs"].items() if "accuracy_floor" in e.get("variants", {}).get("int8", {})
    }


def test_the_cli_states_the_exporters_default_floor() -> None:
    from ldlm.cli.artifacts import MIN_COSINE_DEFAULT_TEXT
    from ldlm.export.quantize import DEFAULT_MIN_COSINE

    assert float(MIN_COSINE_DEFAULT_TEXT) == DEFAULT_MIN_COSINE


@pytest.mark.parametrize("min_cosine", [-0.1, 1.5])
def test_a_floor_out_of_range_is_refused(min_cosine: float) -> None:
    from ldlm.export.quantize import AccuracyFloor, QuantizeError

    with pytest.raises(QuantizeError, match=rf"min_cosine={min_cosine} is out of range; allowed: 0\.\.1"):
        AccuracyFloor([{"x": np.zeros(1)}], min_cosine)
    with pytest.raises(QuantizeError, match="an accuracy floor without feeds; allowed: at least one feed"):
        AccuracyFloor([], 0.9999)
