"""Explicit Q/DQ graphs for TensorRT: static, calibrated INT8 or FP8 (E4M3) on the MatMul and Gemm inputs.

TensorRT builds quantized engines only from explicit quantization: QuantizeLinear/DequantizeLinear
pairs in the ONNX graph, with the scales fixed ahead of time (its implicit INT8 calibrator is gone in
TensorRT 10+ and TensorRT-RTX). This module writes that graph with ONNX Runtime's static quantizer
(``quantize_static``, ``QuantFormat.QDQ``), calibrated on the pipeline's own inputs
(export/calibration.py), then checks it with the verifier every graph passes (``verify_onnx``):

  quantized:    the activation and weight inputs of every MatMul and Gemm (``op_types_to_quantize``),
                weights per output channel (``per_channel``), activations per tensor;
  int8:         activations and weights int8, symmetric (zero point 0: TensorRT takes no other),
                activation ranges by min/max over the calibration feeds;
  fp8:          E4M3 (``QFLOAT8E4M3FN``) for Hopper and Ada, ranges by ONNX Runtime's histogram
                method (``Distribution``, the only one it offers for float 8); the graph comes out at
                opset 19, where QuantizeLinear gained float 8;
  biases:       float (``QuantizeBias: False``): ONNX Runtime would store them int32, and TensorRT's
                DequantizeLinear takes only 8- and 4-bit inputs (TensorRT-RTX 1.7's parser refuses
                the graph: "input has type Int32 but must have type FP8, FP4, Int4, Int8, or UInt8");
                TensorRT adds a float bias inside the quantized GEMM anyway.

What stays outside every Q/DQ pair, and why:

- LayerNormalization and the RMSNorm reductions (Pow, ReduceMean, Add, Sqrt, Div): not in the op
  list. With ONNX Runtime's default op list the static path puts DequantizeLinear on the input, scale
  and bias of every LayerNorm; the verifier refuses such a graph, naming the node;
- Softmax and the elementwise ops: not in the op list, so they read dequantized float tensors;
- the time embedding (``time_mlp``, every block's ``time_proj``) and the vocabulary head
  (``token_decoder.head``), the float modules of export/quantize.py (``FLOAT_MODULES``): the time
  embedding is one row per sample, so quantizing it saves nothing while its error shifts every
  position at every step; the head's argmax margins between tokens are small.

Measured on tiny (random norms; ONNX Runtime CPU against the fp32 graph, per-sample cosine, the denoiser
on a held-out 8 x 16 trajectory of all 21 steps): int8 denoiser >= 0.99996 (max abs 0.04), fp8 >= 0.9993
(max abs 0.20); decoder logits int8 >= 0.9993, fp8 >= 0.989 (argmax tokens 93% and 80% of fp32's: random weights, small margins). Calibration inputs take 2-6 s (the eager
denoiser trajectory; 2 loaded cores), quantization 0.2-1.5 s per graph. TensorRT-RTX 1.7 parses and
AOT-builds both the int8 and the fp8 graphs of all three graphs without a GPU (0.7-1.8 s each).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from ldlm.export.layernorm.verify import LayerNormSpec, VerifyResult, verify_all, verify_onnx
from ldlm.export.quantize import FLOAT_MODULES, float_kept_nodes, require_quantizer
from ldlm.export.trt_flavor import Flavor

if TYPE_CHECKING:
    from ldlm.export.calibration import CalibrationSettings
    from ldlm.pipeline import LDLMPipeline

QDQ_PRECISIONS: tuple[str, ...] = ("int8", "fp8")
QUANTIZED_OP_TYPES: tuple[str, ...] = ("MatMul", "Gemm")
# symmetric: TensorRT takes only zero points of 0; float biases: TensorRT's DequantizeLinear refuses int32 inputs
QDQ_EXTRA_OPTIONS: dict[str, Any] = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False}
METHOD = "onnxruntime.quantization.quantize_static (QDQ; MatMul/Gemm inputs; weights per channel; symmetric; biases float)"


class QdqError(ValueError):
    """A Q/DQ graph that cannot be made, or that came out wrong; the message names the value or node."""


@dataclass(frozen=True)
class QdqReport:
    precision: str
    quantized: list[str]  # MatMul/Gemm nodes whose weight now comes from a DequantizeLinear
    kept_float: list[str]  # MatMul/Gemm nodes of FLOAT_MODULES, left without Q/DQ on purpose
    quantize_linear_nodes: int
    calibration_feeds: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "method": METHOD,
            "quantized_nodes": len(self.quantized),
            "kept_float_nodes": self.kept_float,
            "quantize_linear_nodes": self.quantize_linear_nodes,
            "calibration_feeds": self.calibration_feeds,
            "seconds": round(self.seconds, 3),
        }


def check_qdq_precision(precision: str) -> None:
    if precision not in QDQ_PRECISIONS:
        raise QdqError(f"precision={precision!r} has no Q/DQ path; allowed: {', '.join(QDQ_PRECISIONS)}")


def write_qdq(src: str | os.PathLike[str], dst: str | os.PathLike[str], precision: str, reader: Any) -> QdqReport:
    """Write the calibrated ``precision`` Q/DQ graph of the fp32 ONNX file ``src`` to ``dst`` (one file: 8-bit
    weights are a quarter of fp32's, and the float modules are small). ``reader``: an ONNX Runtime
    ``CalibrationDataReader`` with the graph's inputs (export/calibration.py)."""
    check_qdq_precision(precision)
    require_quantizer()
    # an optional dependency (the cpu extra), imported when a Q/DQ graph is asked for
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    counted = _CountingReader(reader)
    keep = float_kept_nodes(onnx.load(str(src), load_external_data=False))
    quant_type = QuantType.QInt8 if precision == "int8" else QuantType.QFLOAT8E4M3FN
    start = time.perf_counter()
    quantize_static(
        str(src),
        str(dst),
        counted,
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=list(QUANTIZED_OP_TYPES),
        per_channel=True,
        activation_type=quant_type,
        weight_type=quant_type,
        calibrate_method=CalibrationMethod.MinMax if precision == "int8" else CalibrationMethod.Distribution,
        nodes_to_exclude=keep,
        extra_options=dict(QDQ_EXTRA_OPTIONS),
    )
    seconds = time.perf_counter() - start
    model = onnx.load(str(dst), load_external_data=False)
    quantized, kept = _quantized_and_float(model.graph, keep)
    if sorted(kept) != sorted(keep):
        raise QdqError(f"{dst}: the quantizer put Q/DQ on {sorted(set(keep) - set(kept))}, which stay float ({', '.join(FLOAT_MODULES)})")
    if not quantized:
        raise QdqError(f"{dst}: no MatMul or Gemm weight was quantized; the Q/DQ graph would be an fp32 graph")
    quantize_linear = sum(1 for n in model.graph.node if n.op_type == "QuantizeLinear")
    return QdqReport(precision, quantized, kept, quantize_linear, counted.count, seconds)


def lower_qdq(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], precision: str, reader: Any, specs: Sequence[LayerNormSpec], name: str
) -> tuple[QdqReport, VerifyResult]:
    """``write_qdq``, then the verifier every graph passes (LayerNorms float32, no Q/DQ on any norm, the
    precision claimed); the caller decides what a failed verification means."""
    report = write_qdq(src, dst, precision, reader)
    return report, verify_onnx(Path(dst), specs, f"{name} ({precision} Q/DQ)", precision)


