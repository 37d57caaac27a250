"""The parity check users trust before they ship: eager PyTorch against an engine.

Three levels, all against eager as the reference:
  1. per graph: every output on random, padded and stress inputs (GPT-2-like outlier channels of
     magnitude ~1000 for latents; real text for the encoder), padding masked out;
  2. per LayerNorm (ONNX Runtime): a debug copy of each graph marks every LayerNormalization
     output as a graph output; eager outputs come from hooks on the matching nn.LayerNorm;
  3. end to end: the same seed and noise through eager and engine generation with the
     deterministic sampler, as token agreement.
Given an artifact (an export or engine directory), the structural verifier runs first; and every
LayerNorm is also probed alone on inputs where eps decides (export/layernorm/eps_probe.py), on the backend
under test: a wrong epsilon is invisible at ordinary activations. The torch backends (eager, compiled)
run the checkpoint's own modules: with no artifact, neither the verifier nor the probes apply.
``bisect`` names the first LayerNorm (in execution order) whose output diverges. Every input can be saved to
one file and a run replayed from it, on this backend or another, and both sides' outputs saved
(``parity_inputs``).

The parts: ``parity_graphs`` (levels 1 and 2), ``parity_end_to_end`` (level 3, with level 1 before it),
``parity_result`` (the report and its verdict), ``parity_report`` (its JSON, Markdown and plots), ``parity_inputs``
(inputs and outputs as files); here ``run_parity``, which opens the artifact and runs every stage in order.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ldlm.export.artifact import check_from_checkpoint, read_manifest, read_plan_manifest, verified_by_caller
from ldlm.export.graphs import GRAPH_NAMES, graph_io
from ldlm.export.layernorm.compare import min_cosine, tolerance
from ldlm.export.layernorm.eps_probe_trt import locate_plan_onnx
from ldlm.export.layernorm.verify import LayerNormSpec, VerifyResult, verify_onnx
from ldlm.export.onnx_export import export_graphs, graph_layer_norm_specs
from ldlm.model.checkpoint import load_checkpoint
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer
from ldlm.sampling.tuned_grids import TunedSchedules, checkpoint_schedules
from ldlm.serve.checks.eps_probe_artifact import probe_layer_norm_eps
from ldlm.serve.checks.parity_end_to_end import END_TO_END_LENGTH, END_TO_END_SAMPLES, compare_with_eager
from ldlm.serve.checks.parity_graphs import compare_layer_norms
from ldlm.serve.checks.parity_inputs import (
    EndToEndPlan,
    ParityInputs,
    check_files,
    check_inputs,
    check_replay_options,
    generate_inputs,
    read_inputs,
    tensors_sha256,
)
from ldlm.serve.checks.parity_inputs import save_inputs as write_inputs
from ldlm.serve.checks.parity_inputs import save_outputs as write_outputs
from ldlm.serve.checks.parity_result import TOKEN_AGREEMENT_REQUIRED, ParityOutputs, ParityReport, first_divergence
from ldlm.serve.runtime.backends import info_of, open_graphs, ort_providers
from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.registry import DEFAULT_BACKEND
from ldlm.serve.runtime.torch_backends import EagerBackend

AfterGraph = Callable[[ParityReport, str, EagerBackend, dict[str, dict[str, np.ndarray]]], None]


def verify_artifact(model: LDLM, backend: str, source: Path) -> list[VerifyResult]:
    """The structural verifier (export/layernorm/verify.py) on every graph of the artifact, against the
    checkpoint's own modules: the export's ONNX files, or for engines the ONNX each plan was built from."""
    results = []
    for name in GRAPH_NAMES:
        specs = graph_layer_norm_specs(model, graph_io(model, name))
        if info_of(backend).opens == "export":
            path: Path | None = source / read_manifest(source)["graphs"][name]["file"]
            problem = None
        else:
            path, problem = locate_plan_onnx(source, read_plan_manifest(source / f"{name}.plan"), None)
        if path is None:
            results.append(VerifyResult(name, str(source), 0, len(specs), [problem or "no ONNX to verify"]))
        else:
            results.append(verify_onnx(path, specs, name))
    return results


def open_checked_graphs(
    model: LDLM, checkpoint: str | Path, backend: str, source: Path, precision: str, provider: str, device: str
) -> dict[str, GraphBackend]:
    """The graphs of ``source`` on ``backend``, refused when made from another config than ``model``'s. Their
    LayerNorms are not refused on opening: parity verifies them itself, against the checkpoint, and reports
    each failure (and bisects to it) rather than refusing to measure."""
    with verified_by_caller():
        graphs, config, _ = open_graphs(backend, source, precision, ort_providers(provider, backend), device=device, with_logits=True)
    if config.config_hash() != model.config.config_hash():
        raise ValueError(f"{source} was made from another config than checkpoint {checkpoint}")
    return graphs


def layer_norm_stage(
    model: LDLM,
    source: Path,
    manifest: dict[str, Any] | None,
    precision: str,
    atol: float,
    rtol: float,
    work: Path,
    bar: tqdm,
    outputs: ParityOutputs | None = None,
) -> AfterGraph:
    """Level 2 as compare_with_eager's ``after_graph``: each graph's LayerNorm outputs against eager (an
    ONNX Runtime export in fp32 and int8 only, ``manifest`` being its manifest), into ``outputs`` too, then one
    step of ``bar``."""

    def layer_norms(report: ParityReport, name: str, eager: EagerBackend, sets: dict[str, dict[str, np.ndarray]]) -> None:
        if manifest is not None and precision in ("fp32", "int8"):
            entry = manifest["graphs"][name]
            file = entry.get("variants", {}).get(precision, entry)["file"] if precision == "int8" else entry["file"]
            specs = [LayerNormSpec.from_dict(d) for d in entry["layer_norms"]]
            compare_layer_norms(name, model, eager, source / file, specs, sets, atol, rtol, work, report, outputs)
        bar.update()

    return layer_norms


def eps_probe_stage(
    report: ParityReport, model: LDLM, backend: str, source: Path, precision: str, seed: int, provider: str, bar: tqdm
) -> None:
    """Every LayerNorm of the artifact probed alone on the backend under test, into ``report``."""
    bar.set_postfix_str("eps probes")
    opens = info_of(backend).opens
    report.eps_probes = probe_layer_norm_eps(
        model,
        onnx_dir=source if opens == "export" else None,
        engine_dir=source if opens == "engines" else None,
        seed=seed,
        providers=ort_providers(provider, backend),
    )  # where the graphs ran
    if opens == "export" and precision == "fp16":
        report.notes.append("eps probes ran the fp32 export's LayerNormalization nodes (the fp16 cast keeps them in FP32)")
    bar.update()


def parity_notes(backend: str, precision: str, device: str, has_manifest: bool) -> list[str]:
    """What the report says about what was and was not compared, and how."""
    notes = []
    if not has_manifest or precision not in ("fp32", "int8"):
        notes.append("per-LayerNorm outputs are compared on ONNX Runtime fp32 and int8 graphs only")
    if precision == "int8":
        notes.append(
            f"int8 is judged by cosine per sample >= {min_cosine('int8')} on every output and LayerNorm output, and "
            f"token agreement >= {TOKEN_AGREEMENT_REQUIRED['int8']:.0%}; graphs without an int8 variant ran fp32"
        )
    if info_of(backend).runs_checkpoint:
        notes.append(f"{backend} ran the checkpoint on {device} in {precision}; the reference is eager fp32 on CPU")
    return notes


def end_to_end_plan(
    checkpoint: str | Path, precision: str, sampler: str | None, steps: int | None
) -> tuple[str | None, int | None, TunedSchedules | None]:
    """The end-to-end generation's sampler, steps and tuned grids: DDIM@10 (deterministic) unless given; for
    int8, what a request naming neither is served (None: ``ldlm.sampling.resolve`` fills them in, with the
    checkpoint's tuned grids), which a quantized engine must keep."""
    if precision != "int8":
        return sampler or "ddim", steps or 10, None
    return sampler, steps, checkpoint_schedules(checkpoint)


def fresh_inputs(
    model: LDLM, checkpoint: str | Path, precision: str, seed: int | None, steps: int | None, sampler: str | None
) -> ParityInputs:
    """The inputs parity generates from ``seed`` (default 0), with the end-to-end generation of ``end_to_end_plan``."""
    sampler, steps, schedules = end_to_end_plan(checkpoint, precision, sampler, steps)
    length = min(END_TO_END_LENGTH, model.config.max_seq_len)
    plan = EndToEndPlan(seed or 0, END_TO_END_SAMPLES, length, steps, sampler, tuned_grids=schedules is not None)
    return generate_inputs(model, plan.seed, plan)


def replayed_note(inputs: ParityInputs) -> str:
    """What the report says about inputs read from a file."""
    saved = inputs.saved_with
    by = f", saved by a {saved['backend']} {saved['precision']} run on {saved['device']}" if "backend" in saved else ""
    return (
        f"inputs replayed from {inputs.path}{by}: the graphs ran its input sets; the eps probes and the end-to-end generation "
        f"drew from its seed {inputs.seed} the rows and the noise it holds"
    )


def run_parity(
    checkpoint: str | Path,
    backend: str = DEFAULT_BACKEND,
    precision: str = "fp32",
    source: str | Path | None = None,
    bisect: bool = False,
    seed: int | None = None,
    steps: int | None = None,
    progress: bool = False,
    device: str = "cpu",
    provider: str = "cpu",
    sampler: str | None = None,
    save_inputs: str | Path | None = None,
    load_inputs: str | Path | None = None,
    save_outputs: str | Path | None = None,
    overwrite: bool = False,
) -> ParityReport:
    """Compare ``backend`` (an export dir for ort, an engine dir for trt; ort exports the
    checkpoint itself when ``source`` is None; eager and compiled run the checkpoint on ``device``
    in ``precision``) against CPU fp32 eager on the checkpoint, on the inputs of ``seed`` (default 0). The
    end-to-end generation: ``end_to_end_plan``. ``save_inputs``: write every input to this file
    (``parity_inputs``); ``load_inputs``: run on a file's inputs instead (with its seed, steps and sampler; others
    given are refused), refused unless it fits the checkpoint; ``save_outputs``: write both sides' outputs. An
    existing file of either is replaced only with ``overwrite``, and only a parity file of its kind."""
    info = info_of(backend)
    given = source is not None and not info.runs_checkpoint  # an artifact made beforehand: the structural verifier checks it
    if info.runs_checkpoint:
        source = checkpoint  # the checkpoint's own modules: no artifact, so no verifier and no eps probes
    if source is None and info.opens != "export":
        raise ValueError(f"backend {backend!r} needs its engine directory (--engine-dir); only the ONNX Runtime backends export on the fly")
    check_files(save_inputs, load_inputs, save_outputs, overwrite)
    replayed = None if load_inputs is None else read_inputs(load_inputs)  # a file that is none: refused before any work
    if replayed is not None:
        check_replay_options(replayed, seed, steps, sampler)
    if given and source is not None:
        check_from_checkpoint(checkpoint, source)  # before the checkpoint loads
    model, tokenizer = load_checkpoint(checkpoint)
    if replayed is not None:
        check_inputs(replayed, model)
    inputs = replayed or fresh_inputs(model, checkpoint, precision, seed, steps, sampler)
    run = {"backend": backend, "precision": precision, "device": device, "provider": provider}
    if save_inputs is not None:  # now, before anything runs: a run that crashes leaves its case behind
        inputs.saved_with = {**run, "checkpoint": str(checkpoint)}
        write_inputs(inputs, save_inputs)
    outputs = None if save_outputs is None else ParityOutputs()
    bar = tqdm(total=len(GRAPH_NAMES) + 1 + (not info.runs_checkpoint) + given, desc="parity", unit="stage", disable=not progress)
    with bar:
        report = run_stages(model, tokenizer, checkpoint, backend, precision, source, given, device, provider, inputs, outputs, bar)
    if replayed is not None:
        report.notes.append(replayed_note(replayed))
    if outputs is not None and save_outputs is not None:
        about = {**run, "providers": report.providers, "seed": inputs.seed, "config_sha256": inputs.config_sha256}
        write_outputs(outputs, save_outputs, {**about, "inputs_sha256": tensors_sha256(inputs.tensors())})
    if bisect and not report.passed:
        report.first_divergence = first_divergence(report)
    return report


def run_stages(
    model: LDLM,
    tokenizer: TextTokenizer,
    checkpoint: str | Path,
    backend: str,
    precision: str,
    source: str | Path | None,
    given: bool,
    device: str,
    provider: str,
    inputs: ParityInputs,
    outputs: ParityOutputs | None,
    bar: tqdm,
) -> ParityReport:
    """Every stage of ``run_parity`` on ``inputs``, in order, one step of ``bar`` each: the export (when
    ``source`` is None), the structural verifier (``given`` an artifact), the graphs with their LayerNorms, the
    end-to-end generation, the eps probes."""
    atol, rtol = tolerance(precision)
    plan = inputs.end_to_end
    schedules = checkpoint_schedules(checkpoint) if plan.tuned_grids else None
    with tempfile.TemporaryDirectory(prefix="ldlm-parity-") as tmp:
        work = Path(tmp)
        if source is None:
            bar.set_postfix_str("exporting")
            source = export_graphs(checkpoint, work / "onnx", with_logits=True).out
        source = Path(source)
        graphs = open_checked_graphs(model, checkpoint, backend, source, precision, provider, device)
        verification = []
        if given:
            bar.set_postfix_str("structural verifier")
            verification = verify_artifact(model, backend, source)
            bar.update()
        manifest = read_manifest(source) if info_of(backend).opens == "export" else None
        layer_norms = layer_norm_stage(model, source, manifest, precision, atol, rtol, work, bar, outputs)
        bar.set_postfix_str("graphs, then end-to-end generation")
        report = compare_with_eager(
            model, tokenizer, graphs, backend, precision, plan.seed, plan.steps, plan.n, plan.length, after_graph=layer_norms,
            sampler=plan.sampler, schedules=schedules, sets=inputs.graphs, outputs=outputs,
        )  # fmt: skip
        report.verification = verification
        report.notes += parity_notes(backend, precision, device, has_manifest=manifest is not None)
        for graph in graphs.values():
            graph.close()  # TensorRT-RTX keeps the kernels it compiled (runtime cache) for the next run
        bar.update()
        if info_of(backend).runs_checkpoint:
            report.notes.append(f"{backend} has no artifact: no structural verifier and no eps probes ran")
        else:
            eps_probe_stage(report, model, backend, source, precision, inputs.seed, provider, bar)
    return report
