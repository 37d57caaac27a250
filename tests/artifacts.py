"""Test helpers for export directories whose graphs a test edits on purpose."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx

from ldlm.export.artifact import MANIFEST_FILE, read_manifest, sha256_file
from ldlm.export.layernorm.verify import node_name_scopes

ENCODER_LN = "model.feature_model.h.1.ln_2"  # a LayerNorm of the tiny export's encoder graph


def reseal_manifest(directory: Path, graph: str) -> None:
    """Make ``directory``'s manifest agree with ``graph``'s files as they are now, as an attacker (or
    a test that edits a graph on purpose) who controls both could: the artifact check then passes and
    only the later checks (structure, numbers) stand between the edit and a pass."""
    manifest = read_manifest(directory)
    files = manifest["graphs"][graph]["files"]
    for name in files:
        files[name] = {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def edited_export(export_dir: Path, out: Path, graph: str, edit: Callable[[onnx.GraphProto], None]) -> Path:
    """A copy of ``export_dir`` with ``edit`` applied to one graph and the manifest's hashes rewritten."""
    shutil.copytree(export_dir, out)
    path = out / f"{graph}.onnx"
    model = onnx.load(str(path))
    edit(model.graph)
    (out / f"{graph}.onnx.data").unlink()
    onnx.save(model, str(path), save_as_external_data=True, location=f"{graph}.onnx.data")
    reseal_manifest(out, graph)
    return out


def node_of(graph: onnx.GraphProto, module: str) -> onnx.NodeProto:
    """The LayerNormalization node exported from ``module``."""
    return next(n for n in graph.node if n.op_type == "LayerNormalization" and module in node_name_scopes(n))


def set_eps(module: str, eps: float) -> Callable[[onnx.GraphProto], None]:
    """An ``edited_export`` edit: ``module``'s LayerNormalization node gets epsilon ``eps``."""

    def edit(graph: onnx.GraphProto) -> None:
        node = node_of(graph, module)
        kept = [a for a in node.attribute if a.name != "epsilon"]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute("epsilon", eps)])

    return edit
