"""The INT8 denoiser keeps its time embedding float: the MatMuls of ``time_mlp`` and of every block's
``time_proj``, found by their module paths in the fp32 graph (not by the quantizer's own list), are still
float MatMuls in the variant. Their one row per sample saves no time, and an error there moves every
position at every step."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from ldlm.export.layernorm.verify import node_name_scopes

pytest.importorskip("onnxruntime.quantization", reason="INT8 variants need ONNX Runtime's quantization tools (pip install -e .[cpu])")

TIME_EMBEDDING = ("time_mlp", "time_proj")


def test_the_int8_denoiser_keeps_its_time_embedding_float(int8_export_dir: Path) -> None:
    source = onnx.load(str(int8_export_dir / "denoiser.onnx"), load_external_data=False)
    time_nodes = [
        n.name
        for n in source.graph.node
        if n.op_type in ("MatMul", "Gemm") and any(scope.endswith(TIME_EMBEDDING) for scope in node_name_scopes(n))
    ]
    assert len(time_nodes) >= 3, time_nodes  # time_mlp's two Linears and each block's projection
    variant = onnx.load(str(int8_export_dir / "denoiser.int8.onnx"))
    ops = {n.name: n.op_type for n in variant.graph.node}
    # ONNX Runtime splits a Gemm into <name>_MatMul + <name>_Add before it quantizes
    quantized = [name for name in time_nodes if "MatMul" not in (ops.get(name), ops.get(f"{name}_MatMul"))]
    assert quantized == [], f"time-embedding nodes quantized: {quantized}"
    assert any(op == "MatMulInteger" for op in ops.values())  # the rest of the denoiser is int8
