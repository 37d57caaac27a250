"""A checkpoint served on ONNX Runtime is exported once: the verified export is cached, keyed by the
weights (and config, tokenizer, tuned grids, versions), re-verified at every start and re-made when it
fails. Exports are counted by wrapping the export function, never timed."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, pre_tokenizers

pytest.importorskip("onnxruntime", reason="the service serves the export on ONNX Runtime (pip install -e .[cpu])")

from ldlm.export.artifact import read_schedules  # noqa: E402
from ldlm.files import atomic_directory  # noqa: E402
from ldlm.model.checkpoint import init_model, save_checkpoint  # noqa: E402
from ldlm.model.config import LDLMConfig  # noqa: E402
from ldlm.model.tokenizer import TOKENIZER_FILE, TextTokenizer  # noqa: E402
from ldlm.sampling.tuned_grids import SCHEDULES_FILE, TunedGrid, TunedSchedules  # noqa: E402
from ldlm.serve.api import export_cache  # noqa: E402
from ldlm.serve.api.export_cache import cache_root, cached_export, entry_problem  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class CountedExports:
    """The real export function, counted: which checkpoints were exported, into which entries."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, Path]] = []
        real = export_cache.export_graphs

        def counted(checkpoint: str, out: Path, **kwargs: Any) -> Any:
            self.calls.append((str(checkpoint), Path(out)))
            return real(checkpoint, out, **kwargs)

        monkeypatch.setattr(export_cache, "export_graphs", counted)


