"""Levels 1 and 2 of the parity check (serve/checks/parity.py): each graph's outputs, and each of its
LayerNorm outputs (ONNX Runtime), against eager PyTorch on random, padded and stress inputs, with the
padded positions masked out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from ldlm.export.layernorm.compare import compare_outputs, min_cosine
from ldlm.export.layernorm.verify import LayerNormSpec, pair_layer_norm_nodes
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer
from ldlm.serve.checks.parity_result import ParityOutputs, ParityReport
from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.ort_backend import OrtBackend
from ldlm.serve.runtime.torch_backends import EagerBackend

REAL_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "In 1905, Albert Einstein published four papers that changed physics.",
    "Latent diffusion models denoise continuous representations of text.",
]


def input_sets(model: LDLM, graph: str, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Named input sets for ``graph``: random, padded and stress (outliers / real text)."""
    cfg = model.config
    gen = np.random.default_rng(seed)
    b, length, d = 3, min(24, cfg.max_seq_len), cfg.d_model
    full = np.ones((b, length), dtype=np.int64)
    padded = full.copy()
    padded[1, length // 2 :] = 0
    padded[2, length // 3 :] = 0
    if graph == "encoder":
        ids = gen.integers(0, cfg.gpt2_vocab_size, (b, length))
        real = TextTokenizer.gpt2().encode(REAL_TEXT)
        n = min(max(len(r) for r in real), cfg.max_seq_len)
        real_ids = np.full((len(real), n), cfg.eos_token_id, dtype=np.int64)
        real_mask = np.zeros((len(real), n), dtype=np.int64)
        for i, row in enumerate(real):
            real_ids[i, : min(len(row), n)] = row[:n]
            real_mask[i, : min(len(row), n)] = 1
        return {
            "random": {"input_ids": ids, "attention_mask": full},
            "padded": {"input_ids": ids, "attention_mask": padded},
            "real-text": {"input_ids": real_ids, "attention_mask": real_mask},
        }
    x = gen.standard_normal((b, length, d)).astype(np.float32)
    outliers = x.copy()
    channels = gen.choice(d, size=max(2, d // 128), replace=False)
    outliers[:, :, channels] = 1000.0 + 200.0 * gen.standard_normal((b, length, len(channels)))  # GPT-2-like
    if graph == "denoiser":
        t = gen.uniform(0.05, 1.0, b).astype(np.float32)
        x0 = gen.standard_normal((b, length, d)).astype(np.float32)
        return {
            "random": {"x_t": x, "t": t, "x0_prev": x0, "attention_mask": full},
            "padded": {"x_t": x, "t": t, "x0_prev": x0, "attention_mask": padded},
            "stress-outliers": {"x_t": outliers, "t": t, "x0_prev": outliers, "attention_mask": full},
        }
    return {
        "random": {"latents": x, "attention_mask": full},
        "padded": {"latents": x, "attention_mask": padded},
        "stress-outliers": {"latents": outliers, "attention_mask": full},
    }


def _masked(array: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Zero the padded positions (axis 1) so that garbage there is not compared."""
    return array * mask.reshape(mask.shape + (1,) * (array.ndim - 2)).astype(array.dtype) if array.ndim >= 2 else array


def compare_graph(
    name: str,
    eager: GraphBackend,
    candidate: GraphBackend,
    sets: dict[str, dict[str, np.ndarray]],
    atol: float,
    rtol: float,
    report: ParityReport,
    outputs: ParityOutputs | None = None,
) -> None:
    """Every output of ``candidate`` against ``eager`` on each input set, into ``report`` (and, as they came
    out, into ``outputs``)."""
    for set_name, feed in sets.items():
        reference, got = eager.run(feed), candidate.run(feed)
        mask = feed["attention_mask"]
        for output in candidate.output_names:
            if outputs is not None:
                outputs.add(f"{name}/{set_name}/{output}", reference[output], got[output])
            if output == "token_ids":
                valid = mask.astype(bool)
                report.decoder_token_agreement[set_name] = float((got[output][valid] == reference[output][valid]).mean())
                continue
            report.graphs.append(
                compare_outputs(
                    f"{name}/{set_name}/{output}",
                    _masked(reference[output], mask),
                    _masked(got[output], mask),
                    atol,
                    rtol,
                    min_cosine(report.precision),
                )
            )


def layer_norm_debug_copy(src: Path, specs: list[LayerNormSpec], dst: Path) -> list[tuple[str, LayerNormSpec]]:
    """Copy an ONNX graph with every LayerNormalization output marked as a graph output."""
    model = onnx.load(str(src))
    nodes = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    marked = []
    for node, spec in pair_layer_norm_nodes(nodes, specs):
        model.graph.output.append(onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None))
        marked.append((node.output[0], spec))
    order = {n.output[0]: i for i, n in enumerate(nodes)}
    marked.sort(key=lambda m: order[m[0]])  # execution order, for bisecting
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return marked


def compare_layer_norms(
    name: str,
    model: LDLM,
    eager: EagerBackend,
    onnx_path: Path,
    specs: list[LayerNormSpec],
    sets: dict[str, dict[str, np.ndarray]],
    atol: float,
    rtol: float,
    work: Path,
    report: ParityReport,
    outputs: ParityOutputs | None = None,
) -> None:
    """Every LayerNorm output of the ONNX graph at ``onnx_path`` against its eager module's, on the random
    input set and the stress (or real-text) one, into ``report`` (and into ``outputs``)."""
    debug = work / f"{name}.layernorms.onnx"
    marked = layer_norm_debug_copy(onnx_path, specs, debug)
    if not marked:
        return
    session = OrtBackend(debug, name, model.config.max_seq_len).session
    for set_name in ("random", "stress-outliers" if "stress-outliers" in sets else "real-text"):
        feed = sets[set_name]
        captured: dict[str, np.ndarray] = {}
        hooks = [eager.module.get_submodule(spec.name).register_forward_hook(_capture(captured, spec.name)) for _, spec in marked]
        try:
            eager.run(feed)
        finally:
            for hook in hooks:
                hook.remove()
        found = session.run([m[0] for m in marked], eager.check_inputs(feed))
        mask = feed["attention_mask"]
        for (_, spec), got in zip(marked, found):
            if outputs is not None:
                outputs.add(f"{name}:{spec.name}/{set_name}", captured[spec.name], got)
            report.layer_norms.append(
                compare_outputs(
                    f"{name}:{spec.name}/{set_name}",
                    _masked(captured[spec.name], mask),
                    _masked(got, mask),
                    atol,
                    rtol,
                    min_cosine(report.precision),
                )
            )


def _capture(store: dict[str, np.ndarray], name: str) -> Callable[..., None]:
    def hook(module: Any, inputs: Any, output: torch.Tensor) -> None:
        store[name] = output.detach().cpu().numpy()

    return hook
