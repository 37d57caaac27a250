"""The parity check users trust before they ship: eager PyTorch against an engine.

Three levels, all against eager as the reference:
  1. per graph: every output on random, padded and stress inputs (GPT-2-like outlier channels of
     magnitude ~1000 for latents; real text for the encoder), padding masked out;
  2. per LayerNorm (ONNX Runtime): a debug copy of each graph marks every LayerNormalization
     output as a graph output; eager outputs come from hooks on the matching nn.LayerNorm;
  3. end to end: the same seed and noise through eager and engine generation with the
     deterministic sampler, as token agreement.
Given an artifact (an export or engine directory), the structural verifier runs first; and every
LayerNorm is also probed alone on inputs where eps decides (serve/checks/eps_probe.py), on the backend
under test: a wrong epsilon is invisible at ordinary activations. The torch backends (eager, compiled)
run the checkpoint's own modules: with no artifact, neither the verifier nor the probes apply.
``bisect`` names the first LayerNorm (in execution order) whose output diverges.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from tqdm.auto import tqdm

from ldlm.checkpoint import load_checkpoint
from ldlm.export.artifact import check_from_checkpoint, read_manifest
from ldlm.export.graphs import GRAPH_NAMES, graph_io
from ldlm.export.onnx_export import export_graphs, graph_layer_norm_specs
from ldlm.export.verify import LayerNormSpec, VerifyResult, pair_layer_norm_nodes, verify_onnx
from ldlm.model import LDLM
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.checks.compare import Comparison, compare_outputs, tolerance
from ldlm.serve.checks.eps_probe import EpsProbeReport
from ldlm.serve.checks.eps_probe_artifact import probe_layer_norm_eps
from ldlm.serve.checks.eps_probe_trt import locate_plan_onnx
from ldlm.serve.runtime.backends import TORCH_BACKENDS, BackendGraphs, OrtBackend, open_graphs, ort_providers
from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.tensorrt_engine import read_plan_manifest
from ldlm.serve.runtime.torch_backends import EagerBackend
from ldlm.tokenizer import TextTokenizer

TOKEN_AGREEMENT_REQUIRED = {"fp32": 1.0, "fp16": 0.9, "bf16": 0.8}
REAL_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "In 1905, Albert Einstein published four papers that changed physics.",
    "Latent diffusion models denoise continuous representations of text.",
]


@dataclass
class ParityReport:
    backend: str
    precision: str
    providers: dict[str, str]
    atol: float
    rtol: float
    graphs: list[Comparison] = field(default_factory=list)
    layer_norms: list[Comparison] = field(default_factory=list)
    decoder_token_agreement: dict[str, float] = field(default_factory=dict)
    token_agreement: float | None = None
    token_agreement_required: float = 1.0
    first_divergence: str | None = None
    notes: list[str] = field(default_factory=list)
    verification: list[VerifyResult] = field(default_factory=list)  # the artifact's structural check
    eps_probes: EpsProbeReport | None = None

    @property
    def passed(self) -> bool:
        compared = self.graphs or self.layer_norms
        ok = all(c.passed for c in self.graphs) and all(c.passed for c in self.layer_norms)
        e2e = self.token_agreement is not None and self.token_agreement >= self.token_agreement_required
        structure = all(v.passed for v in self.verification) and (self.eps_probes is None or self.eps_probes.passed)
        # The decoder's token ids are an output too: its argmax must agree as well as its logits.
        decoder = all(a >= self.token_agreement_required for a in self.decoder_token_agreement.values())
        return bool(compared) and ok and e2e and structure and decoder

    def summary(self) -> str:
        failed = [c.name for c in [*self.graphs, *self.layer_norms] if not c.passed]
        status = "PASSED" if self.passed else "FAILED"
        line = (
            f"{status} parity {self.backend} ({self.precision}) vs eager: {len(self.graphs)} graph outputs, "
            f"{len(self.layer_norms)} LayerNorm outputs, token agreement {100 * (self.token_agreement or 0):.2f}%"
        )
        if failed:
            line += f"; failing: {', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''}"
        if self.first_divergence:
            line += f"; first divergence: {self.first_divergence}"
        if any(not v.passed for v in self.verification):
            line += "; structural verifier FAILED: " + ", ".join(v.graph for v in self.verification if not v.passed)
        if self.eps_probes is not None:
            line += f"; eps probes {self.eps_probes.status}"
            failing = [f"{p.graph}:{p.module} (node {p.node})" for p in self.eps_probes.layer_norms if p.problems]
            if failing:
                line += f" ({', '.join(failing[:5])}{' ...' if len(failing) > 5 else ''})"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "backend": self.backend,
            "precision": self.precision,
            "providers": self.providers,
            "atol": self.atol,
            "rtol": self.rtol,
            "graphs": [c.to_dict() for c in self.graphs],
            "layer_norms": [c.to_dict() for c in self.layer_norms],
            "decoder_token_agreement": self.decoder_token_agreement,
            "token_agreement": self.token_agreement,
            "token_agreement_required": self.token_agreement_required,
            "first_divergence": self.first_divergence,
            "notes": self.notes,
            "verification": [v.to_dict() for v in self.verification],
            "eps_probes": None if self.eps_probes is None else self.eps_probes.to_dict(),
        }


def input_sets(model: LDLM, graph: str, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Named input sets for ``graph``: random, padded and stress (outliers / real text)."""
    cfg = model.config
    gen = np.random.default_rng(seed)
    b, length, d = 3, min(24, cfg.max_seq_len), cfg.d_model
    full = np.ones((b, length), dtype=np.int64)
    padded = full.copy()
    padded[1, length // 2 :] = 0
    padded[2, length // 3 :] = 0
    if graph == "encoder":
        ids = gen.integers(0, cfg.gpt2_vocab_size, (b, length))
        real = TextTokenizer.gpt2().encode(REAL_TEXT)
        n = min(max(len(r) for r in real), cfg.max_seq_len)
        real_ids = np.full((len(real), n), cfg.eos_token_id, dtype=np.int64)
        real_mask = np.zeros((len(real), n), dtype=np.int64)
        for i, row in enumerate(real):
            real_ids[i, : min(len(row), n)] = row[:n]
            real_mask[i, : min(len(row), n)] = 1
        return {
            "random": {"input_ids": ids, "attention_mask": full},
            "padded": {"input_ids": ids, "attention_mask": padded},
            "real-text": {"input_ids": real_ids, "attention_mask": real_mask},
        }
    x = gen.standard_normal((b, length, d)).astype(np.float32)
    outliers = x.copy()
    channels = gen.choice(d, size=max(2, d // 128), replace=False)
    outliers[:, :, channels] = 1000.0 + 200.0 * gen.standard_normal((b, length, len(channels)))  # GPT-2-like
    if graph == "denoiser":
        t = gen.uniform(0.05, 1.0, b).astype(np.float32)
        x0 = gen.standard_normal((b, length, d)).astype(np.float32)
        return {
            "random": {"x_t": x, "t": t, "x0_prev": x0, "attention_mask": full},
            "padded": {"x_t": x, "t": t, "x0_prev": x0, "attention_mask": padded},
            "stress-outliers": {"x_t": outliers, "t": t, "x0_prev": outliers, "attention_mask": full},
        }
    return {
        "random": {"latents": x, "attention_mask": full},
        "padded": {"latents": x, "attention_mask": padded},
        "stress-outliers": {"latents": outliers, "attention_mask": full},
    }


def _masked(array: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Zero the padded positions (axis 1) so that garbage there is not compared."""
    return array * mask.reshape(mask.shape + (1,) * (array.ndim - 2)).astype(array.dtype) if array.ndim >= 2 else array


def compare_graph(
    name: str,
    eager: GraphBackend,
    candidate: GraphBackend,
    sets: dict[str, dict[str, np.ndarray]],
    atol: float,
    rtol: float,
    report: ParityReport,
) -> None:
    for set_name, feed in sets.items():
        reference, got = eager.run(feed), candidate.run(feed)
        mask = feed["attention_mask"]
        for output in candidate.output_names:
            if output == "token_ids":
                valid = mask.astype(bool)
                report.decoder_token_agreement[set_name] = float((got[output][valid] == reference[output][valid]).mean())
                continue
            report.graphs.append(
                compare_outputs(f"{name}/{set_name}/{output}", _masked(reference[output], mask), _masked(got[output], mask), atol, rtol)
            )


def layer_norm_debug_copy(src: Path, specs: list[LayerNormSpec], dst: Path) -> list[tuple[str, LayerNormSpec]]:
    """Copy an ONNX graph with every LayerNormalization output marked as a graph output."""
    model = onnx.load(str(src))
    nodes = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    marked = []
    for node, spec in pair_layer_norm_nodes(nodes, specs):
        model.graph.output.append(onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None))
        marked.append((node.output[0], spec))
    order = {n.output[0]: i for i, n in enumerate(nodes)}
    marked.sort(key=lambda m: order[m[0]])  # execution order, for bisecting
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return marked


def compare_layer_norms(
    name: str,
    model: LDLM,
    eager: EagerBackend,
    onnx_path: Path,
    specs: list[LayerNormSpec],
    sets: dict[str, dict[str, np.ndarray]],
    atol: float,
    rtol: float,
    work: Path,
    report: ParityReport,
) -> None:
    debug = work / f"{name}.layernorms.onnx"
    marked = layer_norm_debug_copy(onnx_path, specs, debug)
    if not marked:
        return
    session = OrtBackend(debug, name, model.config.max_seq_len).session
    for set_name in ("random", "stress-outliers" if "stress-outliers" in sets else "real-text"):
        feed = sets[set_name]
        captured: dict[str, np.ndarray] = {}
        hooks = [eager.module.get_submodule(spec.name).register_forward_hook(_capture(captured, spec.name)) for _, spec in marked]
        try:
            eager.run(feed)
        finally:
            for hook in hooks:
                hook.remove()
        outputs = session.run([m[0] for m in marked], eager.check_inputs(feed))
        mask = feed["attention_mask"]
        for (_, spec), got in zip(marked, outputs):
            report.layer_norms.append(
                compare_outputs(f"{name}:{spec.name}/{set_name}", _masked(captured[spec.name], mask), _masked(got, mask), atol, rtol)
            )


def _capture(store: dict[str, np.ndarray], name: str) -> Callable[..., None]:
    def hook(module: Any, inputs: Any, output: torch.Tensor) -> None:
        store[name] = output.detach().cpu().numpy()

    return hook


def verify_artifact(model: LDLM, backend: str, source: Path) -> list[VerifyResult]:
    """The structural verifier (export/verify.py) on every graph of the artifact, against the
    checkpoint's own modules: the export's ONNX files, or for engines the ONNX each plan was built from."""
    results = []
    for name in GRAPH_NAMES:
        specs = graph_layer_norm_specs(model, graph_io(model, name))
        if backend == "ort":
            path: Path | None = source / read_manifest(source)["graphs"][name]["file"]
            problem = None
        else:
            path, problem = locate_plan_onnx(source, read_plan_manifest(source / f"{name}.plan"), None)
        if path is None:
            results.append(VerifyResult(name, str(source), 0, len(specs), [problem or "no ONNX to verify"]))
        else:
            results.append(verify_onnx(path, specs, name))
    return results


def eager_tokens(model: LDLM, tokenizer: TextTokenizer, n: int, length: int, steps: int, seed: int, sampler: str = "ddim") -> torch.Tensor:
    """The reference samples: CPU fp32 eager, with ``sampler`` (its noise drawn on the CPU)."""
    return LDLMPipeline(model, tokenizer).generate(n, length, steps, seed, sampler).token_ids


def compare_with_eager(
    model: LDLM,
    tokenizer: TextTokenizer,
    graphs: Mapping[str, GraphBackend],
    backend: str,
    precision: str,
    seed: int = 0,
    steps: int = 10,
    n: int = 4,
    length: int = 32,
    reference_tokens: torch.Tensor | None = None,
    after_graph: Callable[[ParityReport, str, EagerBackend, dict[str, dict[str, np.ndarray]]], None] | None = None,
    sampler: str = "ddim",
) -> ParityReport:
    """Levels 1 and 3 against CPU fp32 eager on ``model``: every output of ``graphs`` on the input sets
    of ``seed``, then the token agreement of ``n`` samples of ``length`` tokens (capped by the config)
    after ``steps`` steps of ``sampler``, sampled on the graphs' device from the reference's CPU noise.
    ``after_graph(report, name, eager, sets)`` runs after each graph (run_parity compares its
    LayerNorms there, into ``report``); ``reference_tokens`` (from ``eager_tokens``) spares generating the reference again when
    several candidates are checked."""
    atol, rtol = tolerance(precision)
    report = ParityReport(
        backend,
        precision,
        {g: b.provider for g, b in graphs.items()},
        atol,
        rtol,
        token_agreement_required=TOKEN_AGREEMENT_REQUIRED[precision],
    )
    eager = {g: EagerBackend(model, g, with_logits="logits" in graphs[g].output_names) for g in GRAPH_NAMES}
    if "logits" not in graphs["decoder"].output_names:
        report.notes.append("the decoder has no logits output: only its token ids were compared")
    for name in GRAPH_NAMES:
        sets = input_sets(model, name, seed)
        compare_graph(name, eager[name], graphs[name], sets, atol, rtol, report)
        if after_graph is not None:
            after_graph(report, name, eager[name], sets)
    length = min(length, model.config.max_seq_len)
    if reference_tokens is None:
        reference_tokens = eager_tokens(model, tokenizer, n, length, steps, seed, sampler)
    # Sampled on the backend's device with the reference's CPU noise: only the graphs differ.
    device = getattr(graphs["denoiser"], "device", "cpu")
    pipe = LDLMPipeline(BackendGraphs(dict(graphs)), tokenizer, device, config=model.config, noise_device="cpu")
    candidate = pipe.generate(n, length, steps, seed, sampler).token_ids
    report.notes.append(f"end-to-end generation: {n} x {length} tokens, {steps} steps of the {sampler} sampler")
    report.token_agreement = float((reference_tokens == candidate).float().mean())
    return report


def run_parity(
    checkpoint: str | Path,
    backend: str = "ort",
    precision: str = "fp32",
    source: str | Path | None = None,
    bisect: bool = False,
    seed: int = 0,
    steps: int = 10,
    progress: bool = False,
    device: str = "cpu",
    provider: str = "cpu",
    sampler: str = "ddim",
) -> ParityReport:
    """Compare ``backend`` (an export dir for ort, an engine dir for trt; ort exports the
    checkpoint itself when ``source`` is None; eager and compiled run the checkpoint on ``device``
    in ``precision``) against CPU fp32 eager on the checkpoint."""
    atol, rtol = tolerance(precision)
    torch_backend = backend in TORCH_BACKENDS
    given = source is not None and not torch_backend  # an artifact made beforehand: the structural verifier checks it
    if torch_backend:
        source = checkpoint  # the checkpoint's own modules: no artifact, so no verifier and no eps probes
    if source is None and backend != "ort":
        raise ValueError(f"backend {backend!r} needs its engine directory (--engine-dir); only ort exports on the fly")
    if given and source is not None:
        check_from_checkpoint(checkpoint, source)  # before the checkpoint loads
    model, tokenizer = load_checkpoint(checkpoint)
    bar = tqdm(total=len(GRAPH_NAMES) + 1 + (not torch_backend) + given, desc="parity", unit="stage", disable=not progress)
    with tempfile.TemporaryDirectory(prefix="ldlm-parity-") as tmp, bar:
        work = Path(tmp)
        if source is None:
            bar.set_postfix_str("exporting")
            source = export_graphs(checkpoint, work / "onnx", with_logits=True).out
        source = Path(source)
        graphs, config, _ = open_graphs(backend, source, precision, ort_providers(provider), device=device, with_logits=True)
        if config.config_hash() != model.config.config_hash():
            raise ValueError(f"{source} was made from another config than checkpoint {checkpoint}")
        verification = []
        if given:
            bar.set_postfix_str("structural verifier")
            verification = verify_artifact(model, backend, source)
            bar.update()
        manifest = read_manifest(source) if backend == "ort" else None

        def layer_norms(report: ParityReport, name: str, eager: EagerBackend, sets: dict[str, dict[str, np.ndarray]]) -> None:
            if manifest is not None and precision == "fp32":
                specs = [LayerNormSpec.from_dict(d) for d in manifest["graphs"][name]["layer_norms"]]
                compare_layer_norms(name, model, eager, source / manifest["graphs"][name]["file"], specs, sets, atol, rtol, work, report)
            bar.update()

        bar.set_postfix_str("graphs, then end-to-end generation")
        report = compare_with_eager(model, tokenizer, graphs, backend, precision, seed, steps, after_graph=layer_norms, sampler=sampler)
        report.verification = verification
        if manifest is None or precision != "fp32":
            report.notes.append("per-LayerNorm outputs are compared on ONNX Runtime fp32 graphs only")
        if torch_backend:
            report.notes.append(f"{backend} ran the checkpoint on {device} in {precision}; the reference is eager fp32 on CPU")
        for graph in graphs.values():
            graph.close()  # TensorRT-RTX keeps the kernels it compiled (runtime cache) for the next run
        bar.update()
        if torch_backend:
            report.notes.append(f"{backend} has no artifact: no structural verifier and no eps probes ran")
        else:
            bar.set_postfix_str("eps probes")
            report.eps_probes = probe_layer_norm_eps(
                model,
                onnx_dir=source if backend == "ort" else None,
                engine_dir=source if backend == "trt" else None,
                seed=seed,
                providers=ort_providers(provider),
            )  # where the graphs ran
            if backend == "ort" and precision != "fp32":
                report.notes.append("eps probes ran the fp32 export's LayerNormalization nodes (the fp16 cast keeps them in FP32)")
            bar.update()
    if bisect and not report.passed:
        report.first_divergence = first_divergence(report)
    return report


def first_divergence(report: ParityReport) -> str:
    """The first failing LayerNorm output in execution order (graphs in pipeline order), then the first
    LayerNorm failing its eps probe, else the first failing graph."""
    for comparison in report.layer_norms:
        if not comparison.passed:
            where = comparison.name.rsplit("/", 1)[0]
            return f"LayerNorm {where} (max abs {comparison.max_abs:.3g} > atol {comparison.atol:g})"
    for probe in report.eps_probes.layer_norms if report.eps_probes is not None else []:
        if probe.problems:
            return f"LayerNorm {probe.graph}:{probe.module} run alone (eps probe, node {probe.node}): {probe.problems[0]}"
    for comparison in report.graphs:
        if not comparison.passed:
            graph = comparison.name.split("/", 1)[0]
            return f"graph {graph}: no LayerNorm output diverged, the error arises in its other blocks ({comparison.name})"
    if any(not v.passed for v in report.verification):
        return "no compared output failed; the structural verifier did (see its problems)"
    return "no compared output failed; the end-to-end token agreement is below the requirement"
