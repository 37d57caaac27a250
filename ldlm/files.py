"""Files that appear whole or not at all: a directory built in a temporary sibling and renamed into
place (checkpoints, exports, engine sets, Triton repositories), and single files written through a
temporary name (reports, plan manifests, runtime and timing caches). An existing directory is replaced
only on request and only when ldlm wrote it (``ldlm_output``): never someone's own files, the current
directory or the input being read."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def refuse_existing(
    out: str | os.PathLike[str], overwrite: bool = False, inputs: Mapping[str, str | os.PathLike[str] | None] | None = None
) -> None:
    """Fail early, before any work, when ``out`` may not be written: it has no name of its own, it is or
    holds the current directory or one of ``inputs`` (what the writer reads, by name: ``{"checkpoint":
    path}``), or it exists and may not be replaced. ``overwrite`` replaces only what ldlm wrote
    (``ldlm_output``) or an empty directory, never someone's own files."""
    refuse_unsafe_target(out, inputs or {})
    out = Path(out)
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (CLI: --force) to replace it")
    replace_only = (
        "--force replaces only a checkpoint, an export, an engine directory or a Triton repository that ldlm wrote; "
        "remove it yourself, or choose another output directory"
    )
    if out.is_symlink():
        raise FileExistsError(f"{out} is a symbolic link (to {os.readlink(out)}), not a directory that ldlm wrote; {replace_only}")
    if not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a directory that ldlm wrote; {replace_only}")
    entries = sorted(p.name for p in out.iterdir())
    if entries and ldlm_output(out) is None:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise FileExistsError(f"{out} was not written by ldlm (it holds {shown}); {replace_only}")


def refuse_unsafe_target(out: str | os.PathLike[str], inputs: Mapping[str, str | os.PathLike[str] | None]) -> None:
    """An output directory is renamed aside and removed when replaced: refuse one that has no name of its
    own (``.``, ``/``, ``a/..``), that is or holds the current directory, or that is or holds an input."""
    given = os.fspath(out)
    path = Path(given)
    if path.name in ("", ".."):
        raise ValueError(
            f"output directory {given!r} has no name of its own; allowed: a path ending in the new directory's name, e.g. ./onnx"
        )
    resolved = path.resolve()
    if resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise ValueError(f"output directory {given!r} is the current directory or holds it; allowed: a new directory, e.g. ./onnx")
    for name, source in inputs.items():
        if source is None:
            continue
        source_path = Path(source).resolve()
        if resolved == source_path or resolved in source_path.parents:
            relation = "is" if resolved == source_path else "holds"
            raise ValueError(
                f"output directory {given!r} {relation} the {name} {os.fspath(source)}; allowed: a directory outside it, e.g. ./onnx"
            )


# What each ldlm writer leaves in its output, so that a directory of someone's own files is never
# taken for one (``manifest.json`` alone is a common name: its content must be ldlm's too).
TRITON_GENERATE_CONFIG = "ldlm_generate/config.pbtxt"  # ldlm.serve.deploy.triton_repo's BLS model


def ldlm_output(directory: Path) -> str | None:
    """What ldlm wrote ``directory`` as (``"export"``, ``"engines"``, ``"checkpoint"``, ``"triton-repo"``), or None."""
    if _written_by_ldlm(directory / "manifest.json"):
        return "export"
    if any(_written_by_ldlm(p) for p in directory.glob("*.plan.json")):
        return "engines"
    if (directory / "config.json").is_file() and "config_sha256" in _safetensors_metadata(directory / "model.safetensors"):
        return "checkpoint"
    if (directory / TRITON_GENERATE_CONFIG).is_file():
        return "triton-repo"
    return None


def _written_by_ldlm(path: Path) -> bool:
    """A JSON record (export or plan manifest) that ldlm wrote: an object with its ``ldlm_version``."""
    try:
        record = json.loads(path.read_bytes()[: 1 << 24])
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "ldlm_version" in record


def _safetensors_metadata(path: Path) -> dict[str, object]:
    """The ``__metadata__`` of a safetensors header (8-byte little-endian length, then JSON), or {}."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(size, 1 << 24)))
    except (OSError, ValueError):
        return {}
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


@contextmanager
def atomic_directory(out: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``out`` only if the block completes."""
    out = Path(out)
    refuse_existing(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".tmp", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the result should look like any new directory
    try:
        yield tmp
        for path in tmp.rglob("*"):  # some writers (safetensors) create 0600 files
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            _remove(old)  # a leftover of an interrupted replace, a directory or a file
            out.rename(old)
            tmp.rename(out)
            _remove(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_atomically(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temporary name unique to this process and thread, then
    rename: a reader never sees a torn file, and concurrent writers (several servers saving one
    runtime cache, two builds sharing a timing cache) never write into each other's temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def save_figure(figure: Any, path: str | os.PathLike[str], dpi: int = 100) -> Path:
    """A matplotlib figure as a PNG at ``path``, rendered in memory and written atomically (a plot
    interrupted half-drawn leaves the earlier file, or none)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return write_atomically(path, buffer.getvalue())


def _remove(path: Path) -> None:
    """Remove a file, link or directory tree if it is there (rmtree alone leaves files and links)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_leftovers(out: Path) -> None:
    """Remove ``.NAME.PID.XXXXXXXX.tmp`` folders of writers to ``out`` that were killed (their PID is
    gone). The name must match exactly: ``.ckpt.v2.<pid>.<rand>.tmp`` belongs to a writer of ``ckpt.v2``."""
    # mkdtemp's random part has no dots; names from before the PID was added have no PID part.
    pattern = re.compile(re.escape(f".{out.name}.") + r"(?:(\d+)\.)?[A-Za-z0-9_]+\.tmp")
    for leftover in out.parent.iterdir():
        match = pattern.fullmatch(leftover.name)
        if match and leftover.is_dir() and (match.group(1) is None or not _alive(int(match.group(1)))):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def sha256_file(path: str | os.PathLike[str]) -> str:
    """A file's sha256, read in 1 MiB blocks (weights files are gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
