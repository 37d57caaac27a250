"""Build stage: verified ONNX -> TensorRT plans, one per graph, each with a manifest beside it.

For each graph: lower to the requested precision, parse with NVIDIA's ONNX parser from the file
path (so external data is found), check the parsed network's LayerNorms
(export/layernorm/trt_network.py), add the optimization profiles, build, and write
``<graph>.plan`` + ``<graph>.plan.json``. Works with TensorRT and TensorRT-RTX alike.

Lowering: fp16 and bf16 by the cast pass (export/precision.py); int8 and fp8 by a calibrated
explicit Q/DQ graph (export/qdq.py). The Q/DQ graph is made here, at build time, from the export
and the checkpoint it was made from (``BuildOptions.calibration_checkpoint``): calibration needs the
eager pipeline (export/calibration.py), the export stays one precision-neutral set of fp32 graphs
that every build starts from, and the Q/DQ file the plan was built from lands beside the plan
(``<graph>.<precision>.onnx``), its calibration recorded in the plan's manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from ldlm import __version__
from ldlm.export.artifact import MANIFEST_SUFFIX, PLAN_SUFFIX, check_artifacts, read_manifest, sha256_file
from ldlm.export.layernorm.trt_network import check_network_layer_norms, parse_onnx_network
from ldlm.export.layernorm.verify import LayerNormSpec, verify_all, verify_onnx
from ldlm.export.precision import PRECISIONS, lower_precision
from ldlm.export.profiles import EngineProfile, default_profiles, profile_shapes
from ldlm.export.qdq import QDQ_PRECISIONS, qdq_refusal
from ldlm.export.trt_flavor import (
    EngineBuildError,
    Flavor,
    flavor_logger,
    gpu_info,
    is_strongly_typed,
    layernorm_overflow_warnings,
    load_flavor,
)
from ldlm.files import atomic_directory, command_writer, refuse_existing, write_atomically
from ldlm.interrupts import deferred_interrupts, interrupted, raise_if_interrupted
from ldlm.model.checkpoint import CONFIG_FILE
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TOKENIZER_FILE

if TYPE_CHECKING:
    from ldlm.export.calibration import CalibrationSettings

BUILD_PRECISIONS: tuple[str, ...] = (*PRECISIONS, *QDQ_PRECISIONS)


@dataclass(frozen=True)
class BuildOptions:
    precision: str = "fp32"
    profiles: tuple[EngineProfile, ...] = ()  # empty: default_profiles(config)
    tf32: bool = False  # TensorRT enables TF32 by default; FP32 parity needs it off
    optimization_level: int = 3
    workspace_mb: int | None = None
    timing_cache: str | None = None  # TensorRT only; TensorRT-RTX's timing cache is a no-op
    calibration_checkpoint: str | None = None  # int8, fp8: the checkpoint the export was made from
    calibration: CalibrationSettings | None = None  # int8, fp8: None is CalibrationSettings()

    def __post_init__(self) -> None:
        if self.precision not in BUILD_PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is unsupported; allowed: {', '.join(BUILD_PRECISIONS)}")
        quantized = self.precision in QDQ_PRECISIONS
        if quantized and self.calibration_checkpoint is None:
            raise ValueError(
                f"precision={self.precision!r} needs calibration_checkpoint (--calibration-checkpoint): the checkpoint the export "
                "was made from, whose eager pipeline makes the calibration inputs"
            )
        if not quantized and (self.calibration_checkpoint is not None or self.calibration is not None):
            raise ValueError(f"calibration settings apply only to precision {' or '.join(QDQ_PRECISIONS)}; precision={self.precision!r}")
        if not 0 <= self.optimization_level <= 5:
            raise ValueError(f"optimization_level={self.optimization_level} is out of range; allowed: 0..5")
        if self.workspace_mb is not None and self.workspace_mb < 1:
            raise ValueError(f"workspace_mb={self.workspace_mb} is out of range; allowed: >= 1")


@dataclass
class EngineBuildResult:
    out: Path
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)  # graph -> plan manifest


def build_engines(
    onnx_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: BuildOptions = BuildOptions(),
    graphs: Sequence[str] | None = None,
    flavor: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> EngineBuildResult:
    """Build one plan per graph of the export in ``onnx_dir`` into ``out`` (atomically). ``overwrite`` replaces
    only an earlier build's output, unchanged since (``ldlm.files.refuse_existing``)."""
    refuse_existing(out, overwrite, {"export": onnx_dir}, BUILD_WRITER)  # before the export is hashed
    onnx_dir = Path(onnx_dir)
    if not onnx_dir.is_dir():
        raise ValueError(f"ONNX directory {onnx_dir} does not exist; make one with `ldlm export`")
    manifest = read_manifest(onnx_dir)
    check_artifacts(onnx_dir, manifest)  # build only from files that match their sha256 and pass verify-onnx
    config = LDLMConfig.load(onnx_dir / CONFIG_FILE)
    graphs = list(graphs or manifest["graphs"])
    unknown = [g for g in graphs if g not in manifest["graphs"]]
    if unknown:
        raise ValueError(f"graphs {unknown} are not in {onnx_dir}; allowed: {', '.join(manifest['graphs'])}")
    profiles = options.profiles or default_profiles(config)
    for profile in profiles:
        profile.check(config.max_seq_len)
    build = _Build(load_flavor(flavor), options, profiles, onnx_dir, manifest, progress)
    if options.precision in QDQ_PRECISIONS and options.calibration_checkpoint is not None:
        # ONNX Runtime's quantization tools (the cpu extra), imported when a Q/DQ build is asked for
        from ldlm.export.calibration import calibration_pipeline

        build.pipeline = calibration_pipeline(options.calibration_checkpoint, manifest)  # refused before any file is written
    result = EngineBuildResult(Path(out))
    with atomic_directory(out, overwrite, BUILD_WRITER) as tmp:
        shutil.copy(onnx_dir / CONFIG_FILE, tmp / CONFIG_FILE)
        if (onnx_dir / TOKENIZER_FILE).is_file():
            shutil.copy(onnx_dir / TOKENIZER_FILE, tmp / TOKENIZER_FILE)
        for name in tqdm(graphs, desc="build-engine", unit="graph", disable=not progress):
            raise_if_interrupted()
            result.plans[name] = _build_graph(build, name, tmp)
            (tmp / f"{name}{MANIFEST_SUFFIX}").write_text(json.dumps(result.plans[name], indent=2) + "\n")
    return result


