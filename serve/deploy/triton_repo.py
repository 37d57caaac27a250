"""Scale-out stage: an export or engine directory -> a Triton Inference Server model repository.

OUT/
  encoder/config.pbtxt, encoder/1/model.plan            (tensorrt_plan, where engines exist)
  encoder/1/model.onnx/{model.onnx, encoder.onnx.data}  (onnxruntime_onnx: external data needs a directory)
  denoiser/..., decoder/...
  ldlm_generate/config.pbtxt, ldlm_generate/1/{model.py, config.json, tokenizer.json[, schedules.json]}   (python backend, BLS)

With ``graph_backend="python"`` (an ONNX export only) each graph model is a Python-backend model:
the same config with ``backend: "python"`` in place of the platform line, and ``<graph>/1/model.py``
(serve/deploy/triton_onnx_model.py, ONNX Runtime) beside the same ``model.onnx/`` folder. For a
Triton without the ONNX Runtime backend, such as nvidia-pytriton's (ldlm.serve.deploy.triton_local).

``precision="int8"`` takes an export's INT8 variants (``ldlm export --quantize int8``) where it has
them; each config.pbtxt names its model's precision in a ``precision`` parameter, and ldlm_generate's
lists all three (``graph_precisions``).

Every config.pbtxt is parsed with the ``model_config`` protobuf schema that tritonclient ships and
checked against the graph's own I/O names, dtypes and dims before the repository is renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from ldlm.export.artifact import MANIFEST_FILE, check_artifacts, check_engine_dir, read_schedules, sha256_file
from ldlm.export.graphs import GRAPH_NAMES
from ldlm.files import atomic_directory, command_writer, refuse_existing
from ldlm.limits import MAX_N, MAX_STEPS, SETTINGS
from ldlm.model.checkpoint import CONFIG_FILE
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TOKENIZER_FILE
from ldlm.sampling.tuned_grids import SCHEDULES_FILE
from ldlm.serve.api.kserve import KSERVE_NAMES
from ldlm.serve.api.kserve_models import GENERATE_MODEL, as_message, config_type, triton_dims
from ldlm.serve.api.kserve_models import generate_config as served_generate_config

GRAPH_BACKENDS = ("native", "python")  # native: tensorrt_plan / onnxruntime_onnx; python: triton_onnx_model.py
PRECISIONS = ("fp32", "int8")  # an export's graphs as exported, or its INT8 variants where it has them
# The Python-backend models copied in as model.py: files beside this one, never imported here (they need Triton's pb_utils).
MODEL_FILES = {"generate": Path(__file__).with_name("triton_generate.py"), "graph": Path(__file__).with_name("triton_onnx_model.py")}


class RepositoryError(ValueError):
    """An input directory or generated config that cannot make a valid repository."""


def load_model_config_schema() -> Any:
    """tritonclient's ``ModelConfig`` protobuf class (its grpc package ships the schema)."""
    try:
        from tritonclient.grpc import model_config_pb2  # optional (the [triton] extra)
    except Exception as error:  # ImportError, or tritonclient's RuntimeError without grpc support
        raise RepositoryError(
            f"validating config.pbtxt needs tritonclient's model_config schema: pip install 'tritonclient[grpc]' ({error})"
        ) from error
    return model_config_pb2.ModelConfig


