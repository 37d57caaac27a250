"""Files that appear whole or not at all: a directory built in a temporary sibling and renamed into
place (checkpoints, exports, engine sets, Triton repositories), and single files written through a
temporary name (reports, plan manifests, runtime and timing caches)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def refuse_existing(out: str | os.PathLike[str], overwrite: bool = False) -> None:
    """Fail early, before any work, when ``out`` exists and may not be replaced."""
    if Path(out).exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (CLI: --force) to replace it")


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
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
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
