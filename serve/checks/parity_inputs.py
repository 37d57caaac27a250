"""Parity's inputs and outputs as files, so that a case seen on one machine can be handed on and run again.

``save_inputs`` writes every input a parity run generates into one safetensors file: each graph's input
sets (random, padded, the outlier stress set or real text), the eps probes' rows, and the end-to-end
generation's seeds with the prior noise they draw. The file's metadata holds one JSON header under
``HEADER_KEY``: the format and its version, the config the inputs were made for, the seeds and the options
that shaped the inputs, what saved them, and every tensor's name, shape and dtype with a sha256 over all of
them; a second sha256 over the header itself seals the case (its seed, steps, sampler, checkpoint ...), so a
header edited by hand is refused as a changed tensor is. ``read_inputs`` and ``check_inputs`` take a file back: the graphs run on its tensors as they are; the eps
probes and the generation draw from their seeds, so the rows and the noise in the file are checked to be what
those seeds draw here; a file that does not fit the checkpoint is refused, naming what differs.
``save_outputs`` writes both sides' outputs (reference and candidate) the same way. Nothing is pickled: a
safetensors file holds tensors and text only.

Tensor names: ``graphs/GRAPH/SET/INPUT``, ``eps_probe_rows/SIZE`` (the rows of a LayerNorm over SIZE values),
``end_to_end/noise`` (samples, length, d_model); in an outputs file ``reference/NAME`` and ``candidate/NAME``,
NAME as the report names the comparison (``GRAPH/SET/OUTPUT``, ``GRAPH:MODULE/SET``) or ``end_to_end/token_ids``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
import torch
from safetensors import safe_open
from torch import nn

from ldlm import __version__
from ldlm.export.graphs import GRAPH_NAMES, graph_io
from ldlm.export.layernorm.eps_probe import probe_rows
from ldlm.files import refuse_existing_file, write_atomically
from ldlm.model.config import LDLMConfig
from ldlm.model.ldlm import LDLM
from ldlm.sampling.noise import NoiseStream, sample_seeds
from ldlm.serve.checks.parity_graphs import input_sets
from ldlm.serve.checks.parity_result import ParityOutputs

FORMAT_VERSION = 2  # 2: the header is sealed by its own sha256 (HEADER_SHA256)
INPUTS_FORMAT = "ldlm-parity-inputs"
OUTPUTS_FORMAT = "ldlm-parity-outputs"
HEADER_KEY = "ldlm_parity"  # the safetensors metadata entry that holds the JSON header
NOISE = "end_to_end/noise"
HEADER_SHA256 = "header_sha256"  # the header entry that holds the sha256 of every other entry
WRITTEN_BY = {INPUTS_FORMAT: "ldlm parity --save-inputs", OUTPUTS_FORMAT: "ldlm parity --save-outputs"}

InputSets = dict[str, dict[str, dict[str, np.ndarray]]]  # graph -> input set -> input name -> array


@dataclass(frozen=True)
class EndToEndPlan:
    """What the end-to-end generation asks ``LDLMPipeline.generate`` for: ``n`` samples of ``length`` tokens
    from ``seed``, ``steps`` steps of ``sampler`` (None: what ``ldlm.sampling.resolve`` fills in), with the
    checkpoint's tuned grids or without them."""

    seed: int
    n: int
    length: int
    steps: int | None
    sampler: str | None
    tuned_grids: bool

    def noise(self, d_model: int) -> np.ndarray:
        """The prior noise (n, length, d_model): each sample's first draw from its own seeded stream, on the
        CPU, as both sides of parity draw it."""
        draws = [NoiseStream(seed, (self.length, d_model)).draw() for seed in sample_seeds(self.seed, self.n)]
        return torch.stack(draws).numpy()


@dataclass
class ParityInputs:
    """Every input of one parity run: ``graphs`` and ``probe_rows`` (by LayerNorm size, the rows the eps probes
    run) drawn from ``seed``, for the config ``config``; the generation's plan and its prior ``noise``."""

    config: dict[str, Any]
    config_sha256: str
    seed: int
    graphs: InputSets
    probe_rows: dict[int, np.ndarray]
    end_to_end: EndToEndPlan
    noise: np.ndarray
    saved_with: dict[str, str] = field(default_factory=dict)  # the run that saved them: backend, precision, device ...
    versions: dict[str, str] = field(default_factory=dict)  # of ldlm, numpy, torch and safetensors, as read from a file
    path: str | None = None  # the file they were read from

    def tensors(self) -> dict[str, np.ndarray]:
        named = {
            f"graphs/{graph}/{set_name}/{name}": array
            for graph, sets in self.graphs.items()
            for set_name, feed in sets.items()
            for name, array in feed.items()
        }
        named.update({f"eps_probe_rows/{size}": rows for size, rows in self.probe_rows.items()})
        named[NOISE] = self.noise
        return {name: np.ascontiguousarray(array) for name, array in named.items()}

    def header(self) -> dict[str, Any]:
        plan = asdict(self.end_to_end)
        return {
            "format": INPUTS_FORMAT,
            "config": self.config,
            "config_sha256": self.config_sha256,
            "seed": self.seed,
            "end_to_end": {**plan, "sample_seeds": sample_seeds(self.end_to_end.seed, self.end_to_end.n)},
            "saved_with": self.saved_with,
        }