def inspect_source(source: Path, precision: str = "fp32") -> tuple[str, dict[str, dict[str, Any]]]:
    """('plan' | 'onnx', {graph: I/O + files + precision}) for an engine or export directory; refuses
    empty or mixed ones. ``precision`` int8 takes an export's INT8 variant of each graph that has one;
    plans carry the precision they were built in, which must be the one asked for."""
    if precision not in PRECISIONS:
        raise RepositoryError(f"precision={precision!r} is unknown; allowed: {', '.join(PRECISIONS)}")
    if not source.is_dir():
        raise RepositoryError(f"{source} is not a directory; allowed: an `ldlm export` or `ldlm build-engine` directory")
    plans = sorted(p.name for p in source.glob("*.plan"))
    manifest_path = source / "manifest.json"
    if plans:
        missing = [g for g in GRAPH_NAMES if not (source / f"{g}.plan").is_file() or not (source / f"{g}.plan.json").is_file()]
        if missing:
            raise RepositoryError(
                f"{source} is mixed: it has plans ({', '.join(plans)}) but none, or no manifest, for {', '.join(missing)}"
            )
        manifests = {g: json.loads((source / f"{g}.plan.json").read_text()) for g in GRAPH_NAMES}
        builds = {(m["flavor"], m["trt_version"], m["precision"]) for m in manifests.values()}
        if len(builds) != 1:
            raise RepositoryError(f"{source} is mixed: its plans come from different builds {sorted(builds)}")
        built = next(iter(builds))[2]
        if precision != "fp32" and built != precision:
            raise RepositoryError(
                f"{source} holds {built} plans, not {precision}: a plan keeps the precision it was built in; "
                f"build {precision} engines with `ldlm build-engine --precision {precision}`"
            )
        return "plan", {
            g: {
                "inputs": m["inputs"],
                "outputs": m["outputs"],
                "profiles": m["profiles"],
                "files": [source / f"{g}.plan"],
                "precision": built,
            }
            for g, m in manifests.items()
        }
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        missing = [g for g in GRAPH_NAMES if g not in manifest.get("graphs", {})]
        if missing:
            raise RepositoryError(f"{source} has no {', '.join(missing)} graph(s); export all three")
        chosen = {g: e.get("variants", {}).get(precision) if precision != "fp32" else None for g, e in manifest["graphs"].items()}
        if precision != "fp32" and not any(chosen.values()):
            raise RepositoryError(
                f"{source} has no {precision} variants (exported without --quantize); "
                f"re-export with `ldlm export CKPT OUT --quantize {precision}`, or write the repository with precision fp32"
            )
        return "onnx", {
            g: {
                "inputs": e["inputs"],  # a dynamic INT8 variant keeps its graph's float inputs and outputs
                "outputs": e["outputs"],
                "profiles": [],
                "files": [source / f for f in (chosen[g] or e)["files"]],
                "precision": precision if chosen[g] else "fp32",
            }
            for g, e in manifest["graphs"].items()
        }
    raise RepositoryError(f"{source} is empty of models: no *.plan and no manifest.json")


