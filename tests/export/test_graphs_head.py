"""The exported decoder's vocabulary head in ONNX Runtime: the bias inside the product, the logits made
whole only where the export asks for them, and token ids that are the first argmax of the logits,
ties between the head's chunks and blocks included."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from ldlm.export.onnx_export import export_graphs
from ldlm.model.checkpoint import save_checkpoint
from ldlm.model.ldlm import LDLM
from ldlm.model.token_decoder import ARGMAX_BLOCK, VOCABULARY_CHUNK
from ldlm.model.tokenizer import TextTokenizer

ort = pytest.importorskip("onnxruntime", reason="runs the exported decoders (pip install -e .[cpu])")

# (first, second) columns made equal: where the pair holds the largest logit, the first must win. Across two
# chunks, across two blocks of one chunk, and from the last whole blocks into the tail shorter than a block
# (negative: counted from the end of the vocabulary).
TIES = ((700, 3 * VOCABULARY_CHUNK + 9), (VOCABULARY_CHUNK + 5, VOCABULARY_CHUNK + 900), (-20, -2))


@pytest.fixture(scope="module")
def tied(tiny_model: LDLM, tokenizer: TextTokenizer, tmp_path_factory: pytest.TempPathFactory) -> tuple[LDLM, Path, list[tuple[int, int]]]:
    """The tiny model with TIES planted in its head, exported without and with logits. Pair k reads feature k
    alone, as its distance from its mean in standard deviations (over random latents), scaled far above the
    other columns: each pair wins wherever its feature is the furthest above its mean."""
    model = copy.deepcopy(tiny_model)
    v = model.config.vocab_size
    pairs = [(first % v, second % v) for first, second in TIES]
    head = model.token_decoder.head
    with torch.no_grad():
        latents = torch.randn(8, 64, model.config.d_model, generator=torch.Generator().manual_seed(5))
        features = model.token_decoder.hidden(model.latent_decoder(latents)).flatten(0, 1)
        mean, std = features.mean(0), features.std(0)
        for k, (first, second) in enumerate(pairs):
            head.weight[first] = 0.0
            head.weight[first, k] = 100.0 / std[k]
            head.weight[second] = head.weight[first]
            head.bias[first] = head.bias[second] = -100.0 * mean[k] / std[k]
    root = tmp_path_factory.mktemp("tied")
    checkpoint = save_checkpoint(model, tokenizer, root / "ckpt")
    export_graphs(checkpoint, root / "ids", graphs=("decoder",))
    export_graphs(checkpoint, root / "logits", graphs=("decoder",), with_logits=True)
    return model, root, pairs


def session(path: Path) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def head_nodes(path: Path) -> tuple[list[onnx.NodeProto], dict[str, list[int | str]]]:
    """The nodes after the token decoder's final LayerNorm, and every value's shape."""
    graph = onnx.load(str(path), load_external_data=False).graph
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in [*graph.value_info, *graph.output]}
    last_norm = max(i for i, n in enumerate(graph.node) if n.op_type == "LayerNormalization")
    return list(graph.node[last_norm + 1 :]), shapes


def test_ties_go_to_the_first_index(tied: tuple[LDLM, Path, list[tuple[int, int]]]) -> None:
    model, root, pairs = tied
    latents = torch.randn(4, 64, model.config.d_model, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 64, dtype=torch.int64)
    with torch.no_grad():
        expected = model.decode_logits(latents, mask.bool()).argmax(-1).numpy()  # torch: the first maximum
    feed = {"latents": latents.numpy(), "attention_mask": mask.numpy()}
    for name in ("ids", "logits"):
        got = session(root / name / "decoder.onnx").run(["token_ids"], feed)[0]
        np.testing.assert_array_equal(got, expected, err_msg=name)
        assert all((got == first).sum() >= 5 for first, _ in pairs), name  # every tie was decided, many times
        assert not any((got == second).any() for _, second in pairs), name
    with torch.no_grad():
        np.testing.assert_array_equal(model.decode_tokens(latents, mask.bool()).numpy(), expected)


def test_the_head_adds_no_pass_over_the_logits(tied: tuple[LDLM, Path, list[tuple[int, int]]]) -> None:
    """Without logits: no value as wide as the vocabulary, and no ArgMax over logits: one scans the block
    maxima (V / ARGMAX_BLOCK of them), one the winning block. With them: the logits come out of the product itself."""
    model, root, _ = tied
    nodes, shapes = head_nodes(root / "ids" / "decoder.onnx")
    products = [n for n in nodes if n.op_type in ("MatMul", "Gemm")]
    assert len(products) > 1 and all(len(n.input) == 2 for n in products)  # one per chunk, the bias inside
    produced = {out for n in products for out in n.output}
    assert not [n.name for n in nodes if n.op_type == "Add" and produced & set(n.input)]
    # every width known (int() of a symbolic one fails the test)
    widths = [int(size) for n in nodes for out in n.output if shapes.get(out, [0])[0] == "batch*seq" for size in shapes[out][1:]]
    assert widths and max(widths) <= VOCABULARY_CHUNK, max(widths)
    scanned = [int(shapes[n.input[0]][-1]) for n in nodes if n.op_type == "ArgMax"]
    assert sorted(scanned) == [ARGMAX_BLOCK, -(-model.config.vocab_size // ARGMAX_BLOCK)], scanned
    nodes, _ = head_nodes(root / "logits" / "decoder.onnx")
    logits = next(n for n in nodes if "logits" in n.output)
    assert logits.op_type == "MatMul" and len([n for n in nodes if n.op_type in ("MatMul", "Gemm")]) == 1
    assert [n.op_type for n in nodes if "logits" in n.input] == ["ArgMax"]


def test_token_ids_equal_the_argmax_of_the_logits(tied: tuple[LDLM, Path, list[tuple[int, int]]], tiny_model: LDLM) -> None:
    """On random latents of several scales, with padding: the chunked graph's ids are the logits graph's argmax."""
    _, root, _ = tied
    ids, logits = session(root / "ids" / "decoder.onnx"), session(root / "logits" / "decoder.onnx")
    gen = torch.Generator().manual_seed(1)
    for scale, batch, length in ((0.3, 3, 17), (1.0, 2, 40), (4.0, 1, 5)):
        latents = scale * torch.randn(batch, length, tiny_model.config.d_model, generator=gen)
        mask = np.ones((batch, length), np.int64)
        mask[0, length // 2 :] = 0
        feed = {"latents": latents.numpy(), "attention_mask": mask}
        token_ids, whole = logits.run(None, feed)
        np.testing.assert_array_equal(ids.run(None, feed)[0], whole.argmax(-1))
        np.testing.assert_array_equal(token_ids, whole.argmax(-1))