BUILD_WRITER = command_writer("build-engine")  # what an engine directory is recorded as written by (ldlm.files.OUTPUT_RECORD)


@dataclass
class _Build:
    """One build's flavour, options and source export, shared by its graphs."""

    flavor: Flavor
    options: BuildOptions
    profiles: Sequence[EngineProfile]
    onnx_dir: Path
    manifest: dict[str, Any]  # the export's
    progress: bool
    pipeline: Any = None  # int8, fp8: the calibration pipeline (export/calibration.py)


def _build_graph(build: _Build, name: str, tmp: Path) -> dict[str, Any]:
    """One graph lowered to the build's precision (where asked), built into ``tmp``: its plan manifest."""
    options, entry = build.options, build.manifest["graphs"][name]
    specs = [LayerNormSpec.from_dict(d) for d in entry["layer_norms"]]
    source = build.onnx_dir / entry["file"]  # verified with the export (check_artifacts)
    parsed, quantization = source, None
    if build.pipeline is not None:
        from ldlm.export.qdq import calibrated_qdq  # ONNX Runtime's quantizer (the cpu extra), for Q/DQ builds only

        parsed = tmp / f"{name}.{options.precision}.onnx"
        quantization = calibrated_qdq(source, parsed, name, specs, options.precision, build.pipeline, options.calibration)
    elif options.precision != "fp32":
        parsed = tmp / f"{name}.{options.precision}.onnx"
        lower_precision(source, parsed, options.precision)
        verify_all([verify_onnx(parsed, specs, f"{name} ({options.precision})")])
    try:
        plan_manifest = build_plan(
            build.flavor, parsed, tmp / f"{name}{PLAN_SUFFIX}", entry, specs, build.profiles, options, build.progress
        )
    except EngineBuildError as error:  # a Q/DQ graph the flavour refuses is reported as what it is
        if quantization is None:
            raise
        raise EngineBuildError(qdq_refusal(build.flavor, options.precision, error)) from error
    if quantization is not None:
        plan_manifest["quantization"] = quantization
    plan_manifest["graph"] = name
    plan_manifest["source_onnx"] = {"file": str(source), "sha256": entry["files"][entry["file"]]["sha256"]}
    # the copies beside the plans are checked against these (artifact.check_engine_dir)
    plan_manifest["tokenizer"] = build.manifest.get("tokenizer")
    plan_manifest["config_sha256"] = build.manifest["config_sha256"]
    plan_manifest["checkpoint_weights_sha256"] = build.manifest.get("checkpoint_weights_sha256")
    return plan_manifest