def model_config(
    name: str,
    kind: str,
    io: dict[str, Any],
    max_batch: int,
    queue_delay_us: int,
    gpu: bool,
    cc_filenames: dict[str, str] | None = None,
    graph_backend: str = "native",
) -> str:
    """config.pbtxt text for one graph. Triton's dims leave out the batch axis. ``graph_backend``
    "python" changes only the backend line (the model file is copied by write_triton_repo)."""
    profiles = io["profiles"]
    if profiles:  # Triton refuses a plan whose profiles stop short of max_batch_size
        max_batch = min(max_batch, max(p["batch"][2] for p in profiles))
    preferred = sorted({p["batch"][1] for p in profiles if p["batch"][1] <= max_batch}) or [min(8, max_batch)]
    backend = (
        'backend: "python"' if graph_backend == "python" else f'platform: "{"tensorrt_plan" if kind == "plan" else "onnxruntime_onnx"}"'
    )
    lines = [f'name: "{name}"', backend, f"max_batch_size: {max_batch}"]
    for section, specs in (("input", io["inputs"]), ("output", io["outputs"])):
        entries = []
        for spec in specs:
            dims = triton_dims(spec)
            # A per-sample scalar (shape [batch]) is dims [1] reshaped to [] for the model.
            reshape = " reshape: { shape: [ ] }" if len(spec["shape"]) == 1 else ""
            entries.append(f'  {{ name: "{spec["name"]}" data_type: {graph_type(spec)} dims: [ {", ".join(map(str, dims))} ]{reshape} }}')
        lines.append(f"{section} [\n" + ",\n".join(entries) + "\n]")
    lines.append(
        f"dynamic_batching {{ preferred_batch_size: [ {', '.join(map(str, preferred))} ] max_queue_delay_microseconds: {queue_delay_us} }}"
    )
    lines.append(f"instance_group [ {{ count: 1 kind: {'KIND_GPU' if gpu else 'KIND_CPU'} }} ]")
    warm = []
    for spec in io["inputs"]:
        dims = [16 if d == -1 else d for d in triton_dims(spec)]
        fill = "random_data: true" if spec["dtype"] == "FLOAT" else "zero_data: true"
        warm.append(f'    key: "{spec["name"]}" value: {{ data_type: {graph_type(spec)} dims: [ {", ".join(map(str, dims))} ] {fill} }}')
    lines.append(
        'model_warmup [ {\n  name: "batch1_seq16"\n  batch_size: 1\n  inputs [\n'
        + ",\n".join("  {" + w.strip() + " }" for w in warm)
        + "\n  ]\n} ]"
    )
    lines.append(f'parameters {{ key: "precision" value: {{ string_value: "{io["precision"]}" }} }}')
    if cc_filenames:
        lines.append("cc_model_filenames [ " + ", ".join(f'{{ key: "{cc}" value: "{file}" }}' for cc, file in cc_filenames.items()) + " ]")
    return "\n".join(lines) + "\n"


def graph_type(spec: dict[str, Any]) -> str:
    """A graph's input or output dtype (ONNX's name, as the manifest has it) as config.pbtxt's data_type."""
    return config_type(KSERVE_NAMES[spec["dtype"]])


def check_source(source: Path, kind: str, cc_dirs: Sequence[Path] = ()) -> None:
    """An export must match its manifest (every file, the tokenizer included) and pass verify-onnx's LayerNorm
    check; an engine directory (and each extra --cc-plan one) its plans' records (artifact.check_engine_dir)."""
    if kind == "onnx":
        check_artifacts(source, json.loads((source / MANIFEST_FILE).read_text()))
        return
    for directory in (source, *cc_dirs):
        check_engine_dir(directory, GRAPH_NAMES)


def generate_config(
    max_n: int,
    tokenizer_sha256: str | None = None,
    max_steps: int = MAX_STEPS,
    bls_max_batch: int | None = None,
    graph_precisions: dict[str, str] | None = None,
) -> str:
    """ldlm_generate's config.pbtxt: the configuration ``ldlm serve``'s model of that name answers with
    (``kserve_models.generate_config``: its inputs and outputs, an input not required ``optional``, and the limits
    max_n and max_steps), run by the Python backend on the CPU. Its parameters add ``bls_max_batch``, the largest
    batch its encoder, denoiser and decoder accept (their max_batch_size): it runs larger N in BLS calls of that
    many samples; the precision each graph it calls runs in (``graph_precisions``, as "encoder=fp32,denoiser=int8");
    and the tokenizer's sha256, which the model checks the tokenizer beside it against before it decodes anything."""
    config = {key: value for key, value in served_generate_config(max_n, max_steps).items() if key != "platform"}
    added = {"bls_max_batch": bls_max_batch, "tokenizer_sha256": tokenizer_sha256}
    if graph_precisions:
        added["graph_precisions"] = ",".join(f"{g}={p}" for g, p in graph_precisions.items())
    config["parameters"].update({key: {"string_value": str(value)} for key, value in added.items() if value is not None})
    config.update(backend="python", instance_group=[{"count": 1, "kind": "KIND_CPU"}])
    return text_format.MessageToString(as_message(config, load_model_config_schema()()))


