"""Export stage: an LDLM checkpoint -> one verified ONNX file per inference graph, plus a manifest.

OUT/
  config.json                 the checkpoint's config
  tokenizer.json              the checkpoint's tokenizer
  encoder.onnx, .onnx.data    weights as external data, so files > 2 GB work and TensorRT
  denoiser.onnx, .onnx.data   parses from the path
  decoder.onnx, .onnx.data
  manifest.json               files + sha256, I/O names, dtypes, shapes, the LayerNorm specs
Everything is written to a temporary directory and renamed into place once verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from tqdm.auto import tqdm

from ldlm import __version__
from ldlm.export.artifact import MANIFEST_FILE, check_artifacts, describe_io, read_manifest, sha256_file, verify_layer_norms
from ldlm.export.graphs import GRAPH_NAMES, GraphIO, graph_io
from ldlm.export.layernorm.verify import LayerNormSpec, VerifyResult, layer_norm_specs, verify_all, verify_onnx
from ldlm.export.quantize import (
    DEFAULT_MIN_COSINE,
    DEFAULT_QUANTIZED_GRAPHS,
    QUANTIZABLE_GRAPHS,
    QUANTIZE_CHOICES,
    AccuracyFloor,
    quantize_int8,
    require_quantizer,
    variant_file,
)
from ldlm.files import atomic_directory, command_writer, refuse_existing
from ldlm.interrupts import raise_if_interrupted
from ldlm.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint
from ldlm.model.config import LDLMConfig
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TOKENIZER_FILE, TextTokenizer
from ldlm.sampling.tuned_grids import SCHEDULES_FILE, TunedSchedules, load_schedules, weights_sha256

SUPPORTED_OPSETS: tuple[int, ...] = (18, 20)  # 17 comes out as 18 from dynamo; 23 has Attention, unknown to TensorRT 10
DEFAULT_OPSET = 18


@dataclass
class ExportResult:
    out: Path
    manifest: dict[str, Any]
    verification: list[VerifyResult]  # one per graph; each path is the final file in ``out``

    def __repr__(self) -> str:  # the manifest holds every LayerNorm spec: far too long to print
        passed = sum(r.passed for r in self.verification)
        return (
            f"ExportResult(out={str(self.out)!r}, graphs={list(self.manifest['graphs'])}, "
            f"opset={self.manifest['opset']}, verified={passed}/{len(self.verification)} passed)"
        )


def check_opset(opset: int) -> None:
    if opset not in SUPPORTED_OPSETS:
        raise ValueError(f"opset={opset!r} is unsupported; allowed: {', '.join(map(str, SUPPORTED_OPSETS))}")


def graph_layer_norm_specs(model: LDLM, io: GraphIO) -> list[LayerNormSpec]:
    """Every nn.LayerNorm the graph runs, named as in the exported module (``model.<component>...``)."""
    return [s for c in io.components for s in layer_norm_specs(getattr(model, c), prefix=f"model.{c}")]


class _KeptLayerNormFilter(logging.Filter):
    """Drops onnxscript's "Skipping constant folding for op LayerNormalization with multiple outputs."

    The latent decoder's query LayerNorm runs over constants (its position queries), so the
    optimizer tries to fold it and skips it. Skipping is what the export needs: every nn.LayerNorm
    must stay one LayerNormalization node. Its other messages still come through."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        return not (message.startswith("Skipping constant folding for op") and record.args == ("LayerNormalization",))


_CONSTANT_FOLDING_LOGGER = "onnxscript.optimizer._constant_folding"  # the module that logs it, by name


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch.onnx logs every optional op it skips (torchvision, ...) and warns about internals."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    folding_logger, kept_layer_norm = logging.getLogger(_CONSTANT_FOLDING_LOGGER), _KeptLayerNormFilter()
    folding_logger.addFilter(kept_layer_norm)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
        folding_logger.removeFilter(kept_layer_norm)


