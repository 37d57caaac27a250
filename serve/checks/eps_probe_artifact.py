"""The eps probes of one artifact: an ``ldlm export`` directory on ONNX Runtime
(``eps_probe_ort``) or an ``ldlm build-engine`` directory on TensorRT (``eps_probe_trt``), each
LayerNorm against the checkpoint's own module. The method and its tolerances: ``eps_probe``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ldlm.export.artifact import check_from_checkpoint
from ldlm.export.layernorm.eps_probe import EpsProbeReport
from ldlm.export.layernorm.eps_probe_ort import probe_onnx_export
from ldlm.export.layernorm.eps_probe_trt import probe_engines
from ldlm.model.checkpoint import load_checkpoint
from ldlm.model.ldlm import LDLM
from ldlm.serve.runtime.registry import PROBE_BACKENDS


def probe_layer_norm_eps(
    checkpoint: str | os.PathLike[str] | LDLM,
    onnx_dir: str | os.PathLike[str] | None = None,
    engine_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
    flavor: str | None = None,
    progress: bool = False,
) -> EpsProbeReport:
    """Probe every LayerNorm of an ``ldlm export`` directory (ONNX Runtime) or an ``ldlm build-engine``
    directory (TensorRT; ``onnx_dir`` then says where the ONNX the plans were built from lives, when
    it is not where the plan manifests say) against the checkpoint's modules. ``checkpoint`` may be
    a model already loaded from one (parity has it at hand)."""
    check_artifact(onnx_dir, engine_dir)  # before the checkpoint is loaded
    if not isinstance(checkpoint, LDLM):
        for directory in (onnx_dir, engine_dir):
            if directory is not None:
                check_from_checkpoint(checkpoint, directory)
    model = checkpoint if isinstance(checkpoint, LDLM) else load_checkpoint(checkpoint)[0]
    start = time.perf_counter()
    if engine_dir is not None:
        report = probe_engines(
            model, Path(engine_dir), None if onnx_dir is None else Path(onnx_dir), seed, flavor, progress, backend=PROBE_BACKENDS["engines"]
        )
    else:
        report = probe_onnx_export(model, Path(onnx_dir), seed, providers, progress, backend=PROBE_BACKENDS["export"])  # type: ignore[arg-type]
    report.seconds = round(time.perf_counter() - start, 3)
    return report


def check_artifact(onnx_dir: str | os.PathLike[str] | None, engine_dir: str | os.PathLike[str] | None) -> None:
    """A ValueError unless an artifact is given and each directory given exists."""
    if onnx_dir is None and engine_dir is None:
        raise ValueError("an artifact is needed; allowed: --onnx-dir DIR (ONNX Runtime) or --engine-dir DIR (TensorRT)")
    for name, path in (("onnx_dir", onnx_dir), ("engine_dir", engine_dir)):
        if path is not None and not Path(path).is_dir():
            raise ValueError(
                f"{name}={str(path)!r} is not a directory; allowed: a directory written by "
                f"{'`ldlm export`' if name == 'onnx_dir' else '`ldlm build-engine`'}"
            )
