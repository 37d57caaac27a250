"""Test helpers for export directories whose graphs a test edits on purpose."""

from __future__ import annotations

import json
from pathlib import Path

from ldlm.export.onnx_export import MANIFEST_FILE, read_manifest, sha256_file


def reseal_manifest(directory: Path, graph: str) -> None:
    """Make ``directory``'s manifest agree with ``graph``'s files as they are now, as an attacker (or
    a test that edits a graph on purpose) who controls both could: the artifact check then passes and
    only the later checks (structure, numbers) stand between the edit and a pass."""
    manifest = read_manifest(directory)
    files = manifest["graphs"][graph]["files"]
    for name in files:
        files[name] = {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