def layer_norm_sizes(model: LDLM) -> list[int]:
    """How many values each LayerNorm of ``model`` normalizes, one entry per distinct size: the eps probes'
    rows are drawn per size."""
    return sorted({math.prod(m.normalized_shape) for m in model.modules() if isinstance(m, nn.LayerNorm)})


def generate_inputs(model: LDLM, seed: int, end_to_end: EndToEndPlan) -> ParityInputs:
    """The inputs parity generates from ``seed`` for ``model``, and the generation's prior noise."""
    return ParityInputs(
        model.config.to_dict(),
        model.config.config_hash(),
        seed,
        {graph: input_sets(model, graph, seed) for graph in GRAPH_NAMES},
        {size: probe_rows(size, seed).x for size in layer_norm_sizes(model)},
        end_to_end,
        end_to_end.noise(model.config.d_model),
    )


def save_inputs(inputs: ParityInputs, path: str | os.PathLike[str]) -> Path:
    """Write ``inputs`` to ``path`` (safetensors, through a temporary name)."""
    return _write(path, inputs.header(), inputs.tensors())


def read_inputs(path: str | os.PathLike[str]) -> ParityInputs:
    """A file written by ``save_inputs``, refused (ValueError) when it is not one, was changed after it was
    written, or is of a format version this ldlm does not read. Whether it fits a model: ``check_inputs``."""
    header, tensors = _read(path, INPUTS_FORMAT)
    try:
        graphs: InputSets = {}
        for name, array in tensors.items():
            kind, _, rest = name.partition("/")
            if kind == "graphs":
                graph, set_name, input_name = rest.split("/")
                graphs.setdefault(graph, {}).setdefault(set_name, {})[input_name] = array
        plan = header["end_to_end"]
        return ParityInputs(
            header["config"],
            header["config_sha256"],
            int(header["seed"]),
            graphs,
            {int(name.rpartition("/")[2]): array for name, array in tensors.items() if name.startswith("eps_probe_rows/")},
            EndToEndPlan(**{f.name: plan[f.name] for f in fields(EndToEndPlan)}),
            tensors[NOISE],
            header.get("saved_with", {}),
            header.get("versions", {}),
            os.fspath(path),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: its header or tensor names are malformed ({error!r}); {_allowed(INPUTS_FORMAT)}") from error


def check_inputs(inputs: ParityInputs, model: LDLM) -> None:
    """Refuse, naming what differs, inputs that do not fit ``model``: another config, other graphs, input
    sets or inputs, a shape or dtype the graph does not take, or eps-probe rows and prior noise other than
    what the seeds draw here (those two are drawn again from the seeds when the inputs are replayed)."""
    where = f"parity inputs {inputs.path}"
    _check_config(inputs, model.config, where)
    if list(inputs.graphs) != list(GRAPH_NAMES):
        raise ValueError(f"{where} hold the graphs {', '.join(inputs.graphs) or 'none'}; allowed: {', '.join(GRAPH_NAMES)}")
    for graph in GRAPH_NAMES:
        made = input_sets(model, graph, inputs.seed)
        if list(inputs.graphs[graph]) != list(made):
            raise ValueError(f"{where}: graph {graph} has the input sets {', '.join(inputs.graphs[graph])}; allowed: {', '.join(made)}")
        for set_name, feed in inputs.graphs[graph].items():
            _check_feed(f"{where}: graphs/{graph}/{set_name}", feed, made[set_name], model, graph)
    _check_draws(inputs, model, where)


def check_replay_options(inputs: ParityInputs, seed: int | None, steps: int | None, sampler: str | None) -> None:
    """Refuse options given alongside a file that disagree with the ones its inputs were made with."""
    plan = inputs.end_to_end
    for option, given, saved in (("seed", seed, inputs.seed), ("steps", steps, plan.steps), ("sampler", sampler, plan.sampler)):
        if given is not None and given != saved:
            raise ValueError(
                f"{option}={given!r} disagrees with the parity inputs {inputs.path}, made with {option} {saved!r}; "
                f"a replay runs the file's own: leave {option} out, or give {saved!r}"
            )


def check_files(
    save_inputs: str | os.PathLike[str] | None,
    load_inputs: str | os.PathLike[str] | None,
    save_outputs: str | os.PathLike[str] | None,
    overwrite: bool = False,
) -> None:
    """Refuse, before any work, an outputs file that is also an inputs file (writing the outputs would replace
    the inputs), and a file to write that may not be (``ldlm.files.refuse_existing_file``): an existing one is
    replaced only with ``overwrite`` and only when it is a parity file of the same kind."""
    for option, path in (("save_inputs", save_inputs), ("load_inputs", load_inputs)):
        if path is not None and save_outputs is not None and Path(path).resolve() == Path(save_outputs).resolve():
            raise ValueError(
                f"save_outputs={os.fspath(save_outputs)!r} is also {option}: the outputs would replace the inputs; "
                "allowed: another file for the outputs"
            )
    for path, format_name in ((save_inputs, INPUTS_FORMAT), (save_outputs, OUTPUTS_FORMAT)):
        if path is not None:
            refuse_existing_file(path, overwrite, WRITTEN_BY[format_name], written_by)


def written_by(path: Path) -> str | None:
    """The command that wrote a parity file, as its header's format names it (``WRITTEN_BY``); None for any other file."""
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            found = json.loads((f.metadata() or {})[HEADER_KEY])["format"]
    except Exception:  # not safetensors, no parity header: safetensors raises its own error types
        return None
    return WRITTEN_BY.get(found) if isinstance(found, str) else None


def _check_config(inputs: ParityInputs, config: LDLMConfig, where: str) -> None:
    if inputs.config_sha256 == config.config_hash():
        return
    ours = config.to_dict()
    differ = [
        f"{name} {inputs.config.get(name)!r} in the file, {ours.get(name)!r} in the checkpoint"
        for name in sorted(set(ours) | set(inputs.config))
        if inputs.config.get(name) != ours.get(name)
    ]
    raise ValueError(
        f"{where} were made for another config than the checkpoint's ({'; '.join(differ) or 'config_sha256 differs'}); "
        "save them again from this checkpoint (--save-inputs)"
    )


def _check_feed(label: str, feed: Mapping[str, np.ndarray], made: Mapping[str, np.ndarray], model: LDLM, graph: str) -> None:
    """One input set against what its graph takes: the names, the dtypes, the shapes (``batch`` and ``seq``
    the same for every input, seq at most the config's ``max_seq_len``), token ids within the vocabulary."""
    if set(feed) != set(made):
        raise ValueError(f"{label} has the inputs {', '.join(feed)}; allowed: {', '.join(made)}")
    config, io = model.config, graph_io(model, graph)
    sizes: dict[str, int] = {}  # what each named axis (batch, seq) is in this set
    for name, dims in zip(io.input_names, io.input_shapes):
        array, pattern = feed[name], "(" + ", ".join(str(d) for d in dims) + ")"
        if array.dtype != made[name].dtype:
            raise ValueError(f"{label}/{name} is {array.dtype}; allowed: {made[name].dtype}")
        wanted = [sizes.setdefault(d, size) if isinstance(d, str) else d for d, size in zip(dims, array.shape)]
        in_range = sizes.get("batch", 1) >= 1 and 1 <= sizes.get("seq", 1) <= config.max_seq_len
        if array.ndim != len(dims) or list(array.shape) != wanted or not in_range:
            raise ValueError(
                f"{label}/{name} has shape {tuple(array.shape)}; allowed: {pattern} with batch and seq the same for every "
                f"input of the set, batch at least 1, seq 1..{config.max_seq_len}"
            )
        if name == "input_ids" and array.size and not 0 <= int(array.min()) <= int(array.max()) < config.gpt2_vocab_size:
            raise ValueError(f"{label}/{name} holds ids {int(array.min())}..{int(array.max())}; allowed: 0..{config.gpt2_vocab_size - 1}")


def _check_draws(inputs: ParityInputs, model: LDLM, where: str) -> None:
    """The eps-probe rows and the prior noise are what the file's seeds draw here; a replay draws them again
    from the seeds, so other numbers (another numpy or torch) would not be replayed."""
    saved = "saved with " + ", ".join(f"{k} {v}" for k, v in inputs.versions.items() if k in ("numpy", "torch"))
    sizes = layer_norm_sizes(model)
    if sorted(inputs.probe_rows) != sizes:
        raise ValueError(f"{where} hold eps-probe rows for LayerNorms of {sorted(inputs.probe_rows)} values; allowed: {sizes}")
    for size, rows in inputs.probe_rows.items():
        if not np.array_equal(rows, probe_rows(size, inputs.seed).x):
            raise ValueError(
                f"{where}: seed {inputs.seed} draws other eps-probe rows for LayerNorms of {size} values here than the file "
                f"holds ({saved}), and the probes draw them from the seed; replay with the numpy that saved them"
            )
    plan = inputs.end_to_end
    if not 1 <= plan.length <= model.config.max_seq_len or plan.n < 1:
        raise ValueError(
            f"{where}: the end-to-end generation asks for {plan.n} x {plan.length} tokens; allowed: length 1..{model.config.max_seq_len}"
        )
    if not np.array_equal(inputs.noise, plan.noise(model.config.d_model)):
        raise ValueError(
            f"{where}: seed {plan.seed} draws other prior noise here than the file holds ({saved}), and the generation "
            "draws it from the seed; replay with the torch that saved it"
        )


def save_outputs(outputs: ParityOutputs, path: str | os.PathLike[str], about: Mapping[str, Any]) -> Path:
    """Write ``outputs`` to ``path`` (safetensors, through a temporary name); ``about`` (the backend, the
    precision, the inputs' sha256 ...) joins the header."""
    tensors = {f"reference/{name}": array for name, array in outputs.reference.items()}
    tensors.update({f"candidate/{name}": array for name, array in outputs.candidate.items()})
    return _write(path, {"format": OUTPUTS_FORMAT, **about}, tensors)


def read_outputs(path: str | os.PathLike[str]) -> tuple[dict[str, Any], ParityOutputs]:
    """The header and the outputs of a file written by ``save_outputs``."""
    header, tensors = _read(path, OUTPUTS_FORMAT)
    outputs = ParityOutputs()
    for name, array in tensors.items():
        side, _, compared = name.partition("/")
        getattr(outputs, side)[compared] = array
    return header, outputs


def tensors_sha256(tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in order."""
    digest = hashlib.sha256()
    for name, array in tensors.items():
        digest.update(json.dumps([name, str(array.dtype), list(array.shape)]).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def header_sha256(header: Mapping[str, Any]) -> str:
    """sha256 over every entry of a header but ``HEADER_SHA256`` itself, as canonical JSON (sorted keys)."""
    sealed = {name: value for name, value in header.items() if name != HEADER_SHA256}
    return hashlib.sha256(json.dumps(sealed, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _listing(tensors: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    return {name: {"shape": list(array.shape), "dtype": str(array.dtype)} for name, array in tensors.items()}


def _allowed(format_name: str) -> str:
    return f"allowed: a file written by `{WRITTEN_BY[format_name]}` (format {format_name} version {FORMAT_VERSION})"


def _write(path: str | os.PathLike[str], header: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Path:
    versions = {"ldlm": __version__, "numpy": np.__version__, "torch": torch.__version__, "safetensors": safetensors.__version__}
    listing = {"tensors": _listing(tensors), "sha256": tensors_sha256(tensors)}
    full = {"format": header["format"], "version": FORMAT_VERSION, "versions": versions, **header, **listing}
    full[HEADER_SHA256] = header_sha256(full)
    data = safetensors.numpy.save(dict(tensors), metadata={HEADER_KEY: json.dumps(full)})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, data)


def _read(path: str | os.PathLike[str], format_name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and the tensors (in the header's order) of a parity file of ``format_name``."""
    if not Path(path).is_file():
        raise ValueError(f"{os.fspath(path)} is not a file; {_allowed(format_name)}")
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has keys(), no __iter__)
    except Exception as error:  # safetensors raises its own error types
        raise ValueError(f"{os.fspath(path)} is not a safetensors file ({error}); {_allowed(format_name)}") from error
    try:
        header = json.loads(metadata[HEADER_KEY])
        found = (header["format"], header["version"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{os.fspath(path)} has no ldlm parity header ({HEADER_KEY!r} metadata); {_allowed(format_name)}") from None
    if found != (format_name, FORMAT_VERSION):
        raise ValueError(f"{os.fspath(path)} is format {found[0]} version {found[1]}; {_allowed(format_name)}")
    if header.get(HEADER_SHA256) != header_sha256(header):
        raise ValueError(
            f"{os.fspath(path)}: its header was changed after it was written ({HEADER_SHA256} differs): the header defines the "
            f"case (seed, steps, sampler, checkpoint ...); save the case again (--save-inputs) rather than edit it; {_allowed(format_name)}"
        )
    listed, found_listing = header.get("tensors", {}), _listing(tensors)
    differ = sorted(name for name in set(listed) | set(found_listing) if listed.get(name) != found_listing.get(name))
    if differ:
        raise ValueError(f"{os.fspath(path)}: its tensors disagree with its header ({', '.join(differ[:5])}); {_allowed(format_name)}")
    ordered = {name: tensors[name] for name in listed}
    if tensors_sha256(ordered) != header.get("sha256"):
        raise ValueError(f"{os.fspath(path)}: its tensors were changed after it was written (sha256 differs); {_allowed(format_name)}")
    return header, ordered