def export_graph(io: GraphIO, path: Path, opset: int, max_seq_len: int, metadata: dict[str, str]) -> None:
    """torch.onnx (dynamo) export of one graph with dynamic batch and sequence axes."""
    check_opset(opset)
    with _quiet_exporter(), torch.inference_mode(False), torch.no_grad():
        program = torch.onnx.export(
            io.module.eval(),
            io.example_inputs,
            dynamo=True,
            opset_version=opset,
            input_names=list(io.input_names),
            output_names=list(io.output_names),
            dynamic_shapes=io.dynamic_shapes(max_seq_len),
            verbose=False,
        )
    if program is None:
        raise RuntimeError(f"torch.onnx.export returned no program for graph {io.name}")
    program.model.metadata_props.update(metadata)
    program.save(str(path), external_data=True)


def check_quantize(quantize: str | None, quantize_graphs: Sequence[str], min_cosine: float) -> None:
    """Refuse quantization arguments out of range, before any work; a missing ONNX Runtime is named first."""
    if not 0 <= min_cosine <= 1:
        raise ValueError(f"min_cosine={min_cosine} is out of range; allowed: 0..1 (0: no accuracy floor)")
    if quantize is None:
        return
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize={quantize!r} is unknown; allowed: {', '.join(QUANTIZE_CHOICES)} (or none)")
    bad = [g for g in quantize_graphs if g not in QUANTIZABLE_GRAPHS]
    if bad or not quantize_graphs:
        raise ValueError(
            f"quantize_graphs={list(quantize_graphs)!r} is invalid; allowed: a non-empty subset of {', '.join(QUANTIZABLE_GRAPHS)}"
        )
    require_quantizer()


def export_graphs(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    opset: int = DEFAULT_OPSET,
    graphs: Sequence[str] = GRAPH_NAMES,
    with_logits: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    quantize: str | None = None,
    quantize_graphs: Sequence[str] = DEFAULT_QUANTIZED_GRAPHS,
    min_cosine: float = DEFAULT_MIN_COSINE,
) -> ExportResult:
    """Export and verify ``graphs`` of ``checkpoint`` into ``out``; nothing is left there on failure.
    ``quantize="int8"`` adds an INT8 variant beside the fp32 file of each of ``quantize_graphs`` (export/quantize.py);
    the denoiser's keeps a worst per-sample cosine of ``min_cosine`` against fp32 along the default sampler's
    trajectory (0: no floor). ``overwrite`` replaces only an earlier export, unchanged since (``ldlm.files.refuse_existing``)."""
    check_opset(opset)
    check_quantize(quantize, quantize_graphs, min_cosine)
    refuse_existing(out, overwrite, {"checkpoint": checkpoint}, EXPORT_WRITER)  # before the checkpoint loads
    unknown = [g for g in graphs if g not in GRAPH_NAMES]
    if unknown or not graphs:
        raise ValueError(f"graphs={list(graphs)!r} is invalid; allowed: a non-empty subset of {', '.join(GRAPH_NAMES)}")
    model, tokenizer = load_checkpoint(checkpoint)
    weights = weights_sha256(Path(checkpoint) / WEIGHTS_FILE)
    job = _ExportJob(
        model,
        tokenizer,
        load_schedules(checkpoint, sha256=weights),  # tuned grids travel with the graphs (t is an input)
        opset,
        with_logits,
        quantize,
        tuple(g for g in graphs if quantize is not None and g in quantize_graphs),
        min_cosine,
        progress,
    )
    try:
        with atomic_directory(out, overwrite, EXPORT_WRITER) as tmp:
            manifest, results = _write_export(tmp, job, graphs, weights)
    except PermissionError as error:
        raise ValueError(f"cannot write to {out}: {error}") from error
    except (NotADirectoryError, FileExistsError) as error:
        if isinstance(error, FileExistsError) and Path(out).exists():
            raise
        raise ValueError(f"cannot create {out}: {error}") from error
    # verified in the temporary directory, which is gone now: point at the files where they are
    results = [dataclasses.replace(r, path=str(Path(out) / Path(r.path).name)) for r in results]
    return ExportResult(Path(out), manifest, results)


EXPORT_WRITER = command_writer("export")  # what an export is recorded as written by (ldlm.files.OUTPUT_RECORD)


@dataclass(frozen=True)
class _ExportJob:
    """One export's model and settings, shared by its graphs."""

    model: LDLM
    tokenizer: TextTokenizer
    schedules: TunedSchedules | None
    opset: int
    with_logits: bool
    quantize: str | None
    variants: tuple[str, ...]  # the graphs that get a ``quantize`` variant
    min_cosine: float
    progress: bool

    def metadata(self, graph: str) -> dict[str, str]:
        """What each ONNX file records of where it came from."""
        config_sha256 = self.model.config.config_hash()
        return {"ldlm.version": __version__, "ldlm.config_sha256": config_sha256, "ldlm.opset": str(self.opset), "ldlm.graph": graph}