def calibrated_qdq(
    src: Path,
    dst: Path,
    name: str,
    specs: Sequence[LayerNormSpec],
    precision: str,
    pipeline: LDLMPipeline,
    settings: CalibrationSettings | None = None,
) -> dict[str, Any]:
    """The Q/DQ graph of the fp32 graph ``name`` at ``src``, calibrated on ``pipeline``'s inputs (export/calibration.py)
    and verified (raises ``VerificationError`` naming every problem); returns what a plan's manifest records of it."""
    from ldlm.export.calibration import CalibrationSettings, calibration_reader  # needs torch and ONNX Runtime: imported when calibrating

    settings = settings or CalibrationSettings()
    start = time.perf_counter()
    reader = calibration_reader(pipeline, name, settings)
    inputs_seconds = time.perf_counter() - start
    report, verification = lower_qdq(src, dst, precision, reader, specs, name)
    verify_all([verification])
    return {**report.to_dict(), "calibration": settings.to_dict(), "calibration_inputs_seconds": round(inputs_seconds, 3)}


def qdq_refusal(flavor: Flavor, precision: str, error: Exception) -> str:
    """What a refused Q/DQ build means: which flavour refused which precision, and what can build it."""
    gpus = "INT8 from compute capability 7.5" if precision == "int8" else "FP8 from compute capability 8.9 (Ada, Hopper)"
    if flavor.is_rtx:
        return (
            f"TensorRT-RTX {flavor.version} (flavor tensorrt_rtx) refused the {precision.upper()} Q/DQ graph: full NVIDIA TensorRT "
            f"on a GPU is needed (--flavor tensorrt on a GPU that runs {gpus}). TensorRT-RTX said: {error}"
        )
    return (
        f"NVIDIA TensorRT {flavor.version} (flavor tensorrt) refused the {precision.upper()} Q/DQ graph; it needs a GPU that runs "
        f"{gpus}. TensorRT said: {error}"
    )


def _quantized_and_float(graph: onnx.GraphProto, keep: Sequence[str]) -> tuple[list[str], list[str]]:
    """(MatMul/Gemm nodes whose weight comes from a DequantizeLinear, FLOAT_MODULES nodes read without one)."""
    producer = {out: node for node in graph.node for out in node.output}

    def dequantized(name: str) -> bool:
        made_by = producer.get(name)
        return made_by is not None and made_by.op_type == "DequantizeLinear"

    matmuls = [n for n in graph.node if n.op_type in QUANTIZED_OP_TYPES]
    quantized = [n.name for n in matmuls if len(n.input) > 1 and dequantized(n.input[1])]
    kept = [n.name for n in matmuls if n.name in keep and not any(dequantized(i) for i in n.input)]
    return quantized, kept


class _CountingReader:
    """Passes ONNX Runtime the reader's feeds and counts them (the report says how many calibrated the scales)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.count = 0

    def get_next(self) -> Any:
        feed = self.reader.get_next()
        self.count += feed is not None
        return feed

    def __iter__(self) -> Any:
        return iter(self.get_next, None)
