"""Artifact trust: an export directory is used only after its manifest checks out.

Reading a manifest lives here too (``read_manifest``, ``describe_io``, ``sha256_file``), so whoever
opens an export (the runtime, the checks) needs this module and never the exporter.

One function, ``check_artifacts``, called wherever an export directory is opened (``open_graphs``
for serve, parity and bench; ``verify_export`` for verify-onnx; build-engine and triton-repo on their
source). It refuses:
- a file path that is absolute, or that leaves the directory (``../``, or a symlink out of it);
- a file whose sha256 or size differs from the manifest (edited weights, a swapped graph);
- an ONNX file whose external-data locations are not files of its own manifest entry;
- a config.json whose hash differs from the manifest's ``config_sha256``;
- a tokenizer.json without its sha256 on record, or that differs from it;
- a graph that fails ``ldlm verify-onnx``'s check against the LayerNorm specs its manifest records, or
  specs whose eps is not config.json's ``layer_norm_eps`` (``verify_layer_norms``), with the verifier's message.
An engine directory is opened through ``check_engine_dir``: each plan's record, and the LayerNorms its build
checked against config.json's eps.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path, PurePosixPath
from typing import Any

import onnx

from ldlm.export.layernorm.verify import LayerNormSpec, VerifyResult, config_eps_problems, verify_all, verify_onnx
from ldlm.files import sha256_file
from ldlm.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TOKENIZER_FILE
from ldlm.sampling.tuned_grids import SCHEDULES_FILE, TunedSchedules, load_schedules

MANIFEST_FILE = "manifest.json"  # written by ldlm.export.onnx_export beside the ONNX files
PLAN_SUFFIX = ".plan"  # ldlm.export.engine_builder writes <graph>.plan and, beside it, <graph>.plan.json
MANIFEST_SUFFIX = ".plan.json"


class ArtifactError(ValueError):
    """An artifact that does not match its manifest; the message names the file and the fix."""


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        plans = built_plans(Path(directory))
        if plans:  # the engines of the export, given where the export belongs
            raise ValueError(
                f"{directory} holds TensorRT plans ({', '.join(plans)}) written by `ldlm build-engine`, not an ONNX export "
                f"(it has no {MANIFEST_FILE}); serve it with --backend trt (parity, probe-eps and bench take it as --engine-dir), "
                "or give ONNX Runtime the export the plans were built from"
            )
        raise ValueError(f"{directory} has no {MANIFEST_FILE}; is it a directory written by `ldlm export`?")
    try:
        return json.loads(path.read_text())
    except ValueError as error:  # not JSON, or not text at all
        raise ArtifactError(
            f"{path} is not valid JSON ({error}): the export is damaged; export the checkpoint again (`ldlm export`)"
        ) from None


def built_plans(directory: Path) -> list[str]:
    """The plans of an ``ldlm build-engine`` directory: each ``<graph>.plan`` with its ``<graph>.plan.json``."""
    return sorted(p.name for p in directory.glob(f"*{PLAN_SUFFIX}") if p.with_name(p.name + ".json").is_file())


def describe_io(values: Sequence[onnx.ValueInfoProto]) -> list[dict[str, Any]]:
    return [
        {
            "name": v.name,
            "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type),
            "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
        }
        for v in values
    ]


def resolve_inside(directory: Path, name: object) -> Path:
    """``directory / name``, refusing any name that is not a relative path staying inside ``directory``."""
    if not isinstance(name, str) or not name:
        raise ArtifactError(f"{directory / MANIFEST_FILE}: file entry {name!r} is invalid; allowed: a relative path inside {directory}")
    if PurePosixPath(name).is_absolute() or Path(name).is_absolute() or Path(name).drive:
        raise ArtifactError(f"{directory / MANIFEST_FILE}: file {name!r} is an absolute path; allowed: a relative path inside {directory}")
    root = directory.resolve()
    path = (directory / name).resolve()  # follows symlinks, so a link out of the directory is caught too
    if not path.is_relative_to(root):
        raise ArtifactError(
            f"{directory / MANIFEST_FILE}: file {name!r} leaves the directory (resolves to {path}); "
            f"allowed: a relative path inside {directory}"
        )
    return path


def check_artifacts(directory: str | os.PathLike[str], manifest: dict[str, Any], verify: bool = True) -> None:
    """Every file the manifest lists: inside ``directory``, present, and with its recorded sha256 and size;
    then, with ``verify``, every graph as ``ldlm verify-onnx`` checks it (``verify_layer_norms``), raising the
    verifier's message on a failure. ``verify=False`` (or inside ``verified_by_caller``): the files alone, for a
    caller that verifies the graphs itself and reports each result."""
    directory = Path(directory)
    graphs = manifest.get("graphs")
    if not isinstance(graphs, dict) or not graphs:
        raise ArtifactError(f"{directory / MANIFEST_FILE} lists no graphs; re-export with `ldlm export`")
    for graph, entry in graphs.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
            raise ArtifactError(
                f"{directory / MANIFEST_FILE}: graph {graph!r} has no 'files' with sha256 sums; re-export with `ldlm export`"
            )
        resolve_inside(directory, entry.get("file"))
        if entry.get("file") not in entry["files"]:
            raise ArtifactError(f"{directory / MANIFEST_FILE}: graph {graph!r} file {entry.get('file')!r} has no sha256 entry")
        variants = entry.get("variants", {})
        if variants and not resolve_inside(directory, entry["file"]).is_file():
            kinds = ", ".join(f"{p} ({v.get('file')})" for p, v in variants.items() if isinstance(v, dict))
            raise ArtifactError(
                f"{directory / entry['file']} is missing: the variant(s) {kinds} are kept only beside their fp32 sibling "
                "(parity and the eps probes compare against it); re-export with `ldlm export --quantize int8`"
            )
        for name, record in entry["files"].items():
            check_file(directory, name, record)
        check_external_data(directory, entry["file"], set(entry["files"]))
        for variant in variants.values():
            resolve_inside(directory, variant.get("file"))
            for name, record in variant.get("files", {}).items():
                check_file(directory, name, record)
    check_tokenizer(directory, manifest.get("tokenizer"))
    config_path = directory / CONFIG_FILE
    if config_path.is_file() and "config_sha256" in manifest and LDLMConfig.load(config_path).config_hash() != manifest["config_sha256"]:
        raise ArtifactError(f"{config_path} does not match the config_sha256 in {directory / MANIFEST_FILE} (edited); re-export it")
    if verify and not _CALLER_VERIFIES.get():
        _check_layer_norms(directory, manifest)


_CALLER_VERIFIES: ContextVar[bool] = ContextVar("caller_verifies", default=False)


@contextmanager
def verified_by_caller() -> Iterator[None]:
    """Within the block, ``check_artifacts`` and ``check_engine_dir`` check the files alone, however deep below the
    artifact is opened: for a check that opens one to diagnose it (``ldlm parity``) and runs the verifier itself,
    against the checkpoint's own modules, reporting each failure rather than refusing to measure. Serving never
    runs inside it."""
    token = _CALLER_VERIFIES.set(True)
    try:
        yield
    finally:
        _CALLER_VERIFIES.reset(token)


# Exports whose graphs passed verify_layer_norms in this process, by their manifest and config.json: every file a
# manifest lists is hashed again at each check_artifacts before this is consulted, so the same key is the same bytes.
_VERIFIED: set[str] = set()


def _check_layer_norms(directory: Path, manifest: dict[str, Any]) -> None:
    """``verify_layer_norms`` on an export whose files were just checked, raising its message on a failure; an
    export this process verified already, file for file, is not verified twice (a server opening its cached
    export, parity opening one export per backend)."""
    config = directory / CONFIG_FILE
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode() + (config.read_bytes() if config.is_file() else b"")).hexdigest()
    if key in _VERIFIED:
        return
    verify_all(verify_layer_norms(directory, manifest))
    _VERIFIED.add(key)


def verify_layer_norms(directory: Path, manifest: dict[str, Any], graphs: Sequence[str] | None = None) -> list[VerifyResult]:
    """``ldlm verify-onnx``'s check of an export from its manifest: each of ``graphs`` (default: all) and its
    variants against the LayerNorm specs the manifest records (``verify_onnx``: one LayerNormalization per
    module, with its eps, axis, scale and bias), and those specs against config.json's ``layer_norm_eps``,
    which every nn.LayerNorm of the model is built with (a manifest edited to match an edited graph fails here).
    An export without config.json (nothing can serve it) is checked against its manifest alone."""
    config = directory / CONFIG_FILE
    eps = LDLMConfig.load(config).layer_norm_eps if config.is_file() else None
    results = []
    for name in graphs or list(manifest["graphs"]):
        entry = manifest["graphs"][name]
        specs = recorded_specs(directory, name, entry.get("layer_norms"))
        against_config = [] if eps is None else config_eps_problems(specs, eps, CONFIG_FILE)
        files = [(name, entry["file"], "fp32")] + [(f"{name}.{p}", v["file"], p) for p, v in entry.get("variants", {}).items()]
        for graph, file, precision in files:
            result = verify_onnx(directory / file, specs, graph, precision)
            result.problems[:0] = against_config
            results.append(result)
    return results


def recorded_specs(
    directory: Path, graph: str, records: object, manifest: str = MANIFEST_FILE, fix: str = "re-export with `ldlm export`"
) -> list[LayerNormSpec]:
    """The LayerNorm specs a manifest records for ``graph``, or an ArtifactError naming what is wrong with them."""
    try:
        if not isinstance(records, list):
            raise TypeError(f"a {type(records).__name__}, not a list")
        return [LayerNormSpec.from_dict(record) for record in records]
    except TypeError as error:
        raise ArtifactError(f"{directory / manifest}: graph {graph!r} has no LayerNorm specs to verify against ({error}); {fix}") from None


def check_file(directory: Path, name: object, record: object, manifest: str = MANIFEST_FILE) -> None:
    """One listed file: inside ``directory``, present, with the recorded size and sha256."""
    path = resolve_inside(directory, name)
    if not path.is_file():
        raise ArtifactError(f"{path} is listed in {directory / manifest} but missing; re-export with `ldlm export`")
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        raise ArtifactError(f"{directory / manifest}: {name!r} has no sha256; re-export with `ldlm export`")
    size = path.stat().st_size
    if record.get("bytes") is not None and size != record["bytes"]:
        raise ArtifactError(f"{path} is {size} bytes; its manifest says {record['bytes']} (edited or truncated); re-export it")
    if sha256_file(path) != record["sha256"]:
        raise ArtifactError(f"{path} does not match the sha256 in {directory / manifest} (edited or replaced); re-export it")


def check_tokenizer(directory: Path, record: object, manifest: str = MANIFEST_FILE) -> None:
    """The tokenizer a server of ``directory`` would load: trusted only with its sha256 on record.
    A directory without one uses GPT-2's built-in tokenizer, so no record is needed then."""
    path = directory / TOKENIZER_FILE
    if record is None:
        if path.is_file():
            raise ArtifactError(
                f"{path} has no sha256 in {directory / manifest}, so it is not trusted "
                "(an export from before tokenizers were hashed, or a file added since); re-export with `ldlm export`"
            )
        return
    if not isinstance(record, dict) or record.get("file") != TOKENIZER_FILE:
        raise ArtifactError(
            f"{directory / manifest}: tokenizer entry {record!r} is invalid; allowed: {{'file': '{TOKENIZER_FILE}', 'sha256': ...}}"
        )
    check_file(directory, TOKENIZER_FILE, record, manifest)