def _write_export(tmp: Path, job: _ExportJob, graphs: Sequence[str], weights: str) -> tuple[dict[str, Any], list[VerifyResult]]:
    """Everything an export holds, written into ``tmp`` and verified; raises before the rename on any failure."""
    config = job.model.config
    config.save(tmp / CONFIG_FILE)
    job.tokenizer.save(tmp)  # servers of this directory need the checkpoint's own tokenizer
    if job.schedules is not None:
        job.schedules.save(tmp / SCHEDULES_FILE)
    entries, results = {}, []
    with tqdm(total=2 * len(graphs) + len(job.variants), desc="export", unit="stage", disable=not job.progress) as bar:
        for name in graphs:
            raise_if_interrupted()  # a Ctrl-C Python dropped during the last stage ends the export here
            entries[name], verified = _export_one(tmp, job, name, bar)
            results += verified
    raise_if_interrupted()
    verify_all(results)  # raises before the rename: a failed export leaves nothing behind
    manifest = _manifest(config, job.opset, entries, tmp / TOKENIZER_FILE, weights, tmp / SCHEDULES_FILE)
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest, results


def _export_one(tmp: Path, job: _ExportJob, name: str, bar: tqdm) -> tuple[dict[str, Any], list[VerifyResult]]:
    """One graph exported and verified (and its variant made, where asked): its manifest entry and results."""
    io = graph_io(job.model, name, job.with_logits)
    bar.set_postfix_str(f"{name}: torch.onnx")
    path = tmp / f"{name}.onnx"
    export_graph(io, path, job.opset, job.model.config.max_seq_len, job.metadata(name))
    bar.update()
    raise_if_interrupted()
    bar.set_postfix_str(f"{name}: verify")
    specs = graph_layer_norm_specs(job.model, io)
    results = [verify_onnx(path, specs, name)]
    entry = _manifest_entry(path, io, specs)
    bar.update()
    if name in job.variants and job.quantize is not None:
        bar.set_postfix_str(f"{name}: {job.quantize}")
        floored = name == "denoiser" and job.min_cosine > 0
        floor = denoiser_floor(job.model, job.tokenizer, job.schedules, job.min_cosine) if floored else None
        results.append(add_variant(tmp, name, entry, specs, job.quantize, floor, job.progress))
        bar.update()
    return entry, results


FLOOR_CALIBRATION = {"samples": 8, "length": 64}  # the floor's trajectories: the calibration's, at a serving length


def denoiser_floor(model: LDLM, tokenizer: TextTokenizer, schedules: TunedSchedules | None, min_cosine: float) -> AccuracyFloor:
    """The int8 denoiser's accuracy floor: its inputs at every step of the default sampler on its grid."""
    # the calibration module imports ONNX Runtime's quantization tools (the cpu extra): only when a variant is made
    from ldlm.export.calibration import CalibrationSettings, denoiser_feeds
    from ldlm.pipeline import LDLMPipeline

    settings = CalibrationSettings(FLOOR_CALIBRATION["samples"], min(FLOOR_CALIBRATION["length"], model.config.max_seq_len))
    feeds, _ = denoiser_feeds(LDLMPipeline(model, tokenizer, schedules=schedules), settings)
    return AccuracyFloor(feeds, min_cosine)