def validate_config(text: str, io: dict[str, Any] | None, where: str) -> Any:
    """Parse with the protobuf schema; compare names, dtypes and dims with the graph's I/O."""
    schema = load_model_config_schema()
    try:
        config = text_format.Parse(text, schema())
    except text_format.ParseError as error:
        raise RepositoryError(f"{where}: config.pbtxt does not parse as ModelConfig: {error}") from error
    if io is None:
        return config
    for section, specs in (("input", io["inputs"]), ("output", io["outputs"])):
        declared = {t.name: t for t in getattr(config, section)}
        if list(declared) != [s["name"] for s in specs]:
            raise RepositoryError(f"{where}: {section} names {list(declared)} != graph's {[s['name'] for s in specs]}")
        for spec in specs:
            tensor = declared[spec["name"]]
            want_type = (
                schema.DESCRIPTOR.fields_by_name["input"]
                .message_type.fields_by_name["data_type"]
                .enum_type.values_by_name[graph_type(spec)]
                .number
            )
            want_dims = triton_dims(spec)
            if tensor.data_type != want_type or list(tensor.dims) != want_dims:
                raise RepositoryError(
                    f"{where}: {section} {spec['name']} is {tensor.data_type}/{list(tensor.dims)}, the graph has {spec['dtype']}/{want_dims}"
                )
    return config


TRITON_REPO_WRITER = command_writer("triton-repo")  # what a repository is recorded as written by (ldlm.files.OUTPUT_RECORD)


def write_triton_repo(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    max_batch: int = 32,
    queue_delay_us: int = 100,
    gpu: bool = True,
    cc_plans: dict[str, str | os.PathLike[str]] | None = None,
    max_n: int = MAX_N,
    overwrite: bool = False,
    max_steps: int = MAX_STEPS,
    graph_backend: str = "native",
    precision: str = "fp32",
) -> Path:
    """Write and validate the repository; ``cc_plans`` maps a compute capability ("8.6") to an
    engine directory built on such a GPU (used as cc_model_filenames). ``max_n`` and ``max_steps``
    bound ldlm_generate's N and STEPS (as ``ldlm serve`` bounds n and steps). ``graph_backend``
    "python" makes the graphs Python-backend models running ONNX Runtime (an export only).
    ``precision`` int8 writes an export's INT8 variants where it has them (fp32 graphs elsewhere);
    every config.pbtxt names the precision its model runs in. ``overwrite`` replaces only an earlier repository
    written here, unchanged since (``ldlm.files.refuse_existing``)."""
    inputs = {"source": source, **{f"--cc-plan {cc}": d for cc, d in (cc_plans or {}).items()}}
    refuse_existing(out, overwrite, inputs, TRITON_REPO_WRITER)
    source = Path(source)
    if graph_backend not in GRAPH_BACKENDS:
        raise RepositoryError(f"graph_backend={graph_backend!r} is unknown; allowed: {', '.join(GRAPH_BACKENDS)}")
    kind, graphs = inspect_source(source, precision)
    refuse_settings(source, kind, graph_backend, bool(cc_plans), {"max_batch": max_batch, "max_n": max_n, "max_steps": max_steps})
    check_source(source, kind, [Path(d) for d in (cc_plans or {}).values()])  # copy only files that match their records
    config = LDLMConfig.load(source / CONFIG_FILE)
    load_model_config_schema()  # fail before writing anything
    batch_sizes: dict[str, int] = {}  # each graph's max_batch_size as written (a plan's profiles may lower it)
    with atomic_directory(out, overwrite, TRITON_REPO_WRITER) as tmp:
        for name, io in graphs.items():
            cc_files = copy_graph_model(tmp / name / "1", name, kind, io, cc_plans, graph_backend)
            text = model_config(name, kind, io, max_batch, queue_delay_us, gpu, cc_files, graph_backend)
            batch_sizes[name] = validate_config(text, io, f"{name}/config.pbtxt").max_batch_size
            (tmp / name / "config.pbtxt").write_text(text)
        generate = tmp / GENERATE_MODEL / "1"
        generate.mkdir(parents=True)
        shutil.copy(MODEL_FILES["generate"], generate / "model.py")
        config.save(generate / CONFIG_FILE)
        tokenizer_sha256 = None
        if (source / TOKENIZER_FILE).is_file():
            shutil.copy(source / TOKENIZER_FILE, generate / TOKENIZER_FILE)
            tokenizer_sha256 = sha256_file(generate / TOKENIZER_FILE)
        schedules = read_schedules(source) if kind == "onnx" else None  # an engine directory carries no tuned grids
        if schedules is not None:
            schedules.save(generate / SCHEDULES_FILE)
        precisions = {name: io["precision"] for name, io in graphs.items()}
        text = generate_config(max_n, tokenizer_sha256, max_steps, min(batch_sizes.values()), precisions)
        validate_config(text, None, f"{GENERATE_MODEL}/config.pbtxt")
        (tmp / GENERATE_MODEL / "config.pbtxt").write_text(text)
    return Path(out)


