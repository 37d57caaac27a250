"""INT8 variants of exported graphs for ONNX Runtime on CPU (the checks every graph passes are in ``verify_quantized``).

The variant is ONNX Runtime's dynamic quantization of the weights of MatMul and Gemm nodes (int8
weights, activations quantized per call): ``MatMulInteger`` where a float ``MatMul`` was. What stays
float, and why:

- LayerNormalization, RMSNorm (Pow, ReduceMean, Sqrt, Div) and Softmax: not MatMuls, so the dynamic
  path never touches them; the checks below prove it on every variant.
- MatMuls whose both inputs are activations (attention scores, attention times values): only
  constant weights are quantized (``MatMulConstBOnly``).
- The time embedding (``time_mlp`` and every block's ``time_proj``): one row per sample, so no
  time is saved, and an error there shifts every position at every step.
- The vocabulary head (``token_decoder.head``): the argmax margins between tokens are small.

Which graphs get a variant: by default the denoiser (``DEFAULT_QUANTIZED_GRAPHS``: it runs at every
step, and is where the time goes); the decoder on request (``QUANTIZABLE_GRAPHS``). Measured on base
with random norms (default sampler and steps, 8 x 32 tokens against eager fp32): the int8 denoiser
keeps 99.2% of the tokens, the int8 decoder beside it brings that to 95.3% (its argmax margins are
small), for 1.76x on the decoder alone. The encoder stays float: GPT-2's middle layers have a few
channels of very large magnitude, where reduced precision breaks first, and it runs once per prompt.

Weights are quantized per output channel: on the trained reference checkpoint the int8 denoiser kept
89.8% of the tokens per channel against 80.9% per tensor, at the same speed on base.

An accuracy floor (``AccuracyFloor``): random weights hide what INT8 costs a trained model, so the
variant is measured before it is kept. Its outputs on the floor's feeds (the denoiser's inputs along
the default sampler's trajectory, export/calibration.py) must keep a worst per-sample cosine of
``min_cosine`` against the fp32 graph. When the whole graph misses it, each weight node is quantized
alone and its error (1 - cosine) measured; the least harmful nodes are quantized while their errors
add up to at most the floor's budget (errors of separate nodes add roughly: on the trained reference's
denoiser the sixteen single-node errors summed to 3.5e-3 and the whole graph's was 2.9e-3), the rest
stay float, and the result is measured again (dropping the most harmful chosen node until it holds).
On base with random norms the whole graph passes at once (0.99994): nothing is kept back, nothing is
slower. The errors come from activations quantized per tensor on the fly: a trained model's down
projections carry outlier channels.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from tqdm import tqdm

from ldlm.export.layernorm.compare import sample_cosines
from ldlm.export.layernorm.verify import node_name_scopes

Feed = dict[str, np.ndarray]  # one ONNX Runtime feed: input name -> array

QUANTIZE_CHOICES: tuple[str, ...] = ("int8",)
QUANTIZABLE_GRAPHS: tuple[str, ...] = ("denoiser", "decoder")
DEFAULT_QUANTIZED_GRAPHS: tuple[str, ...] = ("denoiser",)
FLOAT_MODULES: tuple[str, ...] = ("time_mlp", "time_proj", "token_decoder.head")  # module paths end with these
# The floor's default: per-call cosine 0.9999 is a relative error of about 1.4%. Measured on the trained
# reference (default sampler and steps): random noise of 1% relative kept 99.8% of the tokens and 8%
# (cosine 0.9968, the whole int8 denoiser's) kept 89.8%; the int8 graph itself kept 82%.
DEFAULT_MIN_COSINE = 0.9999


class QuantizeError(ValueError):
    """A quantization that cannot run here, or whose inputs are wrong; the message says what is allowed."""


@dataclass(frozen=True)
class QuantizeReport:
    quantized: list[str]  # MatMul/Gemm nodes whose weights became int8
    kept_float: list[str]  # MatMul/Gemm nodes with a constant weight kept float on purpose (FLOAT_MODULES)
    kept_for_accuracy: list[str] = field(default_factory=list)  # kept float because quantizing them broke the floor
    worst_cosine: float | None = None  # the variant's worst per-sample cosine against fp32 on the floor's feeds
    node_errors: dict[str, float] = field(default_factory=dict)  # 1 - cosine of each node quantized alone (when measured)


@dataclass(frozen=True)
class AccuracyFloor:
    """``feeds``: inputs of the graph as it really runs; the variant's first output must keep a worst
    per-sample cosine of ``min_cosine`` against the fp32 graph's on every feed."""

    feeds: Sequence[Feed]
    min_cosine: float = DEFAULT_MIN_COSINE

    def __post_init__(self) -> None:
        if not 0 <= self.min_cosine <= 1:
            raise QuantizeError(f"min_cosine={self.min_cosine} is out of range; allowed: 0..1 (0: no floor)")
        if not self.feeds:
            raise QuantizeError("an accuracy floor without feeds; allowed: at least one feed of the graph's inputs")


def float_kept_nodes(model: onnx.ModelProto) -> list[str]:
    """MatMul/Gemm nodes inside a FLOAT_MODULES module, by torch.onnx's recorded module path."""
    return [
        n.name
        for n in model.graph.node
        if n.op_type in ("MatMul", "Gemm") and any(scope.endswith(FLOAT_MODULES) for scope in node_name_scopes(n))
    ]