def build_plan(
    flavor: Flavor,
    onnx_path: Path,
    plan_path: Path,
    entry: dict[str, Any],
    specs: Sequence[LayerNormSpec],
    profiles: Sequence[EngineProfile],
    options: BuildOptions,
    progress: bool = False,
) -> dict[str, Any]:
    logger = flavor_logger(flavor)
    # the messages are this build's (the shared logger keeps only the last few); a Ctrl-C is only recorded
    # while TensorRT parses and builds (raised in its callbacks, it would be printed and lost)
    with logger.capture() as messages, deferred_interrupts():
        serialized, seconds, strongly_typed = _build(flavor, onnx_path, specs, entry, profiles, options, progress)
    raise_if_interrupted()  # a Ctrl-C recorded during the build (the monitor cancelled it): reported, not a failure
    if serialized is None:
        errors = "; ".join(m for s, m in messages if s in ("ERROR", "INTERNAL_ERROR"))
        raise EngineBuildError(f"TensorRT could not build {onnx_path}: {errors or 'see the log above'}")
    overflow = layernorm_overflow_warnings(messages)
    if overflow:
        raise EngineBuildError(f"{onnx_path}: TensorRT warned of LayerNorm FP16 overflow (a LayerNorm arrived decomposed): {overflow[0]}")
    plan_path.write_bytes(bytes(serialized))
    gpu = gpu_info()
    return {
        "ldlm_version": __version__,
        "plan": plan_path.name,
        "plan_sha256": sha256_file(plan_path),
        "flavor": flavor.name,
        "trt_version": flavor.version,
        "precision": options.precision,
        "profiles": [p.to_dict() for p in profiles],
        "onnx": {"file": onnx_path.name, "sha256": sha256_file(onnx_path)},
        "build_flags": {
            "strongly_typed": strongly_typed,
            "tf32": options.tf32,
            "optimization_level": options.optimization_level,
            "workspace_mb": options.workspace_mb,
            "timing_cache": None if flavor.is_rtx else options.timing_cache,
        },
        "build_host": {"gpu": gpu.name, "compute_capability": gpu.compute_capability, "description": gpu.description},
        "build_seconds": round(seconds, 3),
        "layer_norms": len(specs),
        # what the parsed network's INormalizationLayers were checked against: a server checks them against config.json
        "layer_norm_specs": [spec.to_dict() for spec in specs],
        "inputs": entry["inputs"],
        "outputs": entry["outputs"],
        "warnings": [m for s, m in messages if s == "WARNING"][:20],
    }


