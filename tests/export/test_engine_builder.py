"""TensorRT engines from the tiny export, built with NVIDIA's real parser and builder.

TensorRT-RTX builds engines ahead of time without a GPU, so everything up to the serialized plan
runs here: cast pass, parsing, the network-level LayerNorm check, profiles, build, manifests.
Running a plan needs a GPU; those tests skip and say so.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from ldlm.export.artifact import PlanMismatchError, read_manifest, read_plan_manifest
from ldlm.export.engine_builder import BuildOptions, build_engines, build_plan
from ldlm.export.layernorm.trt_network import axes_mask, check_network_layer_norms, parse_onnx_network
from ldlm.export.layernorm.verify import LayerNormSpec
from ldlm.export.precision import lower_precision
from ldlm.export.profiles import EngineProfile, ShapeRange
from ldlm.export.trt_flavor import EngineBuildError, FlavorError, GpuInfo, load_flavor
from ldlm.serve.runtime.trt_runtime import TensorRTEngine, check_plan_manifest
from tests.artifacts import ENCODER_LN, edited_export, reseal_manifest, set_eps

trt_rtx = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install -e .[rtx]); no engine was built")
SMALL = (EngineProfile(ShapeRange(1, 2, 4), ShapeRange(1, 16, 64)),)


@pytest.fixture(scope="module", params=["fp32", "fp16", "bf16"])
def engines(request, export_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"engines_{request.param}") / "plans"
    build_engines(export_dir, out, BuildOptions(precision=request.param, profiles=SMALL), flavor="tensorrt_rtx")
    return request.param, out


def specs_of(export_dir: Path, graph: str) -> list[LayerNormSpec]:
    return [LayerNormSpec.from_dict(d) for d in read_manifest(export_dir)["graphs"][graph]["layer_norms"]]


def test_plans_and_manifests(engines, export_dir: Path) -> None:
    precision, out = engines
    export_manifest = read_manifest(export_dir)
    for graph in ("encoder", "denoiser", "decoder"):
        plan = out / f"{graph}.plan"
        assert plan.stat().st_size > 10_000
        manifest = read_plan_manifest(plan)
        assert manifest["flavor"] == "tensorrt_rtx" and manifest["trt_version"] == trt_rtx.__version__
        assert manifest["precision"] == precision
        assert manifest["profiles"] == [{"batch": [1, 2, 4], "seq": [1, 16, 64]}]
        assert manifest["build_flags"]["tf32"] is False and manifest["build_flags"]["strongly_typed"] is True
        assert manifest["layer_norms"] == len(export_manifest["graphs"][graph]["layer_norms"])
        assert manifest["source_onnx"]["sha256"] == export_manifest["graphs"][graph]["files"][f"{graph}.onnx"]["sha256"]
        if not torch.cuda.is_available():
            assert manifest["build_host"]["description"] == "AOT, no GPU"
        assert not any("overflow" in w.lower() for w in manifest["warnings"])


def test_typed_variant_keeps_layer_norms_and_io_in_fp32(engines) -> None:
    precision, out = engines
    if precision == "fp32":
        assert not list(out.glob("*.fp32.onnx"))
        return
    model = onnx.load(str(out / f"encoder.{precision}.onnx"))
    low = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[precision]
    types = {i.name: i.data_type for i in model.graph.initializer}
    types.update({v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]})
    layer_norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert len(layer_norms) == 6
    assert all(types[name] == onnx.TensorProto.FLOAT for n in layer_norms for name in n.input)
    matmul_weights = [
        n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in {i.name for i in model.graph.initializer}
    ]
    lowered = [w for w in matmul_weights if types[w] == low]
    # The rest read only value-independent tensors (the first block's latent-bank queries), which stay FP32.
    assert len(lowered) >= 0.8 * len(matmul_weights), (len(lowered), len(matmul_weights))
    assert all(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for o in model.graph.output)
    softmax = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert softmax and all(types[n.input[0]] == onnx.TensorProto.FLOAT for n in softmax)


def test_fp16_variant_stays_close_to_fp32_in_onnx_runtime(export_dir: Path, tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    lower_precision(export_dir / "decoder.onnx", tmp_path / "decoder.fp16.onnx", "fp16")
    feed = {
        "latents": np.random.default_rng(0).standard_normal((2, 12, 64)).astype(np.float32),
        "attention_mask": np.ones((2, 12), dtype=np.int64),
    }
    ids32, logits32 = ort.InferenceSession(str(export_dir / "decoder.onnx")).run(None, feed)
    ids16, logits16 = ort.InferenceSession(str(tmp_path / "decoder.fp16.onnx")).run(None, feed)
    assert logits16.dtype == np.float32
    assert np.abs(logits16 - logits32).max() < 1e-2 * np.abs(logits32).max()
    assert (ids16 == ids32).mean() >= 0.99


def test_network_check_passes_and_rejects_a_modified_eps(export_dir: Path, tmp_path: Path) -> None:
    flavor = load_flavor("tensorrt_rtx")
    specs = specs_of(export_dir, "encoder")
    _, network, _ = parse_onnx_network(flavor, export_dir / "encoder.onnx")
    assert check_network_layer_norms(flavor.trt, network, specs) == []

    modified = edited_export(export_dir, tmp_path / "edited", "encoder", set_eps(ENCODER_LN, 1e-3)) / "encoder.onnx"
    _, network, _ = parse_onnx_network(flavor, modified)
    problems = check_network_layer_norms(flavor.trt, network, specs)
    assert len(problems) == 1 and "epsilon 0.001 != module eps 1e-05" in problems[0], problems
    entry = read_manifest(export_dir)["graphs"]["encoder"]
    with pytest.raises(EngineBuildError, match="LayerNorm check after parsing failed"):
        build_plan(flavor, modified, tmp_path / "encoder.plan", entry, specs, SMALL, BuildOptions())
    assert not (tmp_path / "encoder.plan").exists()


def test_axes_mask() -> None:
    assert axes_mask(-1, 3) == 0b100
    assert axes_mask(-2, 3) == 0b110
    assert axes_mask(2, 3) == 0b100


def test_corrupt_onnx_and_missing_inputs_fail_clearly(export_dir: Path, tmp_path: Path) -> None:
    flavor = load_flavor("tensorrt_rtx")
    garbage = tmp_path / "encoder.onnx"
    garbage.write_bytes(b"\x08\x07garbage that is not a protobuf")
    entry = read_manifest(export_dir)["graphs"]["encoder"]
    with pytest.raises(EngineBuildError, match="TensorRT's ONNX parser rejected .*encoder.onnx"):
        build_plan(flavor, garbage, tmp_path / "x.plan", entry, [], SMALL, BuildOptions())
    with pytest.raises(EngineBuildError, match="does not exist"):
        build_plan(flavor, tmp_path / "missing.onnx", tmp_path / "x.plan", entry, [], SMALL, BuildOptions())
    with pytest.raises(ValueError, match="does not exist; make one with `ldlm export`"):
        build_engines(tmp_path / "nowhere", tmp_path / "out")
    broken = tmp_path / "broken_export"
    shutil.copytree(export_dir, broken)
    (broken / "denoiser.onnx").write_bytes(b"not onnx")
    reseal_manifest(broken, "denoiser")  # past the sha256 check: the loader must name the file
    with pytest.raises(ValueError, match=r"denoiser\.onnx is not a readable ONNX file"):
        build_engines(broken, tmp_path / "out2", graphs=("denoiser",), flavor="tensorrt_rtx")
    assert not (tmp_path / "out2").exists()


def test_bad_profiles_and_options_are_named(export_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"batch profile 4:2:8 is invalid; allowed: 1 <= min <= opt <= max"):
        EngineProfile.parse("batch=4:2:8,seq=1:2:3")
    with pytest.raises(ValueError, match="malformed"):
        EngineProfile.parse("batch=1:2")
    too_long = (EngineProfile(ShapeRange(1, 1, 2), ShapeRange(1, 8, 4096)),)
    with pytest.raises(ValueError, match="seq profile max 4096 is out of range; allowed: <= 128"):
        build_engines(export_dir, tmp_path / "o", BuildOptions(profiles=too_long), flavor="tensorrt_rtx")
    with pytest.raises(ValueError, match="precision='int4'"):
        BuildOptions(precision="int4")
    with pytest.raises(ValueError, match="optimization_level=9"):
        BuildOptions(optimization_level=9)
    with pytest.raises(FlavorError, match="flavor='tensorrt_llm' is unknown"):
        load_flavor("tensorrt_llm")
    assert not (tmp_path / "o").exists()


def test_plan_from_another_version_or_gpu_is_refused(engines) -> None:
    _, out = engines
    manifest = read_plan_manifest(out / "decoder.plan")
    flavor = load_flavor("tensorrt_rtx")
    check_plan_manifest(manifest, flavor, GpuInfo(None, None))  # the same TensorRT: accepted
    older = {**manifest, "trt_version": "1.2.0"}
    with pytest.raises(
        PlanMismatchError,
        match=r"built by tensorrt_rtx 1.2.0, but this process runs tensorrt_rtx .*rebuild it on this machine: ldlm build-engine",
    ):
        check_plan_manifest(older, flavor, GpuInfo(None, None))
    datacenter = {**manifest, "flavor": "tensorrt", "build_host": {"gpu": "NVIDIA H100", "compute_capability": "9.0"}}

    class FakeTensorRT:  # only the version attribute is read; the check is pure manifest logic
        __version__ = "10.13.0"

    other = type(flavor)("tensorrt", FakeTensorRT)  # type: ignore[arg-type]
    datacenter["trt_version"] = "10.13.0"
    with pytest.raises(PlanMismatchError, match=r"built for compute capability 9.0 \(NVIDIA H100\), but this process runs on NVIDIA A100"):
        check_plan_manifest(datacenter, other, GpuInfo("NVIDIA A100", "8.0"))
    with pytest.raises(PlanMismatchError, match="has no manifest"):
        (out / "lonely.plan").write_bytes(b"x")
        read_plan_manifest(out / "lonely.plan")


def test_engine_directory_files_are_checked_against_the_plans(engines, tmp_path: Path) -> None:
    """The plans carry the export's tokenizer and config records; an edited copy beside them (or a
    precision the plans were not built in) is refused before any engine is loaded (so this runs
    without a GPU too)."""
    from ldlm.export.artifact import ArtifactError
    from ldlm.serve.runtime.backends import open_graphs
    from ldlm.serve.runtime.graph_backend import BackendError

    precision, out = engines
    record = read_plan_manifest(out / "encoder.plan")["tokenizer"]
    assert record["sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    copy = tmp_path / "plans"
    shutil.copytree(out, copy)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace('"the"', '"thE"', 1))
    with pytest.raises(ArtifactError, match=r"tokenizer\.json (is \d+ bytes|does not match the sha256) .*encoder\.plan\.json"):
        open_graphs("trt", copy, precision)
    shutil.copy(out / "tokenizer.json", copy / "tokenizer.json")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "t_min": config["t_min"] * 2}))  # a sampler setting edited
    with pytest.raises(ArtifactError, match=r"config\.json does not match the config_sha256 in .*encoder\.plan\.json"):
        open_graphs("trt", copy, precision)
    other = "fp32" if precision != "fp32" else "bf16"
    with pytest.raises(BackendError, match=f"engines in .* are \\['{precision}'\\]; asked for precision='{other}'"):
        open_graphs("trt", out, other)  # refused from the plan manifests, before any engine is loaded


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the engine runs instead (test below)")
def test_running_a_plan_without_a_gpu_says_so(engines) -> None:
    _, out = engines
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        TensorRTEngine(out / "denoiser.plan")


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU: TensorRTEngine's deserialize_cuda_engine, set_input_shape, set_tensor_address, "
    "execute_async_v3 on its own stream, CUDA graphs (torch capture for TensorRT, cuda_graph_strategy for RTX), "
    "batches split beyond the profile, two threads on one engine, raw stream handles and the per-plan RTX "
    "runtime cache were not exercised",
)
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_engine_runs_on_gpu(engines, tiny_model, cuda_graphs: bool) -> None:
    import threading

    precision, out = engines
    engine = TensorRTEngine(out / "denoiser.plan", cuda_graphs=cuda_graphs)
    tolerance = {"fp32": 1e-4, "fp16": 5e-2, "bf16": 1e-1}[precision]

    def check(batch: int, seq: int, seed: int, stream=None) -> None:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, seq, 64, generator=g)
        t = torch.rand(batch, generator=g)
        feed = {"x_t": x, "t": t, "x0_prev": x, "attention_mask": torch.ones(batch, seq, dtype=torch.int64)}
        got = engine.run(feed, stream)["x0_hat"].float().cpu()
        with torch.no_grad():
            expected = tiny_model.denoise(x, t, x)
        assert (got - expected).abs().max().item() <= tolerance * max(1.0, expected.abs().max().item()), (batch, seq)

    check(2, 16, 0)
    check(2, 16, 1)  # a replay, when graphs are on
    check(11, 16, 2)  # beyond the profile's batch 4: chunks 4, 4, 3
    side = torch.cuda.Stream()
    check(3, 8, 3, stream=side.cuda_stream)  # a raw cudaStream_t
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(10):
                check(1 + (seed + i) % 4, 8 + 8 * (i % 2), seed * 100 + i)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert json.loads((out / "denoiser.plan.json").read_text())["precision"] == precision
    engine.close()
    if engine.flavor.is_rtx:
        assert (out / "denoiser.runtime.cache").stat().st_size > 0
        assert not (out / "runtime.cache").exists()


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU: the TensorRT backend's device tensors (run_tensors) and the sampler on the GPU around "
    "TensorRT engines were not exercised",
)
def test_trt_pipeline_samples_on_the_gpu(engines, pipeline) -> None:
    from ldlm.pipeline import LDLMPipeline
    from ldlm.serve.checks.parity_result import TOKEN_AGREEMENT_REQUIRED
    from ldlm.serve.runtime.backends import BackendGraphs, open_graphs

    precision, out = engines
    graphs, config, tokenizer = open_graphs("trt", out, precision)
    assert graphs["denoiser"].device.type == "cuda"
    on_gpu = LDLMPipeline(BackendGraphs(graphs), tokenizer, graphs["denoiser"].device, config=config, noise_device="cpu")
    got = on_gpu.generate(3, 16, 6, 5, "ddim").token_ids.cpu()
    expected = pipeline.generate(3, 16, 6, 5, "ddim").token_ids
    assert (got == expected).float().mean().item() >= TOKEN_AGREEMENT_REQUIRED[precision]
    for graph in graphs.values():
        graph.close()