@pytest.fixture(scope="module")
def cached(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache entry of the tiny checkpoint, made once; tests copy it rather than export again."""
    root = tmp_path_factory.mktemp("cache")
    return cached_export(str(tiny_checkpoint), root, lambda line: None).directory


def copy_of(entry: Path, root: Path) -> Path:
    """``entry`` under another cache root (the key does not depend on the root)."""
    copy = root / "exports" / entry.name
    shutil.copytree(entry, copy)
    return copy


def test_a_second_start_reuses_the_verified_export(tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exports = CountedExports(monkeypatch)
    settings = ServerSettings(port=0, export_cache=str(tmp_path))
    starts: list[list[str]] = []
    for _ in range(2):
        lines: list[str] = []
        LDLMService(str(tiny_checkpoint), settings, progress=lines.append).close()
        starts.append(lines)
    assert len(exports.calls) == 1, exports.calls
    entry = exports.calls[0][1]
    assert entry.parent == tmp_path / "exports"
    assert starts[0][0] == f"exporting the checkpoint {tiny_checkpoint} to ONNX in {entry} (cached for the next start)"
    weights = sha256(tiny_checkpoint / "model.safetensors")
    assert starts[1][0] == f"reusing the verified export in {entry}, made from these weights (sha256 {weights[:16]})"
    assert starts[1][1] == f"loading the graphs of {entry} (ort)"
    assert (entry / "manifest.json").is_file()  # kept after close, for the next start


def test_a_checkpoint_with_other_weights_gets_its_own_entry(
    cached: Path, tiny_config: LDLMConfig, tokenizer: TextTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = save_checkpoint(init_model(tiny_config, seed=1), tokenizer, tmp_path / "other")
    root = tmp_path / "cache"
    first = copy_of(cached, root)
    exports = CountedExports(monkeypatch)
    lines: list[str] = []
    made = cached_export(str(other), root, lines.append)
    assert len(exports.calls) == 1 and not made.reused
    assert made.directory != first and made.directory.parent == first.parent
    assert json.loads((made.directory / "manifest.json").read_text())["checkpoint_weights_sha256"] == sha256(other / "model.safetensors")
    assert lines == [f"exporting the checkpoint {other} to ONNX in {made.directory} (cached for the next start)"]
    assert entry_problem(first, json.loads((first / "manifest.json").read_text())["checkpoint_weights_sha256"]) is None  # kept


def test_a_tampered_cached_file_is_exported_again(
    tiny_checkpoint: Path, cached: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = copy_of(cached, tmp_path)
    graph = json.loads((entry / "manifest.json").read_text())["graphs"]["decoder"]["file"]
    original = sha256(entry / graph)
    data = bytearray((entry / graph).read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    (entry / graph).write_bytes(bytes(data))
    exports = CountedExports(monkeypatch)
    lines: list[str] = []
    made = cached_export(str(tiny_checkpoint), tmp_path, lines.append)
    assert len(exports.calls) == 1 and not made.reused and made.directory == entry
    assert made.remade is not None and "does not match the sha256" in made.remade
    assert lines == [
        f"the cached export in {entry} failed its check ({made.remade}); exporting the checkpoint {tiny_checkpoint} to ONNX in {entry} "
        "(cached for the next start)"
    ]
    assert sha256(entry / graph) == original  # re-made, not served as it was


def test_an_entry_whose_manifest_names_other_weights_is_not_served(
    tiny_checkpoint: Path, cached: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = copy_of(cached, tmp_path)
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["checkpoint_weights_sha256"] = "0" * 64
    (entry / "manifest.json").write_text(json.dumps(manifest))
    exports = CountedExports(monkeypatch)
    made = cached_export(str(tiny_checkpoint), tmp_path, lambda line: None)
    assert (
        len(exports.calls) == 1
        and made.remade == f"made from weights with sha256 {'0' * 64}, not {sha256(tiny_checkpoint / 'model.safetensors')}"
    )


def test_two_servers_starting_at_once_export_once(
    tiny_checkpoint: Path, cached: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both have computed the key (and, without the lock, would both find no entry) before the first
    export writes anything: the second waits for the first's export and reuses it."""
    keyed, both_keyed = [], threading.Event()
    real_key = export_cache.export_key

    def key(*args: Any) -> tuple[str, str]:
        keyed.append(1)
        if len(keyed) == 2:
            both_keyed.set()
        return real_key(*args)

    made: list[Path] = []

    def export(checkpoint: str, out: Path, **kwargs: Any) -> None:  # a copy of the real export, once both have their key
        assert both_keyed.wait(120)
        made.append(out)
        with atomic_directory(out, overwrite=True) as tmp:
            shutil.copytree(cached, tmp, dirs_exist_ok=True)

    monkeypatch.setattr(export_cache, "export_key", key)
    monkeypatch.setattr(export_cache, "export_graphs", export)
    results: list[export_cache.CachedExport] = []
    threads = [
        threading.Thread(target=lambda: results.append(cached_export(str(tiny_checkpoint), tmp_path, lambda line: None))) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(made) == 1 and sorted(r.reused for r in results) == [False, True]
    assert {r.directory for r in results} == {made[0]}


def copy_checkpoint(checkpoint: Path, out: Path) -> Path:
    """Another checkpoint directory with the same weights, config and tokenizer (and tuned grids, if any)."""
    shutil.copytree(checkpoint, out)
    return out


def test_a_checkpoint_with_another_tokenizer_gets_its_own_entry(
    tiny_checkpoint: Path, cached: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same weights and config, a tokenizer that splits text otherwise: the cached export of the old
    tokenizer is not served; a new entry is made, carrying the new tokenizer."""
    retokenized = copy_checkpoint(tiny_checkpoint, tmp_path / "retokenized")
    tokenizer = Tokenizer.from_file(str(retokenized / TOKENIZER_FILE))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # "Hello" encodes as " Hello" now
    tokenizer.save(str(retokenized / TOKENIZER_FILE))
    assert sha256(retokenized / TOKENIZER_FILE) != sha256(cached / TOKENIZER_FILE)
    root = tmp_path / "cache"
    first = copy_of(cached, root)
    exports = CountedExports(monkeypatch)
    made = cached_export(str(retokenized), root, lambda line: None)
    assert len(exports.calls) == 1 and not made.reused
    assert made.directory != first and made.directory.parent == first.parent
    assert sha256(made.directory / TOKENIZER_FILE) == sha256(retokenized / TOKENIZER_FILE)


def tuned(weights: Path, times: tuple[float, ...]) -> TunedSchedules:
    """Grids as `ldlm tune-schedule` writes them for ``weights``: one dpm3m-psc grid, made its default."""
    steps = len(times) - 1
    return TunedSchedules(sha256(weights), times[-1], (TunedGrid("dpm3m-psc", steps, times),), {"dpm3m-psc": steps})


GRIDS = (1.0, 0.5, 0.2, 0.05)  # the tiny config's t_min is 0.05
RETUNED = (1.0, 0.6, 0.3, 0.1, 0.05)


@pytest.fixture(scope="module")
def tuned_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoint = copy_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("tuned") / "tuned")
    tuned(checkpoint / "model.safetensors", GRIDS).save(checkpoint / SCHEDULES_FILE)
    return checkpoint


@pytest.fixture(scope="module")
def tuned_cached(tuned_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache entry of the tuned checkpoint (its export carries the grids), made once; tests copy it."""
    entry = cached_export(str(tuned_checkpoint), tmp_path_factory.mktemp("tuned-cache"), lambda line: None).directory
    assert (entry / SCHEDULES_FILE).read_text() == (tuned_checkpoint / SCHEDULES_FILE).read_text()
    return entry


def start(checkpoint: Path, root: Path) -> tuple[LDLMService, list[str]]:
    """A service of ``checkpoint`` on ONNX Runtime, its export kept under ``root``, and what it said at start."""
    lines: list[str] = []
    service = LDLMService(str(checkpoint), ServerSettings(port=0, export_cache=str(root)), progress=lines.append)
    return service, lines


def test_a_retuned_checkpoint_is_served_its_new_grids(
    tuned_checkpoint: Path, tuned_cached: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same weights, config and tokenizer, a new schedules.json: the cached export, which carries the old
    grids, is not served; a new entry is exported, carrying the new grids, and the service loads its graphs
    and generates with the new grids. (A service of a checkpoint reads the grids from the checkpoint, so
    the entry it serves from is what tells a stale export apart.)"""
    retuned = copy_checkpoint(tuned_checkpoint, tmp_path / "retuned")
    tuned(retuned / "model.safetensors", RETUNED).save(retuned / SCHEDULES_FILE)
    root = tmp_path / "cache"
    old = copy_of(tuned_cached, root)
    exports = CountedExports(monkeypatch)
    service, lines = start(retuned, root)
    try:
        assert len(exports.calls) == 1, lines
        entry = exports.calls[0][1]
        assert entry != old and entry.parent == old.parent
        assert lines[0] == f"exporting the checkpoint {retuned} to ONNX in {entry} (cached for the next start)"
        assert lines[1] == f"loading the graphs of {entry} (ort)"
        assert "tuned step grids for 1 sampler/step counts; defaults: dpm3m-psc at 4 steps" in lines
        served = read_schedules(entry)
        assert served is not None and served.grids[0].times == RETUNED
        assert service.pipeline.schedules is not None and service.pipeline.schedules.grids[0].times == RETUNED
    finally:
        service.close()
    assert (old / SCHEDULES_FILE).read_text() == (tuned_checkpoint / SCHEDULES_FILE).read_text()  # the old entry is kept


def test_a_tampered_cached_schedules_json_is_exported_again_never_served(
    tuned_checkpoint: Path, tuned_cached: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cached grids edited into other grids that still load (same size, valid times, bound to these
    weights): only their sha256 tells, and the start exports again, as for a tampered graph file, then
    serves the re-made entry."""
    entry = copy_of(tuned_cached, tmp_path)
    original = (entry / SCHEDULES_FILE).read_text()
    tampered = original.replace("0.5,", "0.4,", 1)
    assert tampered != original
    (entry / SCHEDULES_FILE).write_text(tampered)
    exports = CountedExports(monkeypatch)
    service, lines = start(tuned_checkpoint, tmp_path)
    try:
        assert len(exports.calls) == 1 and exports.calls[0][1] == entry, lines
        problem = f"{entry / SCHEDULES_FILE} does not match the sha256 in {entry / 'manifest.json'} (edited or replaced); re-export it"
        assert lines[0] == (
            f"the cached export in {entry} failed its check ({problem}); exporting the checkpoint {tuned_checkpoint} to ONNX in {entry} "
            "(cached for the next start)"
        )
        assert lines[1] == f"loading the graphs of {entry} (ort)"
        assert service.pipeline.schedules is not None and service.pipeline.schedules.grids[0].times == GRIDS  # the checkpoint's
    finally:
        service.close()
    assert (entry / SCHEDULES_FILE).read_text() == original  # re-made, not kept as it was


def test_a_schedules_json_the_manifest_does_not_record_fails_the_entry(tiny_checkpoint: Path, cached: Path, tmp_path: Path) -> None:
    """Grids added to an entry after its export (valid, for these weights) are not trusted: the entry is
    exported again rather than served, or than refused by the server that would load them."""
    entry = copy_of(cached, tmp_path)
    weights = tiny_checkpoint / "model.safetensors"
    tuned(weights, GRIDS).save(entry / SCHEDULES_FILE)
    assert (
        entry_problem(entry, sha256(weights))
        == f"{entry / SCHEDULES_FILE} is not in {entry / 'manifest.json'}; re-export with `ldlm export`"
    )


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in ("LDLM_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


def test_the_cache_is_under_xdg_cache_home_unless_ldlm_cache_dir_says(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "ldlm"
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "ldlm"
    clean_env.setenv("LDLM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_a_full_disk_is_named_and_leaves_no_entry(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    """No space for the export: one error naming the cache and the ways out, and no entry (half-written or not)."""
    import errno

    from ldlm.export import onnx_export

    def out_of_space(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.tmp" / "tokenizer.json"))

    monkeypatch.setattr(onnx_export, "export_graphs", out_of_space)
    monkeypatch.setattr(export_cache, "export_graphs", out_of_space)
    with pytest.raises(OSError, match="no space left for the export of .*LDLM_CACHE_DIR.*--no-export-cache") as raised:
        cached_export(str(tiny_checkpoint), tmp_path / "cache", lambda line: None)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "exports").iterdir() if not p.name.endswith(".lock")]


def test_a_new_graphs_format_is_a_new_entry(tiny_checkpoint: Path, monkeypatch) -> None:
    """Graphs computed another way by a newer exporter (same weights, same versions) are not served from an old entry."""
    before, _ = export_cache.export_key(tiny_checkpoint, True, None)
    monkeypatch.setattr(export_cache, "GRAPHS_FORMAT", export_cache.GRAPHS_FORMAT + 1)
    after, _ = export_cache.export_key(tiny_checkpoint, True, None)
    assert after != before