def refuse_settings(source: Path, kind: str, graph_backend: str, cc_plans: bool, bounded: dict[str, int]) -> None:
    """A RepositoryError naming the first setting the source cannot take or that is out of its range."""
    if graph_backend == "python" and kind != "onnx":
        raise RepositoryError(
            f"graph_backend='python' runs ONNX Runtime on an export's .onnx, but {source} holds TensorRT plans; "
            "allowed: an `ldlm export` directory (or graph_backend='native' for tensorrt_plan models)"
        )
    if cc_plans and kind != "plan":
        raise RepositoryError("cc_model_filenames need engine directories; the source is an ONNX export")
    for name, value in bounded.items():
        try:  # the bounds ldlm serve's settings of the same names have
            SETTINGS[name].check(name, value)
        except ValueError as error:
            raise RepositoryError(str(error)) from None


def copy_graph_model(
    version: Path, name: str, kind: str, io: dict[str, Any], cc_plans: dict[str, str | os.PathLike[str]] | None, graph_backend: str
) -> dict[str, str] | None:
    """One graph's model version directory: its plan (and one per compute capability, returned as
    cc_model_filenames) or its ONNX with external data, and for the Python backend the model.py that runs it."""
    version.mkdir(parents=True)
    if kind == "plan":
        shutil.copy(io["files"][0], version / "model.plan")
        cc_files = {cc: f"model_{cc}.plan" for cc in cc_plans or {}}
        for cc, directory in (cc_plans or {}).items():
            shutil.copy(Path(directory) / f"{name}.plan", version / cc_files[cc])
        return cc_files or None
    onnx_dir = version / "model.onnx"  # a directory: Triton loads model.onnx and its external data from it
    onnx_dir.mkdir()
    for file in io["files"]:
        shutil.copy(file, onnx_dir / ("model.onnx" if file.suffix == ".onnx" else file.name))
    if graph_backend == "python":
        shutil.copy(MODEL_FILES["graph"], version / "model.py")
    return None


def list_models(repo: str | os.PathLike[str]) -> Sequence[str]:
    return sorted(p.parent.name for p in Path(repo).glob("*/config.pbtxt"))


def docker_run_line(repo: str, wheels: str, gpu: bool = True) -> str:
    """The command that serves repository ``repo`` in NVIDIA's Triton container: ldlm_generate imports ``ldlm``,
    so the ldlm wheel in ``wheels`` (``pip wheel --no-deps -w dist .``) is installed into the container's
    Python first. ``gpu`` False (KIND_CPU instances): no ``--gpus all``."""
    gpus = "--gpus all " if gpu else ""
    return (
        f"docker run {gpus}--rm -p8000:8000 -p8001:8001 -p8002:8002 -v {repo}:/models -v {wheels}:/wheels "
        'nvcr.io/nvidia/tritonserver:<xx.yy>-py3 bash -c "pip install /wheels/ldlm-*.whl && tritonserver --model-repository=/models"'
    )
