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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnx

from ldlm.export.verify import node_name_scopes

QUANTIZE_CHOICES: tuple[str, ...] = ("int8",)
QUANTIZABLE_GRAPHS: tuple[str, ...] = ("denoiser", "decoder")
DEFAULT_QUANTIZED_GRAPHS: tuple[str, ...] = ("denoiser",)
FLOAT_MODULES: tuple[str, ...] = ("time_mlp", "time_proj", "token_decoder.head")  # module paths end with these


class QuantizeError(ValueError):
    """A quantization that cannot run here, or whose inputs are wrong; the message says what is allowed."""


@dataclass(frozen=True)
class QuantizeReport:
    quantized: list[str]  # MatMul/Gemm nodes whose weights became int8
    kept_float: list[str]  # MatMul/Gemm nodes with a constant weight kept float on purpose (FLOAT_MODULES)


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


def quantize_int8(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> QuantizeReport:
    """Write the dynamic INT8 variant of the ONNX file ``src`` to ``dst`` (one file: int8 weights are a
    quarter of fp32's, far below protobuf's 2 GB)."""
    require_quantizer()
    # an optional dependency (the cpu extra), imported when a variant is asked for
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = onnx.load(str(src), load_external_data=False)
    keep = float_kept_nodes(source)
    quantize_dynamic(
        str(src),
        str(dst),
        op_types_to_quantize=["MatMul", "Gemm"],
        weight_type=QuantType.QInt8,
        # ONNX Runtime splits a Gemm into <name>_MatMul + <name>_Add before it matches names: exclude both
        nodes_to_exclude=keep + [f"{name}_MatMul" for name in keep],
        extra_options={"MatMulConstBOnly": True},
    )
    quantized = onnx.load(str(dst), load_external_data=False)
    done = [n.name.removesuffix("_quant") for n in quantized.graph.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")]
    kept = [n.name for n in quantized.graph.node if n.op_type in ("MatMul", "Gemm") and n.name.removesuffix("_MatMul") in keep]
    if len(kept) != len(keep):
        raise QuantizeError(f"{src}: the quantizer did not keep {sorted(set(keep) - {k.removesuffix('_MatMul') for k in kept})} float")
    return QuantizeReport(done, kept)


def variant_file(graph: str, precision: str) -> str:
    return f"{graph}.{precision}.onnx"
