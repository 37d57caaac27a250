"""Triton model repository: configs validated by tritonclient's schema, and the ldlm_generate
BLS loop run against an in-process stand-in for Triton's Python backend."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from ldlm.export.artifact import ArtifactError
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.deploy.triton_repo import RepositoryError, docker_run_line, inspect_source, validate_config, write_triton_repo
from tests import REPO

pytest.importorskip("tritonclient.grpc", reason="the model_config schema ships with tritonclient[grpc]")


@pytest.fixture(scope="module")
def repo(export_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_triton_repo(export_dir, tmp_path_factory.mktemp("triton") / "repo", gpu=False, max_n=8)


def test_layout_and_configs_validate(repo: Path, export_dir: Path) -> None:
    assert sorted(p.name for p in repo.iterdir()) == [".ldlm-output.json", "decoder", "denoiser", "encoder", "ldlm_generate"]
    assert (repo / "encoder" / "1" / "model.onnx" / "model.onnx").is_file()  # external data: a directory
    assert (repo / "encoder" / "1" / "model.onnx" / "encoder.onnx.data").is_file()
    _, graphs = inspect_source(export_dir)
    for name in ("encoder", "denoiser", "decoder"):
        config = validate_config((repo / name / "config.pbtxt").read_text(), graphs[name], name)
        assert config.platform == "onnxruntime_onnx" and config.max_batch_size == 32
        assert list(config.dynamic_batching.preferred_batch_size) == [8]
        assert config.instance_group[0].kind == config.instance_group[0].KIND_CPU
        assert len(config.model_warmup) == 1
    denoiser = validate_config((repo / "denoiser" / "config.pbtxt").read_text(), graphs["denoiser"], "denoiser")
    t = next(i for i in denoiser.input if i.name == "t")
    assert list(t.dims) == [1] and list(t.reshape.shape) == []
    generate = validate_config((repo / "ldlm_generate" / "config.pbtxt").read_text(), None, "ldlm_generate")
    assert generate.backend == "python" and {i.name for i in generate.input} >= {"N", "LENGTH", "STEPS", "SEED", "SAMPLER"}


def test_a_config_that_disagrees_with_the_graph_is_rejected(repo: Path, export_dir: Path) -> None:
    _, graphs = inspect_source(export_dir)
    text = (repo / "decoder" / "config.pbtxt").read_text().replace("dims: [ -1, 64 ]", "dims: [ -1, 65 ]", 1)
    with pytest.raises(RepositoryError, match="input latents is"):
        validate_config(text, graphs["decoder"], "decoder")
    with pytest.raises(RepositoryError, match="does not parse"):
        validate_config("name: [broken", graphs["decoder"], "decoder")


def test_repository_from_engines_with_cc_plans(export_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorrt_rtx", reason="engines are built with TensorRT-RTX")
    from ldlm.export.engine_builder import BuildOptions, build_engines
    from ldlm.export.profiles import EngineProfile, ShapeRange

    profiles = (EngineProfile(ShapeRange(1, 1, 4), ShapeRange(1, 16, 64)), EngineProfile(ShapeRange(4, 16, 32), ShapeRange(1, 16, 64)))
    engines = build_engines(export_dir, tmp_path / "engines", BuildOptions(profiles=profiles), flavor="tensorrt_rtx").out
    repo = write_triton_repo(engines, tmp_path / "repo", cc_plans={"8.9": engines})
    _, graphs = inspect_source(engines)
    config = validate_config((repo / "encoder" / "config.pbtxt").read_text(), graphs["encoder"], "encoder")
    assert config.platform == "tensorrt_plan" and list(config.dynamic_batching.preferred_batch_size) == [1, 16]
    wide = write_triton_repo(engines, tmp_path / "wide", max_batch=64)
    config = validate_config((wide / "encoder" / "config.pbtxt").read_text(), graphs["encoder"], "encoder")
    assert config.max_batch_size == 32  # capped at the profiles' largest batch: Triton refuses a plan that cannot take 64
    narrow = write_triton_repo(engines, tmp_path / "narrow", max_batch=8)
    config = validate_config((narrow / "encoder" / "config.pbtxt").read_text(), graphs["encoder"], "encoder")
    assert config.max_batch_size == 8 and list(config.dynamic_batching.preferred_batch_size) == [1]
    config = validate_config((repo / "encoder" / "config.pbtxt").read_text(), graphs["encoder"], "encoder")
    assert dict(config.cc_model_filenames) == {"8.9": "model_8.9.plan"}
    assert (repo / "encoder" / "1" / "model.plan").is_file() and (repo / "encoder" / "1" / "model_8.9.plan").is_file()
    edited = tmp_path / "edited"
    shutil.copytree(engines, edited)
    data = bytearray((edited / "decoder.plan").read_bytes())
    data[len(data) // 2] ^= 0x01
    (edited / "decoder.plan").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"decoder\.plan does not match the sha256 in .*edited/decoder\.plan\.json"):
        write_triton_repo(engines, tmp_path / "r-cc", cc_plans={"8.9": edited})  # an extra plan is checked too
    with pytest.raises(ArtifactError, match=r"decoder\.plan does not match the sha256"):
        write_triton_repo(edited, tmp_path / "r-edited")
    assert not (tmp_path / "r-cc").exists() and not (tmp_path / "r-edited").exists()


def test_bad_sources_and_existing_output(export_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(RepositoryError, match="empty of models"):
        write_triton_repo(tmp_path / "empty", tmp_path / "r1")
    mixed = tmp_path / "mixed"
    shutil.copytree(export_dir, mixed)
    (mixed / "encoder.plan").write_bytes(b"plan")
    with pytest.raises(RepositoryError, match="mixed"):
        write_triton_repo(mixed, tmp_path / "r2")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        write_triton_repo(export_dir, tmp_path / "taken")
    edited = tmp_path / "edited"
    shutil.copytree(export_dir, edited)
    (edited / "tokenizer.json").write_text((edited / "tokenizer.json").read_text().replace('"the"', '"thE"', 1))
    with pytest.raises(ArtifactError, match=r"tokenizer\.json (is \d+ bytes|does not match the sha256)"):
        write_triton_repo(edited, tmp_path / "r3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited", "empty", "mixed", "taken"]


def test_generate_model_refuses_a_tokenizer_edited_in_the_repository(repo: Path, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("onnxruntime", reason="the stand-in BLS loads the repository's ONNX models")
    assert (
        read_config(repo, "ldlm_generate").parameters["tokenizer_sha256"].string_value
        == hashlib.sha256((repo / "ldlm_generate" / "1" / "tokenizer.json").read_bytes()).hexdigest()
    )
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    tokenizer = copy / "ldlm_generate" / "1" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"the"', '"thE"', 1))
    with pytest.raises(RuntimeError, match="config.pbtxt's tokenizer_sha256 is [0-9a-f]{64}; rewrite the repository"):
        load_generate_model(copy, monkeypatch)


def read_config(repo: Path, model: str):
    """A generated config.pbtxt, parsed with tritonclient's model_config schema, as Triton reads it."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


