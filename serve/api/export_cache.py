"""The export a checkpoint is served from, made once and kept: ``cached_export``.

ONNX Runtime serves an export, not a checkpoint, and exporting takes from seconds (tiny) to minutes
(base). The verified export is kept under ``<cache>/exports/<key>/``, where the key is a sha256 of what
the export is made from and by: the checkpoint's weights, its config hash, its tokenizer and tuned
grids, and the exporter's versions as the manifest records them (ldlm, torch, onnx). A later start
re-verifies the entry (every file against the sha256 its manifest records, its graphs as ``ldlm verify-onnx``
checks them, the weights it was made from) before serving it; an entry that fails is removed and exported
again, never served.

Two servers starting at once take a lock per key: the second waits for the first's export and then
reuses it. The entry itself is written through ``atomic_directory`` (by ``export_graphs``), so an
export interrupted or killed leaves no half-written entry behind.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from ldlm import __version__
from ldlm.export.artifact import ArtifactError, check_artifacts, read_manifest, read_schedules, sha256_file
from ldlm.export.graphs import GRAPHS_FORMAT
from ldlm.export.onnx_export import export_graphs
from ldlm.model.checkpoint import WEIGHTS_FILE, load_config
from ldlm.model.tokenizer import TOKENIZER_FILE
from ldlm.sampling.tuned_grids import SCHEDULES_FILE


def cache_root() -> Path:
    """``$LDLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/ldlm``, else ``~/.cache/ldlm``."""
    if os.environ.get("LDLM_CACHE_DIR"):
        return Path(os.environ["LDLM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ldlm"


@dataclass(frozen=True)
class CachedExport:
    """``directory``: the verified export; ``reused``: it was there already; ``remade``: why an entry
    that was there failed its check and was exported again (None when it did not)."""

    directory: Path
    weights_sha256: str
    reused: bool
    remade: str | None = None


def export_key(checkpoint: Path, with_logits: bool, quantize: str | None = None) -> tuple[str, str]:
    """(the cache key, the weights' sha256): a change to anything the export is made from is another key."""
    weights = sha256_file(checkpoint / WEIGHTS_FILE)
    record = {
        "checkpoint_weights_sha256": weights,
        "config_sha256": load_config(checkpoint).config_hash(),
        # copied into the export: another tokenizer or tuned grids with the same weights is another export
        "files": {name: sha256_file(checkpoint / name) for name in (TOKENIZER_FILE, SCHEDULES_FILE) if (checkpoint / name).is_file()},
        "ldlm_version": __version__,
        "graphs_format": GRAPHS_FORMAT,
        "torch_version": torch.__version__,
        "onnx_version": onnx.__version__,
        "with_logits": with_logits,
        **({"quantize": quantize} if quantize is not None else {}),  # without: the keys of exports made before quantizing
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32], weights


def entry_problem(entry: Path, weights: str) -> str | None:
    """Why the cached ``entry`` must not be served (None: it verifies and was made from ``weights``)."""
    try:
        manifest = read_manifest(entry)
        check_artifacts(entry, manifest)
        # the tuned grids, which check_artifacts leaves to their loader: checked as the server will load them
        # (recorded, matching their sha256, bound to the weights), so an entry it would refuse is exported again
        read_schedules(entry)
    except (ArtifactError, ValueError, OSError, AttributeError) as error:  # JSONDecodeError and ScheduleError are ValueErrors
        return str(error)
    if manifest.get("checkpoint_weights_sha256") != weights:
        return f"made from weights with sha256 {manifest.get('checkpoint_weights_sha256')}, not {weights}"
    return None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (flock: released by the kernel if the holder dies)."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_export(
    checkpoint: str,
    root: str | os.PathLike[str],
    say: Callable[[str], None],
    progress: bool = False,
    with_logits: bool = True,
    quantize: str | None = None,
) -> CachedExport:
    """The verified export of ``checkpoint`` under ``root`` (with ``quantize``'s variants), reused if its
    entry checks, else made there; ``say`` is told which, in one line."""
    key, weights = export_key(Path(checkpoint), with_logits, quantize)
    entry = Path(root) / "exports" / key
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _locked(entry.parent / f".{key}.lock"):
        remade = entry_problem(entry, weights) if entry.exists() else None
        if entry.exists() and remade is None:
            say(f"reusing the verified export in {entry}, made from these weights (sha256 {weights[:16]})")
            return CachedExport(entry, weights, reused=True)
        failed = "" if remade is None else f"the cached export in {entry} failed its check ({remade}); "
        say(f"{failed}exporting the checkpoint {checkpoint} to ONNX in {entry} (cached for the next start)")
        if entry.exists():
            # the cache's own entry, failed: removed here, since the exporter replaces only an export unchanged since
            # it wrote it (an edited file, or an entry an older ldlm left without its record, is exactly what failed)
            shutil.rmtree(entry)
        try:
            export_graphs(checkpoint, entry, with_logits=with_logits, progress=progress, quantize=quantize)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            raise OSError(
                errno.ENOSPC,
                f"no space left for the export of {checkpoint} (nothing of it was kept); free space there, point "
                "LDLM_CACHE_DIR at a larger disk, or serve with --no-export-cache",
                str(Path(root)),
            ) from None
    return CachedExport(entry, weights, reused=False, remade=remade)
