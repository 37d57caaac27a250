"""Level 3 of the parity check (serve/checks/parity.py), with level 1 before it: the graphs against
eager PyTorch output by output, then the same seed and noise through eager and candidate generation,
scored as token agreement."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from ldlm.export.graphs import GRAPH_NAMES
from ldlm.export.layernorm.compare import tolerance
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling.tuned_grids import TunedSchedules
from ldlm.serve.checks.parity_graphs import compare_graph, input_sets
from ldlm.serve.checks.parity_result import END_TO_END_TOKENS, TOKEN_AGREEMENT_REQUIRED, ParityOutputs, ParityReport
from ldlm.serve.runtime.backends import BackendGraphs
from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.torch_backends import EagerBackend

# The end-to-end generation: this many samples of this many tokens (capped by the config's max_seq_len).
END_TO_END_SAMPLES = 4
END_TO_END_LENGTH = 32


def eager_tokens(
    model: LDLM,
    tokenizer: TextTokenizer,
    n: int,
    length: int,
    steps: int | None,
    seed: int,
    sampler: str | None = "ddim",
    schedules: TunedSchedules | None = None,
) -> torch.Tensor:
    """The reference samples: CPU fp32 eager, with ``sampler`` (its noise drawn on the CPU); steps or sampler
    None: the plan ``ldlm.sampling.resolve`` gives, with the checkpoint's tuned ``schedules``."""
    return LDLMPipeline(model, tokenizer, schedules=schedules).generate(n, length, steps, seed, sampler).token_ids


def compare_with_eager(
    model: LDLM,
    tokenizer: TextTokenizer,
    graphs: Mapping[str, GraphBackend],
    backend: str,
    precision: str,
    seed: int = 0,
    steps: int | None = 10,
    n: int = END_TO_END_SAMPLES,
    length: int = END_TO_END_LENGTH,
    reference_tokens: torch.Tensor | None = None,
    after_graph: Callable[[ParityReport, str, EagerBackend, dict[str, dict[str, np.ndarray]]], None] | None = None,
    sampler: str | None = "ddim",
    schedules: TunedSchedules | None = None,
    sets: Mapping[str, dict[str, dict[str, np.ndarray]]] | None = None,
    outputs: ParityOutputs | None = None,
) -> ParityReport:
    """Levels 1 and 3 against CPU fp32 eager on ``model``: every output of ``graphs`` on the input sets
    of ``seed`` (or on ``sets``, by graph, as ``parity_inputs`` replays them), then the token agreement of ``n`` samples of ``length`` tokens (capped by the config)
    after ``steps`` steps of ``sampler``, sampled on the graphs' device from the reference's CPU noise (either None:
    what ``ldlm.sampling.resolve`` fills in, with the checkpoint's tuned ``schedules``, as a server would).
    ``after_graph(report, name, eager, sets)`` runs after each graph (run_parity compares its
    LayerNorms there, into ``report``); ``reference_tokens`` (from ``eager_tokens``) spares generating the reference again when
    several candidates are checked. ``outputs`` collects both sides' outputs."""
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
        graph_sets = input_sets(model, name, seed) if sets is None else sets[name]
        compare_graph(name, eager[name], graphs[name], graph_sets, atol, rtol, report, outputs)
        if after_graph is not None:
            after_graph(report, name, eager[name], graph_sets)
    length = min(length, model.config.max_seq_len)
    if reference_tokens is None:
        reference_tokens = eager_tokens(model, tokenizer, n, length, steps, seed, sampler, schedules)
    # Sampled on the backend's device with the reference's CPU noise: only the graphs differ.
    device = getattr(graphs["denoiser"], "device", "cpu")
    pipe = LDLMPipeline(BackendGraphs(dict(graphs)), tokenizer, device, config=model.config, noise_device="cpu", schedules=schedules)
    result = pipe.generate(n, length, steps, seed, sampler)
    candidate, plan = result.token_ids, result.plan
    assert plan is not None  # a generation always says what ran
    report.notes.append(
        f"end-to-end generation: {n} x {length} tokens, {plan.steps} steps of the {plan.sampler.name} sampler, {plan.grid} grid"
    )
    report.token_agreement = float((reference_tokens == candidate).float().mean())
    if outputs is not None:
        outputs.add(END_TO_END_TOKENS, reference_tokens.numpy(), candidate.cpu().numpy())
    return report