class StandInPbUtils(types.ModuleType):
    """The slice of triton_python_backend_utils that ldlm_generate uses; BLS runs the repository's
    own ONNX models in ONNX Runtime, the way Triton's onnxruntime backend would. Like Triton, a BLS
    input must have the shape its generated config.pbtxt declares ([batch] + dims), and reaches the
    model after the config's reshape."""

    def __init__(self, repo: Path) -> None:
        super().__init__("triton_python_backend_utils")
        from ldlm.serve.runtime.ort_backend import OrtBackend

        config = json.loads((repo / "ldlm_generate" / "1" / "config.json").read_text())
        self.models = {
            name: OrtBackend(repo / name / "1" / "model.onnx" / "model.onnx", name, config["max_seq_len"])
            for name in ("encoder", "denoiser", "decoder")
        }
        self.configs = {name: read_config(repo, name) for name in ("encoder", "denoiser", "decoder")}
        self.bls_calls = 0
        utils = self

        class Tensor:
            def __init__(self, name: str, array: np.ndarray) -> None:
                self._name, self._array = name, array

            def name(self) -> str:
                return self._name

            def as_numpy(self) -> np.ndarray:
                return self._array

        class TritonError:
            INTERNAL, INVALID_ARG = "INTERNAL", "INVALID_ARG"  # the Python backend's codes (strings here)

            def __init__(self, message: str, code: str = INTERNAL) -> None:
                self._message = message

            def message(self) -> str:
                return self._message

        class InferenceResponse:
            def __init__(self, output_tensors=None, error=None) -> None:
                self.output_tensors, self._error = output_tensors or [], error

            def has_error(self) -> bool:
                return self._error is not None

            def error(self):
                return self._error

        class InferenceRequest:
            def __init__(self, model_name: str, inputs, requested_output_names) -> None:
                self.model_name, self.inputs, self.requested = model_name, inputs, requested_output_names

            def exec(self):
                utils.bls_calls += 1
                config = utils.configs[self.model_name]
                declared = {i.name: i for i in config.input}
                feed = {}
                for tensor in self.inputs:
                    spec, shape = declared[tensor.name()], list(tensor.as_numpy().shape)
                    dims = list(spec.dims)
                    if (
                        len(shape) != 1 + len(dims)
                        or not 1 <= shape[0] <= config.max_batch_size
                        or any(d != -1 and d != s for d, s in zip(dims, shape[1:]))
                    ):
                        return InferenceResponse(
                            error=TritonError(
                                f"unexpected shape for input '{tensor.name()}' for model '{self.model_name}'. "
                                f"Expected [-1,{','.join(map(str, dims))}], got {shape}"
                            )
                        )
                    model_shape = [shape[0], *spec.reshape.shape] if spec.HasField("reshape") else shape
                    feed[tensor.name()] = tensor.as_numpy().reshape(model_shape)
                try:
                    outputs = utils.models[self.model_name].run(feed)
                except Exception as error:
                    return InferenceResponse(error=TritonError(str(error)))
                return InferenceResponse([Tensor(n, outputs[n]) for n in self.requested])

        self.Tensor, self.TritonError, self.InferenceResponse, self.InferenceRequest = (
            Tensor,
            TritonError,
            InferenceResponse,
            InferenceRequest,
        )

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return next((t for t in request.inputs if t.name() == name), None)

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return next((t for t in response.output_tensors if t.name() == name), None)