def _build(
    flavor: Flavor,
    onnx_path: Path,
    specs: Sequence[LayerNormSpec],
    entry: dict[str, Any],
    profiles: Sequence[EngineProfile],
    options: BuildOptions,
    progress: bool,
) -> tuple[Any, float, bool]:
    """Parse, check the LayerNorms, configure, build: (serialized plan or None, seconds, strongly typed)."""
    trt = flavor.trt
    if not onnx_path.is_file():
        raise EngineBuildError(f"{onnx_path} does not exist")
    builder, network, _parser = parse_onnx_network(flavor, onnx_path)  # the parser owns weights the network uses
    layer_norm_problems = check_network_layer_norms(trt, network, specs)
    if layer_norm_problems:
        raise EngineBuildError(f"{onnx_path}: LayerNorm check after parsing failed:\n  - " + "\n  - ".join(layer_norm_problems))

    config = builder.create_builder_config()
    for profile in profiles:
        trt_profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile_shapes(entry["inputs"], profile).items():
            trt_profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(trt_profile)
    if not options.tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    config.builder_optimization_level = options.optimization_level
    if options.workspace_mb is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mb << 20)
    timing_cache = _attach_timing_cache(flavor, config, options.timing_cache)
    # always attached: besides the bar (with ``progress``) it is what cancels a build at a Ctrl-C
    monitor = BuildProgress(trt, onnx_path.stem, progress) if hasattr(trt, "IProgressMonitor") else None
    if monitor is not None:
        config.progress_monitor = monitor
    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if monitor is not None:
        monitor.close()
    if serialized is not None and timing_cache is not None:
        write_atomically(timing_cache, bytes(config.get_timing_cache().serialize()))
    return serialized, seconds, is_strongly_typed(trt, network)


def _attach_timing_cache(flavor: Flavor, config: Any, path: str | None) -> str | None:
    if path is None or flavor.is_rtx:  # RTX: timing caches are no-ops; its runtime cache lives at run time
        return None
    data = Path(path).read_bytes() if Path(path).is_file() else b""
    config.set_timing_cache(config.create_timing_cache(data), ignore_mismatch=False)
    return str(path)


def BuildProgress(trt: Any, label: str, show: bool = True) -> Any:  # noqa: N802 (a class per flavour, built on its IProgressMonitor)
    """A tqdm bar over TensorRT's top-level build phases (IProgressMonitor).

    TensorRT calls ``phase_start(phase_name, parent_phase, num_steps)``; a phase without a parent is
    a top-level phase and gets the bar (drawn when ``show``), nested phases show as its postfix.
    ``phases`` keeps the (name, parent, steps) of every phase started, for the log and the tests.
    A step after a Ctrl-C returns False, which cancels the build.
    """

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.bar: tqdm | None = None
            self.top: str | None = None
            self.phases: list[tuple[str, str | None, int]] = []

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.phases.append((phase_name, parent_phase, int(num_steps)))
            if parent_phase is None:
                if self.bar is not None:
                    self.bar.close()
                self.top = phase_name
                self.bar = tqdm(total=int(num_steps), desc=f"  {label}: {phase_name[:40]}", unit="step", leave=False, disable=not show)
            elif self.bar is not None:
                self.bar.set_postfix_str(phase_name[:40])

        def step_complete(self, phase_name: str, step: int) -> bool:
            if self.bar is not None and phase_name == self.top:
                self.bar.update(1)
            return not interrupted()  # False cancels the build (a Ctrl-C is only recorded while it runs)

        def phase_finish(self, phase_name: str) -> None:
            if phase_name == self.top and self.bar is not None:
                self.bar.close()
                self.bar = None

        def close(self) -> None:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return Monitor()


def plan_summary(manifest: dict[str, Any]) -> str:
    return (
        f"{manifest['graph']}: {manifest['plan']} ({manifest['flavor']} {manifest['trt_version']}, "
        f"{manifest['precision']}, {len(manifest['profiles'])} profile(s), {manifest['layer_norms']} LayerNorm(s) checked, "
        f"built in {manifest['build_seconds']} s on {manifest['build_host']['description']})"
    )