def require_quantizer() -> None:
    try:
        import onnxruntime.quantization  # noqa: F401
    except ImportError as error:
        raise QuantizeError("--quantize int8 needs ONNX Runtime's quantization tools: pip install 'ldlm[cpu]'") from error


def weight_nodes(model: onnx.ModelProto) -> list[str]:
    """MatMul/Gemm nodes with a constant weight: what the dynamic path can quantize."""
    constants = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and any(i in constants for i in n.input)]


def quantize_int8(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], floor: AccuracyFloor | None = None, progress: bool = False
) -> QuantizeReport:
    """Write the dynamic INT8 variant of the ONNX file ``src`` to ``dst`` (one file: int8 weights are a
    quarter of fp32's, far below protobuf's 2 GB). With ``floor``, nodes whose quantization would break it
    stay float (module docs)."""
    require_quantizer()
    source = onnx.load(str(src), load_external_data=False)
    keep = float_kept_nodes(source)
    candidates = [n for n in weight_nodes(source) if n not in keep]
    _quantize_dynamic(src, dst, keep)
    if floor is None or floor.min_cosine == 0:
        return _report(src, dst, keep)
    measure = VariantAccuracy(src, floor.feeds)
    worst = measure(dst)
    if worst >= floor.min_cosine:
        return _report(src, dst, keep, worst=worst)
    errors: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        one = Path(scratch) / "one.onnx"
        for node in tqdm(candidates, desc="int8 nodes, one at a time", unit="node", disable=not progress):
            _quantize_dynamic(src, one, keep + [n for n in candidates if n != node])
            errors[node] = 1.0 - measure(one)
    chosen: list[str] = []
    spent, budget = 0.0, 1.0 - floor.min_cosine
    for node in sorted(candidates, key=errors.__getitem__):
        if spent + errors[node] > budget:
            break
        chosen.append(node)
        spent += errors[node]
    while True:  # the sum only estimates the whole: measure it, and give up the most harmful node until it holds
        _quantize_dynamic(src, dst, keep + [n for n in candidates if n not in chosen])
        worst = measure(dst) if chosen else 1.0
        if worst >= floor.min_cosine or not chosen:
            break
        chosen.pop()
    return _report(src, dst, keep, [n for n in candidates if n not in chosen], worst, errors)


class VariantAccuracy:
    """The worst per-sample cosine of a variant's first output against the fp32 graph's, over ``feeds``."""

    def __init__(self, src: str | os.PathLike[str], feeds: Sequence[Feed]) -> None:
        self.feeds = list(feeds)
        self.reference = [out[0] for out in self._outputs(src)]

    def _outputs(self, path: str | os.PathLike[str]) -> list[list[np.ndarray]]:
        import onnxruntime as ort  # the cpu extra, as the quantizer itself (require_quantizer)

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return [session.run(None, feed) for feed in self.feeds]

    def __call__(self, variant: str | os.PathLike[str]) -> float:
        outputs = self._outputs(variant)
        return min(float(sample_cosines(ref, out[0]).min()) for ref, out in zip(self.reference, outputs))


def _quantize_dynamic(src: str | os.PathLike[str], dst: str | os.PathLike[str], exclude: list[str]) -> None:
    # an optional dependency (the cpu extra), imported when a variant is asked for
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    root.addFilter(_drop_preprocessing_hint)  # repeated once per node by the floor's measurements
    try:
        quantize_dynamic(
            str(src),
            str(dst),
            op_types_to_quantize=["MatMul", "Gemm"],
            weight_type=QuantType.QInt8,
            # ONNX Runtime splits a Gemm into <name>_MatMul + <name>_Add before it matches names: exclude both
            nodes_to_exclude=exclude + [f"{name}_MatMul" for name in exclude],
            extra_options={"MatMulConstBOnly": True},
        )
    finally:
        root.removeFilter(_drop_preprocessing_hint)


def _drop_preprocessing_hint(record: logging.LogRecord) -> bool:
    """ONNX Runtime's advice to run its shape-inference pre-processing first: it adds nothing for these graphs,
    whose MatMul weights are constants either way."""
    return "pre-processing before quantization" not in record.getMessage()


def _report(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    keep: list[str],
    for_accuracy: Sequence[str] = (),
    worst: float | None = None,
    errors: dict[str, float] | None = None,
) -> QuantizeReport:
    quantized = onnx.load(str(dst), load_external_data=False)
    done = [n.name.removesuffix("_quant") for n in quantized.graph.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")]
    floats = [n.name for n in quantized.graph.node if n.op_type in ("MatMul", "Gemm")]
    missing = sorted((set(keep) | set(for_accuracy)) - {name.removesuffix("_MatMul") for name in floats})
    if missing:
        raise QuantizeError(f"{src}: the quantizer did not keep {missing} float")
    kept = [name for name in floats if name.removesuffix("_MatMul") in keep]
    return QuantizeReport(done, kept, list(for_accuracy), worst, dict(errors or {}))


def variant_file(graph: str, precision: str) -> str:
    return f"{graph}.{precision}.onnx"