def load_generate_model(repo: Path, monkeypatch) -> tuple[object, StandInPbUtils]:
    stand_in = StandInPbUtils(repo)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    spec = importlib.util.spec_from_file_location("ldlm_generate_model", repo / "ldlm_generate" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    # Triton hands the model its own config.pbtxt as JSON.
    from google.protobuf import json_format

    model_config = json_format.MessageToJson(read_config(repo, "ldlm_generate"), preserving_proto_field_name=True)
    model.initialize({"model_repository": str(repo / "ldlm_generate"), "model_version": "1", "model_config": model_config})
    return model, stand_in


def request(pb, **values):
    tensors = []
    for name, value in values.items():
        array = (
            np.array([value.encode()], dtype=np.object_)
            if isinstance(value, str)
            else np.array([value], dtype=np.float32 if isinstance(value, float) else np.int64)
        )
        tensors.append(pb.Tensor(name, array))
    return types.SimpleNamespace(inputs=tensors)


@pytest.mark.parametrize("sampler", ["ddim", "sde"])
def test_generate_loop_gives_the_runners_tokens(repo: Path, pipeline: LDLMPipeline, monkeypatch, sampler: str) -> None:
    pytest.importorskip("onnxruntime", reason="the stand-in BLS runs the repository's ONNX models")
    model, pb = load_generate_model(repo, monkeypatch)
    requests = [
        request(pb, N=2, LENGTH=12, STEPS=4, SEED=3, SAMPLER=sampler),
        request(pb, N=100, LENGTH=12, STEPS=4),
        request(pb, N=1, LENGTH=7, STEPS=3, SEED=9, SAMPLER=sampler, T_MIN=0.1),
        request(pb, N=2, LENGTH=12, STEPS=4, SEED=3, SAMPLER=sampler, PRIOR_TEMPERATURE=0.5),
    ]
    first, bad, third, cooled = model.execute(requests)
    assert not first.has_error() and not third.has_error()
    assert bad.has_error() and "N=100 is out of range; allowed: 1..8" in bad.error().message()
    tokens = pb.get_output_tensor_by_name(first, "TOKEN_IDS").as_numpy()
    expected = pipeline.generate(2, 12, 4, 3, sampler)
    np.testing.assert_array_equal(tokens, expected.token_ids.numpy())
    texts = [t.decode() for t in pb.get_output_tensor_by_name(first, "TEXTS").as_numpy()]
    assert texts == expected.texts
    third_tokens = pb.get_output_tensor_by_name(third, "TOKEN_IDS").as_numpy()
    assert torch.equal(torch.from_numpy(third_tokens), pipeline.generate(1, 7, 3, 9, sampler, t_min=0.1).token_ids)
    cooled_tokens = torch.from_numpy(pb.get_output_tensor_by_name(cooled, "TOKEN_IDS").as_numpy())
    assert torch.equal(cooled_tokens, pipeline.generate(2, 12, 4, 3, sampler, prior_temperature=0.5).token_ids)
    assert not torch.equal(cooled_tokens, expected.token_ids)  # the temperature reached the prior
    assert pb.bls_calls == (4 + 1) + (3 + 1) + (4 + 1)  # one denoiser call per step, one decoder call per request


def test_generate_runs_n_above_max_batch_in_chunks_and_bounds_steps(
    export_dir: Path, tmp_path: Path, pipeline: LDLMPipeline, monkeypatch
) -> None:
    """N above the denoiser's max_batch_size runs in BLS calls of at most that many samples (Triton
    refuses larger ones; the stand-in too), with the runner's tokens; STEPS is bounded by max_steps."""
    pytest.importorskip("onnxruntime", reason="the stand-in BLS runs the repository's ONNX models")
    repo = write_triton_repo(export_dir, tmp_path / "repo", gpu=False, max_batch=2, max_n=8, max_steps=5)
    parameters = read_config(repo, "ldlm_generate").parameters
    assert {k: parameters[k].string_value for k in ("max_n", "max_steps", "bls_max_batch")} == {
        "max_n": "8",
        "max_steps": "5",
        "bls_max_batch": "2",
    }
    model, pb = load_generate_model(repo, monkeypatch)
    five, too_many_steps = model.execute([request(pb, N=5, LENGTH=9, STEPS=3, SEED=2, SAMPLER="sde"), request(pb, N=1, LENGTH=9, STEPS=6)])
    assert not five.has_error(), five.error().message()
    tokens = pb.get_output_tensor_by_name(five, "TOKEN_IDS").as_numpy()
    np.testing.assert_array_equal(tokens, pipeline.generate(5, 9, 3, 2, "sde").token_ids.numpy())
    assert pb.bls_calls == 3 * (3 + 1)  # chunks of 2, 2 and 1 samples: per step, and for the decoder
    assert too_many_steps.has_error() and "STEPS=6 is out of range; allowed: 1..5" in too_many_steps.error().message()
    with pytest.raises(RepositoryError, match="max_steps=0 is out of range; allowed: 1..1048576"):
        write_triton_repo(export_dir, tmp_path / "r-steps", gpu=False, max_steps=0)


def test_python_graph_backend_differs_from_native_only_in_backend_line_and_model_file(
    repo: Path, export_dir: Path, tmp_path: Path, capsys
) -> None:
    """`--graph-backend python`: each graph's config.pbtxt is the native one with `backend: "python"` for the
    platform line; its version folder gains model.py (serve/deploy/triton_onnx_model.py) beside the same files."""
    from ldlm.cli import main

    out = tmp_path / "python"
    assert main(["triton-repo", str(export_dir), str(out), "--cpu", "--max-n", "8", "--graph-backend", "python"]) in (0, None)
    assert "python -P -m ldlm.serve.deploy.triton_local serve" in capsys.readouterr().out
    source = Path(importlib.util.find_spec("ldlm.serve.deploy.triton_onnx_model").origin).read_bytes()
    for name in ("encoder", "denoiser", "decoder"):
        native = (repo / name / "config.pbtxt").read_text().splitlines()
        python = (out / name / "config.pbtxt").read_text().splitlines()
        assert native[1] == 'platform: "onnxruntime_onnx"' and python[1] == 'backend: "python"'
        assert python[:1] + python[2:] == native[:1] + native[2:], name
        files = sorted(str(p.relative_to(out / name)) for p in (out / name).rglob("*"))
        assert files == sorted([*(str(p.relative_to(repo / name)) for p in (repo / name).rglob("*")), "1/model.py"])
        assert (out / name / "1" / "model.py").read_bytes() == source
    assert (out / "ldlm_generate" / "config.pbtxt").read_text() == (repo / "ldlm_generate" / "config.pbtxt").read_text()


def test_python_graph_backend_refuses_plans_and_unknown_names(export_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match="graph_backend='onnx' is unknown; allowed: native, python"):
        write_triton_repo(export_dir, tmp_path / "r1", graph_backend="onnx")
    engines = tmp_path / "engines"  # an engine directory's layout; refused before any plan is read
    engines.mkdir()
    for graph in ("encoder", "denoiser", "decoder"):
        (engines / f"{graph}.plan").write_bytes(b"plan")
        (engines / f"{graph}.plan.json").write_text(
            json.dumps({"flavor": "tensorrt", "trt_version": "10.0", "precision": "fp32", "inputs": [], "outputs": [], "profiles": []})
        )
    with pytest.raises(
        RepositoryError, match="graph_backend='python' runs ONNX Runtime on an export's .onnx, but .*engines holds TensorRT plans"
    ):
        write_triton_repo(engines, tmp_path / "r2", graph_backend="python")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines"]


def test_an_int8_repository_carries_the_exports_variants_and_names_each_models_precision(
    int8_export_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """precision int8: each graph's model file is its INT8 variant where the export has one (by the
    manifest's sha256), each config says which, and ldlm_generate over them gives the tokens of the
    project's own ONNX Runtime int8 runner."""
    pytest.importorskip("onnxruntime", reason="the stand-in BLS and the reference runner run ONNX Runtime")
    from ldlm.serve.runtime.backends import BackendGraphs, open_graphs

    repo = write_triton_repo(int8_export_dir, tmp_path / "repo", gpu=False, max_n=8, precision="int8")
    graphs = json.loads((int8_export_dir / "manifest.json").read_text())["graphs"]
    for graph, entry in graphs.items():
        variant = entry.get("variants", {}).get("int8")
        source = variant or entry
        served = hashlib.sha256((repo / graph / "1" / "model.onnx" / "model.onnx").read_bytes()).hexdigest()
        assert served == source["files"][source["file"]]["sha256"], graph
        assert read_config(repo, graph).parameters["precision"].string_value == ("int8" if variant else "fp32"), graph
    assert read_config(repo, "ldlm_generate").parameters["graph_precisions"].string_value == "encoder=fp32,denoiser=int8,decoder=int8"
    model, pb = load_generate_model(repo, monkeypatch)
    (result,) = model.execute([request(pb, N=2, LENGTH=12, STEPS=4, SEED=3, SAMPLER="ddim")])
    assert not result.has_error(), result.error().message()
    backends, config, tokenizer = open_graphs("ort", int8_export_dir, "int8")
    expected = LDLMPipeline(BackendGraphs(backends), tokenizer, config=config).generate(2, 12, 4, 3, "ddim").token_ids
    np.testing.assert_array_equal(pb.get_output_tensor_by_name(result, "TOKEN_IDS").as_numpy(), expected.numpy())


def test_precision_is_refused_where_the_source_has_none_of_it(export_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(
        RepositoryError,
        match=r"has no int8 variants \(exported without --quantize\); re-export with `ldlm export CKPT OUT --quantize int8`",
    ):
        write_triton_repo(export_dir, tmp_path / "r-int8", precision="int8")
    with pytest.raises(RepositoryError, match="precision='fp8' is unknown; allowed: fp32, int8"):
        write_triton_repo(export_dir, tmp_path / "r-fp8", precision="fp8")
    engines = tmp_path / "engines"  # an fp16 build's layout: the precision check comes before any plan is read
    engines.mkdir()
    for graph in ("encoder", "denoiser", "decoder"):
        (engines / f"{graph}.plan").write_bytes(b"plan")
        (engines / f"{graph}.plan.json").write_text(json.dumps({"flavor": "tensorrt_rtx", "trt_version": "1.0", "precision": "fp16"}))
    with pytest.raises(RepositoryError, match="holds fp16 plans, not int8: a plan keeps the precision it was built in; build int8 engines"):
        write_triton_repo(engines, tmp_path / "r-plans", precision="int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines"]


def test_the_docs_run_line_is_the_one_the_repository_prints() -> None:
    """docs/scale-out.md's `docker run` (the wheel mounted and installed before tritonserver starts, since
    ldlm_generate imports ldlm) is docker_run_line's, word for word; KIND_CPU repositories ask for no GPU."""
    text = (REPO / "docs" / "scale-out.md").read_text()
    block = text[text.index("## Run it") :].split("```bash\n", 1)[1].split("```", 1)[0]
    documented = next(line for line in block.replace("\\\n  ", "").splitlines() if line.startswith("docker run"))
    assert documented == docker_run_line("$PWD/runs/triton", "$PWD/dist")
    assert "pip install /wheels/ldlm-*.whl && tritonserver --model-repository=/models" in documented
    assert docker_run_line("/r", "/w", gpu=False).startswith("docker run --rm -p8000:8000") and "--gpus" not in docker_run_line(
        "/r", "/w", False
    )
