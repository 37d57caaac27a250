"""Files that appear whole or not at all: a directory built in a temporary sibling and renamed into
place (checkpoints, exports, engine sets, Triton repositories), and single files written through a
temporary name (reports, plan manifests, runtime and timing caches).

Every directory written here carries a record of what wrote it (``OUTPUT_RECORD``: the writer, e.g.
``ldlm export``, and each file's size and sha256). An existing directory is replaced only on request and
only when it is the output of the same writer exactly as that writer left it: never someone's own files,
another command's output, weights changed since, the current directory or the input being read. An empty
directory is written into without asking: there is nothing in it to lose.

A single file a command writes (parity's inputs and outputs, tune-schedule's grids) is guarded the same way
(``refuse_existing_file``): an existing one is replaced only on request and only when the same command wrote
it, and none is written inside a checkpoint or another writer's output directory. A file's writer is read
from the format its own header declares (parity's safetensors metadata, schedules.json's grids), each written
by one command only: the record travels with the file when it is copied or renamed, needs no second file
beside it that could be lost or left behind, and a file someone else made cannot carry it by accident."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"  # a checkpoint's two files (ldlm.model.checkpoint writes them)
OUTPUT_RECORD = ".ldlm-output.json"  # beside what a writer wrote: who wrote it, and every file's size and sha256
SHOWN_FILES = 5  # how many file names a refusal lists before "and N more"
DEFAULT_EXAMPLE = "output"  # the directory a refusal suggests where the caller names none of its kind


@dataclass(frozen=True)
class OutputRecord:
    """What ``OUTPUT_RECORD`` says: the writer (a command as typed, ``ldlm export``; None: a program through
    ldlm's Python API that named none) and each file it wrote, by path inside the directory."""

    writer: str | None
    files: dict[str, dict[str, Any]]  # "encoder.onnx" -> {"bytes": 418164, "sha256": "..."}


def refuse_existing(
    out: str | os.PathLike[str],
    overwrite: bool = False,
    inputs: Mapping[str, str | os.PathLike[str] | None] | None = None,
    writer: str | None = None,
) -> None:
    """Fail early, before any work, when ``out`` may not be written: it has no name of its own, it is or
    holds the current directory or one of ``inputs`` (what the writer reads, by name: ``{"checkpoint":
    path}``), or it exists, is not an empty directory, and may not be replaced. ``overwrite`` replaces
    only what ``writer`` wrote (its ``OUTPUT_RECORD``), holding nothing else and no file changed since.
    ``writer`` None accepts any writer's record: for a check made before the writer is known (the CLI's,
    before a command runs) and for programs that name no writer."""
    refuse_unsafe_target(out, inputs or {})
    out = Path(out)
    if not (out.exists() or out.is_symlink()) or empty_directory(out):
        return
    if not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (CLI: --force) to replace it")
    if out.is_symlink():
        raise FileExistsError(f"{out} is a symbolic link (to {os.readlink(out)}), not a directory that ldlm wrote; {replace_only(out)}")
    if not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a directory that ldlm wrote; {replace_only(out)}")
    record = ldlm_output(out)
    if record is None:
        shown = listed(sorted(p.name for p in out.iterdir()))
        raise FileExistsError(f"{out} was not written by ldlm (it holds {shown}, and no {OUTPUT_RECORD}); {replace_only(out)}")
    if writer is not None and record.writer != writer:
        raise FileExistsError(f"{out} was written by {writer_words(record.writer)}, not {writer_words(writer)}; {replace_only(out)}")
    added, changed = unrecorded_files(out, record)
    problems = [f"files {writer_words(record.writer)} did not write: {listed(added)}"] if added else []
    problems += [f"files changed since {writer_words(record.writer)} wrote them: {listed(changed)}"] if changed else []
    if problems:
        raise FileExistsError(f"{out} holds {'; and '.join(problems)}; {replace_only(out)}")


def empty_directory(path: Path) -> bool:
    """A directory (not a link to one) with nothing in it: written into without ``overwrite``, as nothing is lost."""
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def replace_only(out: Path) -> str:
    """The rule and the way out, the end of every refusal to replace ``out``."""
    return (
        "--force replaces only the output of the same ldlm command, exactly as it wrote it; "
        f"choose a new output directory, or delete {out} by hand if nothing in it is needed"
    )


def command_writer(command: str) -> str:
    """The writer an ``ldlm COMMAND`` output is recorded as: the command as typed, ``ldlm export``."""
    return f"ldlm {command}"


def force_help(command: str) -> str:
    """The rule, as ``ldlm COMMAND --force``'s help says it."""
    return (
        f"replace OUT if an earlier `{command_writer(command)}` wrote it and nothing in it changed since; another command's "
        "output, a directory holding anything else (a trained checkpoint, your own files) or one without ldlm's record is refused"
    )


def writer_words(writer: str | None) -> str:
    return f"`{writer}`" if writer else "a program through ldlm's Python API"


def listed(names: list[str]) -> str:
    """``a, b, c`` (the first ``SHOWN_FILES``, then how many more)."""
    more = len(names) - SHOWN_FILES
    return ", ".join(names[:SHOWN_FILES]) + (f" and {more} more" if more > 0 else "")


def refuse_unsafe_target(
    out: str | os.PathLike[str], inputs: Mapping[str, str | os.PathLike[str] | None], example: str = DEFAULT_EXAMPLE
) -> None:
    """An output directory is renamed aside and removed when replaced: refuse one that has no name of its
    own (``.``, ``/``, ``a/..``), that is or holds the current directory, or that is or holds an input.
    Each refusal suggests a directory named ``example`` (the kind the writer makes) where it may go."""
    given = os.fspath(out)
    path = Path(given)
    if path.name in ("", ".."):
        raise ValueError(
            f"output directory {given!r} has no name of its own; allowed: a path ending in the new directory's name, "
            f"e.g. {example_directory(example, inputs)}"
        )
    resolved = path.resolve()
    if resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise ValueError(
            f"output directory {given!r} is the current directory or holds it; allowed: a new directory, e.g. {example_directory(example, inputs)}"
        )
    for name, source in inputs.items():
        if source is None:
            continue
        source_path = Path(source).resolve()
        if within(source_path, resolved):
            relation = "is" if resolved == source_path else "holds"
            raise ValueError(
                f"output directory {given!r} {relation} the {name} {os.fspath(source)}; allowed: a directory outside it, "
                f"e.g. {example_directory(example, inputs)}"
            )


def within(path: Path, directory: Path) -> bool:
    """``path`` is ``directory`` or lies inside it (both resolved)."""
    return path == directory or directory in path.parents


def example_directory(name: str, inputs: Mapping[str, str | os.PathLike[str] | None]) -> str:
    """Where a new output directory called ``name`` may go, as a path to type from here: ``./NAME``, or beside
    the input that holds the current directory (``../NAME``), numbered (``NAME-2``) where ``NAME`` would be,
    hold or lie inside an input, or hold the current directory."""
    here = Path.cwd().resolve()
    sources = [Path(source).resolve() for source in inputs.values() if source is not None]
    base = here
    while any(within(base, source) for source in sources):
        if base == base.parent:  # an input is the root: nowhere lies outside it
            return f"./{name}"
        base = base.parent
    number = 1
    while True:
        candidate = base / (name if number == 1 else f"{name}-{number}")
        if not within(here, candidate) and not any(within(candidate, s) or within(s, candidate) for s in sources):
            shown = os.path.relpath(candidate, here)
            return shown if shown.startswith("..") else f"./{shown}"
        number += 1


def refuse_existing_file(
    path: str | os.PathLike[str],
    overwrite: bool,
    writer: str,
    written_by: Callable[[Path], str | None],
    owned: Iterable[str] = (),
) -> None:
    """Fail early, before any work, when the file ``path`` may not be written by ``writer``: it is a directory
    or a link, it lies inside a checkpoint or a directory an ldlm writer recorded (``holding_output``; a
    checkpoint's files named in ``owned`` are this writer's own), or it exists and ``written_by`` (the writer
    its header names, None for any other file) is not ``writer``, or is and ``overwrite`` is not given."""
    path = Path(path)
    if path.is_symlink():
        raise FileExistsError(f"{path} is a symbolic link (to {os.readlink(path)}), not a file `{writer}` wrote; {replace_only_file(path)}")
    if path.is_dir():
        raise FileExistsError(f"{path} is a directory; allowed: a file path, a new file or one `{writer}` wrote")
    holder = holding_output(path)
    if holder is not None and not (holder.checkpoint and path.parent.resolve() == holder.directory and path.name in owned):
        directory, what = holder.directory, holder.words
        raise FileExistsError(
            f"{path} is inside {directory}, {what}: a file written there changes it, and replacing it loses the file; "
            f"allowed: a path outside {directory}"
        )
    if not path.exists():
        return
    found = written_by(path)
    if found != writer:
        wrote = f"was written by {writer_words(found)}, not `{writer}`" if found else f"was not written by `{writer}`"
        raise FileExistsError(f"{path} {wrote}; {replace_only_file(path)}")
    if not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=True (CLI: --force) to replace it, or choose another file")


def replace_only_file(path: Path) -> str:
    """The rule and the way out, the end of every refusal to replace the file ``path``."""
    return f"--force replaces only a file the same ldlm command wrote; choose another file, or delete {path} by hand if it is not needed"


@dataclass(frozen=True)
class HoldingDirectory:
    """A directory a file must not be written into: ``checkpoint`` (its config and weights), else the output of a writer."""

    directory: Path
    checkpoint: bool
    words: str  # "a checkpoint written by `ldlm init`", "the output of `ldlm export`"


def holding_output(path: Path) -> HoldingDirectory | None:
    """The nearest directory above ``path`` that a file must not be written into: one holding an ldlm writer's
    ``OUTPUT_RECORD`` (its output, replaced whole and checked file by file), or a checkpoint (its config and
    weights, with or without a record)."""
    for directory in Path(path).resolve().parents:
        checkpoint = (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file()
        recorded = (directory / OUTPUT_RECORD).is_file()
        record = ldlm_output(directory) if recorded else None
        if checkpoint:
            by = f" written by {writer_words(record.writer)}" if record is not None else ""
            return HoldingDirectory(directory, True, f"a checkpoint{by}")
        if recorded:
            return HoldingDirectory(directory, False, f"the output of {writer_words(record.writer if record else None)}")
    return None


def ldlm_output(directory: Path) -> OutputRecord | None:
    """The record ``directory``'s writer left (``OUTPUT_RECORD``), or None where there is none that reads as one."""
    try:
        data = json.loads((directory / OUTPUT_RECORD).read_bytes()[: 1 << 24])
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return None
    writer = data.get("writer")
    files = {name: entry for name, entry in data["files"].items() if isinstance(entry, dict)}
    return OutputRecord(writer if isinstance(writer, str) else None, files)


def written_files(directory: Path) -> list[str]:
    """Every file (or link, or other non-directory) under ``directory`` but its record, as relative POSIX paths.
    Links are listed, never followed: a link to someone's files is not a file ldlm wrote."""
    found = []
    for root, dirs, files in os.walk(directory):
        here = Path(root)
        found += [(here / name).relative_to(directory).as_posix() for name in files]
        found += [(here / name).relative_to(directory).as_posix() for name in dirs if (here / name).is_symlink()]
    return sorted(name for name in found if name != OUTPUT_RECORD)


def record_output(directory: Path, writer: str | None) -> None:
    """Write ``OUTPUT_RECORD`` in ``directory``: ``writer`` and each file's size and sha256."""
    files = {
        name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)} for name in written_files(directory)
    }
    record = {"writer": writer, "files": files}
    (directory / OUTPUT_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def unrecorded_files(directory: Path, record: OutputRecord) -> tuple[list[str], list[str]]:
    """(files the record does not list, files whose size or sha256 differ from it). A listed file that is
    gone is neither: replacing the directory loses nothing of it."""
    added, changed = [], []
    for name in written_files(directory):
        path, entry = directory / name, record.files.get(name)
        if entry is None or path.is_symlink() or not path.is_file():
            added.append(name)
        elif path.stat().st_size != entry.get("bytes") or sha256_file(path) != entry.get("sha256"):
            changed.append(name)
    return added, changed


@contextmanager
def atomic_directory(out: str | os.PathLike[str], overwrite: bool = False, writer: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``out`` only if the block completes, recorded as written
    by ``writer`` (``OUTPUT_RECORD``). An existing ``out`` is replaced only as ``refuse_existing`` allows."""
    out = Path(out)
    refuse_existing(out, overwrite, writer=writer)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".tmp", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the result should look like any new directory
    try:
        yield tmp
        record_output(tmp, writer)
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