def add_variant(
    directory: Path,
    graph: str,
    entry: dict[str, Any],
    specs: list[LayerNormSpec],
    precision: str,
    floor: AccuracyFloor | None = None,
    progress: bool = False,
) -> VerifyResult:
    """Quantize ``graph``'s fp32 file into its ``precision`` variant, verify it, and record it in ``entry``."""
    path = directory / variant_file(graph, precision)
    report = quantize_int8(directory / entry["file"], path, floor, progress)
    entry.setdefault("variants", {})[precision] = {
        "file": path.name,
        "files": {path.name: {"sha256": sha256_file(path), "bytes": path.stat().st_size}},
        "method": "onnxruntime.quantization.quantize_dynamic (MatMul/Gemm weights int8, MatMulConstBOnly)",
        "quantized_nodes": report.quantized,
        "kept_float_nodes": report.kept_float,
        **(
            {}
            if floor is None
            else {
                "accuracy_floor": {
                    "min_cosine": floor.min_cosine,
                    "worst_cosine": report.worst_cosine,
                    "kept_for_accuracy": report.kept_for_accuracy,
                    "node_errors": report.node_errors,
                    "feeds": f"{len(floor.feeds)} steps of the default sampler, {FLOOR_CALIBRATION['samples']} samples",
                }
            }
        ),
    }
    return verify_onnx(path, specs, f"{graph}.{precision}", precision)


def _manifest_entry(path: Path, io: GraphIO, specs: list[LayerNormSpec]) -> dict[str, Any]:
    model = onnx.load(str(path), load_external_data=False)
    files = sorted(p for p in path.parent.iterdir() if p.name == path.name or p.name.startswith(path.name + "."))
    return {
        "file": path.name,
        "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
        "inputs": describe_io(model.graph.input),
        "outputs": describe_io(model.graph.output),
        "components": list(io.components),
        "layer_norms": [s.to_dict() for s in specs],
    }


def _manifest(config: LDLMConfig, opset: int, entries: dict[str, Any], tokenizer: Path, weights: str, schedules: Path) -> dict[str, Any]:
    tuned = {"schedules": {"file": schedules.name, "sha256": sha256_file(schedules)}} if schedules.is_file() else {}
    return {
        "ldlm_version": __version__,
        "torch_version": torch.__version__,
        "onnx_version": onnx.__version__,
        "exporter": "torch.onnx.export(dynamo=True)",
        "opset": opset,
        "config_sha256": config.config_hash(),
        # the checkpoint's model.safetensors: a check against a checkpoint names one it was not made from, and
        # the tuned grids (schedules.json) are bound to it
        "checkpoint_weights_sha256": weights,
        "tokenizer": tokenizer_record(tokenizer),
        **tuned,
        "graphs": entries,
    }


def tokenizer_record(path: Path) -> dict[str, Any]:
    """The manifest entry of a tokenizer.json: servers load it only if it still matches."""
    return {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size}


def verify_export(path: str | os.PathLike[str], checkpoint: str | os.PathLike[str] | None = None) -> list[VerifyResult]:
    """Verify an export directory, or one ONNX file in it, against its manifest's LayerNorm specs and config.json's
    eps (``artifact.verify_layer_norms``, the check every server of it runs too), or against the modules of
    ``checkpoint`` when given (which also compares weights by value)."""
    path = Path(path)
    allowed = "allowed: a directory written by `ldlm export`, or an .onnx file in one"
    if not path.exists():
        raise ValueError(f"{path} does not exist; {allowed}")
    if not path.is_dir() and path.suffix != ".onnx":
        raise ValueError(f"{path} is a file, not an export directory or an .onnx file; {allowed}")
    directory = path if path.is_dir() else path.parent
    if not path.is_dir() and not (directory / MANIFEST_FILE).is_file():
        raise ValueError(f"{path} is not inside an export: {directory.resolve()} has no {MANIFEST_FILE}; {allowed}")
    manifest = read_manifest(directory)
    check_artifacts(directory, manifest, verify=False)  # paths inside the directory, sha256 of every file
    names = list(manifest["graphs"]) if path.is_dir() else [path.stem]
    if path.is_file() and path.stem not in manifest["graphs"]:
        raise ValueError(f"{path.name} is not listed in {directory / MANIFEST_FILE}")
    if checkpoint is None:
        return verify_layer_norms(directory, manifest, names)
    model, _ = load_checkpoint(checkpoint)
    if model.config.config_hash() != manifest["config_sha256"]:
        raise ValueError(f"checkpoint {checkpoint} has another config than the export (config_sha256 differs)")
    results = []
    for name in names:
        entry = manifest["graphs"][name]
        specs = graph_layer_norm_specs(model, graph_io(model, name))
        results.append(verify_onnx(directory / entry["file"], specs, name))
        for precision, variant in entry.get("variants", {}).items():
            results.append(verify_onnx(directory / variant["file"], specs, f"{name}.{precision}", precision))
    return results