def read_schedules(directory: str | os.PathLike[str]) -> TunedSchedules | None:
    """An export's tuned step grids (copied from its checkpoint), trusted only with their sha256 on record
    and bound to the weights the manifest names; None when the export has none."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    record = manifest.get("schedules")
    if record is None:
        if (directory / SCHEDULES_FILE).exists():
            raise ArtifactError(f"{directory / SCHEDULES_FILE} is not in {directory / MANIFEST_FILE}; re-export with `ldlm export`")
        return None
    check_file(directory, record.get("file") if isinstance(record, dict) else None, record)
    return load_schedules(directory, sha256=manifest.get("checkpoint_weights_sha256"))


def check_engine_dir(directory: str | os.PathLike[str], graphs: Sequence[str], plans: bool = True) -> dict[str, dict[str, Any]]:
    """An ``ldlm build-engine`` directory has no export manifest: each plan's ``.plan.json`` is its
    record. Checks each plan's sha256 (unless ``plans`` is False, for a caller that hashes the bytes
    it loads), and the tokenizer and config.json against the records the plans carry. Returns the
    plan manifests by graph."""
    directory = Path(directory)
    manifests = {}
    for graph in graphs:
        plan, record = directory / f"{graph}{PLAN_SUFFIX}", directory / f"{graph}{MANIFEST_SUFFIX}"
        if not plan.is_file() or not record.is_file():
            if (directory / MANIFEST_FILE).is_file() and not built_plans(directory):
                raise ArtifactError(
                    f"{directory} is an ONNX export written by `ldlm export` (it has a {MANIFEST_FILE}), not TensorRT plans; "
                    f"serve it with --backend ort, or build engines from it: ldlm build-engine {directory} ENGINE_DIR"
                )
            raise ArtifactError(f"{directory} has no {plan.name} with its {record.name}; build it with `ldlm build-engine`")
        manifests[graph] = json.loads(record.read_text())
        if plans:
            check_file(directory, plan.name, {"sha256": manifests[graph].get("plan_sha256")}, record.name)
    first = f"{graphs[0]}{MANIFEST_SUFFIX}"
    check_tokenizer(directory, manifests[graphs[0]].get("tokenizer"), first)
    config = directory / CONFIG_FILE
    expected = manifests[graphs[0]].get("config_sha256")
    if expected is None or not config.is_file() or LDLMConfig.load(config).config_hash() != expected:
        raise ArtifactError(
            f"{config} does not match the config_sha256 in {directory / first} (missing, edited, or plans built "
            "before configs were recorded); rebuild with `ldlm build-engine`"
        )
    eps = LDLMConfig.load(config).layer_norm_eps
    for graph, record in manifests.items():
        if not _CALLER_VERIFIES.get():
            check_plan_layer_norms(directory, graph, record, eps)
    return manifests


def check_plan_layer_norms(directory: Path, graph: str, record: dict[str, Any], eps: float) -> None:
    """The LayerNorms a plan's build checked in the parsed network (its manifest's ``layer_norm_specs``, one per
    INormalizationLayer): as many as it says it checked, each with config.json's ``layer_norm_eps``. A plan is
    opaque without TensorRT's runtime, so its build's record is what is checked; the plan's own bytes are the
    ones that build wrote (``plan_sha256``, checked as the plan is read)."""
    name = f"{graph}{MANIFEST_SUFFIX}"
    if "layer_norm_specs" not in record:
        raise ArtifactError(
            f"{directory / name} does not record the LayerNorms its build checked (a plan built before they were recorded); "
            "rebuild with `ldlm build-engine`"
        )
    specs = recorded_specs(directory, graph, record["layer_norm_specs"], name, "rebuild with `ldlm build-engine`")
    problems = config_eps_problems(specs, eps, CONFIG_FILE)
    if len(specs) != record.get("layer_norms"):
        problems.insert(0, f"{len(specs)} LayerNorm spec(s) recorded, but the build says it checked {record.get('layer_norms')}")
    if problems:
        raise ArtifactError(f"{directory / name}: FAILED {graph}:\n  - " + "\n  - ".join(problems) + "\nrebuild with `ldlm build-engine`")


def check_from_checkpoint(checkpoint: str | os.PathLike[str], directory: str | os.PathLike[str]) -> None:
    """Refuse an export or engine directory made from other weights than ``checkpoint``'s: comparing
    against it measures nothing (token agreement near 0%, no hint why). The record is the export
    manifest's ``checkpoint_weights_sha256``, or each plan manifest's; an artifact made before it was
    recorded, or a checkpoint without weights (its loader names that), is not checked here."""
    directory, weights = Path(directory), Path(checkpoint) / WEIGHTS_FILE
    engines = not (directory / MANIFEST_FILE).is_file()
    records = sorted(directory.glob(f"*{MANIFEST_SUFFIX}")) if engines else [directory / MANIFEST_FILE]
    recorded = {}
    for record in records:
        try:
            value = json.loads(record.read_text()).get("checkpoint_weights_sha256")
        except (OSError, ValueError, AttributeError):
            continue  # an unreadable record is the artifact checks' to name
        if isinstance(value, str):
            recorded[record] = value
    if not recorded or not weights.is_file():
        return
    actual = sha256_file(weights)
    for record, value in recorded.items():
        if value == actual:
            continue
        what, fix = ("this export is", f"re-export it from this checkpoint: ldlm export {checkpoint} {directory} --force")
        if engines:
            what = "these engines are"
            fix = f"re-export and rebuild: ldlm export {checkpoint} ONNX_DIR, then ldlm build-engine ONNX_DIR {directory} --force"
        raise ArtifactError(
            f"{what} not from this checkpoint: {record} records weights sha256 {value}, but {weights} has sha256 {actual}; {fix}"
        )


def check_external_data(directory: Path, onnx_file: str, listed: set[str]) -> None:
    """The ONNX file's weights may live in other files; each must be one the manifest hashes."""
    try:
        graph = onnx.load(str(directory / onnx_file), load_external_data=False).graph
    except Exception as error:  # protobuf's DecodeError and friends
        raise ArtifactError(f"{directory / onnx_file} is not a readable ONNX file ({type(error).__name__}); re-export it") from error
    for tensor in graph.initializer:
        location = next((e.value for e in tensor.external_data if e.key == "location"), None)
        if location is not None:
            resolve_inside(directory, location)
            if location not in listed:
                raise ArtifactError(
                    f"{directory / onnx_file} reads tensor {tensor.name!r} from {location!r}, "
                    f"which {directory / MANIFEST_FILE} does not list; re-export it"
                )


class PlanMismatchError(ValueError):
    """The plan was built for another TensorRT or GPU, or is corrupt; the message says what to rebuild."""


def read_plan_manifest(plan: str | Path) -> dict[str, Any]:
    plan = Path(plan)
    manifest = plan.with_name(plan.name.removesuffix(PLAN_SUFFIX) + MANIFEST_SUFFIX)
    if not plan.is_file():
        raise PlanMismatchError(f"plan {plan} does not exist; build it with `ldlm build-engine`")
    if not manifest.is_file():
        raise PlanMismatchError(f"plan {plan} has no manifest {manifest.name}; rebuild it with `ldlm build-engine`")
    return json.loads(manifest.read_text())
